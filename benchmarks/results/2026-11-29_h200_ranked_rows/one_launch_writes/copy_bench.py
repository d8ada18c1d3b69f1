import time

import torch

dev = torch.device("cuda")
ring = torch.randn(1, 3, 300, 64, device=dev, dtype=torch.bfloat16)
host = torch.zeros(1, 3, 4096, 64, dtype=torch.bfloat16, pin_memory=True)
hostc = torch.zeros(3 * 16 * 64, dtype=torch.bfloat16, pin_memory=True)
side = torch.cuda.Stream()
def run(name, fn, n=200):
    for i in range(20):
        fn(i)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    py = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    tot = (time.perf_counter() - t) / n * 1e6
    print(f"{name:40s} {py:7.1f} us/call in Python, {tot:7.1f} with the sync")
run("noncontig D2H nb", lambda i: host[:, :, (i % 200) * 16:(i % 200) * 16 + 16].copy_(ring[:, :, 16:32], non_blocking=True))
run("contig src, noncontig dst nb", lambda i: host[:, :, (i % 200) * 16:(i % 200) * 16 + 16].copy_(ring[:, :, 16:32].contiguous(), non_blocking=True))
run("contig both nb", lambda i: hostc.copy_(ring[:, :, 16:32].reshape(-1), non_blocking=True))
def side_copy(i):
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host[:, :, (i % 200) * 16:(i % 200) * 16 + 16].copy_(ring[:, :, 16:32], non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(side)
run("noncontig D2H on side stream + event", side_copy)
srcc = torch.randn(3 * 16 * 64, device=dev, dtype=torch.bfloat16)
run("contig src (no kernel), contig pinned dst nb", lambda i: hostc.copy_(srcc, non_blocking=True))
run("D2D small copy", lambda i: srcc.copy_(ring[:, :, 16:32].reshape(-1)))
run("amin", lambda i: ring[:, :, 16:32].amin(dim=2))
run("event create+record", lambda i: torch.cuda.Event().record(side))
