"""Greedy tokens of a tensor-parallel run against the one-device run of the same model, policy by policy.

    torchrun --standalone --nproc-per-node 2 -m tandem.distributed.check --model llama-3.1-8b --layers 2
    torchrun --standalone --nproc-per-node 2 -m tandem.distributed.check --device cpu --model tiny-llama

Every rank builds the whole model (a named shape with seeded random weights, the same on every rank, or a local
checkpoint), runs the reference on its own device, then runs its shard (the model cut in place; for a checkpoint,
read slice by slice with `load_shard`):
a prefill of a random prompt through transformers' forward, greedy decode steps through the engine (Tandem's
own forward and, on CUDA, one CUDA graph per step holding the collectives), and one more eager decode step.
Rank 0 prints one JSON line per policy; the exit status is 0 only if, for every policy, the tokens are equal
and the prefill's and the last step's logits are within `TOLERANCE` of the reference's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .. import shapes
from ..config import DistributedConfig, QuestConfig, TandemConfig
from ..engine import TandemRunner
from ..integrations.hf import TandemCache
from . import launch
from .loading import load_shard
from .tensor_parallel import shard_model_

# largest |logit difference| allowed, relative to the largest |logit|: the shards' partial sums add in another
# order than one matmul's
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


def _run(model, policy: str, prompt: torch.Tensor, steps: int, use_graphs, host_split: str = "heads") -> dict:
    """One run over a fresh cache: the prefill's logits [B, V] (transformers' forward), the greedy tokens
    [B, steps] (the engine), and the logits [B, V] of one more decode step of Tandem's own forward, run eagerly."""
    config = TandemConfig(
        policy=policy,
        sink_tokens=16,
        window_tokens=32,
        **({"quest": QuestConfig(budget=0.25)} if policy == "quest" else {}),
        distributed=DistributedConfig(host_split=host_split),
    )
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache, use_graphs=use_graphs)
    logits = runner.prefill(prompt, chunk_tokens=128, max_new_tokens=steps + 2)
    tokens, _ = runner.decode(logits.argmax(-1), steps)
    with torch.inference_mode():
        last = tokens[:, -1:].to(runner.device)
        step_logits = (
            runner.decoder(last, runner.next_position[:, None]) if runner.decoder is not None else None
        )
    host = cache.tandem_layers()[0].host
    return {
        "host_tier": [host.batch, host.num_kv_heads],  # requests and KV heads in this rank's host tier
        "prefill": logits.float().cpu(),
        "tokens": tokens,
        "step": None if step_logits is None else step_logits.float().cpu(),
    }


def _difference(ours: torch.Tensor | None, reference: torch.Tensor | None) -> float | None:
    """Largest |difference| relative to the largest |reference logit|."""
    if ours is None or reference is None:
        return None
    return float((ours - reference).abs().max() / reference.abs().max().clamp(min=1e-12))


def _build(args, device, dtype):
    if args.model in shapes.SHAPES:
        config = shapes.shape_config(args.model, args.layers)
        if (
            args.bias
        ):  # every projection with a bias: o_proj's and down_proj's must be added once, not per rank
            config.attention_bias = config.mlp_bias = True
        model = shapes.build_random_model(config, device, dtype, seed=args.seed)
        if args.bias:
            gen = torch.Generator(device=device).manual_seed(args.seed + 1)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("proj.bias"):
                        param.normal_(0.0, 0.5, generator=gen)
        return model
    from ..models import load_model

    return load_model(args.model, device=str(device), dtype=args.dtype)[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.distributed.check", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default="llama-3.1-8b", help="a named shape (random weights) or a local model path"
    )
    p.add_argument("--layers", type=int, default=2, help="first N layers of a named shape (default 2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--policies", default="full,quest", help="comma list of policies to compare")
    p.add_argument(
        "--host-splits",
        default="heads",
        help="comma list of TandemConfig.distributed.host_split values the shard runs with (heads, requests)",
    )
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--bias", action="store_true", help="a named shape with random biases on every projection")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graph per step)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rank = launch.init_ranks(args.device)
    dtype = getattr(torch, args.dtype)
    use_graphs = False if args.no_graphs else "auto"
    model = _build(args, rank.device, dtype)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, vocab, (args.batch, args.prompt_tokens), generator=gen)
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    reference = {policy: _run(model, policy, prompt, args.steps, use_graphs) for policy in policies}
    if args.model in shapes.SHAPES:
        shard_model_(model, rank)
    else:  # a checkpoint: the shard read slice by slice, as `tandem generate --gpus` reads it
        model = load_shard(args.model, rank, dtype=args.dtype)[0]
    agree = True
    tolerance = TOLERANCE[args.dtype]
    splits = [name.strip() for name in args.host_splits.split(",") if name.strip()]
    for policy, host_split in ((p, s) for s in splits for p in policies):
        ours, ref = _run(model, policy, prompt, args.steps, use_graphs, host_split), reference[policy]
        same = torch.equal(ours["tokens"], ref["tokens"])
        prefill_diff = _difference(ours["prefill"], ref["prefill"])
        step_diff = _difference(ours["step"], ref["step"])
        close = prefill_diff <= tolerance and (step_diff is None or step_diff <= tolerance)
        agree &= same and close
        mismatch = (ours["tokens"] != ref["tokens"]).nonzero()
        report = {
            "policy": policy, "host_split": host_split, "ranks": rank.world, "device": str(rank.device), "dtype": args.dtype,
            "model": args.model, "layers": model.config.num_hidden_layers, "graphs": not args.no_graphs,
            "host_tier": ours["host_tier"], "tokens_equal": same, "logits_close": close, "tolerance": tolerance,
            "first_mismatch": mismatch[0].tolist() if len(mismatch) else None,
            "prefill_logits_rel_diff": prefill_diff, "decode_logits_rel_diff": step_diff,
            "tokens": ours["tokens"].tolist(), "reference_tokens": ref["tokens"].tolist(),
        }  # fmt: skip
        if rank.rank == 0:
            print(json.dumps(report), flush=True)
    launch.exit_rank(0 if agree else 1)


if __name__ == "__main__":
    sys.exit(main())
