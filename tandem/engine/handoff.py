"""Hand-offs between a replayed CUDA graph and the host thread through flags in pinned memory.

A decode step needs the host twice per layer: it takes q once the GPU has copied it out, and it gives back
the CPU part's (out, lse) before the GPU may merge them. Cutting the step into two graphs per layer does that
with launches and events, and the GPU idles during every launch. Here the whole step is one graph, and the
hand-offs are CUDA stream memory operations recorded in it:

    GPU (graph)                                      host thread
    q, selection -> pinned buffers
    write ready[l] = 1  (fenced after the copies)    spin until ready[l] == 1
    hot-tier attention, device share                 CPU part of layer l -> pinned out / lse
    wait until done[l] == 1  <---------------------  done[l] = 1
    copy out / lse in, merge, next layer ...

`cuStreamWriteValue32` orders the flag after everything before it on the stream (a system-wide fence), and
`cuStreamWaitValue32` holds the stream in the GPU's front end without occupying an SM. Both are recorded by
stream capture as graph nodes. The flags are reset by the host before each replay; the previous replay has
finished by then (the decode loop waits for each step's end).

If the host's part raises, every `done` flag is set so the graph can finish, and the error propagates.

A CPU part that is one compiled call (quest's ranked attention, or nothing to attend) offers it as a
`NativePart`: its Python bookkeeping lays the call out before the ready flag, while the GPU still computes the
query; one call into the CPU library (`cpu.serve_handoffs`) spins on the flag, runs the call and sets `done`; the
statistics are recorded after, while the GPU merges. Served from Python, that bookkeeping sat between `ready` and
`done`, on the step's critical path. Other CPU parts run in Python as above.

The launch is not instant, and not always short: the launch call submits the graph's nodes to a queue of bounded
size while the GPU already runs the first ones, and the GPU soon stops at a `done` flag. A graph too large for the
queue then blocks its launch call until the GPU drains it, which it never does if the thread in that call is the
one that would set the flag: a 96-layer model's step (~3800 nodes) deadlocked that way on an H200 host, while 64
layers (~2500 nodes) ran (`benchmarks/results/2026-11-26_h200_launch_deadlock/`). `Launcher` therefore runs the launch on a
second thread (the replay releases the GIL) and the calling thread serves the hand-offs meanwhile, whatever the
graph's size. (At the 8B shape the thread moved no step time: docs/engine.md § Hand-offs between GPU and host.)
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import time

import torch

from ..attention.decode import NativePart
from ..kernels import cpu

STRIDE = 16  # int32s between flags: one 64-byte line each, so the host's writes never share a line
# seconds a compiled wait for a ready flag runs before it returns to Python, which handles signals (Ctrl-C)
# and, within the timeout, waits again
SERVE_SLICE = 0.1
WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
WRITE_FENCED = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier before the write


class _Driver:
    """The few CUDA driver entry points used here, through ctypes (torch does not expose them)."""

    def __init__(self, lib) -> None:
        self.write_value = _entry(lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self.wait_value = _entry(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self.device_pointer = _entry(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        for fn in (self.write_value, self.wait_value):
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self.device_pointer.restype = ctypes.c_int
        self.device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]


def _entry(lib, *names):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    raise OSError(f"the CUDA driver has none of {names}")


_DRIVER: list = []


def driver() -> _Driver | None:
    """The driver's stream memory operations, or None where there is no CUDA driver that has them."""
    if not _DRIVER:
        try:
            _DRIVER.append(_Driver(ctypes.CDLL("libcuda.so.1")) if torch.cuda.is_available() else None)
        except OSError:
            _DRIVER.append(None)
    return _DRIVER[0]


def available() -> bool:
    return driver() is not None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {code}")


class HostFlags:
    """`count` pairs of flags (ready: GPU -> host, done: host -> GPU) in pinned memory.

    device: where the graphs run (CUDA), or None for a host-only instance (tests drive the GPU's side).
    timeout: seconds the host waits for a ready flag before it gives up (a step is milliseconds).
    """

    def __init__(self, count: int, device: torch.device | None, timeout: float = 60.0) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.count = count
        self.timeout = timeout
        pinned = device is not None and device.type == "cuda"
        self.memory = torch.zeros(2 * count * STRIDE, dtype=torch.int32, pin_memory=pinned)
        self._view = (ctypes.c_int32 * self.memory.numel()).from_address(self.memory.data_ptr())
        self._device_base = None
        if pinned:
            drv = driver()
            if drv is None:
                raise RuntimeError("stream memory operations need the CUDA driver (libcuda.so.1)")
            base = ctypes.c_uint64()
            _check(
                drv.device_pointer(ctypes.byref(base), self.memory.data_ptr(), 0), "cuMemHostGetDevicePointer"
            )
            self._device_base = base.value

    def _index(self, kind: int, i: int) -> int:
        if not 0 <= i < self.count:
            raise IndexError(f"flag {i} out of range: this step has {self.count} hand-offs")
        return (kind * self.count + i) * STRIDE

    # ---- recorded on the GPU stream (captured into the graph) ----------------------------------------------
    def signal_ready(self, i: int) -> None:
        """Queue `ready[i] = 1` on the current stream, after everything queued before it."""
        self._device_op(driver().write_value, self._index(0, i), WRITE_FENCED, "cuStreamWriteValue32")

    def wait_done(self, i: int) -> None:
        """Queue a wait until `done[i] >= 1` on the current stream: nothing after it starts before the host's
        part of hand-off i is finished."""
        self._device_op(driver().wait_value, self._index(1, i), WAIT_GEQ, "cuStreamWaitValue32")

    def _device_op(self, fn, index: int, flags: int, what: str) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        _check(fn(stream, self._device_base + 4 * index, 1, flags), what)

    # ---- the host's side ------------------------------------------------------------------------------------
    def reset(self) -> None:
        """All flags to 0, before a replay (the previous one must have finished)."""
        ctypes.memset(self.memory.data_ptr(), 0, self.memory.numel() * 4)

    def wait_ready(self, i: int, failed=None) -> None:
        """Spin until the GPU has set `ready[i]` (its q is in the pinned buffers).

        failed: None, or a callable returning the error of the launch that should set the flag (a `Launcher`'s
        `failed`), checked while spinning: a launch that failed raises here instead of timing out."""
        index = self._index(0, i)
        view = self._view
        if view[index]:
            return
        deadline = time.perf_counter() + self.timeout
        while True:
            for _ in range(1000):
                if view[index]:
                    return
            error = failed() if failed is not None else None
            if error is not None:
                raise RuntimeError(f"the step's graph launch failed before hand-off {i}") from error
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"the GPU did not hand over hand-off {i}'s query within {self.timeout:.0f} s "
                    "(a stalled or failed graph replay)"
                )

    def set_done(self, i: int) -> None:
        """`done[i] = 1`: the GPU may go on past hand-off i (the host's stores before it are visible first:
        x86 keeps stores in order, and the CPU kernel's threads joined before this)."""
        self._view[self._index(1, i)] = 1

    def set_all_done(self) -> None:
        """Release every wait, so a replay whose host side failed still runs to its end."""
        for i in range(self.count):
            self.set_done(i)

    def serve(self, i: int, part: NativePart, launcher: Launcher | None = None) -> None:
        """Serve hand-off i with the `NativePart` `part` through the CPU library: wait for its ready flag, run the
        call and set its done flag, with no Python in between (Python only resumes the wait every SERVE_SLICE
        seconds). Raises the call's error (the done flag unset), a `TimeoutError`, or, once `launcher`'s launch
        has failed, its error, as `wait_ready` does."""
        base = self.memory.data_ptr()
        ready, done = base + 4 * self._index(0, i), base + 4 * self._index(1, i)
        abort = launcher.abort_address if launcher is not None else None
        deadline = time.perf_counter() + self.timeout
        while True:
            # waits of at most SERVE_SLICE seconds per call, so that Python handles signals (Ctrl-C) meanwhile
            wait = max(0.0, min(SERVE_SLICE, deadline - time.perf_counter()))
            status, _ = cpu.serve_handoffs([part.task], ready, done, STRIDE, abort, wait)
            if status != cpu.TIMED_OUT or time.perf_counter() >= deadline:
                break
        if status == cpu.SERVED:
            return
        if status == cpu.TASK_FAILED:
            part.finish()  # raises the call's error
            raise RuntimeError(f"hand-off {i}'s CPU part failed (code {part.task.result})")
        if status == cpu.ABORTED:
            raise RuntimeError(f"the step's graph launch failed before hand-off {i}") from launcher.failed()
        raise TimeoutError(
            f"the GPU did not hand over hand-off {i}'s query within {self.timeout:.0f} s "
            "(a stalled or failed graph replay)"
        )

    def ready(self, i: int) -> bool:
        return bool(self._view[self._index(0, i)])

    def done(self, i: int) -> bool:
        return bool(self._view[self._index(1, i)])


class Launcher:
    """A thread that runs one call at a time for its owner (a graph's launch), so the owner can serve the
    hand-offs that the launched work reaches while the launch is still submitting the rest.

    `start(call)` returns once the thread has begun `call`; `join()` waits for it to return and raises its error.
    `close()` ends the thread (it is a daemon: an interpreter exit does not wait for it).
    """

    def __init__(self, name: str = "tandem-launch") -> None:
        self._go = threading.Event()
        self._started = threading.Event()
        self._finished = threading.Event()
        self._finished.set()
        self._call = None
        self._error: BaseException | None = None
        self._abort = ctypes.c_int32(0)  # set with _error: a compiled hand-off server stops waiting on it
        self.abort_address = ctypes.addressof(self._abort)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def start(self, call) -> None:
        if self._closed:
            raise RuntimeError("the launcher is closed")
        if not self._finished.is_set():
            raise RuntimeError("the previous launch has not been joined")
        self._error = None
        self._abort.value = 0
        self._call = call
        self._finished.clear()
        self._started.clear()
        self._go.set()
        self._started.wait()

    def failed(self) -> BaseException | None:
        """The running or last call's error, once it has raised; None before that."""
        return self._error

    def join(self) -> None:
        self._finished.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        if self._closed:
            return
        self._finished.wait()
        self._closed = True
        self._call = None
        self._go.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            call, self._call = self._call, None
            if call is None:
                return
            self._started.set()
            try:
                call()
            except BaseException as error:  # handed to the owner's join()
                self._error = error
                self._abort.value = 1
            finally:
                self._finished.set()


def run_host_side(
    flags: HostFlags, actions, launcher: Launcher | None = None, compiled: bool = True, idle=()
) -> None:
    """The host's side of one replay: for each hand-off in order, wait for its q, run its action, release it.
    On an error every wait is released (the graph finishes with that layer's stale out / lse) and it is raised.

    idle: short pieces of host work (callables) that make no CUDA call, run from the first hand-off on (by then the
    GPU has passed everything queued before the graph) while the GPU has not yet reached the next one, one at a
    time, each after checking its ready flag; the rest after the last hand-off. Work the host would otherwise do
    before the launch, with the GPU idle.

    An action with a `native()` method may return a `NativePart` for this step (or None): it is laid out before
    its ready flag, served by the compiled library (`HostFlags.serve`: the flag, the call and the done flag
    without Python in between) and finished after its done flag. Other actions, and all of them with `compiled`
    False, are called here between the flags.

    launcher: the `Launcher` that is launching the graph, or None (launched before this call). It is joined
    before this returns, and a launch that fails ends the wait for the next query with its error."""
    failed = launcher.failed if launcher is not None else None
    idle = collections.deque(idle)
    try:
        for i, action in enumerate(actions):
            # laid out while the GPU still computes hand-off i's query: off the path from ready to done
            part = _native_part(action) if compiled else None
            while i and idle and not flags.ready(i):
                idle.popleft()()
            if part is None:
                flags.wait_ready(i, failed)
                action()
                flags.set_done(i)
            else:
                flags.serve(i, part, launcher)
                part.finish()  # statistics, while the GPU merges and goes on
    except BaseException:
        flags.set_all_done()
        if launcher is not None:
            # the launch's own error is the cause of the one raised here, or secondary to it
            with contextlib.suppress(BaseException):
                launcher.join()
        raise
    while idle:
        idle.popleft()()
    if launcher is not None:
        launcher.join()


def _native_part(action) -> NativePart | None:
    native = getattr(action, "native", None)
    if native is None or not cpu.is_available():
        return None
    return native()
