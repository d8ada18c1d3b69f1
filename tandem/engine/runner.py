"""Prefill and decode loop over a `TandemCache` with low per-step overhead.

Prefill runs the model on `chunk_tokens` tokens at a time: each chunk's KV goes to the cache as it is made
(sinks and window on the GPU, the rest to pinned host memory), so a 128K-token prompt never holds more than
one chunk's activations on the GPU. Every chunk attends all earlier tokens exactly.

Decode steps have fixed addresses: the new token's hot-tier slot is a device tensor (`DecodeStep.slot`), and
each layer's q / CPU output / LSE live in fixed pinned buffers. That lets CUDA graphs hold a whole step, recorded
once: Tandem's own decode forward for the Llama family (`forward.py`: concatenated projections, fused norms, RoPE
and SiLU), or for other models their transformers code with Tandem's registered attention (`forward="hf"`). The host meets
the GPU twice per layer (take q, give back the CPU part's out / LSE), in one of two ways (`handoff`):

- "memops": the step is one graph; the hand-offs are flags in pinned memory that the graph writes and waits
  on (CUDA stream memory operations, `handoff.py`). A second thread launches it, while the calling thread
  spins on each layer's flag, runs the CPU part and sets the answer flag; the GPU never waits for a launch.
- "launches": the recording is cut at each layer's CPU part into two graphs per layer; a replay launches
  them in order and, between them, records q's copy event and runs the CPU part (2 launches per layer).

Python per step is then the bookkeeping (slot, block evictions) and one CPU part per layer. Without CUDA the
same step runs eagerly; `use_graphs=False` does that on CUDA too (still overlapped per layer).

(A single graph with each CPU part as a CUDA host node was tried first: every host node cost ~0.3 ms of
driver-thread round trip, 10 ms per step on an 8B model, against tens of microseconds for the launches.)
"""

from __future__ import annotations

import contextlib
import gc
import platform
import sys
import time

import torch

from ..integrations.hf import TandemCache, generate_cache_kwargs
from ..kernels import gpu as gpu_kernels
from . import handoff as handoff_module
from .forward import DecodeForward, unsupported_reason
from .fused import FusedLayers

HANDOFFS = ("auto", "memops", "launches")
FORWARDS = ("auto", "own", "hf")  # the decode step's layer code: Tandem's own (Llama family) or transformers'


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


def device_memory_error(err: BaseException, device: torch.device, during: str, levers: str) -> MemoryError:
    """A MemoryError for the allocator's out-of-memory on `device`: what ran out, how much is free, and what
    needs less. The cache that was filling refuses further use (`TandemCache.mark_failed`)."""
    free = ""
    if device.type == "cuda":
        with contextlib.suppress(RuntimeError):
            free_bytes, total_bytes = torch.cuda.mem_get_info(device)
            free = f" ({free_bytes / 2**30:.2f} of {total_bytes / 2**30:.1f} GiB free now)"
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return MemoryError(
        f"{device} ran out of memory during {during}{free}: {first_line}. The cache is left unusable: build a new "
        f"one. Needs less: {levers}"
    )


class DecodeStep:
    """What the fixed-address decode path shares across the layers of one cache.

    slot:       [1] int64 on the model's device: this step's hot-tier slot (the same in every layer, since all
                layers store the same tokens with the same geometry)
    device_blocks: [1] int64 on the model's device: how many ranked host blocks per KV head the device attends
                itself this step (a quest `gpu_share`; the same in every layer, whose host tiers grow together)
    capturing:  True while `capture` records a step; the layers then mark their hand-offs (`q_ready`,
                `host_work`)
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
        self.device = device
        self.flags = flags
        self.launcher = handoff_module.Launcher() if flags is not None else None
        self.compiled_host_side = True
        self.actions: list = []
        self.after: list = []  # host work after each replay that needs no hand-off (statistics)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.device_blocks = torch.zeros(1, dtype=torch.long, device=device)
        self._device_blocks_value = 0
        self.capturing = False
        self.host_seconds = 0.0  # time spent in the CPU parts of this step (a profile of where a step goes)
        self.segments: list[tuple[torch.cuda.CUDAGraph, object]] = []
        self.generations: list[int] = []  # host tier buffer generations the segments were recorded with
        self._graph = None
        self._pool = None

    def prepare(self, layers) -> int:
        """Bookkeeping of one step in every layer (slot, evictions, device share); the device tensors are
        updated in stream order."""
        events = [layer.host.last_event if layer.host is not None else None for layer in layers]
        slots = {layer.reserve_decode_slot() for layer in layers}
        if len(slots) != 1:
            raise RuntimeError(
                f"layers disagree on the decode slot ({sorted(slots)}); the cache is inconsistent"
            )
        slot = slots.pop()
        self.slot.fill_(slot)
        for layer in layers:
            layer.policy.prepare_step(layer)
        shares = {layer.policy.device_share(layer) for layer in layers}
        if len(shares) != 1:
            raise RuntimeError(
                f"layers disagree on the device share ({sorted(shares)}); the cache is inconsistent"
            )
        share = shares.pop()
        if share != self._device_blocks_value:
            self.device_blocks.fill_(share)
            self._device_blocks_value = share
        if share and self.device.type == "cuda":
            # the device reads host rows in place: rows evicted just now must have landed in host memory first
            stream = torch.cuda.current_stream(self.device)
            for layer, before in zip(layers, events, strict=True):
                if layer.host.last_event is not before:
                    stream.wait_event(layer.host.last_event)
        return slot

    # ---- capture -------------------------------------------------------------------------------------------
    def capture(self, body) -> None:
        """Record `body()` (one decode step) as CUDA graphs sharing one memory pool: one graph with hand-off
        flags, or without them graphs cut where a layer calls `split`. Nothing runs on the GPU while
        recording; `replay` then runs the step."""
        # garbage collected during the capture could free pinned host memory, which a capture does not allow
        # (the capture fails); torch.cuda.graph collects first as well
        gc.collect()
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
        self.segments = []
        self.actions = []
        self.after = []
        self._pool = torch.cuda.graph_pool_handle()  # one pool for all segments, replayed in capture order
        self.capturing = True
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
            self.capturing = False
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

    def host_work(self, action) -> None:
        """At replay `action()` (the layer's CPU part) runs on the host after its `q_ready`; what the layer
        queues after this call runs on the GPU once it has returned."""
        if self.flags is None:
            self.split(action)
        else:
            self.flags.wait_done(len(self.actions))
            self.actions.append(action)

    def after_replay(self, action) -> None:
        """At replay `action()` runs on the host once the step's graphs have been launched and its hand-offs
        served (no GPU work waits for it): bookkeeping of layers with no CPU part."""
        self.after.append(action)

    def replay(self) -> None:
        if self.flags is not None:
            self.flags.reset()
            graph, stream = self.segments[0][0], torch.cuda.current_stream(self.device)
            self.launcher.start(lambda: _replay_on(graph, stream))
            handoff_module.run_host_side(self.flags, self.actions, self.launcher, self.compiled_host_side)
        else:
            for graph, after in self.segments:
                graph.replay()
                if after is not None:
                    after()
        for action in self.after:
            action()

    def close(self) -> None:
        """End the launcher thread, if any."""
        if self.launcher is not None:
            self.launcher.close()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        self._graph = graph

    def _end(self, after) -> None:
        self._graph.capture_end()
        self.segments.append((self._graph, after))
        self._graph = None


def _replay_on(graph, stream) -> None:
    """Replay `graph` on `stream` (from a thread whose current stream would be the default one)."""
    with torch.cuda.stream(stream):
        graph.replay()


class TandemRunner:
    """Chunked prefill and greedy decode of a Hugging Face causal LM over a `TandemCache`.

    Example:
        >>> from tandem import TandemCache, TandemConfig, load_model
        >>> from tandem.engine import TandemRunner
        >>> model, tok = load_model()
        >>> runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="quest")))
        >>> logits = runner.prefill(tok("The capital of France is", return_tensors="pt").input_ids)
        >>> tokens, seconds = runner.decode(logits.argmax(-1), steps=8)
    """

    def __init__(
        self,
        model,
        cache: TandemCache,
        use_graphs: bool | str = "auto",
        warmup_steps: int = 2,
        handoff: str = "auto",
        fused: bool | str = "auto",
        forward: str = "auto",
    ) -> None:
        if not isinstance(cache, TandemCache):
            raise ValueError(
                f"cache must be a TandemCache (TandemCache.for_model(model)), got {type(cache).__name__}"
            )
        if use_graphs not in (True, False, "auto"):
            raise ValueError(f"use_graphs must be True, False or 'auto', got {use_graphs!r}")
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        if use_graphs is True and self.device.type != "cuda":
            raise ValueError(f"use_graphs=True needs the model on a CUDA device; it is on {self.device}")
        self.use_graphs = self.device.type == "cuda" if use_graphs == "auto" else use_graphs
        if handoff not in HANDOFFS:
            raise ValueError(f"handoff must be one of {', '.join(HANDOFFS)}, got {handoff!r}")
        if handoff == "memops" and self.use_graphs and not handoff_module.available():
            raise ValueError(
                "handoff='memops' needs the CUDA driver's stream memory operations (libcuda.so.1); "
                "use handoff='launches'"
            )
        if handoff == "auto":
            # x86 keeps the host's stores in order, which the done flag relies on (set from Python, unfenced)
            x86 = platform.machine().lower() in ("x86_64", "amd64")
            handoff = "memops" if self.use_graphs and x86 and handoff_module.available() else "launches"
        self.handoff = handoff
        if fused not in (True, False, "auto"):
            raise ValueError(f"fused must be True, False or 'auto', got {fused!r}")
        can_fuse = gpu_kernels.triton_available(self.device)
        if fused is True and not can_fuse:
            raise ValueError(
                f"fused=True needs the Triton kernels on {self.device} (CUDA with triton installed, or Triton's "
                "interpreter on CPU); use fused=False"
            )
        use_fused = can_fuse and (fused is True or self.device.type == "cuda")
        # the model's RMSNorm / RoPE as one kernel each, during this runner's passes only
        self.fused_layers = FusedLayers(model, self.device) if use_fused else None
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
        reason = unsupported_reason(model) if forward != "hf" else None
        if forward == "own" and reason is not None:
            raise ValueError(
                f"forward='own': Tandem's decode forward cannot run this model: {reason}; use forward='hf'"
            )
        if forward == "auto" and reason is not None:
            print(f"tandem: decoding with transformers' layer code ({reason})", file=sys.stderr)
        # Tandem's own decode forward (Llama family), else transformers' layers with the attention registered
        self.decoder = None
        if forward != "hf" and reason is None:
            self.decoder = DecodeForward(model, cache, kernels="triton" if use_fused else "torch")
        self.forward = "own" if self.decoder is not None else "hf"
        self.warmup_steps = max(1, warmup_steps)
        self.cache_kwargs = generate_cache_kwargs(model, cache)
        self.next_position: torch.Tensor | None = None  # [B] position of each request's next token
        self.prefill_seconds = 0.0
        self.host_seconds: list[float] = []  # per decode step: seconds in the CPU parts

    @property
    def layers(self):
        return self.cache.tandem_layers()

    # ---- prefill -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, input_ids, attention_mask=None, chunk_tokens: int = 8192, max_new_tokens: int = 0):
        """Run the prompt through the model `chunk_tokens` at a time; returns the last position's logits [B, V].

        input_ids: [B, T] int64 (left-padded for ragged batches); attention_mask: [B, T] (1 = token, 0 = pad).
        max_new_tokens sizes the host tier once for the prompt plus that many decode tokens.
        """
        if self.layers[0].seq_len:
            raise ValueError("prefill runs on an empty cache; build a new TandemCache for a new prompt")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be [batch, tokens] with tokens >= 1, got {tuple(input_ids.shape)}"
            )
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        input_ids = input_ids.to(self.device)
        batch, total = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(self.device).long()
        if tuple(mask.shape) != (batch, total):
            raise ValueError(
                f"attention_mask must be [batch, tokens] = {(batch, total)}, got {tuple(mask.shape)}"
            )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        for layer in self.layers:
            layer.capacity_hint = total + max_new_tokens
        start = time.perf_counter()
        try:
            with self.fused_layers or contextlib.nullcontext():
                logits = self._prefill_chunks(input_ids, mask, positions, chunk_tokens)
        except BaseException as err:
            self.cache.mark_failed(err)  # some layers may hold a chunk the others lack
            if isinstance(err, torch.OutOfMemoryError):
                raise device_memory_error(
                    err,
                    self.device,
                    f"prefill of {batch} x {total} tokens in chunks of {chunk_tokens}",
                    "a smaller chunk_tokens (tandem's --prefill-chunk), batch or prompt",
                ) from err
            raise
        finally:
            for layer in self.layers:
                layer.observe_appends = True
        self._sync()
        self.prefill_seconds = time.perf_counter() - start
        self.next_position = positions[:, -1] + 1
        return logits

    def _prefill_chunks(self, input_ids, mask, positions, chunk_tokens: int) -> torch.Tensor:
        total = input_ids.shape[1]
        for s in range(0, total, chunk_tokens):
            e = min(total, s + chunk_tokens)
            for layer in self.layers:  # only the last chunk's HGCA observation survives: skip the others
                layer.observe_appends = e == total
            out = self.model(
                input_ids=input_ids[:, s:e],
                attention_mask=mask[:, :e],
                position_ids=positions[:, s:e],
                use_cache=True,
                logits_to_keep=1,
                **self.cache_kwargs,
            )
        return out.logits[:, -1].float()

    def set_positions(self, next_position: torch.Tensor) -> None:
        """Positions [B] of each request's next token, for a cache filled without `prefill` (benchmarks)."""
        if next_position.dim() != 1:
            raise ValueError(f"next_position must be [batch], got {tuple(next_position.shape)}")
        self.next_position = next_position.to(self.device, torch.long)

    # ---- decode --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, first_tokens: torch.Tensor, steps: int):
        """Greedy decode: feed `first_tokens` [B] (e.g. the argmax of the prefill logits), then each step's
        argmax. Returns (tokens [B, steps] int64 on the CPU: the tokens produced, seconds per step).
        """
        seconds: list[float] = []
        tokens = list(self.stream(first_tokens, steps, seconds))
        batch = first_tokens.shape[0]
        history = torch.stack(tokens, dim=1) if tokens else torch.empty(batch, 0, dtype=torch.long)
        return history.cpu(), seconds

    def stream(self, first_tokens: torch.Tensor, steps: int, seconds: list | None = None):
        """`decode` as a generator: yields each step's tokens [B] (int64, on the model's device) once the step
        has run, so a caller can print them as they come or stop early (at an end-of-sequence token: close the
        generator, or just stop iterating). `seconds`, if given, receives each step's wall time."""
        if self.next_position is None:
            raise ValueError("decode needs a prefilled cache: call prefill() (or fill the cache) first")
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        batch = self.next_position.shape[0]
        if tuple(first_tokens.shape) != (batch,):
            raise ValueError(f"first_tokens must be [batch] = [{batch}], got {tuple(first_tokens.shape)}")
        limit = self.cache.layers[0].max_positions
        if limit is not None and self.layers[0].seq_len + steps > limit:
            raise ValueError(
                f"context of {self.layers[0].seq_len + steps} tokens exceeds the model's maximum of {limit} "
                "positions (config.max_position_embeddings); decode fewer steps"
            )
        return self._stream(first_tokens, steps, seconds if seconds is not None else [])

    def _stream(self, first_tokens: torch.Tensor, steps: int, seconds: list):
        batch = self.next_position.shape[0]
        self._ids = first_tokens.to(self.device, torch.long).reshape(batch, 1).clone()
        self._positions = self.next_position.reshape(batch, 1).clone()
        history = torch.empty(batch, steps, dtype=torch.long, device=self.device)
        self.host_seconds = []  # per step: seconds in the CPU parts
        flags = None
        if self.use_graphs and self.handoff == "memops":
            flags = handoff_module.HostFlags(len(self.layers), self.device)
        step = self.cache.decode_step = DecodeStep(self.device, flags)
        end = torch.cuda.Event(blocking=True) if self.device.type == "cuda" else None
        fused = self.fused_layers or contextlib.nullcontext()
        try:
            for t in range(steps):
                start = time.perf_counter()
                with torch.inference_mode(), fused:
                    self._decode_step(step, t)
                    history[:, t] = self._ids[:, 0]
                    if end is not None:
                        end.record()
                        end.synchronize()  # one event per step, not a device-wide sync
                seconds.append(time.perf_counter() - start)
                self.host_seconds.append(step.host_seconds)
                yield history[:, t]
        finally:
            step.close()
            self.cache.decode_step = None
            self.next_position = self._positions[:, 0].clone()

    def _decode_step(self, step: DecodeStep, t: int) -> None:
        try:
            self._run_step(step, t)
        except BaseException as err:
            self.cache.mark_failed(err)  # part of the step may have run: the cache refuses further use
            if isinstance(err, torch.OutOfMemoryError):
                graphs = "recording or running its CUDA graph" if self.use_graphs else "running it"
                raise device_memory_error(
                    err,
                    self.device,
                    f"decode step {t} ({graphs}) at {self.layers[0].seq_len} tokens",
                    "a smaller batch or window_tokens, gpu_cache=0 (quest), or use_graphs=False",
                ) from err
            raise

    def _run_step(self, step: DecodeStep, t: int) -> None:
        if self.decoder is not None:
            self.decoder.check_weights()
        step.host_seconds = 0.0
        step.prepare(self.layers)
        if self.use_graphs and t >= self.warmup_steps:
            generations = [(layer.host.generation, layer.hot.generation) for layer in self.layers]
            if not step.segments or generations != step.generations:
                # (re)record: a host tier that grew has moved the digest mirror the graphs read, a hot tier that
                # grew has moved its storage
                step.capture(self._step_body)
                step.generations = generations
            step.replay()
        else:
            self._step_body()

    def _step_body(self) -> None:
        """One decode step at fixed addresses: model forward, greedy pick, inputs of the next step."""
        if self.decoder is not None:
            logits = self.decoder(self._ids, self._positions)
            self._ids.copy_(logits.argmax(dim=-1, keepdim=True))
            self._positions.add_(1)
            return
        out = self.model(
            input_ids=self._ids,
            position_ids=self._positions,
            use_cache=True,
            logits_to_keep=1,
            **self.cache_kwargs,
        )
        self._ids.copy_(out.logits[:, -1].argmax(dim=-1, keepdim=True))
        self._positions.add_(1)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
