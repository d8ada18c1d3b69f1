"""The scheduler with a prefix cache (`cache.prefix`): requests over shared documents start from the kept prefix
and give the tokens of a server without one; a request may opt out; kept prefixes give their memory up to a
request the host budget would otherwise keep waiting."""

import pytest

from tandem import TandemConfig
from tandem.attention import TaskPool
from tandem.cache.prefix import PrefixCache
from tandem.serve.scheduler import Limits, Scheduler
from tests.serve.test_scheduler import CONFIG, TIMEOUT, LetterTokenizer, _job, model  # noqa: F401

CHUNK = 8


def _run(model, jobs, prefix=None, **limits):  # noqa: F811
    """Run `jobs` one after the other (each waits for the one before: later ones find the earlier prefixes)."""
    scheduler = Scheduler(
        model, LetterTokenizer(), Limits(prefill_chunk=CHUNK, **limits), TaskPool(1), prefix=prefix
    )
    scheduler.start()
    try:
        for job in jobs:
            scheduler.submit(job.request)
            assert job.done.wait(TIMEOUT)
    finally:
        scheduler.stop()
    return scheduler


def _over(document: list[int], question: int, max_tokens: int = 6, config=CONFIG, cache: bool = True):
    job = _job(question, max_tokens, config, first=question)
    job.request.prompt_ids = document + job.request.prompt_ids
    job.request.prefix_cache = cache
    return job


@pytest.mark.parametrize(
    "config",
    [CONFIG, TandemConfig(policy="quest", sink_tokens=2, window_tokens=8, block_size=4)],
    ids=["hgca", "quest"],
)
def test_requests_over_shared_documents_start_from_the_kept_prefix(model, config):  # noqa: F811
    documents = [[(d * 31 + 5 * i) % 128 for i in range(45)] for d in (1, 2)]
    asks = [(0, 3), (1, 4), (0, 5), (1, 6), (0, 7)]
    cold = [_over(documents[d], q, config=config) for d, q in asks]
    _run(model, cold)
    store = PrefixCache()
    warm = [_over(documents[d], q, config=config) for d, q in asks]
    _run(model, warm, store)
    assert [job.request.tokens for job in warm] == [job.request.tokens for job in cold]
    cached = [job.request.cached_tokens for job in warm]
    assert cached[:2] == [0, 0] and all(n > 0 and n % CHUNK == 0 for n in cached[2:])
    stats = store.stats()
    assert (stats["lookups"], stats["hits"], stats["hit_tokens"]) == (5, 3, sum(cached))


def test_a_request_that_opts_out_neither_takes_nor_keeps_a_prefix(model):  # noqa: F811
    document = [(3 * i) % 128 for i in range(45)]
    store = PrefixCache()
    jobs = [_over(document, 3, cache=False), _over(document, 4), _over(document, 5, cache=False)]
    _run(model, jobs, store)
    assert [job.request.cached_tokens for job in jobs] == [0, 0, 0]
    assert store.stats()["lookups"] == 1 and store.stats()["inserted"] > 0


def test_kept_prefixes_give_their_memory_to_a_request_that_needs_it(model):  # noqa: F811
    """A host budget of one request: the first request's prefixes fill the rest of it once it ends, and the next
    request (another document) is admitted all the same, the prefixes dropped for it."""
    jobs = [_over([(7 * i) % 128 for i in range(45)], 3), _over([(11 * i) % 128 for i in range(45)], 4)]
    probe = Scheduler(model, LetterTokenizer(), Limits(prefill_chunk=CHUNK), TaskPool(1))
    need = probe.size(jobs[0].request).on_host
    store = PrefixCache(max_bytes=need)
    _run(model, jobs, store, host_bytes=need)
    assert all(job.events[-1] == ("done", "length") for job in jobs)
    stats = store.stats()
    assert stats["evictions"] > 0 and stats["bytes"] <= need
