"""Which online source of per-head budgets comes close to each step's exact Eq. 2 budgets (fluxion's oracle)?

fluxion's budget rule keeps full attention's answers at a few percent of the host tier when each step's exact
budgets are known (`fluxion_mode="oracle"`), but the exact budgets need every host key and value. This program
asks how close the sources a decode step can afford come, on the prompts of `tandem eval`'s retrieval tasks
(this is analysis, not calibration: nothing here trains on them).

For every sampled prompt it decodes a few greedy tokens with full attention, records each layer's queries, and
at every (layer, decode step, query head) splits the KV as a Tandem cache holds it (the profile's sinks, 16-token
host blocks, the window). Each source then gives a number of host blocks, taken best first by the head's Quest
bound, as the policy takes them:

- `predictor`, `static`: the shipped profile (Eq. 1 at 16-token blocks; streaming at p >= 0.9 / the static label);
- `digest(a)`: Eq. 2 evaluated on the blocks' summaries instead of their rows. A block's softmax mass is
  estimated from its mean key, log m = log 16 + s (q.mean_k + a (bound - q.mean_k)), its values by their mean.
  a = 0 is Jensen's lower bound on the mass; a = 1 is Quest's upper bound;
- `digest-var`: the same with a second-order mass term from the block's per-dimension key variance;
- `exact-mass`: every block's exact mass with mean values (not affordable online; it bounds the digest sources).

Reported per source: the share of head-steps whose blocks meet tau (Eq. 2's true error <= tau), the share of
head-steps it skipped (streaming) although the step needed host blocks, and the mean budget (share of the host
tier's rows).

    python benchmarks/bench_fluxion_budget_sources.py --out benchmarks/results/<date>_<machine>_fluxion_budget_sources
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from transformers import AttentionInterface, DynamicCache

from tandem import load_model, manifest
from tandem.integrations.hf import generate_cache_kwargs
from tandem.models import attention_shape
from tandem.policies.fluxion_features import anchor_stats, join_segments, step_features
from tandem.policies.fluxion_predictor import predictor_from_state, streaming_logit_threshold
from tandem.policies.fluxion_profile import load_profile
from tandem.policies.fluxion_search import block_digests, budget_at, head_block_bounds, prefix_errors
from tandem.tools.calibration.collect import CAPTURE_NAME, _Recorder, segments
from tandem.tools.evaluation.haystack import load_haystack
from tandem.tools.evaluation.tasks import TaskBuilder

BLOCK = 16
ALPHAS = (0.0, 0.1, 0.15, 0.2, 0.3)


def digest_blocks(error_curve_inputs, log_mass: torch.Tensor, values: torch.Tensor, order: torch.Tensor,
                  tau: float) -> torch.Tensor:  # fmt: skip
    """Blocks Eq. 2 asks for when each host block is replaced by (estimated mass, value summary).

    error_curve_inputs: (hot numerator [B, Hkv, G, D], hot denominator [B, Hkv, G], hot max logit [B, Hkv, G]);
    log_mass [B, Hkv, G, n]; values [B, Hkv, G, n, D]; order [B, Hkv, G, n] (best first). Returns [B, Hq]."""
    num, den, hot_top = error_curve_inputs
    top = torch.maximum(hot_top, log_mass.amax(-1))
    scale_hot = torch.exp(hot_top - top)
    num, den = num * scale_hot[..., None], den * scale_hot
    w = torch.exp(log_mass - top[..., None])
    w = torch.gather(w, 3, order)
    v = torch.gather(values, 3, order[..., None].expand_as(values))
    cum_num = torch.cat([torch.zeros_like(v[..., :1, :]), (w[..., None] * v).cumsum(3)], 3)
    cum_den = torch.cat([torch.zeros_like(w[..., :1]), w.cumsum(3)], 3)
    outs = (num[..., None, :] + cum_num) / (den[..., None] + cum_den)[..., None]
    full = outs[..., -1:, :]
    ref = full.norm(dim=-1).amax(dim=(1, 2), keepdim=True).clamp_min(1e-30)
    errors = (outs - full).norm(dim=-1) / ref[..., 0]
    suffix = errors.flip(-1).cummax(-1).values.flip(-1)
    batch = errors.shape[0]
    return (suffix <= tau).float().argmax(-1).reshape(batch, -1)


def measure_step(q, sink, cpu, local, scale, tau, profile_step):
    """Per source: (blocks [B, Hq]) for one layer and step; plus the exact error curve."""
    hot = join_segments(sink, local)
    errors, _ = prefix_errors(q, hot, cpu, scale, BLOCK)  # [B, Hq, n + 1]
    keys, values, mask = cpu
    batch, num_kv_heads, rows, head_dim = keys.shape
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    nblk = rows // BLOCK
    out = {}
    suffix = errors.flip(-1).cummax(-1).values.flip(-1)
    out["oracle"] = (suffix <= tau).float().argmax(-1)
    qg = q.float().view(batch, num_kv_heads, group, head_dim)
    k_blocks = keys.float().view(batch, num_kv_heads, nblk, BLOCK, head_dim)
    v_blocks = values.float().view(batch, num_kv_heads, nblk, BLOCK, head_dim)
    k_mean, v_mean = k_blocks.mean(3), v_blocks.mean(3)
    bound = head_block_bounds(q, *block_digests(keys, mask, BLOCK)).view(batch, num_kv_heads, group, nblk)
    order = torch.argsort(bound, dim=-1, descending=True, stable=True)
    mu = torch.einsum("bhgd,bhnd->bhgn", qg, k_mean)
    s_hot = torch.einsum("bhgd,bhtd->bhgt", qg, hot[0].float()) * scale
    s_hot = s_hot.masked_fill(~hot[2][:, None, None, :], -math.inf)
    hot_top = s_hot.amax(-1)
    w_hot = torch.exp(s_hot - hot_top[..., None])
    hot_inputs = (torch.einsum("bhgt,bhtd->bhgd", w_hot, hot[1].float()), w_hot.sum(-1), hot_top)
    v_group = v_mean[:, :, None].expand(-1, -1, group, -1, -1)
    for alpha in ALPHAS:
        log_mass = math.log(BLOCK) + scale * (mu + alpha * (bound - mu))
        out[f"digest({alpha:g})"] = digest_blocks(hot_inputs, log_mass, v_group, order, tau)
    variance = torch.einsum("bhgd,bhnd->bhgn", qg * qg, k_blocks.var(3, unbiased=False)) * scale * scale
    out["digest-var"] = digest_blocks(
        hot_inputs, math.log(BLOCK) + scale * mu + variance / 2, v_group, order, tau
    )
    logits = torch.einsum("bhgd,bhnkd->bhgnk", qg, k_blocks) * scale
    out["exact-mass"] = digest_blocks(hot_inputs, torch.logsumexp(logits, -1), v_group, order, tau)
    for name, (bgt0, k, streaming) in profile_step.items():
        budget = budget_at(bgt0, k, BLOCK) * torch.logical_not(streaming)
        out[name] = torch.ceil(budget * nblk - 1e-6).long().clamp(0, nblk)
    return errors, out, nblk


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    num_layers, num_q_heads, _, head_dim = attention_shape(model.config.get_text_config(decoder=True))
    scale = head_dim**-0.5
    profile = load_profile(args.profile)
    tau_key = profile.tau_key(args.tau)
    tau_index = profile.tau_index(args.tau)
    predictor = predictor_from_state(profile.predictor[tau_key])
    threshold = streaming_logit_threshold(profile.meta.get("quantile", 0.9))
    static = profile.static[tau_key]
    sinks, window = profile.meta["sink_tokens"], profile.meta["window_tokens"]
    builder = TaskBuilder(tokenizer, load_haystack(args.haystack), seed=args.seed)
    totals: dict = {}
    start = time.perf_counter()
    for task in args.tasks.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            cell = totals.setdefault(f"{task} {length}", {})
            for sample in builder.samples(task, length, args.samples):
                ids = sample.input_ids
                recorder = _Recorder()
                AttentionInterface.register(CAPTURE_NAME, recorder)
                previous = model.config._attn_implementation
                model.set_attn_implementation(CAPTURE_NAME)
                cache = DynamicCache(config=model.config)
                try:
                    with torch.no_grad():
                        out = model(
                            ids, **generate_cache_kwargs(model, cache), use_cache=True, logits_to_keep=1
                        )
                        token = out.logits[:, -1:].argmax(-1)
                        for _ in range(args.steps):
                            out = model(token, **generate_cache_kwargs(model, cache), use_cache=True)
                            token = out.logits[:, -1:].argmax(-1)
                finally:
                    model.set_attn_implementation(previous)
                prompt = ids.shape[1]
                for layer_idx, queries in sorted(recorder.queries.items()):
                    keys = cache.layers[layer_idx].keys.float()
                    values = cache.layers[layer_idx].values.float()
                    anchor = anchor_stats(queries[0][None], *segments(keys, values, prompt, sinks, window), scale,
                                          profile.taus)  # fmt: skip
                    for step in range(args.steps):
                        q = queries[1 + step][None]
                        sink, cpu, local = segments(keys, values, prompt + step + 1, sinks, window)
                        if cpu[0].shape[2] == 0:
                            continue
                        features = step_features(
                            layer_idx, q, anchor, sink, local, cpu[2].sum(-1), scale, tau_index
                        )
                        with torch.no_grad():
                            bgt0, k, logit = predictor(features.view(-1, features.shape[-1]))
                        shape = q.shape[:2]
                        profile_step = {
                            "predictor": (bgt0.view(shape), k.view(shape), (logit >= threshold).view(shape)),
                            "static": (
                                static["bgt0"][layer_idx][None],
                                static["k"][layer_idx][None],
                                static["streaming"][layer_idx][None],
                            ),  # fmt: skip
                        }
                        errors, blocks, nblk = measure_step(
                            q, sink, cpu, local, scale, args.tau, profile_step
                        )
                        oracle = blocks["oracle"]
                        for name, chosen in blocks.items():
                            true_error = torch.gather(errors, 2, chosen[..., None])[..., 0]
                            acc = cell.setdefault(name, [0, 0.0, 0.0, 0.0])
                            acc[0] += chosen.numel()
                            acc[1] += float((true_error <= args.tau + 1e-6).sum())
                            acc[2] += float(((chosen == 0) & (oracle > 0)).sum())
                            acc[3] += float((chosen.float() / nblk).sum())
            print(f"{task} {length}: {time.perf_counter() - start:.0f} s", flush=True)
    cells = {
        cell: {
            name: {
                "head_steps": a[0],
                "meets_tau": a[1] / a[0],
                "false_skip": a[2] / a[0],
                "budget": a[3] / a[0],
            }
            for name, a in sources.items()
        }  # fmt: skip
        for cell, sources in totals.items()
    }
    names = list(next(iter(totals.values())).keys())
    overall = {}
    for name in names:
        acc = [sum(totals[c][name][i] for c in totals) for i in range(4)]
        overall[name] = {"head_steps": acc[0], "meets_tau": acc[1] / acc[0], "false_skip": acc[2] / acc[0],
                         "budget": acc[3] / acc[0]}  # fmt: skip
    return {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "model": str(args.model or "default (SmolLM2-135M-Instruct GGUF)"),
        "profile": str(profile.path),
        "tau": args.tau,
        "hot_set": {"sinks": sinks, "window": window},
        "samples_per_cell": args.samples,
        "decode_steps": args.steps,
        "seed": args.seed,
        "seconds": time.perf_counter() - start,
        "overall": overall,
        "cells": cells,
    }


def markdown(result: dict) -> str:
    lines = [
        "# Online budget sources against each step's exact Eq. 2 budgets",
        "",
        f"Machine: {result['machine']}. Model: {result['model']}. tau {result['tau']}; sinks "
        f"{result['hot_set']['sinks']}, window {result['hot_set']['window']}; {result['samples_per_cell']} "
        f"samples per cell, {result['decode_steps']} greedy decode steps each, seed {result['seed']}.",
        "",
        "| source | head-steps meeting tau | skipped though needed | mean budget (host rows) |",
        "|---|---:|---:|---:|",
    ]
    for name, row in result["overall"].items():
        lines.append(f"| {name} | {row['meets_tau']:.1%} | {row['false_skip']:.1%} | {row['budget']:.1%} |")
    lines += ["", "Per cell (meets tau / mean budget):", ""]
    cells = list(result["cells"])
    lines.append("| source | " + " | ".join(cells) + " |")
    lines.append("|---|" + "---:|" * len(cells))
    for name in result["overall"]:
        row = [
            f"{result['cells'][c][name]['meets_tau']:.0%} / {result['cells'][c][name]['budget']:.1%}"
            for c in cells
        ]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="local HF directory or GGUF file (default: SmolLM2-135M)"
    )
    parser.add_argument("--profile", default=None, help="fluxion profile (default: the shipped one)")
    parser.add_argument("--haystack", default=None, help="haystack source for the task prompts")
    parser.add_argument("--tasks", default="niah,multikey,vt")
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--steps", type=int, default=6, help="greedy decode steps measured per prompt")
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json and results.md")
    args = parser.parse_args()
    result = run(args)
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        manifest.write(args.out)
        (args.out / "results.json").write_text(json.dumps(result, indent=1))
        (args.out / "results.md").write_text(text)


if __name__ == "__main__":
    main()
