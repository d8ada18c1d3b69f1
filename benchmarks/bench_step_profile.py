"""Where a Tandem decode step's time goes, on a random-weight model of a real shape (GPU host).

For each context and configuration (`streaming`: the CPU part is trivial, so the step is the GPU side plus
launches and bookkeeping; `quest` at a device share), the engine decodes with CUDA graphs and this prints:

- host side, per step (wall clock on the Python thread): graph launches, waits for q's copy, and inside the
  CPU parts the policy's selection, the compiled kernel, the Python around it and the statistics;
- GPU side, per step (a torch.profiler trace of a few steps): busy time by kernel kind (matmuls, hot-tier
  attention, the device share's UVA attention, merges, top-k, copies, the rest) and the idle time, i.e.
  where the GPU waited for the host;
- the same CPU part timed back to back on the main thread after the run (the kernel's isolated cost).

The engine serves the hand-offs of compiled CPU parts (quest, streaming) in C++ (`handoff.run_host_side`): their
per-part timers stay empty and `cpu_parts_ms` is the engine's own time in CPU parts; `--python-host-side` serves
every hand-off from Python with the per-part timers, as the engine did before.

    python benchmarks/bench_step_profile.py --model llama-3.1-8b --contexts 64k,128k --configs streaming,quest:0,quest:0.5
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tandem import TandemCache, TandemConfig, manifest
from tandem.attention import decode
from tandem.config import HostConfig, QuestConfig
from tandem.engine import TandemRunner
from tandem.engine import handoff as handoff_module
from tandem.engine import step as step_module
from tandem.kernels import ops
from tandem.kernels.cpu import ops as cpu_ops
from tandem.policies.quest import QuestPolicy
from tandem.shapes import build_random_model
from tandem.tools.bench.baselines import release_memory
from tandem.tools.bench.tandem_side import fill_tandem_synthetic

TIMERS: collections.Counter = collections.Counter()
MARK_STEPS = False
PER_STEP: list[dict] = []
COMPILED = [True]  # DecodeStep.compiled_host_side for the steps profiled


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[name] += time.perf_counter() - start

    return wrapper


class _TimedLib:
    """The compiled library, with its attention entry point timed (the kernel alone, GIL released)."""

    def __init__(self, lib):
        self._lib = lib
        self.tandem_sparse_attention = timed("kernel", lib.tandem_sparse_attention)

    def __getattr__(self, name):
        return getattr(self._lib, name)


def instrument() -> None:
    native = cpu_ops._native
    cache = {}

    def timed_native():
        lib = native()
        if lib is None:
            return None
        if id(lib) not in cache:
            cache[id(lib)] = _TimedLib(lib)
        return cache[id(lib)]

    cpu_ops._native = timed_native
    decode.host_part = timed("cpu_part", decode.host_part)
    decode.host_attention = timed("attend", decode.host_attention)
    decode._record_selection = timed("statistics", decode._record_selection)
    QuestPolicy.select = timed("select", QuestPolicy.select)
    ops.sparse_attention_lse = timed("attend_ops", ops.sparse_attention_lse)

    def q_wait(bufs):
        return bufs.q_copied.synchronize()

    original_cpu_part = decode.cpu_part

    def cpu_part(layer, bufs, scale, pool, wait_copy=True, on_seconds=None):
        if wait_copy and bufs.q_copied is not None:
            start = time.perf_counter()
            bufs.q_copied.synchronize()
            TIMERS["q_wait"] += time.perf_counter() - start
        saved, bufs.q_copied = bufs.q_copied, None
        try:
            original_cpu_part(layer, bufs, scale, pool, on_seconds=on_seconds)
        finally:
            bufs.q_copied = saved

    decode.cpu_part = cpu_part

    def replay(self):
        if MARK_STEPS:
            torch.cuda._sleep(1)  # a `spin_kernel` on the stream: the trace's step boundary
        if self.flags is not None:  # handoff="memops": one launch, then the hand-offs through flags
            start = time.perf_counter()
            self.flags.reset()
            graph, stream = self.segments[0][0], torch.cuda.current_stream(self.device)
            # as `DecodeStep.replay`: a graph longer than the launch queue returns from its launch only once the
            # GPU passed hand-offs served here, so it is launched from the engine's launcher thread
            self.launcher.start(lambda: step_module._replay_on(graph, stream))
            TIMERS["launch"] += time.perf_counter() - start
            if self.compiled_host_side:  # as the engine serves them (compiled parts: no per-part timers)
                start = time.perf_counter()
                handoff_module.run_host_side(self.flags, self.actions, self.launcher, True)
                TIMERS["host_side"] += time.perf_counter() - start
                return
            try:
                for i, action in enumerate(self.actions):
                    start = time.perf_counter()
                    self.flags.wait_ready(i, self.launcher.failed)
                    middle = time.perf_counter()
                    TIMERS["q_wait"] += middle - start
                    action()
                    TIMERS["after"] += time.perf_counter() - middle
                    self.flags.set_done(i)
            except BaseException:
                self.flags.set_all_done()
                raise
            finally:
                self.launcher.join()
            return
        for graph, after in self.segments:
            start = time.perf_counter()
            graph.replay()
            middle = time.perf_counter()
            TIMERS["launch"] += middle - start
            if after is not None:
                after()
                TIMERS["after"] += time.perf_counter() - middle

    step_module.DecodeStep.replay = replay
    prepare = step_module.DecodeStep.prepare

    def timed_prepare(self, layers):
        self.compiled_host_side = COMPILED[0]
        PER_STEP.append(dict(TIMERS))
        TIMERS.clear()
        start = time.perf_counter()
        try:
            return prepare(self, layers)
        finally:
            TIMERS["prepare"] += time.perf_counter() - start

    step_module.DecodeStep.prepare = timed_prepare


KINDS = (
    ("hot_attention", ("hot_decode",)),
    ("device_share", ("block_attention", "combine_splits")),
    ("merge", ("merge_lse",)),
    ("topk", ("topk", "sort", "radix", "gatherTopK", "bitonic")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "matmul", "dot_kernel")),
)


def kind_of(name: str, category: str) -> str:
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def gpu_profile(runner, first, steps: int) -> dict:
    """Busy ms per step by kernel kind and idle ms per step, from a torch.profiler trace of the graph-replayed
    steps among `steps` (each replay starts with a marker kernel; the windows between markers are steps)."""
    from torch.profiler import ProfilerActivity, profile

    global MARK_STEPS
    MARK_STEPS = True
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.decode(first, steps)
    finally:
        MARK_STEPS = False
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    spans, marks = [], []
    names: collections.Counter = collections.Counter()  # over all traced steps, warm-up included
    for ev in trace.get("traceEvents", []):
        cat = ev.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in ev:
            if "spin_kernel" in ev.get("name", ""):
                marks.append(float(ev["ts"]))
            else:
                spans.append((float(ev["ts"]), float(ev["dur"]), kind_of(ev.get("name", ""), cat)))
                names[ev.get("name", "")[:90]] += float(ev["dur"])
    marks.sort()
    if len(marks) < 2:
        return {"gpu_trace_error": f"{len(marks)} step markers in the trace"}
    spans = sorted(s for s in spans if marks[0] <= s[0] < marks[-1])
    windows = len(marks) - 1
    by_kind: collections.Counter = collections.Counter()
    busy = 0.0
    cur_s = cur_e = marks[0]
    for s, d, kind in spans:
        by_kind[kind] += d
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, s + d
        else:
            cur_e = max(cur_e, s + d)
    busy += cur_e - cur_s
    out = {f"gpu_{k}_ms": round(v / windows / 1e3, 3) for k, v in sorted(by_kind.items())}
    out["gpu_step_ms"] = round((marks[-1] - marks[0]) / windows / 1e3, 3)
    out["gpu_busy_ms"] = round(busy / windows / 1e3, 3)
    out["gpu_kernels_per_step"] = round(len(spans) / windows, 1)
    total = sum(names.values())
    out["gpu_top_kernels_share"] = {n: round(v / total, 4) for n, v in names.most_common(30)}
    return out


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--contexts", default="64k,128k")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--configs",
        default="streaming,quest:0,quest:0.5",
        help="policy[:gpu_share[:host.dtype]], comma-separated (an empty gpu_share: the default)",
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--no-gpu-trace", action="store_true")
    p.add_argument(
        "--handoff",
        default="auto",
        help="TandemRunner's handoff: auto, memops or launches; comma-separated to compare",
    )
    p.add_argument("--fused", default="on", help="the fused RMSNorm / RoPE kernels: on, off or on,off")
    p.add_argument(
        "--python-host-side",
        action="store_true",
        help="serve every hand-off from Python with per-part timers (the engine serves compiled parts in C++)",
    )
    p.add_argument(
        "--certify-kernels",
        default="on",
        help="the certified selection's Triton kernels (sketch bounds, histogram): on, off or on,off",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = build_random_model(args.model, "cuda", torch.bfloat16, num_layers=args.layers)
    model.config.max_position_embeddings = 1 << 20
    instrument()
    machine = {
        "gpu": torch.cuda.get_device_name(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", ""),
        "torch": torch.__version__,
    }
    print(json.dumps(machine), flush=True)
    results = []
    first = torch.zeros(args.batch, dtype=torch.long)
    for text in args.contexts.split(","):
        context = int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)
        combos = itertools.product(
            args.configs.split(","),
            args.handoff.split(","),
            args.fused.split(","),
            args.certify_kernels.split(","),
        )
        for spec, handoff, fused, kernels in combos:
            ops._CERTIFY_FALLBACK.clear()
            if kernels == "off":  # the torch versions stand in, as after a kernel's failure
                ops._CERTIFY_FALLBACK.update(sketch_bounds="off", certify_histogram="off")
            policy, _, rest = spec.partition(":")
            share, _, host_dtype = rest.partition(":")
            config = TandemConfig(
                policy=policy,
                quest=QuestConfig(gpu_share=float(share) if share else None),
                host=HostConfig(dtype=host_dtype or None),
            )
            cache = TandemCache.for_model(model, config)
            runner = TandemRunner(model, cache, handoff=handoff, fused={"on": True, "off": False}[fused])
            fill_tandem_synthetic(cache, model, args.batch, context)
            runner.set_positions(torch.full((args.batch,), context))
            PER_STEP.clear()
            TIMERS.clear()
            COMPILED[0] = not args.python_host_side
            _, seconds = runner.decode(first, 4 + args.steps)
            PER_STEP.append(dict(TIMERS))
            TIMERS.clear()
            steps = PER_STEP[1:][4:]  # PER_STEP[i + 1] holds step i's timers; skip warm-up and capture
            row = {"context": context, "batch": args.batch, "config": spec, "handoff": runner.handoff}
            row["fused"] = fused
            row["certify_kernels"] = kernels
            row["step_ms"] = round(statistics.median(seconds[4:]) * 1e3, 2)
            row["host_side"] = "python" if args.python_host_side else "compiled"
            row["cpu_parts_ms"] = round(statistics.median(runner.host_seconds[4:]) * 1e3, 3)
            keys = sorted({k for s in steps for k in s})
            for key in keys:
                row[f"host_{key}_ms"] = round(statistics.median(s.get(key, 0.0) for s in steps) * 1e3, 3)
            layer = cache.tandem_layers()[0]
            bufs = layer.decode_buffers
            TIMERS.clear()
            start = time.perf_counter()
            for _ in range(20):
                decode.host_part(layer, bufs, layer.head_dim**-0.5, cache.pool, True)
            row["one_cpu_part_back_to_back_ms"] = round((time.perf_counter() - start) / 20 * 1e3, 3)
            row["one_kernel_back_to_back_ms"] = round(TIMERS["kernel"] / 20 * 1e3, 3)
            TIMERS.clear()
            if not args.no_gpu_trace:
                row.update(gpu_profile(runner, torch.zeros(args.batch, dtype=torch.long), 9))
            row["layers"] = len(cache.tandem_layers())
            print(json.dumps(row), flush=True)
            results.append(row)
            del cache, runner, bufs, layer
            release_memory(torch.device("cuda"))
    if args.out:
        out = Path(args.out)
        manifest.write(out.parent, name=f"{out.stem}.manifest.json")
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
