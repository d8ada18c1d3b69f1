"""The host's side of the flag hand-offs (`tandem.engine.handoff`), with a thread playing the GPU's part.

On CUDA the graph writes `ready[i]` and waits on `done[i]` (stream memory operations); here a thread does the
same through the flags' memory, so the protocol (order, release on error, timeout) is tested without a GPU.
The graph-replayed engine with these flags is tested in test_engine.py's CUDA cases."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tandem.engine import handoff
from tandem.engine.handoff import HostFlags, run_host_side
from tandem.kernels import cpu


def fake_gpu(flags: HostFlags, log: list, stop_at: int | None = None, publish=None, merge=None):
    """What a replayed graph does per hand-off: publish q (ready), then hold until the host is done.
    publish(i) / merge(i): run just before ready[i] is set / once done[i] is seen."""

    def body():
        for i in range(flags.count if stop_at is None else stop_at):
            log.append(("q", i))
            if publish is not None:
                publish(i)
            flags.memory[flags._index(0, i)] = 1
            deadline = time.monotonic() + 10
            while not flags.done(i):
                if time.monotonic() > deadline:
                    log.append(("stuck", i))
                    return
            if merge is not None:
                merge(i)
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


def test_idle_work_runs_while_the_gpu_has_not_reached_a_hand_off_and_all_of_it_by_the_end():
    """Host work given to the replay (`idle`) runs in order, each piece once: from the first hand-off on (the GPU
    has then passed what was queued before the graph), before a hand-off while its query is not ready, the rest
    after the last hand-off; an action still runs only after its ready flag."""
    flags = HostFlags(3, None)
    log = []

    def publish(i):
        time.sleep(0.05)  # the "GPU" reaches each hand-off 50 ms after the previous one
        log.append(("ready", i))

    gpu = fake_gpu(flags, log, publish=publish)
    idle = [lambda k=k: log.append(("idle", k)) for k in range(4)]
    run_host_side(flags, [lambda i=i: log.append(("cpu", i)) for i in range(3)], idle=idle)
    gpu.join(10)
    assert [event for event in log if event[0] == "idle"] == [("idle", k) for k in range(4)]
    # after hand-off 0, and while the GPU had not reached hand-off 1
    assert log.index(("cpu", 0)) < log.index(("idle", 0)) < log.index(("ready", 1))
    for i in range(3):
        assert log.index(("ready", i)) < log.index(("cpu", i)) < log.index(("merge", i))

    # the GPU already past every query: the hand-offs first, the idle work after them
    flags = HostFlags(3, None)
    for i in range(3):
        flags.memory[flags._index(0, i)] = 1
    log = []
    idle = [lambda k=k: log.append(("idle", k)) for k in range(2)]
    run_host_side(flags, [lambda i=i: log.append(("cpu", i)) for i in range(3)], idle=idle)
    assert log == [("cpu", 0), ("cpu", 1), ("cpu", 2), ("idle", 0), ("idle", 1)]


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


# ---- compiled hand-off server (`HostFlags.serve`, `cpu.serve_handoffs`) -------------------------------------

needs_cpu_kernels = pytest.mark.skipif(not cpu.is_available(), reason="compiled CPU kernels unavailable")


def _ranked(seed: int, batch=2, kv_heads=2, group=4, dim=32, blocks=12, block_size=4, width=5):
    """A `RankedAttention` over random data, its output buffers and its ranked block ids (some invalid)."""
    gen = torch.Generator().manual_seed(seed)
    cap = blocks * block_size
    q = torch.randn(batch, kv_heads * group, dim, generator=gen).to(torch.bfloat16)
    keys = torch.randn(batch, kv_heads, cap, dim, generator=gen).to(torch.bfloat16)
    values = torch.randn(batch, kv_heads, cap, dim, generator=gen).to(torch.bfloat16)
    ranked = torch.stack([torch.randperm(blocks + 3, generator=gen)[:width] for _ in range(batch * kv_heads)])
    ranked = ranked.reshape(batch, kv_heads, width).contiguous()  # ids >= blocks: invalid picks, skipped
    out = torch.zeros(batch, kv_heads * group, dim)
    lse = torch.zeros(batch, kv_heads * group)
    call = cpu.RankedAttention(q, keys, values, ranked, 0.17, block_size, out, lse, num_threads=2)
    return call, out, lse


class _Part:
    """An action with a `native()` form, as the decode path's `CpuPart`: calling it runs the call from Python."""

    def __init__(self, call, skip, count, log, i):
        self.call, self.skip, self.count, self.log, self.i = call, skip, count, log, i
        self.available = torch.tensor([40, 13])
        self.results = []

    def __call__(self):
        self.log.append(("cpu", self.i))
        self.results.append(self.call(self.skip, self.count, self.available))

    def native(self):
        task = self.call.task(self.skip, self.count, self.available)

        def finish():
            self.results.append(self.call.result(task.result, self.skip, self.count))

        return handoff.NativePart(task, finish)


@needs_cpu_kernels
def test_compiled_parts_are_served_in_order_with_the_results_of_python_calls():
    """Runs of compiled parts (ranked attention, an empty part) between Python actions: each runs between its
    ready and done flags, writes what the same call from Python writes and records the same counts."""
    log = []
    calls = [_ranked(seed) for seed in range(4)]
    expected, queries = [], []
    for call, out, lse in calls:
        counts = call(1, 4, torch.tensor([40, 13]))
        expected.append((out.clone(), lse.clone(), counts))
        out.fill_(7.0), lse.fill_(7.0)
        q = call.tensors[0]
        queries.append(q.clone())
        q.zero_()  # the "GPU" writes q just before its ready flag: a part run early would attend zeros
    empty_out, empty_lse = torch.ones(2, 8, 32), torch.ones(2, 8)
    empty = handoff.NativePart(
        cpu.empty_task(empty_out, empty_lse), lambda: log.append(("finish empty", None))
    )
    parts = [_Part(call, 1, 4, log, i) for i, (call, _, _) in enumerate(calls)]
    python_only = lambda: log.append(("cpu", 2))  # noqa: E731
    actions = [parts[0], parts[1], python_only, SimpleNamespace(native=lambda: empty), parts[3]]
    flags = HostFlags(len(actions), None)
    gpu_log, merged = [], {}
    with_call = {0: 0, 1: 1, 4: 3}  # hand-off -> call

    def publish(i):
        if i in with_call:
            calls[with_call[i]][0].tensors[0].copy_(queries[with_call[i]])

    def merge(i):  # what the GPU reads back once done[i] is set
        if i in with_call:
            merged[i] = (calls[with_call[i]][1].clone(), calls[with_call[i]][2].clone())

    gpu = fake_gpu(flags, gpu_log, publish=publish, merge=merge)
    run_host_side(flags, actions)
    gpu.join(10)
    assert gpu_log == [event for i in range(5) for event in (("q", i), ("merge", i))]
    assert ("cpu", 2) in log and ("cpu", 0) not in log  # part 0 ran compiled, the plain action in Python
    for i, c in with_call.items():
        assert torch.equal(merged[i][0], expected[c][0]) and torch.equal(merged[i][1], expected[c][1])
        assert parts[c].results == [expected[c][2]]
    assert not empty_out.any() and torch.isneginf(empty_lse).all()


@needs_cpu_kernels
def test_a_ranked_rows_task_is_served_with_the_results_of_its_python_call():
    """Requests with their own stores and ranks in one compiled hand-off (`RankedRowsAttention.task`, what a pooled
    step hands off per layer): the same output and per-request counts as the call from Python."""
    from tandem.kernels import ops

    gen = torch.Generator().manual_seed(3)
    kv_heads, group, dim, block_size = 2, 4, 32, 4
    stores = []
    for blocks in (12, 7, 9):
        shape = (1, kv_heads, blocks * block_size, dim)
        stores.append(
            (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), None, None, None)
        )
    q = torch.randn(3, kv_heads * group, dim, generator=gen)
    ranked = torch.full((3, kv_heads, 6), -1, dtype=torch.long)
    for b, blocks in enumerate((12, 7, 9)):
        ranked[b, :, :5] = torch.stack([torch.randperm(blocks, generator=gen)[:5] for _ in range(kv_heads)])
    out, lse = torch.zeros(3, kv_heads * group, dim), torch.zeros(3, kv_heads * group)
    call = ops.ranked_rows_call(q, stores, ranked, 0.2, block_size, out, lse, num_threads=2)
    call.skips.copy_(torch.tensor([1, 0, 2]))
    call.counts.copy_(torch.tensor([4, 5, 2]))  # the third request attends nothing
    available = torch.tensor([40, 20, 30])
    expected = (call(available).clone(), out.clone(), lse.clone())
    out.fill_(7.0), lse.fill_(7.0)
    task = call.task(available)
    results = []
    part = handoff.NativePart(task, lambda: results.append(call.result(task.result).clone()))
    flags = HostFlags(1, None)
    gpu = fake_gpu(flags, [])
    run_host_side(flags, [SimpleNamespace(native=lambda: part)])
    gpu.join(10)
    assert torch.equal(results[0], expected[0]) and results[0][:, 2].tolist() == [80, 40, 60]
    assert torch.equal(out, expected[1]) and torch.equal(lse, expected[2])
    assert torch.isneginf(lse[2]).all()
    for bad in (torch.tensor([40, 20]), available.int()):  # read in place at each call: checked at each
        with pytest.raises(ValueError, match=r"available must be \[B\] = \[3\] int64, contiguous, got"):
            call(bad)
        with pytest.raises(ValueError, match=r"available must be \[B\] = \[3\] int64"):
            call.task(bad)


@needs_cpu_kernels
def test_a_failing_compiled_part_raises_its_error_and_releases_every_wait():
    calls = [_ranked(seed)[0] for seed in range(3)]  # one task per call: each hand-off has its own
    log = []
    bad = _Part(calls[1], 3, 2, log, 1)  # skip > count: the call refuses it
    actions = [_Part(calls[0], 0, 2, log, 0), bad, _Part(calls[2], 0, 2, log, 2)]
    flags = HostFlags(3, None)
    gpu = fake_gpu(flags, [])
    with pytest.raises(ValueError, match="skip / count"):
        run_host_side(flags, actions)
    gpu.join(10)
    assert not gpu.is_alive() and all(flags.done(i) for i in range(3))


@needs_cpu_kernels
def test_compiled_serving_times_out_and_stops_on_a_failed_launch():
    calls = [_ranked(seed)[0] for seed in range(3)]
    flags = HostFlags(3, None, timeout=0.2)
    gpu = fake_gpu(flags, [], stop_at=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="hand-off 1"):
        run_host_side(flags, [_Part(calls[i], 0, 2, [], i) for i in range(3)])
    assert time.monotonic() - start < 5
    gpu.join(10)
    assert all(flags.done(i) for i in range(3))

    flags = HostFlags(2, None, timeout=30)
    launcher = handoff.Launcher()

    def launch():
        time.sleep(0.05)  # the server is waiting by then
        raise OSError("cudaGraphLaunch failed")

    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="launch failed before hand-off 0") as info:
            launcher.start(launch)
            run_host_side(flags, [_Part(calls[i], 0, 2, [], i) for i in range(2)], launcher)
        assert isinstance(info.value.__cause__, OSError)
        assert time.monotonic() - start < 5
    finally:
        launcher.close()


def test_without_the_compiled_library_native_parts_run_in_python(monkeypatch):
    monkeypatch.setattr(handoff.cpu, "is_available", lambda: False)
    log = []

    class Action:
        def __call__(self):
            log.append("python")

        def native(self):
            raise AssertionError("not asked without the library")

    flags = HostFlags(2, None)
    gpu = fake_gpu(flags, [])
    run_host_side(flags, [Action(), Action()])
    gpu.join(10)
    assert log == ["python", "python"]


@needs_cpu_kernels
@pytest.mark.parametrize("policy", ["quest", "streaming", "hgca"])
def test_a_layers_compiled_cpu_part_matches_its_python_one(policy):
    """The decode path's `CpuPart` after real decode steps (CPU, eager): served compiled, it writes the same out /
    LSE and records the same counts as called from Python; hgca's part has no compiled form."""
    from tandem import TandemCache, TandemConfig
    from tandem.attention.decode import CpuPart
    from tandem.config import QuestConfig
    from tandem.engine import TandemRunner
    from tests.tiny import tiny_model

    torch.manual_seed(0)
    model = tiny_model("Llama", num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512)
    extra = {"quest": QuestConfig(budget=0.3, gpu_share=0.4, gpu_cache=0)} if policy == "quest" else {}
    config = TandemConfig(policy=policy, sink_tokens=4, window_tokens=16, block_size=4, **extra)
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache, use_graphs=False)
    logits = runner.prefill(torch.randint(0, 100, (2, 150)), chunk_tokens=64, max_new_tokens=8)
    runner.decode(logits.argmax(-1), 3)
    layer = cache.tandem_layers()[1]
    bufs = layer.decode_buffers
    part = CpuPart(layer, bufs, 0.125, cache.pool, False)
    counters = ("rows_attended", "rows_attended_device", "rows_available", "decode_steps")

    def run(served: bool):
        bufs.out_host.fill_(7.0), bufs.lse_host.fill_(7.0)
        before = [getattr(layer, name) for name in counters]
        if served:
            native = part.native()
            if native is None:
                return None
            gpu_log = []
            gpu = fake_gpu(flags, gpu_log)
            flags.serve(0, native)
            native.finish()
            gpu.join(10)
            assert gpu_log == [("q", 0), ("merge", 0)]
        else:
            part()
        counts = [getattr(layer, name) - b for name, b in zip(counters, before, strict=True)]
        return bufs.out_host.clone(), bufs.lse_host.clone(), counts

    flags = HostFlags(1, None)  # made outside inference mode: the "GPU" thread writes it
    with torch.inference_mode():  # the runner's buffers are inference tensors
        python, served = run(False), run(True)
    if policy == "hgca":
        assert served is None
        return
    assert torch.equal(served[0], python[0]) and torch.equal(served[1], python[1])
    assert served[2] == python[2] and python[2][3] == 1  # one step counted
    assert python[2][2] > 0  # rows were available on the host
    if policy == "quest":
        assert python[2][0] > 0 and torch.isfinite(python[1]).all()
    else:
        assert python[2][0] == 0 and torch.isneginf(python[1]).all()


@needs_cpu_kernels
def test_compiled_waits_return_to_python_in_slices_and_each_hand_off_gets_the_whole_timeout(monkeypatch):
    """A long wait comes back to Python every SERVE_SLICE (so Ctrl-C is handled); the timeout counts per hand-off,
    so two hand-offs each arriving just inside it are both served."""
    calls = []
    serve = cpu.serve_handoffs

    def counted(*args):
        calls.append(args[-1])
        return serve(*args)

    monkeypatch.setattr(handoff.cpu, "serve_handoffs", counted)
    monkeypatch.setattr(handoff, "SERVE_SLICE", 0.05)
    parts = [handoff.NativePart(cpu.empty_task(torch.ones(4), torch.ones(2)), lambda: None) for _ in range(2)]
    flags = HostFlags(2, None, timeout=0.4)
    gpu_log = []

    def publish(i):
        time.sleep(0.3)  # each hand-off 0.3 s after the previous one: 0.6 s in all, above the 0.4 s timeout

    gpu = fake_gpu(flags, gpu_log, publish=publish)
    run_host_side(flags, [SimpleNamespace(native=lambda part=part: part) for part in parts])
    gpu.join(10)
    assert gpu_log == [("q", 0), ("merge", 0), ("q", 1), ("merge", 1)]
    assert len(calls) >= 8 and max(calls) <= 0.05  # ~12 slices of 0.05 s


@needs_cpu_kernels
def test_a_prepared_call_and_its_task_are_freed_without_the_garbage_collector():
    """No reference cycle between a call and its task: a cycle left the decode buffers (pinned on CUDA) to the
    garbage collector, which ran inside a later graph capture and made it fail."""
    import gc
    import weakref

    call, _, _ = _ranked(0)
    call.task(0, 2, torch.tensor([40, 13]))
    ref = weakref.ref(call)
    was_on = gc.isenabled()
    gc.disable()
    try:
        del call
        assert ref() is None
    finally:
        if was_on:
            gc.enable()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_the_garbage_collector_is_off_while_a_step_is_recorded():
    import gc

    from tandem.engine.step import DecodeStep

    seen = []
    x = torch.zeros(4, device="cuda")

    def body():
        seen.append(gc.isenabled())
        x.add_(1)

    step = DecodeStep(torch.device("cuda"))
    step.capture(body)
    step.replay()
    torch.cuda.synchronize()
    assert seen == [False] and gc.isenabled() and x.sum().item() == 4
