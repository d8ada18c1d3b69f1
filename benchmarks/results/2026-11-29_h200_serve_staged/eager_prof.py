"""cProfile of 5 eager pooled rows steps at B=16 (default model's shape, random bf16 weights, 2,048-token prompts,
one policy per argument), the calling thread only: python eager_prof.py OUT.txt quest"""

import cProfile
import io
import pstats
import sys
import time

import torch

from tandem import TandemCache, TandemConfig
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model

BATCH, PROMPT, STEPS = 16, 2048, 5

model = build_random_model("smollm2-135m", torch.device("cuda"), torch.bfloat16)
out = open(sys.argv[1], "w")
for policy in sys.argv[2].split(","):
    config = TandemConfig(policy=policy)
    runner = RowsRunner(model, use_graphs=False, slots=BATCH, config=config)
    caches = []
    with torch.inference_mode():
        for b in range(BATCH):
            cache = TandemCache.for_model(model, config)
            runner.attach(cache)
            for kv in cache.tandem_layers():
                kv.capacity_hint = PROMPT + 40
            ids = torch.randint(0, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(b))
            model(input_ids=ids.cuda(), use_cache=True, logits_to_keep=1, past_key_values=cache)
            caches.append(cache)
        for _ in range(STEPS):
            runner.step(caches, [1] * BATCH, [c.get_seq_length() for c in caches])
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        start = time.perf_counter()
        profile.enable()
        for _ in range(STEPS):
            runner.step(caches, [1] * BATCH, [c.get_seq_length() for c in caches])
        profile.disable()
        ms = (time.perf_counter() - start) * 1e3 / STEPS
    for order, count in (("tottime", 25), ("cumtime", 30)):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(count)
        head = (
            f"== {policy} B={BATCH} pooled eager {ms:.1f} ms/step (profiled)\n" if order == "tottime" else ""
        )
        out.write(head + text.getvalue())
    runner.release()
    del caches, runner
    torch.cuda.empty_cache()
