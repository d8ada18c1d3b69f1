"""`tandem generate` as a user runs it, against Hugging Face's DynamicCache on the same prompt, in one run: the
decode rate of each policy (a fresh `tandem generate --json` process each, so compilation and graph capture are
paid as a user pays them) beside `model.generate` with a DynamicCache in this process, and beside the engine's
steady state for each policy in this process (the rate `tandem bench` reports: what a long answer approaches).

    python benchmarks/bench_generate.py --model /path/to/model.gguf --prompt-tokens 3500 --tokens 96 \
        --policies certified,streaming,quest --out benchmarks/results/<date>_<machine>_generate

The prompt is prose (Python's documentation) cut to `--prompt-tokens`, a completion prompt (no chat template).
Decode rate = (generated - 1) / the seconds from the first token to the last, as `tandem generate` reports it; the
DynamicCache row is timed the same way through a streamer. Prints and saves generate.json / generate.md (+ a
manifest naming the commit and the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
from transformers import DynamicCache

from tandem import load_model, manifest
from tandem.tools.evaluation.haystack import load_haystack


class _FirstToken:
    """A `generate` streamer that records when the first new token arrives (the prompt comes first)."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


def hf_dynamic(model, ids: torch.Tensor, tokens: int) -> dict:
    streamer = _FirstToken()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
            past_key_values=DynamicCache(), streamer=streamer, pad_token_id=model.config.eos_token_id,
        )  # fmt: skip
        if ids.is_cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
    generated = out.shape[1] - ids.shape[1]
    first = streamer.first or end
    rate = (generated - 1) / (end - first) if generated > 1 and end > first else None
    return {"system": "hf-dynamic", "generated_tokens": generated, "prefill_seconds": first - start,
            "decode_tokens_per_s": rate}  # fmt: skip


def steady_state(model, ids: torch.Tensor, args, policy: str) -> float:
    """The engine's steady decode rate for `policy` on the same prompt, in this process: the median step of
    `--tokens` steps taken after the warm-up request, the eager steps and the recording (what `tandem bench`
    reports), as tokens/s."""
    from tandem import TandemCache
    from tandem.cli import build_parser
    from tandem.cli.generate import build_config
    from tandem.engine import TandemRunner

    cli = build_parser().parse_args(["generate", "--prompt", "-", "--policy", policy, *args.extra])
    runner = TandemRunner(model, TandemCache.for_model(model, build_config(cli)))
    skip = runner.warmup_steps + 4
    runner.warm_up(ids.shape[1], skip + args.tokens)
    logits = runner.prefill(ids, max_new_tokens=skip + args.tokens)
    _, seconds = runner.decode(logits.argmax(-1), skip + args.tokens)
    steps = sorted(seconds[skip:])
    return 1.0 / steps[len(steps) // 2]


def tandem_generate(args, prompt_file: str, policy: str) -> dict:
    command = [sys.executable, "-m", "tandem.cli", "generate", "--prompt-file", prompt_file, "--json",
               "--max-new-tokens", str(args.tokens), "--policy", policy]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    if args.device:
        command += ["--device", args.device]
    command += args.extra
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        return {
            "system": policy,
            "error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"],
        }
    stats = json.loads(done.stdout.strip().splitlines()[-1])["stats"]
    return {"system": policy, "generated_tokens": stats["generated_tokens"], "prefill_seconds": stats["prefill_seconds"],
            "decode_tokens_per_s": stats["decode_tokens_per_s"], "engine": stats.get("engine"),
            "warmup_seconds": stats.get("warmup_seconds"),
            "fraction_attended": stats.get("mean_fraction_attended")}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local HF directory or .gguf (default: the default model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: CUDA if available)")
    p.add_argument("--prompt-tokens", type=int, default=3500)
    p.add_argument("--tokens", type=int, default=96, help="new tokens per generation")
    p.add_argument("--policies", default="certified,streaming,quest", help="tandem generate --policy values")
    p.add_argument("--timeout", type=float, default=600, help="seconds per tandem generate process")
    p.add_argument("--out", default=None, help="directory for generate.json / .md and the manifest")
    p.add_argument("extra", nargs="*", help="after --: more arguments for every tandem generate")
    args = p.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None}  # fmt: skip
    print(json.dumps(machine), flush=True)
    model, tokenizer = load_model(args.model, device=device)
    text_ids = tokenizer(load_haystack().text, add_special_tokens=False).input_ids[: args.prompt_tokens]
    prompt = tokenizer.decode(text_ids)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    hf_dynamic(model, ids[:, :256], 4)  # warm-up: kernels loaded, allocator grown
    rows = [hf_dynamic(model, ids, args.tokens)]
    print(json.dumps(rows[-1]), flush=True)
    steady = {policy: steady_state(model, ids, args, policy) for policy in args.policies.split(",")}
    print(json.dumps({"steady_tokens_per_s": steady}), flush=True)
    del model
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    try:
        for policy in args.policies.split(","):
            rows.append(dict(tandem_generate(args, f.name, policy), steady_tokens_per_s=steady[policy]))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        os.unlink(f.name)
    base = rows[0]["decode_tokens_per_s"]
    lines = [
        f"# `tandem generate` against DynamicCache: {args.model or 'the default model'} on {machine['gpu'] or machine['cpu']}",
        "",
        f"A {ids.shape[1]}-token prose prompt, {args.tokens} greedy tokens. Decode rate = (generated - 1) / seconds "
        "from the first token to the last; each `tandem generate` a fresh process. Steady state: the engine's "
        "median step in this process on the same prompt and policy, past its warm-up, eager steps and recording.",
        "",
        "| system | decode tokens/s | vs DynamicCache | steady state tokens/s | vs steady state | generated | "
        "prefill s | warm-up s | host entries attended |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | failed: {r['error']} | | | | | | | |")
            continue
        rate, steady_rate = r["decode_tokens_per_s"], r.get("steady_tokens_per_s")
        ratio = f"{rate / base:.2f}x" if rate and base else "-"
        share = "-" if r.get("fraction_attended") is None else f"{r['fraction_attended']:.1%}"
        steady_cells = f"{steady_rate:.1f} | {rate / steady_rate:.2f}x" if rate and steady_rate else "- | -"
        warmup = "-" if r.get("warmup_seconds") is None else f"{r['warmup_seconds']:.2f}"
        lines.append(f"| {r['system']} | {rate or 0:.1f} | {ratio} | {steady_cells} | {r['generated_tokens']} | "
                     f"{r['prefill_seconds']:.2f} | {warmup} | {share} |")  # fmt: skip
    print("\n".join(lines))
    if args.out:
        manifest.save_results(
            args.out, "generate", {"machine": machine, "prompt_tokens": ids.shape[1], "rows": rows},
            "\n".join(lines) + "\n",
        )  # fmt: skip


if __name__ == "__main__":
    main()
