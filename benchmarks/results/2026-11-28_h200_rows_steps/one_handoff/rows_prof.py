"""RowsRunner on CUDA: step times (eager, recording, replay) for B requests of 2K tokens (smollm2-135m shape, random
weights) against TandemRunner's static batch-B step. Usage: rows_prof.py OUT.txt POLICY"""

import sys
import time

import torch

from tandem import TandemCache, TandemConfig
from tandem.engine.rows import RowsRunner
from tandem.engine.runner import TandemRunner
from tandem.shapes import build_random_model

PROMPT = 2048


def timed(fn, *args) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    out = open(sys.argv[1], "w")
    policy = sys.argv[2] if len(sys.argv) > 2 else "certified"
    device = torch.device("cuda")
    model = build_random_model("smollm2-135m", device, torch.bfloat16)
    config = TandemConfig(policy=policy)
    with torch.inference_mode():
        for batch in (1, 4, 16):
            caches = []
            for _ in range(batch):
                cache = TandemCache.for_model(model, config)
                for kv in cache.tandem_layers():
                    kv.capacity_hint = PROMPT + 64
                ids = torch.randint(0, 49152, (1, PROMPT), device=device)
                model(input_ids=ids, use_cache=True, logits_to_keep=1, past_key_values=cache)
                caches.append(cache)
            runner = RowsRunner(model, record_after=2)
            times = []
            for _ in range(12):
                positions = [cache.get_seq_length() for cache in caches]
                times.append(round(1e3 * timed(runner.step, caches, [1] * batch, positions), 2))
            print(
                f"{policy} B={batch} rows step ms: {times} recordings {runner.recordings}",
                file=out,
                flush=True,
            )
            runner.release()
            del caches
            static = TandemRunner(model, TandemCache.for_model(model, config))
            static.prefill(torch.randint(0, 49152, (batch, PROMPT), device=device), max_new_tokens=64)
            _, seconds = static.decode(torch.ones(batch, dtype=torch.long, device=device), 12)
            print(
                f"{policy} B={batch} static step ms: {[round(1e3 * s, 2) for s in seconds]}",
                file=out,
                flush=True,
            )
            del static
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
