"""The host pool (`cache.memory.HostPool`): a large store's mapping, once no tensor views it, serves the next store
of about its size, zeroed, without being mapped or page-locked again; a store in use is never lent; a store that
finds none first gives free mappings back; the pool off or trimmed gives them all back."""

import ctypes
import sys
import threading
import time

import pytest
import torch

from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.cache.host import HostTier
from tandem.cache.prefix import PrefixCache
from tandem.models import attention_shape
from tandem.serve import scheduler as scheduler_module
from tandem.serve.metrics import host_pool_collector
from tandem.serve.scheduler import Limits, Scheduler
from tandem.serve.sizing import CacheShape, host_stores
from tests.cache.test_tiers import FakeCudart
from tests.engine.test_engine import _tiny
from tests.engine.test_prefix import POLICIES, _answer, _ids
from tests.serve.test_scheduler import TIMEOUT, LetterTokenizer, _job, model  # noqa: F401

HUGE = memory.HUGE_PAGE

pytestmark = pytest.mark.skipif(not memory.huge_pages_supported(), reason="no transparent huge pages here")


@pytest.fixture
def pool():
    assert memory.host_pool() is None
    pool = memory.enable_host_pool()
    yield pool
    memory.disable_host_pool()


def _store(size: int = HUGE, pin: bool = False) -> torch.Tensor:
    return memory.host_zeros((size // 4,), torch.float32, pin=pin)


def test_a_freed_store_serves_the_next_one_zeroed(pool):
    first = _store()
    first.fill_(7.0)
    address = first.data_ptr()
    del first
    assert (pool.free_bytes, pool.made, pool.reused) == (HUGE, 1, 0)
    second = _store()
    assert second.data_ptr() == address and pool.reused == 1 and pool.free_bytes == 0
    assert torch.count_nonzero(second) == 0


def test_a_store_in_use_is_never_lent(pool):
    first = _store()
    view = first[10:]
    del first
    assert pool.free_bytes == 0  # a view holds it
    second = _store()
    assert second.data_ptr() != view.data_ptr() - 40 and pool.made == 2
    view.fill_(1.0)
    assert torch.count_nonzero(second) == 0  # the two never share memory
    del view
    assert pool.free_bytes == HUGE


def test_a_pinned_store_is_registered_once_and_unregistered_when_given_back(pool, monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    first = _store(pin=True)
    address = first.data_ptr()
    del first
    second = _store(pin=True)
    assert second.data_ptr() == address and len(cudart.registered) == 1
    unpinned = _store(pin=False)  # another kind: not from the pinned mapping
    assert pool.made == 2 and not cudart.unregistered
    del second, unpinned
    pool.trim()
    assert cudart.unregistered == [address] and pool.free_bytes == 0


def test_a_store_takes_the_smallest_mapping_within_the_fit(pool):
    stores = [_store(HUGE), _store(2 * HUGE), _store(4 * HUGE)]
    addresses = [s.data_ptr() for s in stores]
    del stores
    exact = _store(HUGE)
    assert exact.data_ptr() == addresses[0]
    smaller = _store(2 * HUGE - 4096)  # within 1.25x of 2 MiB pages
    assert smaller.data_ptr() == addresses[1]
    assert pool.reused == 2 and pool.free_bytes == 4 * HUGE  # 4 MiB would waste more than a quarter of it


def test_a_store_that_finds_none_gives_free_mappings_back_first(pool):
    stores = [_store(HUGE), _store(2 * HUGE), _store(HUGE)]
    del stores
    assert pool.free_bytes == 4 * HUGE
    big = _store(3 * HUGE)  # none fits: free mappings of at least 3 MiB go, the largest first
    assert pool.given_back == 2 and pool.free_bytes == HUGE and pool.made == 4
    del big
    assert pool.free_bytes == 4 * HUGE


def test_the_pool_off_gives_back_the_free_mappings_and_those_that_come_back(pool, monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    kept, freed = _store(pin=True), _store(pin=True)
    kept_address, freed_address = kept.data_ptr(), freed.data_ptr()
    del freed
    memory.disable_host_pool()
    assert cudart.unregistered == [freed_address]
    del kept
    assert cudart.unregistered == [freed_address, kept_address]
    memory.enable_host_pool()  # for the fixture's teardown


def test_a_host_tier_from_the_pool_holds_only_its_own_rows(pool):
    """A tier of a freed one's size takes its memory and reads as a new tier: no row, digest or flag of the old."""
    gen = torch.Generator().manual_seed(0)
    rows = HUGE // (2 * 64 * 4)  # keys and values of 2 heads x 64 dims float32: a huge page each

    def tier():
        host = HostTier(1, 2, 4, 64, torch.float32, 16, pin=False, keep_digest=True, keep_maw=False)
        host.reserve(rows, headroom=False)
        return host

    old = tier()
    keys = torch.randn(1, 2, rows, 64, generator=gen)
    old.append(keys, keys + 1, torch.ones(1, rows, dtype=torch.bool))
    addresses = {old.keys.data_ptr(), old.values.data_ptr()}
    del old
    new = tier()
    assert {new.keys.data_ptr(), new.values.data_ptr()} == addresses and pool.reused == 2
    assert new.rows == 0 and not new.valid.any()
    assert torch.count_nonzero(new.keys) == 0 and torch.count_nonzero(new.values) == 0


def _serve(model, jobs, one_at_a_time: bool = False, idle: float = 0.0) -> None:  # noqa: F811
    """Run `jobs` on a scheduler (all submitted at once, or each once the one before has ended), then stay idle
    `idle` seconds before it stops."""
    scheduler = Scheduler(model, LetterTokenizer(), Limits(prefill_chunk=64), TaskPool(1))
    scheduler.start()
    try:
        for job in jobs:
            scheduler.submit(job.request)
            assert not one_at_a_time or job.done.wait(TIMEOUT)
        assert all(job.done.wait(TIMEOUT) for job in jobs)
        time.sleep(idle)
    finally:
        scheduler.stop()


def test_an_idle_server_gives_the_pool_back_and_answers_as_without_it(model, pool, monkeypatch):  # noqa: F811
    """A request right after another reuses its stores, with the tokens of a server without the pool; once idle
    the server gives the free stores back."""
    monkeypatch.setattr(memory, "HUGE_PAGE", 4096)  # the tiny model's stores go through mappings
    monkeypatch.setattr(scheduler_module, "HOST_POOL_IDLE_SECONDS", 1.0)
    pooled = [_job(300, 5, first=3), _job(300, 5, first=4)]
    _serve(model, pooled, one_at_a_time=True, idle=2.0)  # idle: the free stores go back
    assert pool.made > 0 and pool.reused > 0 and pool.given_back > 0 and pool.free_bytes == 0
    memory.disable_host_pool()
    plain = [_job(300, 5, first=3), _job(300, 5, first=4)]
    _serve(model, plain, one_at_a_time=True, idle=2.0)
    memory.enable_host_pool()  # for the fixture's teardown
    assert [job.request.tokens for job in pooled] == [job.request.tokens for job in plain]


def test_a_kept_prefix_keeps_its_host_rows_from_other_stores(pool, monkeypatch):
    """A kept prefix reads its request's host rows in place after the request ended: while it does, the pool never
    lends their memory to other requests' stores, and the prefix still answers as a cold prefill."""
    monkeypatch.setattr(memory, "HUGE_PAGE", 4096)  # the tiny model's stores go through mappings
    tiny, config = _tiny(), POLICIES["quest"]
    document = _ids(70, 7, "cpu")
    prompt = torch.cat([document, _ids(6, 8, "cpu")], dim=1)
    memory.disable_host_pool()
    cold = _answer(tiny, config, prompt, 10)  # the reference, every store mapped anew
    pool = memory.enable_host_pool()
    store = PrefixCache()
    _answer(tiny, config, torch.cat([document, _ids(12, 9, "cpu")], dim=1), 4, store)
    made = pool.made
    for seed in (10, 11, 12):  # other prompts, each one's stores from the one's before
        _answer(tiny, config, _ids(76, seed, "cpu"), 4)
    assert pool.reused > 0 and pool.made > made
    warm = _answer(tiny, config, prompt, 10, store)
    assert warm[3] > 0 and torch.equal(warm[0], cold[0]) and torch.equal(warm[1], cold[1])


def _threads_that_map(monkeypatch) -> list[str]:
    """The names of the threads that map new stores from now on."""
    names, new_mapping = [], memory._new_mapping

    def recorded(nbytes, pin, **kwargs):
        names.append(threading.current_thread().name)
        return new_mapping(nbytes, pin, **kwargs)

    monkeypatch.setattr(memory, "_new_mapping", recorded)
    return names


def test_a_reservation_is_made_on_the_worker_and_drawn_zeroed(pool, monkeypatch):
    """Stores made ahead: a free mapping zeroed and a new one mapped, both by the worker thread; the stores made
    while drawing take them without mapping or zeroing on the caller's thread."""
    old = _store(2 * HUGE)
    old.fill_(5.0)
    reused = old.data_ptr()
    del old
    threads = _threads_that_map(monkeypatch)
    reservation = pool.reserve([2 * HUGE, HUGE, 1024], pinned=False)  # 1024: never from the pool
    assert reservation.sizes == [2 * HUGE, HUGE]
    assert reservation.done.wait(TIMEOUT) and reservation.error is None
    assert threads == ["tandem-host-stores"] and pool.free_bytes == 0
    zeroed = []
    monkeypatch.setattr(
        torch.Tensor, "zero_", lambda t: zeroed.append(t.numel()) or t
    )  # the caller's zeroing
    with reservation.drawn():
        big, small = _store(2 * HUGE), _store(HUGE)
    assert big.data_ptr() == reused and torch.count_nonzero(big) == 0 and torch.count_nonzero(small) == 0
    assert zeroed == [] and threads == ["tandem-host-stores"]
    assert pool.stats()["ahead"] == 2 and (pool.made, pool.reused) == (2, 1)


def test_what_a_request_leaves_undrawn_goes_to_the_free_mappings(pool):
    reservation = pool.reserve([HUGE, HUGE], pinned=False)
    with reservation.drawn():
        kept = _store(HUGE)
    assert pool.free_bytes == HUGE and pool.ahead == 1
    outside = _store(HUGE)  # no reservation drawn: the free mapping, zeroed
    assert pool.reused == 1 and pool.free_bytes == 0
    del kept, outside
    released = pool.reserve([HUGE, HUGE], pinned=False)
    released.release()  # its request ended first: what the worker made or makes goes to the free mappings
    assert released.done.wait(TIMEOUT) and released.mappings == []
    assert pool.free_bytes == 2 * HUGE


def _resident(address: int, nbytes: int) -> float:
    """The share of the 4 KiB pages of [address, address + nbytes) in memory (mincore)."""
    pages = -(-nbytes // 4096)
    vec = (ctypes.c_ubyte * pages)()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0
    return sum(v & 1 for v in vec) / pages


class ResidentAtRegistration(FakeCudart):
    """Records, for each registration, the share of its pages already in memory."""

    def __init__(self):
        super().__init__()
        self.resident = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.resident.append(_resident(ptr, nbytes))
        return super().cudaHostRegister(ptr, nbytes, flags)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore through Linux's libc")
def test_the_worker_faults_a_new_store_in_before_registering_it(pool, monkeypatch):
    """CUDA's registration faulting a store's pages in itself kept the model's thread waiting as long as it ran:
    the worker's new stores are in memory before they are registered; a store made on the caller's thread is
    registered as mapped (its registration faults it in faster than a memset would)."""
    cudart = ResidentAtRegistration()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    reservation = pool.reserve([2 * HUGE, HUGE], pinned=True)
    assert reservation.done.wait(TIMEOUT) and reservation.error is None
    assert cudart.resident == [1.0, 1.0]
    with reservation.drawn():
        drawn = _store(2 * HUGE, pin=True)
    assert torch.count_nonzero(drawn) == 0 and len(cudart.registered) == 2
    own = _store(4 * HUGE, pin=True)  # no reservation: mapped and registered on this thread
    assert cudart.resident[2:] == [0.0] and torch.count_nonzero(own) == 0


def test_a_reservation_of_another_kind_or_after_the_pool_closed_serves_nothing(pool):
    pinned = pool.reserve([HUGE], pinned=True)
    pinned.release()
    assert pinned.done.wait(TIMEOUT)
    reservation = pool.reserve([HUGE], pinned=False)
    with reservation.drawn():
        store = _store(HUGE, pin=False)
    assert pool.ahead == 1
    del store
    memory.disable_host_pool()
    late = pool.reserve([HUGE], pinned=False)
    assert late.done.is_set() and late.sizes and late.mappings == []
    memory.enable_host_pool()  # for the fixture's teardown


def test_the_server_makes_each_requests_stores_ahead_with_the_same_tokens(model, pool, monkeypatch):  # noqa: F811
    """Every store of a request's host tier is made by the pool's worker from its admission's reservation (its
    sizes are `sizing.host_stores`'), none on the scheduler's thread, and the answers are a server's without the
    pool."""
    monkeypatch.setattr(memory, "HUGE_PAGE", 4096)  # the tiny model's stores go through mappings
    threads = _threads_that_map(monkeypatch)
    ahead = [_job(300, 5, first=3), _job(200, 6, first=4), _job(400, 4, first=5)]
    _serve(model, ahead)
    assert threads and set(threads) == {"tandem-host-stores"}
    shape = CacheShape(*attention_shape(model.config), torch.float32)
    planned = [
        n
        for job in ahead
        for n in host_stores(shape, job.request.config, len(job.request.prompt_ids), job.request.max_tokens)
        if n >= memory.HUGE_PAGE
    ]
    assert planned and pool.ahead == len(planned) * shape.global_layers  # each one drawn
    memory.disable_host_pool()
    plain = [_job(300, 5, first=3), _job(200, 6, first=4), _job(400, 4, first=5)]
    _serve(model, plain)
    memory.enable_host_pool()  # for the fixture's teardown
    assert [job.request.tokens for job in ahead] == [job.request.tokens for job in plain]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_a_pinned_store_from_the_pool_is_read_and_written_by_the_gpu(pool):
    """Really page-locked and mapped: the GPU copies into and out of a reused store, which starts zeroed."""
    first = _store(4 * HUGE, pin=True)
    first.fill_(3.0)
    address = first.data_ptr()
    del first
    second = _store(4 * HUGE, pin=True)
    assert second.data_ptr() == address and second.is_pinned()
    assert torch.count_nonzero(second.cuda()) == 0
    ones = torch.ones(second.shape, device="cuda")
    second.copy_(ones, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(second, ones.cpu())
    del second
    pool.trim()


def test_the_server_metrics_read_the_pool_and_nothing_while_it_is_off(pool):
    first = _store()
    del first
    kept = _store()
    values = {m.name: m.samples[0].value for m in host_pool_collector().collect()}
    assert values == {
        "tandem_host_pool_reused": 1,
        "tandem_host_pool_made": 1,
        "tandem_host_pool_ahead": 0,
        "tandem_host_pool_free_bytes": 0,
    }
    del kept
    memory.disable_host_pool()
    assert list(host_pool_collector().collect()) == []
    memory.enable_host_pool()  # for the fixture's teardown
