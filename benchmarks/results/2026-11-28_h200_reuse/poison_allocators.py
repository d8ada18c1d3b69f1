"""pytest plugin (scratch): before each test, fill freed CUDA (and pinned host) allocator memory with NaN."""

import os

import pytest
import torch


def poison(value=float("nan")):
    if not torch.cuda.is_available():
        return
    keep = []
    for size in [512, 4096, 65536, 1 << 20, 2 << 20, 8 << 20, 64 << 20]:
        n = (256 << 20) // size if size >= (1 << 20) else 2000
        for _ in range(n):
            keep.append(torch.full((size // 4,), value, device="cuda"))
    torch.cuda.synchronize()
    del keep
    if os.environ.get("POISON_PINNED"):
        keep = [
            torch.full((s // 4,), value).pin_memory()
            for s in [1 << i for i in range(9, 23)]
            for _ in range(32)
        ]
        del keep


@pytest.fixture(autouse=True)
def _poison_allocators():
    poison(float(os.environ.get("POISON_VALUE", "nan")))
    yield
