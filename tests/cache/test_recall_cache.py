"""Quest's recall cache (`gpu_cache`): recently selected host blocks kept on the compute device.

The selection is quest's own, so with the cache on a decode step must attend exactly the blocks it attends
without it, only reading some of them from device memory: the tests compare tokens, fractions attended and
row counts with the cache on and off, check the bookkeeping's invariants step by step against a plain-Python
model of it, and the copy kernel against its torch reference. On CPU the same orchestration runs with the
reference kernels (and Triton's interpreter for the kernel test); the `cuda` cases run the Triton kernels and
the engine's CUDA graphs."""

import pytest
import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.cache.recall import RecallCache
from tandem.config import DEFAULT_GPU_CACHE, QuestConfig
from tandem.kernels import gpu, reference
from tests.engine.test_engine import _hf_greedy, _run, _tiny

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
    ),
]


def _config(**extra):
    return TandemConfig(policy="quest", sink_tokens=4, window_tokens=12, block_size=4, **extra)


def _padded_prompts(device):
    """(ids, mask) of 2 random 160-token prompts, the second left-padded by 21 tokens."""
    ids = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(6)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :21] = 0
    return ids, mask


def test_config_refuses_a_cache_without_quest_or_without_a_device_share():
    with pytest.raises(ValueError, match=r"gpu_cache=2\.0 .*policy='quest'"):
        TandemConfig(policy="hgca", quest=QuestConfig(gpu_cache=2))
    with pytest.raises(ValueError, match=r"gpu_cache=2\.0 .*device share"):
        TandemConfig(policy="quest", quest=QuestConfig(gpu_share=0, gpu_cache=2))
    with pytest.raises(ValueError, match=r"gpu_cache=-1 .*\[0, 64\]"):
        TandemConfig(policy="quest", quest=QuestConfig(gpu_cache=-1))
    assert TandemConfig(policy="quest", quest=QuestConfig(gpu_cache=4)).quest.gpu_cache == 4.0
    # the default: on with a device share on CUDA only
    assert TandemConfig(policy="quest").quest.gpu_cache is None
    assert TandemConfig(policy="quest").gpu_cache_on("cuda") == DEFAULT_GPU_CACHE > 0
    assert TandemConfig(policy="quest").gpu_cache_on("cpu") == 0.0
    assert TandemConfig(policy="quest", quest=QuestConfig(gpu_share=0)).gpu_cache_on("cuda") == 0.0
    assert TandemConfig(policy="hgca").gpu_cache_on("cuda") == 0.0
    assert TandemConfig(policy="quest", quest=QuestConfig(gpu_share=0.5)).gpu_cache_on("cpu") == 0.0
    # on CPU the device share defaults to 0: the cache would never fill, so the first append says so
    model = _tiny()
    cache = TandemCache.for_model(model, _config(quest=QuestConfig(gpu_cache=2)))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"gpu_cache=2\.0 needs a device share.*gpu_share"):
        model(ids, **generate_cache_kwargs(model, cache))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_copy_kernel_matches_reference(dtype, block_size):
    """Blocks copied into their slots, counts per (request, KV head) from 0 to W, the store's last block
    partial (rows past it not valid), padding rows' validity carried along, other slots untouched."""
    if not gpu.triton_available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("triton unavailable")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(4)
    batch, heads, dim, slots, width = 2, 3, 72, 7, 5
    rows = 9 * block_size + block_size // 2  # a partial last block
    src_k = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype)
    src_v = torch.randn(batch, heads, rows, dim, generator=gen).to(dtype)
    src_valid = torch.rand(batch, rows, generator=gen) > 0.2
    cache_rows = heads * slots * block_size
    keys = torch.randn(batch, cache_rows, dim, generator=gen).to(dtype)
    values = torch.randn(batch, cache_rows, dim, generator=gen).to(dtype)
    valid = torch.rand(batch, cache_rows, generator=gen) > 0.5
    src_ids = torch.stack([torch.randperm(10, generator=gen)[:width] for _ in range(batch * heads)])
    dst_ids = torch.stack([torch.randperm(slots, generator=gen)[:width] for _ in range(batch * heads)])
    src_ids, dst_ids = src_ids.view(batch, heads, width), dst_ids.view(batch, heads, width)
    counts = torch.tensor([[0, 2, width], [1, width, 3]])
    expected = [t.clone() for t in (keys, values, valid)]
    reference.recall_blocks(src_k, src_v, src_valid, *expected, src_ids, dst_ids, counts, block_size, slots)
    # the reference against a plain loop
    loop = [t.clone() for t in (keys, values, valid)]
    for b in range(batch):
        for h in range(heads):
            for w in range(int(counts[b, h])):
                for r in range(block_size):
                    src, dst = (
                        int(src_ids[b, h, w]) * block_size + r,
                        (h * slots + int(dst_ids[b, h, w])) * block_size + r,
                    )
                    inside = src < rows
                    loop[0][b, dst] = src_k[b, h, src] if inside else loop[0][b, dst]
                    loop[1][b, dst] = src_v[b, h, src] if inside else loop[1][b, dst]
                    loop[2][b, dst] = bool(src_valid[b, src]) if inside else False
    assert torch.equal(loop[2], expected[2])
    live = loop[2]  # rows past the store hold whatever was there: only valid rows are ever read
    assert torch.equal(loop[0][live], expected[0][live]) and torch.equal(loop[1][live], expected[1][live])
    actual = [t.clone().to(device) for t in (keys, values, valid)]
    gpu.recall_blocks(
        src_k.to(device), src_v.to(device), src_valid.to(device), *actual,
        src_ids.to(device), dst_ids.to(device), counts.to(device), block_size, slots,
    )  # fmt: skip
    assert torch.equal(actual[2].cpu(), expected[2])
    assert torch.equal(actual[0].cpu()[live], expected[0][live])
    assert torch.equal(actual[1].cpu()[live], expected[1][live])
    untouched = torch.ones_like(valid)
    for b in range(batch):
        for h in range(heads):
            for w in range(int(counts[b, h])):
                start = (h * slots + int(dst_ids[b, h, w])) * block_size
                untouched[b, start : start + block_size] = False
    assert torch.equal(actual[0].cpu()[untouched], keys[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_kernel_reads_each_rows_own_store(dtype):
    """`recall_blocks_table`: each cache row copies from its own store (other capacities, other addresses, one row
    with none), in one launch, as the reference does row by row; the rows' table names them by their offsets from
    the cache's own tensors."""
    if not gpu.triton_available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("triton unavailable")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(8)
    heads, dim, slots, width, block_size = 2, 40, 6, 4, 4
    stores = []
    for rows in (10 * block_size, None, 6 * block_size + 2, 13 * block_size):
        if rows is None:
            stores.append(None)
            continue
        keys = torch.randn(1, heads, rows, dim, generator=gen).to(dtype)
        stores.append((keys, torch.randn(1, heads, rows, dim, generator=gen).to(dtype),
                       torch.rand(1, rows, generator=gen) > 0.2))  # fmt: skip
    batch, cache_rows = len(stores), heads * slots * block_size
    cache = [torch.randn(batch, cache_rows, dim, generator=gen).to(dtype),
             torch.randn(batch, cache_rows, dim, generator=gen).to(dtype), torch.zeros(batch, cache_rows, dtype=torch.bool)]  # fmt: skip
    src_ids = torch.stack([torch.randperm(7, generator=gen)[:width] for _ in range(batch * heads)])
    dst_ids = torch.stack([torch.randperm(slots, generator=gen)[:width] for _ in range(batch * heads)])
    src_ids, dst_ids = src_ids.view(batch, heads, width), dst_ids.view(batch, heads, width)
    counts = torch.tensor([[width, 1], [0, 0], [2, width], [3, 0]])
    expected = [t.clone() for t in cache]
    for b, store in enumerate(stores):
        if store is not None:
            r = slice(b, b + 1)
            reference.recall_blocks(
                *store, *(t[r] for t in expected), src_ids[r], dst_ids[r], counts[r], block_size, slots
            )
    on = [None if s is None else tuple(t.to(device) for t in s) for s in stores]
    actual = [t.clone().to(device) for t in cache]
    table = gpu.store_table(on, actual).to(device)
    gpu.recall_blocks_table(
        on, table, *actual, src_ids.to(device), dst_ids.to(device), counts.to(device), block_size, slots
    )
    assert torch.equal(actual[2].cpu(), expected[2])
    live = expected[2]  # rows past a store hold whatever was there: only valid rows are ever read
    assert live.sum() > 0
    for got, want in zip(actual[:2], expected[:2], strict=True):
        assert torch.equal(got.cpu()[live], want[live])
    with pytest.raises(ValueError, match=r"stores must hold one entry per row of the cache \(4\)"):
        gpu.recall_blocks_table(on[:3], table, *actual, src_ids, dst_ids, counts, block_size, slots)


def test_copy_kernel_refuses_bad_input():
    if not gpu.triton_available(torch.device("cpu")):
        pytest.skip("triton's interpreter unavailable")
    k = torch.zeros(1, 2, 32, 8)
    valid = torch.ones(1, 32, dtype=torch.bool)
    cache = torch.zeros(1, 2 * 3 * 4, 8)
    ids = torch.zeros(1, 2, 2, dtype=torch.long)
    counts = torch.zeros(1, 2, dtype=torch.long)
    args = [k, k, valid, cache, cache.clone(), torch.ones(1, 24, dtype=torch.bool), ids, ids, counts, 4, 3]
    gpu.recall_blocks(*args)
    bad = list(args)
    bad[3] = torch.zeros(1, 20, 8)
    with pytest.raises(ValueError, match=r"keys must have shape \[B, Hkv \* slots \* block_size, D\]"):
        gpu.recall_blocks(*bad)
    bad = list(args)
    bad[6] = ids.int()
    with pytest.raises(ValueError, match="src_ids.dtype must be int64"):
        gpu.recall_blocks(*bad)
    bad = list(args)
    bad[9] = 0
    with pytest.raises(ValueError, match="block_size and slots must be positive"):
        gpu.recall_blocks(*bad)


def _selection(gen, heads, num_blocks, k, width_k, previous=None, keep=0.7):
    """[1, heads, width_k] ascending sets of k block ids (invalid picks = num_blocks past k), each keeping about
    `keep` of the previous step's set, like consecutive decode steps."""
    out = torch.full((1, heads, width_k), num_blocks, dtype=torch.long)
    for h in range(heads):
        kept = []
        if previous is not None:
            old = previous[0, h][previous[0, h] < num_blocks]
            kept = old[torch.rand(len(old), generator=gen) < keep].tolist()[:k]
        rest = [b for b in torch.randperm(num_blocks, generator=gen).tolist() if b not in kept]
        ids = sorted(kept + rest[: k - len(kept)])
        out[0, h, :k] = torch.tensor(ids)
    return out


class _Host:
    def __init__(self, gen, heads, num_blocks, bs, dim):
        self.keys = torch.randn(1, heads, num_blocks * bs, dim, generator=gen)
        self.values = torch.randn(1, heads, num_blocks * bs, dim, generator=gen)
        self.valid = torch.ones(1, num_blocks * bs, dtype=torch.bool)
        self.key_scale = self.value_scale = None  # unquantized


@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
def test_plan_splits_each_step_and_keeps_the_bookkeeping_consistent(share):
    """Step after step: hits, the device's `share` of the other blocks (copied in) and the CPU's blocks are
    disjoint and make up the selection; a block is a hit exactly when it was cached before the step; no block
    of the step is evicted; the slot maps stay inverse to each other; and every slot holds its block's rows."""
    gen = torch.Generator().manual_seed(7)
    heads, num_blocks, k, width_k, width, bs, dim = 2, 40, 6, 8, 5, 4, 8
    slots = RecallCache.slots_for(2.0, width_k, width)
    cache = RecallCache(
        1, heads, dim, torch.float32, torch.device("cpu"), bs, slots, num_blocks, width_k, width
    )
    host = _Host(gen, heads, num_blocks, bs, dim)
    ids, hits_seen = None, 0
    cached_before = [set() for _ in range(heads)]
    for _ in range(30):
        ids = _selection(gen, heads, num_blocks, k, width_k, ids)
        plan = cache.plan(ids, k, share)
        cache.fill(host, plan)
        state = cache.state
        for h in range(heads):
            chosen = set(ids[0, h, :k].tolist())
            cpu = {b for b in plan.cpu_ids[0, h].tolist() if b < num_blocks}
            recalled = plan.src[0, h, : int(plan.counts[0, h])].tolist()
            hits = chosen & cached_before[h]
            hits_seen += len(hits)
            assert set(recalled) | cpu | hits == chosen
            assert len(recalled) + len(cpu) + len(hits) == k
            assert len(recalled) == min(width, int(share * (k - len(hits)) + 0.5))
            slot_block = state["slot_block"][0, h]
            now = {b for b in slot_block.tolist() if b >= 0}
            assert (hits | set(recalled)) <= now <= cached_before[h] | set(recalled)
            assert len(now) == min(slots, len(cached_before[h] | set(recalled)))
            for s_, b in enumerate(slot_block.tolist()):
                if b >= 0:
                    assert int(state["block_slot"][0, h, b]) == s_
                    rows = slice((h * slots + s_) * bs, (h * slots + s_ + 1) * bs)
                    assert torch.equal(cache.keys[0, rows], host.keys[0, h, b * bs : (b + 1) * bs])
                    assert torch.equal(cache.values[0, rows], host.values[0, h, b * bs : (b + 1) * bs])
            assert int((state["block_slot"][0, h] >= 0).sum()) == len(now)
            # the device attends the hits and this step's copies, at their slots
            gpu_slots = [g - h * slots for g in plan.gpu_ids[0, h].tolist() if g < heads * slots]
            assert sorted(int(slot_block[s_]) for s_ in gpu_slots) == sorted(hits | set(recalled))
            cached_before[h] = now
    assert (hits_seen > 0) == (share > 0)


@pytest.mark.parametrize("per_request", [False, True])
def test_plan_kernel_matches_reference(per_request):
    """The Triton plan (one program per request and KV head) gives the reference's loops' outputs and state,
    bit for bit, over many steps: wrap-arounds of the clock, steps with nothing to copy, k below the width; with
    `per_request`, each request's own k and counters (a pool's rows)."""
    if not gpu.triton_available(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("triton unavailable")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(11)
    batch, heads, num_blocks, width_k, width, bs = 2, 3, 50, 9, 4, 16
    slots = RecallCache.slots_for(1.5, width_k, width)
    caches = [
        RecallCache(
            batch,
            heads,
            8,
            torch.float32,
            torch.device(d),
            bs,
            slots,
            num_blocks,
            width_k,
            width,
            per_request,
        )
        for d in ("cpu", device)
    ]
    ids = None
    for step in range(40):
        k = width_k if step % 5 else width_k - 3
        flat = _selection(
            gen, batch * heads, num_blocks, k, width_k, None if ids is None else ids.view(1, -1, width_k)
        )
        ids = flat.view(batch, heads, width_k)
        share = (0.0, 0.4, 1.0)[step % 3]
        ks = [k, k - 1 - step % 4] if per_request else [k]
        reference.recall_plan(ids, torch.tensor(ks), share, caches[0].state, caches[0].out, bs)
        k_dev = torch.tensor(ks, device=device)
        gpu.recall_plan(ids.to(device), k_dev, share, caches[1].state, caches[1].out, bs)
        for name in ("cpu", "src", "dst", "counts", "gpu"):
            expected, actual = caches[0].out[name], caches[1].out[name].cpu()
            if name in ("src", "dst"):  # entries past counts carry no meaning
                live = torch.arange(width) < caches[0].out["counts"][..., None]
                expected, actual = expected[live], actual[live]
            assert torch.equal(expected, actual), (step, name)
        for name, value in caches[0].state.items():
            if torch.is_tensor(value):
                assert torch.equal(value, caches[1].state[name].cpu()), (step, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gpu_cache", [1.0, 4.0])
def test_cache_attends_what_quest_attends_without_it(device, gpu_cache):
    """Sparse budget, left-padded batch: the same greedy tokens and the same fraction attended with the cache as
    without it, through the engine (CUDA graphs on CUDA) and model.generate; the cache serves rows, the CPU reads
    fewer, and every row is counted once."""
    model = _tiny(device=device)
    ids, mask = _padded_prompts(device)
    plain, plain_runner = _run(
        model,
        ids,
        mask,
        _config(quest=QuestConfig(budget=0.3, gpu_share=0.5, gpu_cache=0)),
        24,
        chunk_tokens=32,
    )
    cached, cached_runner = _run(
        model,
        ids,
        mask,
        _config(quest=QuestConfig(budget=0.3, gpu_share=0.5, gpu_cache=gpu_cache)),
        24,
        chunk_tokens=32,
    )
    assert torch.equal(plain, cached)
    plain_stats, cached_stats = plain_runner.cache.stats(), cached_runner.cache.stats()
    assert plain_stats["mean_fraction_attended"] == cached_stats["mean_fraction_attended"] < 1.0
    assert cached_stats["hot_bytes"] > plain_stats["hot_bytes"]  # the cache lives on the device

    def rows(cache):
        layers = cache.tandem_layers()
        total = sum(layer.rows_attended for layer in layers)
        pcie = sum(layer.rows_attended_device for layer in layers)
        hbm = sum(layer.rows_attended_cached for layer in layers)
        return total, pcie, hbm, total - pcie - hbm

    plain_rows, cached_rows = rows(plain_runner.cache), rows(cached_runner.cache)
    assert plain_rows[0] == cached_rows[0] and plain_rows[2] == 0
    assert cached_rows[2] > 0 and cached_rows[3] < plain_rows[3]
    eager_plain = TandemCache.for_model(
        model, _config(quest=QuestConfig(budget=0.3, gpu_share=0.5, gpu_cache=0))
    )
    eager = TandemCache.for_model(
        model, _config(quest=QuestConfig(budget=0.3, gpu_share=0.5, gpu_cache=gpu_cache))
    )
    assert torch.equal(_hf_greedy(model, ids, mask, 24, eager_plain), _hf_greedy(model, ids, mask, 24, eager))
    assert sum(layer.rows_attended_cached for layer in eager.tandem_layers()) == 0  # not collected yet
    eager.stats()
    assert sum(layer.rows_attended_cached for layer in eager.tandem_layers()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_cache_at_full_budget_matches_dynamic_cache(device):
    """Every block attended, most of them from the cache: greedy tokens equal DynamicCache's."""
    model = _tiny(device=device)
    ids = torch.randint(0, 128, (2, 83), generator=torch.Generator().manual_seed(2)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    base = _hf_greedy(model, ids, mask, 24)
    ours, runner = _run(
        model,
        ids,
        mask,
        _config(quest=QuestConfig(budget=1.0, gpu_share=0.5, gpu_cache=2)),
        24,
        chunk_tokens=32,
    )
    assert torch.equal(base, ours)
    assert runner.cache.stats()["mean_fraction_attended"] == 1.0
    assert sum(layer.rows_attended_cached for layer in runner.cache.tandem_layers()) > 0


def test_a_cache_that_does_not_fit_is_a_clear_memory_error(monkeypatch):
    """Device memory exhausted while the cache is made: a MemoryError (the CLI prints it) naming gpu_cache."""
    import tandem.cache.layer as layer_module

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(layer_module, "RecallCache", type("Full", (RecallCache,), {"__init__": full}))
    model = _tiny()
    cache = TandemCache.for_model(model, _config(quest=QuestConfig(budget=0.3, gpu_share=0.5, gpu_cache=2)))
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    with pytest.raises(MemoryError, match=r"gpu_cache=2\.0: quest's recall cache needs .* GiB .*gpu_cache=0"):
        _hf_greedy(model, ids, torch.ones_like(ids), 4, cache)


def test_budget_keeps_the_default_size_where_it_fits_and_shrinks_it_where_not(monkeypatch):
    from tandem.cache import recall

    shape = dict(batch=2, num_kv_heads=4, k_max=10, width=5, block_size=16, head_dim=64, element_size=2)
    per_slot = 2 * 4 * (2 * 16 * 64 * 2 + 16 + 17)
    wanted = RecallCache.slots_for(4.0, 10, 5)  # 40 slots

    def factor(free, requested=4.0):
        monkeypatch.setattr(recall, "free_bytes", lambda device: free)
        budget = recall.RecallBudget(num_layers=3)
        return budget.factor_for(requested, **shape, device=torch.device("cpu")), budget

    roomy = 3 * wanted * per_slot / recall.HEADROOM
    assert factor(roomy)[0] == 4.0
    assert factor(None)[0] == 4.0  # free memory unknown: as asked
    with pytest.warns(
        UserWarning, match=r"kept 2\.00x the budget \(20 blocks per KV head\) instead of 4\.0x"
    ):
        half, budget = factor(roomy / 2)
    assert half == 2.0
    # decided once for the shape: a later call (another layer, a larger k_max) gets the same factor
    assert budget.factor_for(4.0, **{**shape, "k_max": 12}, device=torch.device("cpu")) == 2.0
    with pytest.warns(UserWarning, match="turned it off"):
        assert factor(roomy / 10)[0] == 0.0  # 4 slots fit, a step needs 15


@pytest.mark.parametrize("device", DEVICES)
def test_default_cache_shrinks_to_free_memory_and_still_attends_what_quest_attends(monkeypatch, device):
    """The default size (gpu_cache None) where the device has little free memory: a smaller cache, or none, with
    a warning; the tokens stay those without a cache (CUDA: through the engine's graphs). On CPU the default is
    off, so it is forced on here."""
    from tandem.cache import recall
    from tandem.config import TandemConfig as Config

    model = _tiny(device=device)
    ids = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(6)).to(device)
    mask = torch.ones_like(ids)
    plain, _ = _run(
        model,
        ids,
        mask,
        _config(quest=QuestConfig(budget=0.3, gpu_share=0.5, gpu_cache=0)),
        16,
        chunk_tokens=32,
    )
    if device == "cpu":
        monkeypatch.setattr(Config, "gpu_cache_on", lambda self, device_type: DEFAULT_GPU_CACHE)

    def run(free):
        monkeypatch.setattr(recall, "free_bytes", lambda device: free)
        ours, runner = _run(
            model, ids, mask, _config(quest=QuestConfig(budget=0.3, gpu_share=0.5)), 16, chunk_tokens=32
        )
        assert torch.equal(plain, ours)
        layers = runner.cache.tandem_layers()
        factors = {layer.gpu_cache for layer in layers}
        assert len(factors) == 1  # every layer the same size
        return factors.pop(), layers

    with _no_warning():
        factor, layers = run(1 << 40)
    assert factor == DEFAULT_GPU_CACHE
    full = sum(layer.recall.nbytes() for layer in layers)
    with pytest.warns(UserWarning, match="recall cache"):
        factor, layers = run(full)  # half of it may be used: about half the size
    assert 0 < factor < DEFAULT_GPU_CACHE
    assert sum(layer.recall.nbytes() for layer in layers) <= recall.HEADROOM * full * 1.1
    with pytest.warns(UserWarning, match="turned it off"):
        factor, layers = run(1000)
    assert factor == 0.0 and all(layer.recall is None for layer in layers)


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def check():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield

    return check()
