"""Where a CPU decode step of the server's rows goes: matmul times by row count, and a profile of one
`RowsRunner` step over B requests (random float32 weights of the default model's shape, 512-token prompts, the
default policy). Run from the repository root:
python benchmarks/results/2026-11-28_cpu_rows_step_profile/cpu_step_profile.py --batch 24
"""

import argparse
import time

import torch

from tandem import TandemCache, TandemConfig
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model


def timed(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=24)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n| weight (out x in) | rows | F.linear | x @ W.T (W.T contiguous) |\n|---|---:|---:|---:|")
    for out_f, in_f in ((1536, 576), (49152, 576)):
        w = torch.randn(out_f, in_f)
        wt = w.t().contiguous()
        for rows in (1, 8, 24, 32):
            x = torch.randn(rows, in_f)
            a = timed(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            b = timed(lambda x=x, wt=wt: x @ wt)
            print(f"| {out_f} x {in_f} | {rows} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms |")
    model = build_random_model("smollm2-135m", torch.device("cpu"), torch.float32, seed=0)
    caches = []
    with torch.inference_mode():
        for _ in range(args.batch):
            cache = TandemCache.for_model(model, TandemConfig())
            for kv in cache.tandem_layers():
                kv.capacity_hint = 600
            model(input_ids=torch.randint(0, 1000, (1, 512)), use_cache=True, logits_to_keep=1, past_key_values=cache)
            caches.append(cache)
    runner = RowsRunner(model)

    def step():
        runner.step(caches, [1] * args.batch, [c.get_seq_length() for c in caches])

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(3):
        step()
    print(f"\nRowsRunner step, {args.batch} requests: {(time.perf_counter() - start) / 3 * 1e3:.0f} ms (mean of 3)")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
