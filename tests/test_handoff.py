"""The host's side of the flag hand-offs (`tandem.engine.handoff`), with a thread playing the GPU's part.

On CUDA the graph writes `ready[i]` and waits on `done[i]` (stream memory operations); here a thread does the
same through the flags' memory, so the protocol (order, release on error, timeout) is tested without a GPU.
The graph-replayed engine with these flags is tested in test_engine.py's CUDA cases."""

import threading
import time

import pytest

from tandem.engine import handoff
from tandem.engine.handoff import HostFlags, run_host_side


def fake_gpu(flags: HostFlags, log: list, stop_at: int | None = None):
    """What a replayed graph does per hand-off: publish q (ready), then hold until the host is done."""

    def body():
        for i in range(flags.count if stop_at is None else stop_at):
            log.append(("q", i))
            flags.memory[flags._index(0, i)] = 1
            deadline = time.monotonic() + 10
            while not flags.done(i):
                if time.monotonic() > deadline:
                    log.append(("stuck", i))
                    return
            log.append(("merge", i))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def test_actions_run_in_order_between_ready_and_done():
    flags = HostFlags(5, None)
    log = []
    gpu = fake_gpu(flags, log)
    run_host_side(flags, [lambda i=i: log.append(("cpu", i)) for i in range(5)])
    gpu.join(10)
    expected = [event for i in range(5) for event in (("q", i), ("cpu", i), ("merge", i))]
    assert log == expected
    flags.reset()
    assert not any(flags.ready(i) or flags.done(i) for i in range(5))


def test_a_failing_action_releases_every_wait_and_raises():
    flags = HostFlags(4, None)
    log = []
    gpu = fake_gpu(flags, log)

    def fail():
        raise ValueError("CPU part failed")

    actions = [lambda: None, fail, lambda: log.append(("cpu", 2)), lambda: log.append(("cpu", 3))]
    with pytest.raises(ValueError, match="CPU part failed"):
        run_host_side(flags, actions)
    gpu.join(10)
    assert not gpu.is_alive()  # the "graph" ran to its end
    assert all(flags.done(i) for i in range(4))
    assert ("cpu", 2) not in log and not any(event[0] == "stuck" for event in log)


def test_a_missing_query_times_out_and_releases():
    flags = HostFlags(3, None, timeout=0.2)
    gpu = fake_gpu(flags, [], stop_at=1)  # publishes hand-off 0, never 1
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="hand-off 1"):
        run_host_side(flags, [lambda: None] * 3)
    assert time.monotonic() - start < 5
    gpu.join(10)
    assert all(flags.done(i) for i in range(3))


def test_flags_refuse_bad_indices_and_counts():
    flags = HostFlags(2, None)
    with pytest.raises(IndexError, match="2 hand-offs"):
        flags.set_done(2)
    with pytest.raises(ValueError, match="count"):
        HostFlags(0, None)


def test_flags_sit_on_separate_cache_lines():
    flags = HostFlags(3, None)
    addresses = [flags._index(kind, i) * 4 for kind in (0, 1) for i in range(3)]
    assert len({a // 64 for a in addresses}) == 6


def test_driver_is_none_without_cuda(monkeypatch):
    monkeypatch.setattr(handoff, "_DRIVER", [])
    monkeypatch.setattr(handoff.torch.cuda, "is_available", lambda: False)
    assert handoff.driver() is None and not handoff.available()


def test_hand_offs_are_served_while_the_launch_is_still_running():
    """A launch that keeps submitting after the first nodes run: the host's first action must not wait for it."""
    flags = HostFlags(3, None)
    log = []
    launcher = handoff.Launcher()
    returned = threading.Event()

    def launch():  # the "GPU" starts at once; the launch call itself returns only after the host served 0
        gpu = fake_gpu(flags, log)
        deadline = time.monotonic() + 10
        while not flags.done(0) and time.monotonic() < deadline:
            time.sleep(0.001)
        log.append(("launch returned", None))
        returned.set()
        gpu.join(10)

    try:
        launcher.start(launch)
        run_host_side(flags, [lambda i=i: log.append(("cpu", i)) for i in range(3)], launcher)
        assert returned.is_set()
        assert log.index(("cpu", 0)) < log.index(("launch returned", None))
        assert [e for e in log if e[0] == "cpu"] == [("cpu", 0), ("cpu", 1), ("cpu", 2)]
        # the thread runs one launch after another
        flags.reset()
        log.clear()
        launcher.start(lambda: fake_gpu(flags, log).join(10))
        run_host_side(flags, [lambda: None] * 3, launcher)
        assert log[-1] == ("merge", 2)
    finally:
        launcher.close()
    assert not launcher._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        launcher.start(lambda: None)


def test_a_failing_launch_ends_the_wait_with_its_error():
    flags = HostFlags(2, None, timeout=30)
    launcher = handoff.Launcher()

    def launch():
        raise OSError("cudaGraphLaunch failed")

    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="launch failed before hand-off 0") as info:
            launcher.start(launch)
            run_host_side(flags, [lambda: None] * 2, launcher)
        assert isinstance(info.value.__cause__, OSError)
        assert time.monotonic() - start < 5  # not the 30 s timeout
        assert all(flags.done(i) for i in range(2))
        # a later launch on the same thread works
        flags.reset()
        launcher.start(lambda: fake_gpu(flags, []).join(10))
        run_host_side(flags, [lambda: None] * 2, launcher)
    finally:
        launcher.close()


def test_a_launch_must_be_joined_before_the_next():
    launcher = handoff.Launcher()
    release = threading.Event()
    try:
        launcher.start(lambda: release.wait(10))
        with pytest.raises(RuntimeError, match="not been joined"):
            launcher.start(lambda: None)
        release.set()
        launcher.join()
    finally:
        launcher.close()
