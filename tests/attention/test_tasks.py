"""CPU task planning: adjacent (request, KV head) units merged into at most `num_threads` balanced tasks."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from tandem.attention.tasks import TaskPool, plan_head_tasks

CASES = [
    (1, 1, 1),
    (1, 8, 3),
    (3, 4, 1),
    (3, 4, 5),  # tasks cross request boundaries, pieces must not
    (2, 2, 15),  # more threads than units
    (27, 8, 15),
    (61, 2, 7),
    (5, 3, 4),
    (113, 1, 16),
]


def units_of(pieces):
    return [(b, h) for b, h0, h1 in pieces for h in range(h0, h1)]


@pytest.mark.parametrize(("batch", "num_kv_heads", "num_threads"), CASES)
def test_plan_covers_every_unit_once_in_balanced_tasks(batch, num_kv_heads, num_threads):
    tasks = plan_head_tasks(batch, num_kv_heads, num_threads)
    units = batch * num_kv_heads
    assert 1 <= len(tasks) <= num_threads
    assert len(tasks) == min(num_threads, units)  # no thread idles while another has 2+ extra units
    covered = Counter(u for task in tasks for u in units_of(task))
    assert covered == Counter((b, h) for b in range(batch) for h in range(num_kv_heads))
    sizes = [len(units_of(task)) for task in tasks]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    for task in tasks:
        for b, h0, h1 in task:  # a piece stays inside one request
            assert 0 <= b < batch and 0 <= h0 < h1 <= num_kv_heads
        # a task is a run of adjacent units (merged heads, then the next request's first heads)
        flat = [b * num_kv_heads + h for b, h in units_of(task)]
        assert flat == list(range(flat[0], flat[0] + len(flat)))
        assert len(task) == len({b for b, _, _ in task})  # adjacent heads merged: one piece per request


def test_plan_merges_heads_into_single_pieces():
    # 2 requests x 8 heads over 4 threads: each task is half a request, one piece each
    assert plan_head_tasks(2, 8, 4) == [[(0, 0, 4)], [(0, 4, 8)], [(1, 0, 4)], [(1, 4, 8)]]
    # 3 units per task straddle the request boundary as two pieces
    assert plan_head_tasks(2, 2, 1) == [[(0, 0, 2), (1, 0, 2)]]


@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize(("batch", "num_kv_heads"), [(1, 1), (3, 4), (5, 2)])
def test_task_pool_calls_every_piece(num_threads, batch, num_kv_heads):
    pool = TaskPool(num_threads)
    calls, threads = [], set()
    lock = threading.Lock()

    def piece_fn(b, h0, h1):
        with lock:
            calls.append((b, h0, h1))
            threads.add(threading.get_ident())

    try:
        pool.run(batch, num_kv_heads, piece_fn)
    finally:
        pool.shutdown()
    expected = [piece for task in plan_head_tasks(batch, num_kv_heads, num_threads) for piece in task]
    assert Counter(calls) == Counter(expected)
    assert Counter(units_of(calls)) == Counter((b, h) for b in range(batch) for h in range(num_kv_heads))
    if num_threads == 1:
        assert threads == {threading.get_ident()}  # no pool: runs inline


def test_task_pool_propagates_errors():
    pool = TaskPool(3)

    def piece_fn(b, h0, h1):
        if b == 2:
            raise KeyError("boom")

    try:
        with pytest.raises(KeyError, match="boom"):
            pool.run(3, 4, piece_fn)
    finally:
        pool.shutdown()
