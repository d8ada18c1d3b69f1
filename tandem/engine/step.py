"""One decode step of the engine: the token's bookkeeping in every layer, and its record / replay as CUDA graphs.

Each layer runs its one decode function (`tandem.attention.rows.decode_attention`) with the step as its
`StepContext`; the step owns what happens between the layers' parts when it is recorded. The new token's slot
is a device tensor (`slot`), so one recording serves every step, and the host meets the GPU twice per layer
(take q, give back the CPU part's out / LSE), in one of two ways (`flags`):

- "memops": the step is one graph; the hand-offs are flags in pinned memory that the graph writes and waits on
  (CUDA stream memory operations, `handoff.py`). A second thread launches it, while the calling thread spins on
  each layer's flag, runs the CPU part and sets the answer flag; the GPU never waits for a launch.
- "launches": the recording is cut at each layer's CPU part into two graphs per layer; a replay launches them in
  order and, between them, records q's copy event and runs the CPU part (2 launches per layer).

A layer whose policy never attends the host tier, or whose device attends the whole selection, has no hand-off:
its statistics are recorded on the host after the replay.

(A single graph with each CPU part as a CUDA host node was tried first: every host node costs a driver-thread
round trip, far more per step than the launches; docs/engine.md § Measured and not kept.)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import weakref

import torch

from ..attention.context import StepContext
from ..cache.layer import reserve_decode_slots
from . import handoff as handoff_module

_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every recording on `device` runs on. One per device, not one per recording: cuBLAS keeps a
    workspace (32 MiB on Hopper) for each stream it has run on, for the life of the process, so a new stream per
    recording (a runner per request, a re-recording when a tier grows) would hold one more each time, up to the
    32 of torch's stream pool."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        stream = _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def freeze_heap() -> None:
    """Collect once, then keep every object alive now (the model, its modules, the tokenizer) out of the cyclic
    garbage collector's later passes (`gc.freeze`). A long-running decode loop otherwise sets off full
    collections that walk the whole heap, and with a large model loaded one lasts many decode steps' time
    (docs/engine.md § Where a step's time goes). For processes that load a model once and decode for long (the
    server, benchmarks, `tandem generate`).

    The frozen objects go back to the collector at exit: the interpreter's last collection skips frozen ones, and
    Triton's bindings then report the cycles among their module objects as leaks (dozens of "nanobind: leaked"
    lines after every `tandem generate`)."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)  # once per process


class DecodeStep(StepContext):
    """The engine's `attention.StepContext`: what the fixed-address decode path shares across the layers of one
    cache (`slot`, `device_blocks`: see there), and the recording of a step whose hand-offs the layers mark
    through the context's hooks while `capture` runs (`defers_host_work`).

    flags:      the hand-off flags (`handoff="memops"`), or None: the recording is cut at each CPU part
    launcher:   with flags, the thread that launches the graph (`handoff.Launcher`), or None; `close()` ends it.
                Hand-offs must be served while the launch call is still submitting: a large graph's launch blocks
                until the GPU has drained part of it, and the GPU waits for the hand-offs (launched from the
                calling thread, a 96-layer step deadlocked)
    segments:   the recorded CUDA graphs, each followed by a host-side action (or None) at replay; with flags
                one graph, and `actions` holds the CPU parts in hand-off order
    compiled_host_side: with flags, serve the hand-offs whose CPU part is one compiled call from the CPU library
                (`handoff.run_host_side`); False serves every hand-off from Python (for comparisons)
    """

    def __init__(self, device: torch.device, flags: handoff_module.HostFlags | None = None) -> None:
        super().__init__(device)
        self.flags = flags
        # with flags the graph itself says when q has landed: no event to wait on
        self.waits_for_copy = flags is None
        self.launcher = handoff_module.Launcher() if flags is not None else None
        self.compiled_host_side = True
        self.actions: list = []
        self.after: list = []  # host work after each replay that needs no hand-off (statistics)
        self.segments: list[tuple[torch.cuda.CUDAGraph, object]] = []
        self.generations: list[int] = []  # host tier buffer generations the segments were recorded with
        self._graph = None
        self._pool = None
        self.captures = 0  # recordings made: a recording may make step tensors that `prepare` must fill
        # what the recording read of its layers (`read_layout`), taken when the stream that made it ends; the
        # runner compares a new request's layers to it before replaying the recording for them (`check_layout`)
        self.layout: list | None = None
        self.check_layout = False
        self._shares: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # context -> `prepare`'s last

    def prepare(self, layers, context: StepContext | None = None, wait: bool = True) -> int:
        """Bookkeeping of one step in every layer of one cache (slot, evictions, device share) into `context`'s
        slot and device share (default: this step's own; a multi-request step passes each request's
        `RowContext`); the device tensors are updated in stream order. `wait` False: with hand-off flags the
        caller waits for the copies into host memory queued here (`wait_for_copies`) before the replay, once for
        every cache of the step, instead of this call."""
        context = self if context is None else context
        if not layers:  # only sliding-window layers: nothing tiered to keep
            return 0
        events = [layer.host.last_event if layer.host is not None else None for layer in layers]
        slot, moved = reserve_decode_slots(layers)
        context.slot.fill_(slot)
        # The policies' step state and device share follow the host tiers' rows: where no layer did more than take
        # its newest block's next slot since the last step, and no recording made new step tensors, they stand.
        key, tokens = (self.captures, len(layers), _tier_key(layers[0])), layers[0].seq_len
        known = self._shares.get(context)
        if moved or known is None or known[0] != key or known[1] != tokens - 1:
            for layer in layers:
                layer.policy.prepare_step(layer)
            shares = {layer.policy.device_share(layer) for layer in layers}
            if len(shares) != 1:
                raise RuntimeError(
                    f"layers disagree on the device share ({sorted(shares)}); the cache is inconsistent"
                )
            share = shares.pop()
            queued = any(layer.queue_split != "share" for layer in layers)  # its GPU side reads host rows
        else:
            share, queued = known[2:]
        self._shares[context] = (key, tokens, share, queued)
        if share != context.device_blocks_value:
            context.device_blocks.fill_(share)
            context.device_blocks_value = share
        if moved and (share or queued) and self.device.type == "cuda":
            # the device reads host rows in place: rows evicted just now must have landed in host memory first
            stream = torch.cuda.current_stream(self.device)
            for layer, before in zip(layers, events, strict=True):
                if layer.host.last_event is not before:
                    stream.wait_event(layer.host.last_event)
        if self.flags is not None and wait:
            # With hand-off flags the launcher thread launches the graph while this thread serves its hand-offs,
            # and the launch of a graph longer than the driver's launch queue (the certified selection is many
            # kernels per layer) returns only once the GPU has passed hand-offs this thread serves. A CUDA call
            # on this thread during the replay can block behind that launch: `HostTier.wait` (an event's
            # synchronize and destruction, from `CpuPart.native`) hung the step. The copies evicted or staged just now were
            # queued before the launch: wait for them now, so that the replay's waits find no event.
            self.wait_for_copies(layers)
        return slot

    @staticmethod
    def wait_for_copies(layers) -> None:
        """Block until the copies into host memory queued by `layers` (evictions, staged blocks) have landed,
        the last queued first: a cache's layers share one side stream, so the earlier ones have landed by then."""
        for layer in reversed(layers):
            if layer.host is not None:
                layer.host.wait()

    # ---- capture -------------------------------------------------------------------------------------------
    def capture(self, body) -> None:
        """Record `body()` (one decode step) as CUDA graphs sharing one memory pool: one graph with hand-off
        flags, or without them graphs cut where a layer calls `split`. Nothing runs on the GPU while
        recording; `replay` then runs the step."""
        # garbage collected during the capture could free pinned host memory, which a capture does not allow
        # (the capture fails): the collector stays off while it records. No collection first (torch.cuda.graph
        # makes one): with a model loaded and the heap not frozen, a full pass is most of a short answer's
        # recording cost, and the garbage it would free is no hazard while the collector is off
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            self._capture(body)
        finally:
            if gc_was_on:
                gc.enable()

    def _capture(self, body) -> None:
        torch.cuda.synchronize(self.device)
        stream = capture_stream(self.device)  # capture needs a stream other than the default one
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self.captures += 1
        self.segments = []
        self.actions = []
        self.after = []
        self._pool = torch.cuda.graph_pool_handle()  # one pool for all segments, replayed in capture order
        self.defers_host_work = True
        try:
            with torch.cuda.stream(stream):
                try:
                    self._begin()
                    body()
                    self._end(None)
                except BaseException:
                    # the capture ends on the stream it began on, or that stream stays capturing and every later
                    # CUDA call in the process fails; a capture the failure invalidated raises here, ended anyway
                    if self._graph is not None:
                        with contextlib.suppress(RuntimeError):
                            self._graph.capture_end()
                    raise
        except BaseException:
            self.segments = []
            raise
        finally:
            self.defers_host_work = False
            self._graph = None
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def split(self, after) -> None:
        """End the graph being recorded; at replay, `after()` runs on the host once it has been launched."""
        self._end(after)
        self._begin()

    def q_ready(self, record_event) -> None:
        """A layer has queued its q (and selection) copies into pinned memory: the host may start its CPU part
        once they land. `record_event` records the copy's event (the launches hand-off)."""
        if self.flags is None:
            self.split(record_event)
        else:
            self.flags.signal_ready(len(self.actions))

    def host_work(self, action, wait: bool = True) -> None:
        """At replay `action()` (the layer's CPU part) runs on the host after its `q_ready`; what the layer
        queues after this call runs on the GPU once it has returned (with wait=False, with flags: the GPU goes
        on; a later hand-off's wait covers it, since the host serves them in order)."""
        if self.flags is None:
            self.split(action)
        else:
            if wait:
                self.flags.wait_done(len(self.actions))
            self.actions.append(action)

    def after_replay(self, action) -> None:
        """At replay `action()` runs on the host once the step's graphs have been launched and its hand-offs
        served (no GPU work waits for it): bookkeeping of layers with no CPU part."""
        self.after.append(action)

    def replay(self, idle=()) -> None:
        """Run the recorded step. idle: host work (callables that make no CUDA call) that reads what the stream
        computed before the replay: done while the GPU runs, between the hand-offs (`handoff.run_host_side`),
        else once the step has run; all of it is done on return."""
        between = self.flags is not None and bool(self.actions)  # else no hand-off says how far the GPU is
        if self.flags is not None:
            self.flags.reset()
            graph, stream = self.segments[0][0], torch.cuda.current_stream(self.device)
            # no garbage collection while the hand-offs are served: one that frees a CUDA event or pinned memory
            # makes a CUDA call on this thread during the launch (see `prepare`)
            gc_was_on = gc.isenabled()
            gc.disable()
            try:
                self.launcher.start(lambda: _replay_on(graph, stream))
                handoff_module.run_host_side(
                    self.flags, self.actions, self.launcher, self.compiled_host_side, idle if between else ()
                )
            finally:
                if gc_was_on:
                    gc.enable()
        else:
            for graph, after in self.segments:
                graph.replay()
                if after is not None:
                    after()
        if idle and not between:
            torch.cuda.current_stream(self.device).synchronize()
            for work in idle:
                work()
        for action in self.after:
            action()

    def close(self) -> None:
        """End the launcher thread, if any, and drop the recording. Its host-side parts hold their requests' layers
        (and through them the host tiers), and each part's timing callback holds its request's context, which holds
        this step: a cycle that, left to the garbage collector, kept ended requests' host tiers for as long as no
        full collection came (a server after a load: hundreds of MB)."""
        if self.launcher is not None:
            self.launcher.close()
        self.segments, self.actions, self.after = [], [], []
        self._shares = weakref.WeakKeyDictionary()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        self._graph = graph

    def _end(self, after) -> None:
        self._graph.capture_end()
        self.segments.append((self._graph, after))
        self._graph = None


def read_layout(layers, device: torch.device) -> list:
    """What a recorded step over `layers` reads of them, as addresses: each tensor on `device` or in host memory
    (pinned or not: asking which costs a driver call per tensor) reachable from the layers through Tandem's objects
    (tiers, policy, buffers) and the lists, tuples and dicts they hold, with its shape, strides and dtype, and each
    such object's identity (the step's host-side parts hold the objects). Values are left out: two requests whose
    layers give equal layouts can replay one recording. Depth first in attribute order, each object once; an
    object's `layout_skips` names attributes that hold what a step leaves behind (its results, work queued for the
    host), which no recording reads."""
    out, seen, stack = [], set(), list(reversed(layers))
    while stack:
        obj = stack.pop()
        kind = type(obj)
        if kind in _SCALARS:
            continue
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" or obj.device == device:
                out.append((obj.data_ptr(), obj.shape, obj.stride(), obj.dtype))
            continue
        if id(obj) in seen:
            continue
        if kind is dict:
            seen.add(id(obj))
            stack.extend(reversed(list(obj.values())))
        elif kind is list or kind is tuple:
            seen.add(id(obj))
            stack.extend(reversed(obj))
        elif kind.__module__.startswith("tandem.") and hasattr(obj, "__dict__"):
            seen.add(id(obj))
            out.append((kind.__name__, id(obj)))
            skips = getattr(obj, "layout_skips", ())
            stack.extend(reversed([v for k, v in vars(obj).items() if k not in skips]))
    return out


_SCALARS = frozenset((type(None), bool, int, float, str, torch.dtype, torch.device))


def _tier_key(layer) -> tuple:
    """What a layer's step state and device share are worked out from, besides its policy's own settings: its
    host tier: which, how many rows, its buffers' generation, whether its digests are mirrored."""
    host = layer.host
    if host is None:
        return None
    return id(host), host.rows, host.generation, host.key_min_dev is None


def _replay_on(graph, stream) -> None:
    """Replay `graph` on `stream` (from a thread whose current stream would be the default one)."""
    with torch.cuda.stream(stream):
        graph.replay()
