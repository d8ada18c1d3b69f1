"""The two KV tiers and the layer cache that moves tokens between them.

Every token carries its identity in its key (keys[..., 0] = position, keys[..., 1] = request, keys[..., 2] =
KV head; values[..., 0] = position + 0.5), so the tests can tell exactly where each token ended up.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from tandem.cache import host as host_module
from tandem.cache import memory
from tandem.cache.host import HostMemoryError, HostTier
from tandem.cache.hot import HotTier
from tandem.cache.layer import LayerKV
from tandem.config import CertifiedConfig, HostConfig, TandemConfig
from tandem.policies.certify import block_digest, key_sketch

BATCH, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, BLOCK = 2, 2, 4, 8, 4


@pytest.fixture(autouse=True)
def one_torch_thread():
    # these tensors are tiny: intra-op threads only add spin-wait overhead on a busy 2-core box
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_host(dtype=torch.float32, pin=False):
    return HostTier(
        BATCH, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, dtype, BLOCK, pin=pin, keep_digest=True, keep_maw=True
    )


def random_blocks(gen, num_blocks, dtype, with_maw=True):
    n = num_blocks * BLOCK
    keys = torch.randn(BATCH, NUM_KV_HEADS, n, HEAD_DIM, generator=gen).to(dtype)
    values = torch.randn(BATCH, NUM_KV_HEADS, n, HEAD_DIM, generator=gen).to(dtype)
    valid = torch.rand(BATCH, n, generator=gen) > 0.2
    if torch.rand(1, generator=gen) < 0.15:
        valid[1, :BLOCK] = False  # a block of padding only: its digest is empty
    maw = torch.rand(BATCH, NUM_Q_HEADS, n, generator=gen) if with_maw else None
    return keys, values, valid, maw


def digest_by_loop(keys, valid):
    """Per block and request: min/max over the block's valid rows (+inf/-inf when it has none)."""
    batch, heads, rows, head_dim = keys.shape
    key_min = torch.full((batch, heads, rows // BLOCK, head_dim), math.inf, dtype=keys.dtype)
    key_max = torch.full_like(key_min, -math.inf)
    for b in range(batch):
        for j in range(rows // BLOCK):
            sel = valid[b, j * BLOCK : (j + 1) * BLOCK]
            if sel.any():
                part = keys[b, :, j * BLOCK : (j + 1) * BLOCK][:, sel]
                key_min[b, :, j], key_max[b, :, j] = part.amin(dim=1), part.amax(dim=1)
    return key_min, key_max


def host_bytes(capacity, element_size):
    kv = 2 * BATCH * NUM_KV_HEADS * capacity * HEAD_DIM * element_size
    digest = 2 * BATCH * NUM_KV_HEADS * (capacity // BLOCK) * HEAD_DIM * element_size
    return kv + BATCH * capacity + digest + BATCH * NUM_Q_HEADS * capacity * 4


# ---- host tier --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_tier_grows_geometrically_and_keeps_content(dtype):
    gen = torch.Generator().manual_seed(0)
    host = make_host(dtype)
    assert host.nbytes() == 0 and host.valid_rows().tolist() == [0, 0] and host.valid_blocks_total() == 0
    chunks, growths = [], 0
    for i in range(200):
        old_capacity = host.capacity
        chunk = random_blocks(gen, 1 + i % 3, dtype, with_maw=i % 5 != 0)
        first = host.append(*chunk)
        assert first == sum(c[0].shape[2] for c in chunks)
        chunks.append(chunk)
        assert host.rows % BLOCK == 0 and host.capacity % BLOCK == 0 and host.rows <= host.capacity
        assert host.capacity <= max(64 * BLOCK, 1.5 * host.rows + BLOCK)  # never far more than needed
        if host.capacity != old_capacity:
            growths += 1
            assert host.capacity >= 1.5 * old_capacity  # geometric: appends stay amortized O(1)
            check_host_content(host, chunks)
        assert host.nbytes() == host_bytes(host.capacity, torch.empty((), dtype=dtype).element_size())
    assert host.rows == sum(1 + i % 3 for i in range(200)) * BLOCK
    assert growths <= 1 + math.ceil(math.log(host.rows / (64 * BLOCK), 1.5))  # O(log n): here 4
    check_host_content(host, chunks)


def check_host_content(host, chunks):
    keys, values, valid = host.live()
    assert torch.equal(keys, torch.cat([c[0] for c in chunks], dim=2))
    assert torch.equal(values, torch.cat([c[1] for c in chunks], dim=2))
    assert torch.equal(valid, torch.cat([c[2] for c in chunks], dim=1))
    maw = torch.cat(
        [c[3] if c[3] is not None else torch.zeros(BATCH, NUM_Q_HEADS, c[0].shape[2]) for c in chunks], 2
    )
    assert torch.equal(host.maw[:, :, : host.rows], maw)  # appends without maw start at 0
    assert torch.equal(host.valid_rows(), valid.sum(dim=1))
    # counted as rows arrive: blocks with a non-padding row (a block of padding only is not one)
    assert host.valid_blocks_total() == int(valid.view(BATCH, -1, BLOCK).any(-1).sum())
    key_min, key_max = host.digest()
    ref_min, ref_max = digest_by_loop(keys, valid)
    assert torch.equal(key_min, ref_min) and torch.equal(key_max, ref_max)


def check_certified_digests(host):
    """The certified selection's digests and key sketch on the bounds device equal those of the live rows, and
    past them there are no rows."""
    keys, values, valid = host.live()
    n, nb = host.rows, host.rows // host.block_size
    digests = block_digest(keys, values, valid, BLOCK)
    for name, expected in zip(("key_centre_dev", "key_radius_dev", "value_norm_dev"), digests):
        assert torch.equal(getattr(host, name)[:, :, :nb], expected), name
    sketch = key_sketch(keys, valid)
    for name, expected in zip(("key_codes_dev", "key_code_scale_dev", "key_code_error_dev"), sketch):
        assert torch.equal(getattr(host, name)[:, :, :n], expected), name
    assert torch.equal(host.block_rows_dev[:, :nb], valid.view(BATCH, nb, BLOCK).sum(-1).float())
    assert torch.equal(host.row_valid_dev[:, :n], valid)
    assert not host.block_rows_dev[:, nb:].any() and not host.row_valid_dev[:, n:].any()
    decoded = host.key_codes_dev[:, :, :n].float() * host.key_code_scale_dev[:, :, :n, None]
    inside = (keys.float() - decoded).norm(dim=-1) <= host.key_code_error_dev[:, :, :n]
    assert torch.all(inside | ~valid[:, None]), "a live row outside its sketch's error radius"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_tier_keeps_the_certified_digests_and_key_sketch_through_growth(dtype):
    gen = torch.Generator().manual_seed(5)
    host = HostTier(
        BATCH, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, dtype, BLOCK, pin=False, keep_digest=True, keep_maw=False,
        bounds_device=torch.device("cpu"),
    )  # fmt: skip
    growths = 0
    for i in range(120):
        capacity = host.capacity
        host.append(*random_blocks(gen, 1 + i % 3, dtype, with_maw=False)[:3])
        if host.capacity != capacity:
            growths += 1
            check_certified_digests(host)
    assert growths >= 2
    check_certified_digests(host)
    cap, nb = host.capacity, host.capacity // BLOCK
    # centre, radius and value norm per block; rows per block; codes, scale and error per row; row valid
    digests = BATCH * NUM_KV_HEADS * nb * (HEAD_DIM + 2) * 4 + BATCH * nb * 4
    sketch = BATCH * NUM_KV_HEADS * cap * (HEAD_DIM + 4 + 4) + BATCH * cap
    assert host.device_nbytes() == digests + sketch


@pytest.mark.parametrize("quant", [None, "int8"])
def test_staged_rows_stay_invisible_until_appended_and_then_equal_a_plain_append(quant):
    """`stage` writes the next blocks past the live rows (growing the store first if needed), their certified bounds and
    key sketch included, without making them live: rows, live() and the device-side markers (the mirror's
    block_valid_dev, block_rows_dev, row_valid_dev) do not see them. `append(..., staged=True)` then
    leaves every store as a plain `append` of the same blocks does."""
    gen = torch.Generator().manual_seed(9)

    def host():
        return HostTier(
            BATCH, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, torch.float32, BLOCK, pin=False, keep_digest=True,
            keep_maw=quant is None, mirror_device=torch.device("cpu"), quant=quant,
            bounds_device=torch.device("cpu") if quant is None else None,
        )  # fmt: skip

    plain, staged = host(), host()
    for _ in range(70):  # past the first capacity (64 blocks): stage grows the store
        keys, values, valid, maw = random_blocks(gen, 1, torch.float32, with_maw=quant is None)
        plain.append(keys, values, valid, maw)
        rows, generation = staged.rows, staged.generation
        staged.stage(keys, values, valid)
        assert staged.rows == rows and staged.staged == BLOCK
        nb = rows // BLOCK
        assert not staged.block_valid_dev[:, nb:].any()  # no ranking on the device sees the staged block
        if staged.bounds_device is not None:
            assert not staged.block_rows_dev[:, nb:].any() and not staged.row_valid_dev[:, rows:].any()
        assert staged.live()[0].shape[2] == rows
        if staged.generation != generation:
            assert torch.equal(staged.keys[:, :, rows : rows + BLOCK], plain.keys[:, :, rows : rows + BLOCK])
        assert staged.append(keys, values, valid, maw, staged=True) == rows and staged.staged == 0
    names = ["keys", "values", "valid", "key_min", "key_max", "key_min_dev", "key_max_dev", "block_valid_dev"]
    names += (
        ["key_scale", "value_scale"]
        if quant
        else ["maw", "key_centre_dev", "key_radius_dev", "value_norm_dev", "block_rows_dev", "row_valid_dev"]
        + ["key_codes_dev", "key_code_scale_dev", "key_code_error_dev"]
    )
    assert (staged.rows, staged.capacity) == (plain.rows, plain.capacity)
    for name in names:
        assert torch.equal(getattr(staged, name), getattr(plain, name)), name
    with pytest.raises(RuntimeError, match="4 rows: 0 are staged"):
        staged.append(keys, values, valid, staged=True)


def test_an_append_over_staged_rows_writes_them_again():
    """A bulk append (a prompt continued after decoding) starts at the live rows: staged rows there are replaced."""
    gen = torch.Generator().manual_seed(10)
    host = make_host()
    first = random_blocks(gen, 1, torch.float32)
    host.stage(*first[:3])
    chunk = random_blocks(gen, 2, torch.float32)
    assert host.append(*chunk) == 0 and host.staged == 0
    check_host_content(host, [chunk])


def test_a_cleared_tier_counts_only_its_new_rows():
    """`clear` (a cache reused for another request) starts the incremental counts again."""
    gen = torch.Generator().manual_seed(11)
    host = make_host()
    host.append(*random_blocks(gen, 3, torch.float32))
    assert host.valid_blocks_total() > 0
    host.clear()
    assert host.valid_blocks_total() == 0 and host.valid_total() == 0
    chunk = random_blocks(gen, 2, torch.float32)
    chunk[2][0, :BLOCK] = False  # a block of padding only
    host.append(*chunk)
    check_host_content(host, [chunk])


def test_host_tier_failed_growth_raises_host_memory_error_and_keeps_state(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    host = make_host()
    chunks = [random_blocks(gen, 64, torch.float32)]
    host.append(*chunks[0])
    assert (host.rows, host.capacity) == (256, 288)  # the first allocation leaves an eighth for the decode
    chunks.append(random_blocks(gen, 8, torch.float32))  # exactly the first capacity
    host.append(*chunks[-1])
    assert (host.rows, host.capacity) == (288, 288)

    def no_memory(self, shape, dtype):
        raise MemoryError()

    # reserve() turns a plain MemoryError from any of its allocations into HostMemoryError
    monkeypatch.setattr(HostTier, "_zeros", no_memory)
    with pytest.raises(HostMemoryError, match=r"host memory exhausted .* 432 rows") as info:
        host.append(*random_blocks(gen, 1, torch.float32))
    assert isinstance(info.value, MemoryError) and type(info.value.__cause__) is MemoryError
    assert (host.rows, host.capacity) == (288, 288)
    check_host_content(host, chunks)
    monkeypatch.undo()
    chunks.append(random_blocks(gen, 1, torch.float32))
    assert host.append(*chunks[-1]) == 288
    check_host_content(host, chunks)


@pytest.mark.parametrize("pin", [False, True])
def test_host_tier_allocator_runtime_error_becomes_host_memory_error(monkeypatch, pin):
    def failing_zeros(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    host = make_host(pin=pin)
    # pinned allocations fail with RuntimeError; _zeros itself must translate it
    monkeypatch.setattr(torch, "zeros", failing_zeros)
    with pytest.raises(HostMemoryError) as info:
        host.append(*random_blocks(torch.Generator().manual_seed(2), 1, torch.float32))
    message = str(info.value)
    assert "GiB" in message and "reduce the batch size or context length" in message
    assert "simulated" in message and ("pinned host memory" in message) == pin
    assert isinstance(info.value.__cause__, RuntimeError)
    assert (host.rows, host.capacity, host.keys) == (0, 0, None)


# ---- host memory --------------------------------------------------------------------------------------------

HUGE = memory.HUGE_PAGE


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls; `register_error` is what register returns."""

    def __init__(self, register_error=0):
        self.register_error, self.registered, self.unregistered = register_error, [], []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered.append((ptr, nbytes, flags))
        return self.register_error

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


needs_thp = pytest.mark.skipif(not memory.huge_pages_supported(), reason="no transparent huge pages here")


@needs_thp
def test_host_zeros_maps_large_stores_and_frees_them_with_the_last_view(monkeypatch):
    freed = []
    monkeypatch.setattr(memory._Mapping, "__del__", lambda self: freed.append(len(self)))
    t = memory.host_zeros((3, HUGE // 4), torch.bfloat16, pin=False)
    assert t.shape == (3, HUGE // 4) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    t.copy_(torch.arange(t.numel()).view(t.shape))  # writable, every byte
    assert torch.equal(t.flatten()[-3:].float(), torch.arange(t.numel())[-3:].bfloat16().float())
    view = t[1:, 5:]
    del t
    assert freed == []  # a view keeps the mapping
    del view
    assert freed == [3 * HUGE // 2]


def test_host_zeros_small_or_not_huge_is_a_plain_tensor(monkeypatch):
    monkeypatch.setattr(memory, "_Mapping", None)  # any use of the mapping path would fail
    assert memory.host_zeros((4, 16), torch.float32, pin=False).shape == (4, 16)
    assert memory.host_zeros((HUGE,), torch.float32, pin=False, huge=False).shape == (HUGE,)


@needs_thp
def test_host_zeros_pinned_registers_the_mapping_until_the_last_view_dies(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    t = memory.host_zeros((2, HUGE), torch.float16, pin=True)
    ptr = t.data_ptr()
    assert cudart.registered == [(ptr, 4 * HUGE, 3)] and cudart.unregistered == []  # mapped + portable
    view = t[1]
    del t
    assert cudart.unregistered == []
    del view
    assert cudart.unregistered == [ptr]


@needs_thp
def test_host_tier_failed_registration_becomes_host_memory_error(monkeypatch):
    cudart = FakeCudart(register_error=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    host = HostTier(1, 8, 8, 128, torch.bfloat16, 16, pin=True, keep_digest=False, keep_maw=False)
    with pytest.raises(HostMemoryError, match=r"pinned host memory .*cudaHostRegister") as info:
        host.reserve(HUGE // 256)
    assert (host.rows, host.capacity, host.keys) == (0, 0, None)
    assert isinstance(info.value.__cause__, MemoryError)
    assert len(cudart.registered) == 1 and cudart.unregistered == []  # the failed one was never registered


@pytest.mark.parametrize("huge_pages", [False, True])
def test_layer_passes_huge_pages_to_its_host_tier(huge_pages):
    cfg = TandemConfig(
        policy="quest",
        device="cpu",
        sink_tokens=4,
        window_tokens=8,
        block_size=BLOCK,
        host=HostConfig(huge_pages=huge_pages),
    )
    layer = LayerKV(cfg, 0, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    keys = torch.randn(1, NUM_KV_HEADS, 40, HEAD_DIM)
    layer.append(keys, keys.clone(), torch.ones(1, 40, dtype=torch.bool))
    assert layer.host is not None and layer.host.huge_pages is huge_pages


@pytest.mark.parametrize("huge_pages", [False, True])
def test_host_tier_on_huge_pages_or_not_keeps_the_same_content(huge_pages):
    gen = torch.Generator().manual_seed(3)
    host = HostTier(1, 8, 8, 128, torch.bfloat16, 16, pin=False, keep_digest=True, keep_maw=False,
                    huge_pages=huge_pages)  # fmt: skip
    keys, values = (torch.randn(1, 8, 3000, 128, generator=gen).bfloat16() for _ in range(2))
    valid = torch.ones(1, 3000, dtype=torch.bool)
    host.append(keys[:, :, :2048], values[:, :, :2048], valid[:, :2048])
    host.append(keys[:, :, 2048:2992], values[:, :, 2048:2992], valid[:, 2048:2992])  # grows past 2 MiB
    assert host.keys.numel() * 2 >= HUGE
    assert torch.equal(host.keys[:, :, :2992], keys[:, :, :2992])
    assert torch.equal(host.values[:, :, :2992], values[:, :, :2992])


# ---- hot tier ---------------------------------------------------------------------------------------------


def test_hot_tier_take_free_block_clears_only_that_block():
    hot = HotTier(
        BATCH, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"),
        sink_slots=3, ring_blocks=3, block_size=BLOCK, keep_maw=True,
    )  # fmt: skip
    slots = 3 + 3 * BLOCK
    assert hot.keys.shape == (BATCH, NUM_KV_HEADS, slots, HEAD_DIM) and hot.valid.shape == (BATCH, slots)
    hot.valid[:] = True  # every slot holds a token, as after the ring filled up
    assert hot.take_free_block() == 0
    assert not hot.valid[:, 3 : 3 + BLOCK].any()
    assert hot.valid[:, :3].all() and hot.valid[:, 3 + BLOCK :].all()
    hot.valid[:] = True
    hot.release([0], None)
    assert [hot.take_free_block() for _ in range(2)] == [1, 2]  # FIFO: the released block comes last
    assert not hot.valid[:, 3 + BLOCK :].any() and hot.valid[:, : 3 + BLOCK].all()
    assert hot.take_free_block() == 0
    assert not hot.valid[:, 3:].any() and hot.valid[:, :3].all()
    assert hot.free == []


def test_hot_tier_takes_blocks_by_runs():
    """`take_free_blocks` gives the free blocks in their order and clears exactly their slots, one fill per run of
    adjacent blocks; `ordered_ring` reads a ring laid over several runs in token order."""
    assert HotTier.block_runs([]) == []
    assert HotTier.block_runs([3, 4, 5, 0, 1, 7]) == [(3, 3), (0, 2), (7, 1)]
    hot = HotTier(
        BATCH, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"),
        sink_slots=2, ring_blocks=4, block_size=BLOCK, keep_maw=False,
    )  # fmt: skip
    hot.free = [2, 3, 0, 1]
    hot.valid[:] = True
    assert hot.take_free_blocks(3) == [2, 3, 0] and hot.free == [1]
    assert not hot.valid[:, 2 : 2 + BLOCK].any() and not hot.valid[:, 2 + 2 * BLOCK :].any()
    assert hot.valid[:, :2].all() and hot.valid[:, 2 + BLOCK : 2 + 2 * BLOCK].all()
    tokens = torch.arange(3 * BLOCK, dtype=torch.float32)
    hot.order, hot.tail_fill = [2, 3, 0], BLOCK - 1
    for i, block in enumerate(hot.order):
        start = hot.block_start(block)
        hot.keys[:, :, start : start + BLOCK, 0] = tokens[i * BLOCK : (i + 1) * BLOCK]
    keys, _, valid, maw = hot.ordered_ring()
    assert torch.equal(keys[0, 0, :, 0], tokens[: 3 * BLOCK - 1]) and maw is None
    assert valid.shape == (BATCH, 3 * BLOCK - 1)


# ---- layer cache ------------------------------------------------------------------------------------------

SCHEDULES = {
    # token counts of successive appends; the first prompt left-pads request 1 by 6 tokens
    "bulk_then_single": [61] + [1] * 30 + [27] + [1] * 13 + [113] + [1] * 5,
    "single_from_start": [1] * 70,
    "short_prompt_then_bulk": [3, 1, 1, 50, 1, 9, 1, 61, 2],
    # appends shorter than the ring once it wraps: its newest block topped up, then runs of free blocks
    "chunks_under_the_ring": [30] + [1] * 5 + [5, 2, 7, 1, 9, 1, 6, 3],
}


class Feeder:
    """Appends tokens whose keys encode (position, request, head); remembers the real ones."""

    def __init__(self, pads):
        self.pads = pads
        self.total = 0
        self.expected = Counter()
        self.gen = torch.Generator().manual_seed(len(pads) + sum(pads))

    def next(self, m):
        pos = torch.arange(self.total, self.total + m, dtype=torch.float32)
        keys = torch.randn(BATCH, NUM_KV_HEADS, m, HEAD_DIM, generator=self.gen)
        keys[..., 0] = pos
        keys[..., 1] = torch.arange(BATCH, dtype=torch.float32)[:, None, None]
        keys[..., 2] = torch.arange(NUM_KV_HEADS, dtype=torch.float32)[None, :, None]
        values = torch.randn(BATCH, NUM_KV_HEADS, m, HEAD_DIM, generator=self.gen)
        values[..., 0] = pos + 0.5
        valid = pos[None, :] >= torch.tensor(self.pads, dtype=torch.float32)[:, None]
        for b in range(BATCH):
            self.expected.update((b, int(p)) for p in pos[valid[b]])
        self.total += m
        return keys, values, valid


def tokens_in(keys, values, valid):
    """(request, position) of every valid slot of a tier, after checking its key/value identity fields."""
    found = []
    for b in range(BATCH):
        slots = valid[b].nonzero().flatten()
        k, v = keys[b][:, slots].float(), values[b][:, slots].float()  # [Hkv, n, D]
        assert (k[..., 1] == b).all(), "token of another request"
        assert torch.equal(
            k[..., 2], torch.arange(NUM_KV_HEADS, dtype=torch.float32)[:, None].expand_as(k[..., 2])
        )
        assert (k[..., 0] == k[:1, :, 0]).all(), "heads of one slot hold different tokens"
        assert torch.equal(v[..., 0], k[..., 0] + 0.5), "value does not belong to its key"
        found += [(b, int(p)) for p in k[0, :, 0]]
    return found


def check_layer(layer, feeder, cfg, window, hot_buffers):
    hot, host = layer.hot, layer.host
    assert layer.seq_len == feeder.total
    # the hot tier moves only when its ring grows (generation counts the moves), by doubling, up to the window
    generation, buffers = hot_buffers
    if hot.generation == generation:
        assert [(t.data_ptr(), t.shape) for t in (hot.keys, hot.values, hot.valid)] == buffers
    assert hot.allocated_blocks <= hot.ring_blocks
    assert hot.keys.shape[2] == hot.sink_slots + hot.allocated_blocks * hot.block_size
    assert len(hot.order) <= hot.ring_blocks and hot.sink_used <= hot.sink_slots
    assert host.rows % cfg.block_size == 0
    hot_tokens = tokens_in(hot.keys, hot.values, hot.valid)
    host_tokens = tokens_in(*host.live()) if host.rows else []
    assert Counter(hot_tokens) + Counter(host_tokens) == feeder.expected, "tokens lost or duplicated"
    assert len(hot_tokens) + len(host_tokens) == feeder.expected.total()
    hot_set = set(hot_tokens)
    sink_keys = hot.keys[:, 0, : hot.sink_slots, 0]
    for b, pad in enumerate(feeder.pads):
        # the first sink_tokens real tokens of every request stay in the sink slots
        sinks = range(pad, min(pad + cfg.sink_tokens, feeder.total))
        assert all((b, p) in hot_set for p in sinks)
        assert set(sinks) <= {int(p) for p in sink_keys[b][hot.valid[b, : hot.sink_slots]]}
        # the recent window stays on the device too
        recent = range(max(pad, feeder.total - window), feeder.total)
        assert all((b, p) in hot_set for p in recent)
    if layer.policy.needs_digest:
        if host.rows:
            key_min, key_max = host.digest()
            ref_min, ref_max = digest_by_loop(*host.live()[0::2])
            assert torch.equal(key_min, ref_min) and torch.equal(key_max, ref_max)
    else:
        assert host.key_min is None
    if host.bounds_device is not None and host.rows:
        check_certified_digests(host)
    if layer.policy.needs_maw:
        assert hot.maw is not None and hot.maw.shape == (BATCH, NUM_Q_HEADS, hot.keys.shape[2])
        if host.rows:
            assert (
                host.maw.shape[:2] == (BATCH, NUM_Q_HEADS)
                and torch.isfinite(host.maw[:, :, : host.rows]).all()
            )
    else:
        assert hot.maw is None and host.maw is None


@pytest.mark.parametrize("window_tokens", [10, 0.25])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("policy", ["full", "streaming", "hgca", "quest", "quest-certified"])
def test_layer_keeps_every_token_exactly_once(policy, schedule, window_tokens):
    certified = policy == "quest-certified"
    cfg = TandemConfig(
        policy="quest" if certified else policy,
        certified=CertifiedConfig(epsilon=0.05 if certified else None),
        device="cpu",
        sink_tokens=4,
        window_tokens=window_tokens,
        block_size=BLOCK,
        host=HostConfig(threads=1),
    )
    layer = LayerKV(cfg, 0, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    sizes = SCHEDULES[schedule]
    pads = [0, min(6, sizes[0] - 1)]
    feeder = Feeder(pads)
    window = cfg.window_for_prompt(sizes[0] - max(pads))
    hot_buffers = None
    for m in sizes:
        layer.append(*feeder.next(m))
        if hot_buffers is None:
            hot = layer.hot
            assert hot.sink_slots == cfg.sink_tokens + max(pads)
            assert hot.ring_blocks == math.ceil(window / BLOCK) + 1
            hot_buffers = (
                hot.generation,
                [(t.data_ptr(), t.shape) for t in (hot.keys, hot.values, hot.valid)],
            )
        check_layer(layer, feeder, cfg, window, hot_buffers)
        if layer.hot.generation != hot_buffers[0]:
            hot = layer.hot
            hot_buffers = (
                hot.generation,
                [(t.data_ptr(), t.shape) for t in (hot.keys, hot.values, hot.valid)],
            )
    assert layer.host.rows > 0  # the schedule did evict


def _short_prompt_under_a_wide_window():
    """(config, layer, feeder): 8 tokens of 2 requests in a layer whose window holds 64."""
    cfg = TandemConfig(
        policy="full",
        device="cpu",
        sink_tokens=4,
        window_tokens=64,
        block_size=BLOCK,
        host=HostConfig(threads=1),
    )
    layer = LayerKV(cfg, 0, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    feeder = Feeder([0, 0])
    layer.append(*feeder.next(8))
    return cfg, layer, feeder


def test_hot_ring_grows_with_the_sequence_and_keeps_every_token():
    """A short prompt under a wide window allocates a ring for its own tokens; decoding doubles it (each move
    counted by `generation`) up to the window's blocks, and no token is lost or duplicated on the way."""
    cfg, layer, feeder = _short_prompt_under_a_wide_window()
    hot = layer.hot
    max_blocks = math.ceil(64 / BLOCK) + 1
    assert hot.allocated_blocks < max_blocks and hot.generation == 0
    first_bytes = hot.nbytes()
    generations = [0]
    for _ in range(120):
        layer.append(*feeder.next(1))
        generations.append(hot.generation)
        buffers = [(t.data_ptr(), t.shape) for t in (hot.keys, hot.values, hot.valid)]
        check_layer(layer, feeder, cfg, 64, (hot.generation, buffers))  # every token once, in hot or host
    assert hot.allocated_blocks == max_blocks
    assert generations[-1] >= 2 and generations == sorted(generations)  # doubled, never shrank
    assert hot.nbytes() > first_bytes
    assert layer.host.rows > 0  # and the full ring then evicted to the host tier


def test_a_ring_that_cannot_grow_raises_memory_error_and_stays_as_it_was(monkeypatch):
    """Out of device memory while the ring doubles: a MemoryError naming window_tokens, before any of the
    tier's tensors is replaced, so the tier still holds every token and grows once memory is back."""
    cfg, layer, feeder = _short_prompt_under_a_wide_window()
    hot = layer.hot
    while hot.free or hot.tail_fill < BLOCK:  # fill what is allocated
        layer.append(*feeder.next(1))
    before = [t.clone() for t in (hot.keys, hot.values, hot.valid)]
    blocks, generation, calls = hot.allocated_blocks, hot.generation, {"n": 0}
    real_new_zeros = torch.Tensor.new_zeros

    def second_fails(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # keys granted, values refused
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_new_zeros(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_zeros", second_fails)
    with pytest.raises(MemoryError, match=r"ring could not grow from \d+ to \d+ blocks .*window_tokens"):
        hot._grow()
    monkeypatch.undo()
    assert (hot.allocated_blocks, hot.generation) == (blocks, generation)
    assert all(torch.equal(a, b) for a, b in zip(before, (hot.keys, hot.values, hot.valid)))
    layer.append(*feeder.next(1))  # memory is back: the ring grows and keeps every token
    assert hot.allocated_blocks > blocks
    check_layer(layer, feeder, cfg, 64, (-1, None))


@pytest.mark.parametrize("bound", ["sketch", "digest"])
def test_the_key_sketch_is_kept_only_for_the_sketch_bound(bound):
    cfg = TandemConfig(policy="quest", certified=CertifiedConfig(epsilon=0.05, bound=bound), device="cpu", sink_tokens=4, window_tokens=8, block_size=BLOCK, host=HostConfig(threads=1))  # fmt: skip
    layer = LayerKV(cfg, 0, num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    layer.append(*Feeder([0, 3]).next(61))
    host = layer.host
    assert host.rows > 0 and host.key_centre_dev is not None and host.block_rows_dev is not None
    sketch = [getattr(host, name) for name in ("key_codes_dev", "key_code_scale_dev", "key_code_error_dev")]
    if bound == "sketch":
        assert all(t is not None for t in sketch)
        check_certified_digests(host)
    else:  # the digest bound reads no sketch: none is allocated, and the device bytes say so
        assert all(t is None for t in sketch) and host.row_valid_dev is None
        rows_bytes = host.capacity * (NUM_KV_HEADS * (HEAD_DIM + 8) + 1) * BATCH
        sketched = LayerKV(
            dataclasses.replace(cfg, certified=dataclasses.replace(cfg.certified, bound="sketch")), 0, num_q_heads=NUM_Q_HEADS,
            num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        )  # fmt: skip
        sketched.append(*Feeder([0, 3]).next(61))
        assert sketched.host.device_nbytes() - host.device_nbytes() == rows_bytes


def test_contiguous_from_finds_where_slices_stop_being_strided():
    store = torch.zeros(2, 3, 40, 8)
    assert host_module._contiguous_from(store) == 0
    assert host_module._contiguous_from(store[:, :, 5:9]) == 2  # rows of a [B, H, cap, D] store: per (b, h)
    assert host_module._contiguous_from(store[:1, :1, 5:9]) == 0  # size-1 leading dims never break it
    assert host_module._contiguous_from(torch.zeros(2, 40, dtype=torch.bool)[:, 3:7]) == 1
    assert host_module._contiguous_from(store[:, :, :, 2:4]) == 3  # a slice of the last dim: per row


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_copies_into_rows_of_a_pinned_store_do_not_wait_for_the_gpu():
    """torch copies into a strided host view through a pageable temporary, which blocks the CPU until the GPU has
    run everything queued before the copy; `copy_to_host` copies each (request, head) slice asynchronously: the
    stream is still busy when the call returns, and the rows land where a plain copy puts them. More than
    MAX_SLICES small slices take torch's copy instead."""
    store = torch.zeros(2, 3, 64, 8, pin_memory=True)
    src = torch.randn(2, 3, 16, 8, device="cuda")
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the GPU busy for a while (about 0.1 s)
    host_module.copy_to_host(store[:, :, 10:26], src, non_blocking=True)
    assert not stream.query()  # the CPU did not wait for the sleep
    stream.synchronize()
    expected = torch.zeros(2, 3, 64, 8)
    expected[:, :, 10:26] = src.cpu()
    assert torch.equal(store, expected)
    valid = torch.zeros(2, 64, dtype=torch.bool, pin_memory=True)
    host_module.copy_to_host(
        valid[:, 4:8], torch.ones(2, 4, dtype=torch.bool, device="cuda"), non_blocking=True
    )
    stream.synchronize()
    assert valid.sum().item() == 8 and valid[:, 4:8].all()
    # many small slices (a large batch's evicted block) take torch's one copy, which waits for the GPU
    wide = torch.zeros(4, 8, 64, 8, pin_memory=True)
    torch.cuda._sleep(200_000_000)
    host_module.copy_to_host(wide[:, :, 16:32], torch.ones(4, 8, 16, 8, device="cuda"), non_blocking=True)
    assert stream.query() and wide.sum().item() == 4 * 8 * 16 * 8
