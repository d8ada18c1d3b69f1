"""The GPU running out of memory, for real (on the GPU host): at engine start (prefill) and mid-run (the hot
ring growing while decoding with CUDA graphs). torch's allocator is capped with
`torch.cuda.set_per_process_memory_fraction`, so the failure is the allocator's own, not a simulation. Each
must end in a MemoryError naming what needs less, leave the cache refusing further use, leave no thread or
step behind, and give all the device memory back once the cache and runner are dropped.
(tests/test_hardening.py checks the same paths on CPU with the error injected.)"""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner
from tests.tiny import tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
MiB = 2**20


@contextlib.contextmanager
def device_memory_capped_at(extra_bytes: int):
    """torch's allocator may hold only what it holds now, and about `extra_bytes` of it is free: the cap stops new
    segments, and filler tensors take the free space inside the segments it holds (prefill leaves hundreds of
    MiB of it), all but `extra_bytes` in 2 MiB pieces."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)
    fillers = []
    try:
        with contextlib.suppress(torch.OutOfMemoryError):
            while len(fillers) < 1 << 16:
                fillers.append(torch.empty(2 * MiB, dtype=torch.uint8, device="cuda"))
        del fillers[: -(-extra_bytes // (2 * MiB))]
        yield
    finally:
        fillers.clear()
        torch.cuda.set_per_process_memory_fraction(1.0)


def _settled_allocated() -> int:
    """Device memory allocated once garbage and the allocator's cache are gone. Measured after a first run
    of the same kind (`_works`): cuBLAS keeps a workspace per stream from its first call, tens of MiB."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _model():
    return tiny_model("Llama", max_position_embeddings=1 << 20).cuda()


def _works(model, config) -> None:
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache)
    first = runner.prefill(torch.randint(0, 128, (2, 300), device="cuda")).argmax(-1)
    tokens, _ = runner.decode(first, 8)
    assert tokens.shape == (2, 8)


def test_out_of_device_memory_in_prefill_is_a_memory_error_and_frees_everything():
    model = _model()
    config = TandemConfig(policy="quest", sink_tokens=4, window_tokens=256, block_size=16)
    _works(model, config)
    baseline = _settled_allocated()
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache)
    prompt = torch.randint(0, 128, (8, 32768), device="cuda")
    with device_memory_capped_at(64 * MiB), pytest.raises(MemoryError) as caught:
        runner.prefill(prompt, chunk_tokens=32768)  # one chunk's attention alone needs GiBs
    assert "ran out of memory during prefill of 8 x 32768 tokens in chunks of 32768" in str(caught.value)
    assert "chunk_tokens" in str(caught.value)
    with pytest.raises(RuntimeError, match="unusable"):
        runner.prefill(prompt[:, :16])
    del runner, cache, caught
    assert _settled_allocated() <= baseline + prompt.nbytes + 1 * MiB
    _works(model, config)


@pytest.mark.parametrize("use_graphs", [True, False])
def test_out_of_device_memory_mid_decode_is_a_memory_error_and_frees_everything(use_graphs):
    model = _model()
    config = TandemConfig(policy="quest", sink_tokens=4, window_tokens=1 << 16, block_size=16)
    _works(model, config)
    baseline = _settled_allocated()
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache, use_graphs=use_graphs)
    batch = 64
    first = runner.prefill(torch.randint(0, 128, (batch, 2048), device="cuda")).argmax(-1)
    hot = cache.tandem_layers()[0].hot
    assert hot.allocated_blocks < hot.ring_blocks  # the ring was sized for the prompt: decoding grows it
    runner.decode(first, 4)  # warm: graphs recorded, buffers allocated
    ring_bytes = hot.keys.nbytes
    assert ring_bytes > 8 * MiB
    threads = {t.name for t in threading.enumerate()}
    with device_memory_capped_at(ring_bytes // 2), pytest.raises(MemoryError) as caught:
        runner.decode(first, 4096)  # the ring doubles before 4096 tokens: a new one needs 2 x ring_bytes
    message = str(caught.value)
    assert "window_tokens" in message and (
        "ring could not grow" in message or "during decode step" in message
    )
    assert cache.step_context is None
    assert {t.name for t in threading.enumerate()} <= threads  # no thread left waiting on a flag
    with pytest.raises(RuntimeError, match="unusable"):
        runner.decode(first, 1)
    del runner, cache, hot, caught
    assert _settled_allocated() <= baseline + first.nbytes + 1 * MiB
    _works(model, config)
