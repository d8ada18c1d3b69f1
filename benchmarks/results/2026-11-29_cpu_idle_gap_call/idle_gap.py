"""Time of one prepared ranked-rows call (`cpu.RankedRowsAttention`, 16 requests, 3 KV heads x 3, head_dim 64,
2,048-row bf16 stores, 7 ranked 16-row blocks each) called back to back and after idle gaps of 1, 10 and 30 ms,
30 calls each, on this machine's cores: python idle_gap.py"""

import time

import torch

from tandem import manifest
from tandem.kernels import ops

print(manifest.machine())
gen = torch.Generator().manual_seed(0)
batch, kv_heads, group, dim, block_size = 16, 3, 3, 64, 16
shape = (1, kv_heads, 2048, dim)
stores = [
    (
        torch.randn(shape, generator=gen).bfloat16(),
        torch.randn(shape, generator=gen).bfloat16(),
        None,
        None,
        None,
    )
    for _ in range(batch)
]
q = torch.randn(batch, kv_heads * group, dim).bfloat16()
ranked = torch.stack(
    [torch.stack([torch.randperm(128, generator=gen)[:7] for _ in range(kv_heads)]) for _ in range(batch)]
).contiguous()
out, lse = torch.zeros(batch, kv_heads * group, dim), torch.zeros(batch, kv_heads * group)
call = ops.ranked_rows_call(q, stores, ranked, 0.125, block_size, out, lse)
call.counts.fill_(7)
for gap in (0, 0.001, 0.01, 0.03):
    times = []
    for _ in range(30):
        if gap:
            time.sleep(gap)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"gap {gap * 1e3:.0f} ms: median {times[15] * 1e6:.0f} us, max {times[-1] * 1e6:.0f} us")
