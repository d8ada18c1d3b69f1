"""Host-side cost of re-pointing a rows runner's step at a batch where one request changed (`RowsRunner._serve`,
what a recorded step runs on CUDA before it replays for other requests): 64 pooled quest requests with a device
share, random float32 weights of the default model's shape (30 layers), 80-token prompts, on the CPU. Prints the
milliseconds of eight such changes. `python repoint_cost.py`."""

import gc
import time

import torch

from tandem import TandemCache, TandemConfig
from tandem.config import QuestConfig
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model

torch.manual_seed(0)
model = build_random_model("smollm2-135m", torch.device("cpu"), torch.float32)
config = TandemConfig(
    policy="quest",
    quest=QuestConfig(budget=0.5, gpu_share=0.5),
    sink_tokens=4,
    window_tokens=16,
    block_size=16,
)
B = 64
runner = RowsRunner(model, slots=B, config=config)


def new():
    cache = TandemCache.for_model(model, config)
    runner.attach(cache)
    runner.prefill_chunk(cache, torch.randint(0, 1000, (1, 80)), 0, last=True)
    return cache


with torch.inference_mode():
    caches = [new() for _ in range(B)]
    runner.step(caches, [1] * B, [c.get_seq_length() for c in caches])
    rows = list(runner._layout(caches)[0])
    if hasattr(runner, "_served_rows"):  # what a recording leaves (the code before it had none)
        runner._served = runner._served_rows(rows)
    times = []
    for i in range(8):
        runner.detach(caches[i])
        caches[i] = None
        gc.collect()
        caches[i] = new()
        rows = list(runner._layout(caches)[0])
        start = time.perf_counter()
        runner._serve(rows)
        times.append((time.perf_counter() - start) * 1000)
    print("serve, one row changed, ms:", [round(x, 1) for x in times])
