"""Chunked prefill of a long prompt on a random-weight model of a real shape: Tandem's exact append path with the
flash-style kernel (`gpu.prefill_attention`; `streamed`: the same with the host rows copied back to the GPU for
every chunk instead of attended from the layers' device copy, `LayerKV.keep_prompt_rows`) against the reference
kernel it replaced, and against Hugging Face's own chunked prefill into a `DynamicCache` (everything on the GPU),
in one run (GPU host).

Per row: seconds, prompt tokens per second, the time the prompt's FLOPs take at the bf16 matmul rate measured in
the same run (`shapes.prefill_flops`, `bandwidth.matmul_rate`) and the row's seconds as a multiple of it, the
FLOP utilisation (FLOPs over seconds, against that rate), GPU memory peak; for Tandem, the decode steps after it.
Pairs of paths at the same context also report how far apart their last logits are (largest difference, cosine,
same argmax): the flash path must give the reference's answer up to rounding, as HF's SDPA does. A row that does
not fit is reported as OOM.

    python benchmarks/bench_prefill.py --model llama-3.1-8b --contexts 32k,128k --paths flash,reference --out prefill
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

from tandem import TandemCache, TandemConfig, manifest
from tandem.attention import hybrid
from tandem.engine import TandemRunner
from tandem.engine import prefill as prefill_module
from tandem.integrations.hf import generate_cache_kwargs, restore_attention
from tandem.shapes import build_random_model, prefill_flops
from tandem.tools.bench.bandwidth import matmul_rate
from tandem.tools.bench.baselines import SDPA_BACKENDS, is_oom, release_memory

PATHS = ("flash", "streamed", "reference", "hf-dynamic")


def tandem_prefill(model, ids, path: str, chunk: int, decode_steps: int) -> tuple[dict, torch.Tensor | None]:
    original, budget = hybrid.flash_prefill_available, prefill_module.prompt_rows_budget
    hybrid.flash_prefill_available = (lambda q: False) if path == "reference" else original
    if path == "streamed":
        prefill_module.prompt_rows_budget = lambda device, num_layers: 0
    device = ids.device
    torch.cuda.reset_peak_memory_stats(device)
    row = {"system": f"tandem-{path}"}
    cache = runner = None
    try:
        cache = TandemCache.for_model(model, TandemConfig(policy="quest"))
        runner = TandemRunner(model, cache)
        start = time.perf_counter()
        logits = runner.prefill(ids, chunk_tokens=chunk, max_new_tokens=decode_steps + 1)
        row["seconds"] = time.perf_counter() - start
        row["gpu_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        stats = cache.stats()
        row["gpu_kv_gb"], row["host_kv_gb"] = stats["hot_bytes"] / 1e9, stats["host_bytes"] / 1e9
        _, seconds = runner.decode(logits.argmax(-1), decode_steps)
        row["tpot_ms_after"] = sorted(seconds)[len(seconds) // 2] * 1e3
        return row, logits.cpu()
    except Exception as err:
        row["status"] = "oom" if is_oom(err) else f"error: {str(err)[:200]}"
        return row, None
    finally:
        hybrid.flash_prefill_available, prefill_module.prompt_rows_budget = original, budget
        cache = runner = None
        release_memory(device)


def hf_prefill(model, ids, chunk: int) -> tuple[dict, torch.Tensor | None]:
    """HF's own chunked prefill into a DynamicCache: each chunk attends the cache so far (SDPA, masked)."""
    from transformers import DynamicCache

    restore_attention(model)
    device = ids.device
    torch.cuda.reset_peak_memory_stats(device)
    row = {"system": "hf-dynamic"}
    cache = out = None
    try:
        cache = DynamicCache()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.no_grad(), sdpa_kernel(list(SDPA_BACKENDS)):
            for s in range(0, ids.shape[1], chunk):
                out = model(
                    input_ids=ids[:, s : s + chunk],
                    **generate_cache_kwargs(model, cache),
                    use_cache=True,
                    logits_to_keep=1,
                )
        torch.cuda.synchronize(device)
        row["seconds"] = time.perf_counter() - start
        row["gpu_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        return row, out.logits[:, -1].float().cpu()
    except Exception as err:
        row["status"] = "oom" if is_oom(err) else f"error: {str(err)[:200]}"
        return row, None
    finally:
        cache = out = None
        release_memory(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--contexts", default="32k,128k")
    p.add_argument(
        "--paths", default="flash,reference,hf-dynamic", help=f"comma-separated, of {', '.join(PATHS)}"
    )
    p.add_argument("--reference-max", default="32k", help="skip the reference path above this context")
    p.add_argument("--chunk-tokens", type=int, default=16384)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--out", default="prefill_bench")
    args = p.parse_args()
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    bad = [x for x in paths if x not in PATHS]
    if bad:
        raise SystemExit(f"--paths: unknown {', '.join(bad)}; allowed: {', '.join(PATHS)}")

    def tokens(text: str) -> int:
        return int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)

    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill.py times the GPU path: it needs CUDA")
    model = build_random_model(args.model, "cuda", torch.bfloat16)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, 1 << 20)
    machine = {"gpu": torch.cuda.get_device_name(), "cpu": platform.processor(), "torch": torch.__version__}
    machine["matmul_tflops"] = matmul_rate("cuda", torch.bfloat16)
    print(json.dumps(machine), flush=True)
    rows = []
    vocab = model.config.vocab_size
    for text in args.contexts.split(","):
        context = tokens(text)
        ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0)).cuda()
        logits = {}
        for path in paths:
            if path == "reference" and context > tokens(args.reference_max):
                continue
            if path == "hf-dynamic":
                row, logits[path] = hf_prefill(model, ids, args.chunk_tokens)
            else:
                row, logits[path] = tandem_prefill(model, ids, path, args.chunk_tokens, args.decode_steps)
            flops = prefill_flops(model.config, 0, context)["total"]
            row.update(context=context, chunk_tokens=args.chunk_tokens, flops=flops)
            row["flops_seconds"] = flops / (machine["matmul_tflops"] * 1e12)
            if "seconds" in row:
                row["tokens_per_s"] = context / row["seconds"]
                row["of_flops_time"] = row["seconds"] / row["flops_seconds"]
                row["utilisation"] = flops / row["seconds"] / (machine["matmul_tflops"] * 1e12)
            rows.append(row)
            print(json.dumps(row), flush=True)
        pairs = (
            ("flash", "streamed"),
            ("flash", "reference"),
            ("flash", "hf-dynamic"),
            ("reference", "hf-dynamic"),
        )
        for first, second in pairs:
            if logits.get(first) is None or logits.get(second) is None:
                continue
            ours, theirs = logits[first], logits[second]
            rows.append(
                {
                    "system": f"{first} vs {second}",
                    "context": context,
                    "max_logit_diff": (ours - theirs).abs().max().item(),
                    "max_abs_logit": theirs.abs().max().item(),
                    "logit_std": theirs.std().item(),
                    "cosine": torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min().item(),
                    "same_argmax": bool((ours.argmax(-1) == theirs.argmax(-1)).all()),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        del ids
    out = Path(args.out)
    manifest.write(out)
    (out / "prefill.json").write_text(
        json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=1)
    )
    lines = [
        f"# Prefill, {args.model} (random bf16 weights), {machine['gpu']}, chunks of {args.chunk_tokens} tokens",
        "",
        f"bf16 matmul rate measured in this run: {machine['matmul_tflops']:.0f} TFLOP/s. FLOPs time: the prompt's "
        "FLOPs (projections, LM head, causal attention) at that rate; utilisation: FLOPs over seconds, against it.",
        "",
        "| system | context | seconds | tokens/s | FLOPs time (s) | x FLOPs time | utilisation | GPU peak GB "
        "| TPOT after (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "max_logit_diff" in r:
            continue
        cells = [
            r["system"],
            str(r["context"]),
            f"{r['seconds']:.1f}" if "seconds" in r else r.get("status", ""),
        ]
        cells += [f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "", f"{r['flops_seconds']:.2f}"]
        cells += [f"{r['of_flops_time']:.2f}x" if "of_flops_time" in r else ""]
        cells += [f"{r['utilisation']:.0%}" if "utilisation" in r else "", f"{r.get('gpu_peak_gb', 0):.1f}"]
        cells += [f"{r['tpot_ms_after']:.2f}" if "tpot_ms_after" in r else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [
        f"{r['system']} at {r['context']}: largest logit difference {r['max_logit_diff']:.3g} (logits' std "
        f"{r['logit_std']:.3g}, largest {r['max_abs_logit']:.3g}), cosine {r['cosine']:.6f}, "
        f"same argmax: {r['same_argmax']}"
        for r in rows
        if "max_logit_diff" in r
    ]
    (out / "prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
