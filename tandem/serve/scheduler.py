"""Continuous batching over per-request Tandem caches: one thread owns the model and runs, in turn, a chunk of a
waiting prompt and one decode step of every running request (or, with `Limits.prefill_thread`, a second thread
runs the prompts' chunks beside the decode steps).

- **Admission.** A request's cache bytes (`sizing.request_bytes`) are known before it starts. It is admitted
  when the batch has room (`max_batch`) and the host and device budgets hold its bytes next to those of every
  admitted request; otherwise it waits in a FIFO queue of `max_queue`. A full queue refuses at once
  (`QueueFull`), and so does a request that could never fit (`TooLarge`): nothing waits forever.
- **Prefill** runs `prefill_chunk` tokens at a time, one chunk per turn, so a running stream waits at most one
  chunk between two tokens (measured: `SchedulerStats.prefill_chunk_seconds`, `/metrics`). With a token budget
  per turn (`Limits.step_tokens`), a turn runs the oldest prompts' next chunks while they fit beside the decoding
  requests' one token each: a filling server's prompts then prefill in fewer turns, and a running stream waits
  for as many chunks as the budget holds. The chunks are the
  engine's (`RowsRunner.prefill_chunk`, cut by `engine.prefill.chunk_end`): with `hgca` the last one holds at
  least the `observation_tokens` whose attention scores the prompt, as one whole prefill does.
- **Prefill beside the steps** (`Limits.prefill_thread`). A thread of its own (and, on CUDA, a stream of its own)
  runs the oldest prompt's next chunk again and again while this one runs decode steps, so a running stream waits
  for no chunk; the two share the device and the host's cores. Each thread owns its requests: the prefill thread
  ends its cancelled prompts after their chunk, and a prompt joins the decoding requests once its first token is
  taken. The hot-tier pool changes (a request's row taken or given back, the digest mirrors grown) only between
  steps (`SlotPool.lock`).
- **Prefixes.** With a `PrefixCache`, a prompt that begins with a prefix kept there under its settings starts
  from it and prefills only the rest, and each prompt keeps its own last chunk boundaries' prefixes
  (`engine.prefill.kept_ends`) for later requests: the same tokens as a cold prefill (`cache.prefix`). A request
  may opt out (`Request.prefix_cache`). The prefixes' host bytes count against the host budget: admission drops
  the least recently used ones where a request needs their memory.
- **Decode.** Every request past its prefill decodes one token per step, all of them in one step of the engine
  (`engine.rows.RowsRunner`: one model forward, each row over its own cache, recorded as CUDA graphs while the
  batch keeps its requests), and the rows' tokens are chosen in one call. A request leaves the batch when it
  finishes or is cancelled, and its cache is dropped there and then: its tensors are freed before the next step
  (to the allocator; glibc's free heap goes back to the OS when the server is idle).
- **Events.** Each request's `emit(event)` callback gets `("text", piece)` for every token it generates (the
  text that became final with it, possibly empty: a partial character or a possible stop string is held back),
  then one `("done", finish_reason)` or `("error", message)`. It is called from the scheduler's thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import itertools
import secrets
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..attention import TaskPool
from ..cache import memory
from ..cache.prefix import PrefixCache
from ..config import TandemConfig
from ..engine.prefill import chunk_end, keep_prefix, observed_tokens, start_from_prefix
from ..engine.rows import RowsRunner, choose_tokens
from ..engine.sampling import seed_key
from ..integrations.hf import TandemCache, layer_windows
from ..models import attention_shape, end_of_sequence_ids
from .sampling import TextStream, choose_token
from .sizing import CacheShape, RequestBytes, host_stores, request_bytes

SWITCH_INTERVAL_SECONDS = 0.0002  # see Scheduler.start
# an idle server keeps the host pool's free stores this long for the next request, then gives them back
HOST_POOL_IDLE_SECONDS = 1.0
WARMUP_PROMPT_TOKENS = 16  # the prompts of Scheduler.warm_up's throwaway requests


class QueueFull(Exception):
    """The waiting queue is full; try again later (HTTP 429)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooLarge(ValueError):
    """The request could never fit the server's memory budgets or batch (HTTP 400)."""


@dataclass
class Request:
    """One generation: the prompt's token ids, when to stop, how to choose tokens, the cache's settings."""

    prompt_ids: list[int]
    max_tokens: int
    config: TandemConfig
    emit: Callable[[tuple], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    id: str = ""
    prefix_cache: bool = True  # start from a kept prefix, and keep this prompt's (with the server's store)
    # filled in by the scheduler
    cached_tokens: int = 0  # prompt tokens taken from a kept prefix
    bytes: RequestBytes | None = None
    host_stores: memory.Reservation | None = None  # its host tier's stores, made ahead (`Scheduler._admit`)
    cache: TandemCache | None = None
    prefilled: int = 0
    tokens: list[int] = field(default_factory=list)
    text: TextStream | None = None
    draw_seed: int = 0  # the key of the request's draws (`sampling.choose_token`), set at its first chunk
    cancelled: bool = False
    finish_reason: str | None = None
    generated: int = 0  # tokens chosen, an end-of-sequence token included
    submitted: float = 0.0
    admitted: float = 0.0
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class Limits:
    """The scheduler's bounds. Byte budgets of None are unbounded."""

    max_batch: int = 16
    max_queue: int = 256
    prefill_chunk: int = 512
    host_bytes: int | None = None
    device_bytes: int | None = None
    # tokens a turn runs: one for each decoding request, and prompt chunks while they fit (one at least while a
    # prompt waits); None: one chunk a turn
    step_tokens: int | None = None
    # prompt chunks on a thread (and CUDA stream) of their own, beside the decode steps, instead of in turns
    prefill_thread: bool = False


class SchedulerStats:
    """Counters and recent timings, read by `/metrics` (the callbacks run on the scheduler's threads)."""

    def __init__(self) -> None:
        self.on_prefill_chunk: Callable[[float], None] | None = None
        # (seconds, batch, how the step ran: `RowsRunner.last_step`)
        self.on_decode_step: Callable[[float, int, str], None] | None = None
        self.on_first_token: Callable[[float], None] | None = None
        self.on_token_gap: Callable[[float], None] | None = None
        self.on_finish: Callable[[Request, str], None] | None = None
        self.request_seconds = 0.0  # moving average of a request's time from admission to its end


class Scheduler:
    """Runs requests on `model` in a background thread (see the module's docstring)."""

    def __init__(
        self,
        model,
        tokenizer,
        limits: Limits,
        pool: TaskPool,
        tokenizer_lock=None,
        runner: RowsRunner | None = None,
        prefix: PrefixCache | None = None,
    ) -> None:
        if limits.prefill_thread and limits.step_tokens is not None:
            raise ValueError(
                "Limits.step_tokens budgets the turns of prompt chunks and decode steps, and Limits.prefill_thread "
                "runs the chunks beside the steps instead: set one of them"
            )
        self.model, self.tokenizer, self.limits, self.pool = model, tokenizer, limits, pool
        self.prefix = prefix  # prompts' kept prefixes (`cache.prefix`), or None
        # the decode steps, with a pool of hot tiers for the batch (sized for the default configuration's window)
        self.runner = runner if runner is not None else RowsRunner(model, slots=limits.max_batch)
        self.tokenizer_lock = tokenizer_lock or threading.Lock()
        self.device = next(model.parameters()).device
        text = model.config.get_text_config(decoder=True)
        sliding = tuple(w for w in layer_windows(text) if w is not None)
        self.shape = CacheShape(*attention_shape(text), next(model.parameters()).dtype, sliding)
        self.max_positions = getattr(text, "max_position_embeddings", None)
        self.eos = end_of_sequence_ids(model)
        self.stats = SchedulerStats()
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        self._reserved_host = 0
        self._reserved_device = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._prefill_thread: threading.Thread | None = None  # with Limits.prefill_thread
        self._owns_host_pool = False  # whether start() turned the host pool on (stop() turns it off)
        self.failure: BaseException | None = None  # what stopped the thread, if anything did
        self._live_caches: weakref.WeakSet = weakref.WeakSet()

    # ---- the API side ---------------------------------------------------------------------------------------
    def size(self, request: Request) -> RequestBytes:
        """The request's cache bytes; TooLarge when it could never be admitted."""
        pool = self.runner.pool
        nbytes = request_bytes(
            self.shape, request.config, len(request.prompt_ids), request.max_tokens, self.device.type,
            pool.slots if pool is not None else 0,
        )  # fmt: skip
        lim = self.limits
        for need, budget, where, flag in (
            (nbytes.on_host, lim.host_bytes, "host memory", "--host-memory"),
            (nbytes.on_device, lim.device_bytes, f"{self.device.type} memory", "--device-memory"),
        ):
            if budget is not None and need > budget:
                raise TooLarge(
                    f"this request's cache needs {need / 2**30:.2f} GiB of {where} ({len(request.prompt_ids)} prompt "
                    f"tokens + max_tokens {request.max_tokens}) and the server's budget is {budget / 2**30:.2f} GiB "
                    f"({flag}): shorten the prompt or max_tokens, or use host.dtype='int8'"
                )
        return nbytes

    def submit(self, request: Request) -> Request:
        """Queue a request; it starts when it fits. Raises QueueFull or TooLarge (nothing is queued then)."""
        request.bytes = self.size(request)
        with self._cond:
            if self._stop or self.failure is not None:
                raise RuntimeError("the server is shutting down")
            request.id = request.id or f"req-{next(self._ids)}"
            request.submitted = time.perf_counter()
            self._waiting.append(request)
            self._admit()  # one that fits the batch now never counts against the queue (--max-queue 0 works)
            if len(self._waiting) > self.limits.max_queue:
                self._waiting.pop()  # it is the last one: _admit takes them in order
                raise QueueFull(
                    f"{len(self._waiting)} requests are waiting (--max-queue {self.limits.max_queue}); retry later",
                    retry_after=max(1.0, self.stats.request_seconds),
                )
            self._cond.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (a client went away): it leaves at the next step boundary and its cache is freed."""
        with self._cond:
            request.cancelled = True
            self._cond.notify_all()

    def counts(self) -> dict:
        with self._cond:
            return {
                "waiting": len(self._waiting),
                "prefilling": len(self._prefilling),
                "decoding": len(self._decoding),
                "reserved_host_bytes": self._reserved_host,
                "reserved_device_bytes": self._reserved_device,
                "live_caches": len(self._live_caches),
            }

    @torch.inference_mode()
    def warm_up(self, config: TandemConfig, prompt_tokens: int = WARMUP_PROMPT_TOKENS) -> float:
        """Before the first request (not while the thread runs): one decode step at every batch size up to
        `max_batch` over throwaway caches of `config` with `prompt_tokens`-token prompts, then their memory given
        back. The one-time costs of each batch shape fall here instead of in the first load: the CPU's matmul
        primitives and their scratch, the allocator's growth, kernel builds on a GPU. Without it, the server's
        memory stays well above its idle level after its first load (measured with and without it in
        docs/serve.md § Measured, "Memory"). Returns the seconds it took."""
        if self._thread is not None:
            raise RuntimeError(
                "warm_up runs before start(): the scheduler's thread owns the model afterwards"
            )
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        start = time.perf_counter()
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        draw = torch.Generator().manual_seed(0)
        caches = []
        for _ in range(self.limits.max_batch):
            cache = TandemCache.for_model(self.model, config, pool=self.pool)
            self.runner.attach(cache)
            ids = torch.randint(0, vocab, (1, prompt_tokens), generator=draw)
            self.runner.prefill_chunk(cache, ids, 0, last=True)
            caches.append(cache)
        for batch in range(1, self.limits.max_batch + 1):
            rows = caches[:batch]
            ids = torch.randint(0, vocab, (batch,), generator=draw)
            # a decode step, as `_decode_step` runs it
            self.runner.step(rows, ids, [cache.get_seq_length() for cache in rows])
        self.runner.release()
        for cache in caches:
            self.runner.detach(cache)
        del caches, rows
        gc.collect()  # (once, before the heap is frozen) whatever cycle still held a cache
        _return_free_heap(self.device)
        return time.perf_counter() - start

    def start(self) -> None:
        # This thread gives up the GIL in every torch op and must win it back from the event loop's thread each
        # time; at CPython's default 5 ms switch interval a busy event loop stretches every CPU decode step many
        # times over (docs/serve.md § Switch interval)
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_SECONDS))
        # On CUDA a request's host tier is page-locked memory, whose registration costs as much as a prompt's
        # first chunks: the stores of ended requests serve the next ones (`cache.memory.HostPool`)
        self._owns_host_pool = self.device.type == "cuda" and memory.host_pool() is None
        if self._owns_host_pool:
            memory.enable_host_pool()
        self._thread = threading.Thread(target=self._run, name="tandem-scheduler", daemon=True)
        if self.limits.prefill_thread:
            self._prefill_thread = threading.Thread(
                target=self._run_prefill, name="tandem-prefill", daemon=True
            )
            self._prefill_thread.start()
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for thread in (self._thread, self._prefill_thread):
            if thread is not None:
                thread.join(timeout)
        if self._owns_host_pool:
            memory.disable_host_pool()
            self._owns_host_pool = False

    @property
    def alive(self) -> bool:
        threads = [t for t in (self._thread, self._prefill_thread) if t is not None]
        return bool(threads) and all(t.is_alive() for t in threads) and self.failure is None

    # ---- the scheduler's thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        # with a prefill thread this thread runs the decode steps alone, and drops only its own cancelled requests
        beside = self._prefill_thread is not None
        mine = (self._decoding,) if beside else (self._prefilling, self._decoding)
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        self._drop_cancelled(mine)
                        self._admit()
                        while not (self._stop or self.failure is not None or self._has_work(beside)):
                            idle = self._idle()
                            if not self._cond.wait(_host_pool_wait() if idle else None) and self._idle():
                                # idle for HOST_POOL_IDLE_SECONDS: give the free stores back without holding
                                # the lock, which a request arriving meanwhile takes (unregistering 17 GB
                                # takes about 0.3 s)
                                self._cond.release()
                                try:
                                    _trim_host_pool()
                                finally:
                                    self._cond.acquire()
                        if self._stop or self.failure is not None:
                            break
                        self._drop_cancelled(mine)
                        self._admit()
                        prefill = self._prefilling[0] if self._prefilling and not beside else None
                        batch = list(self._decoding)
                    if prefill is not None:
                        self._prefill_turn(len(batch))
                    if batch:
                        self._decode_step(batch)
                    with self._cond:
                        idle = self._idle()
                    if idle:
                        self.runner.release()  # what the last step held of the last requests' caches
                        _return_free_heap(self.device)
        except BaseException as err:  # a bug in the scheduler itself: fail every request, never hang them
            self.failure = err
            raise
        finally:
            if beside:
                # the prefill thread stops after its chunk (it reads the stop or the failure): its request's cache
                # is its own until then
                with self._cond:
                    self._cond.notify_all()
                self._prefill_thread.join()
            with self._cond:
                message = (
                    "the server is shutting down"
                    if self.failure is None
                    else f"the server's scheduler failed: {type(self.failure).__name__}: {self.failure}"
                )
                for request in list(self._waiting) + self._prefilling + self._decoding:
                    self._end(request, error=message)
                self._waiting.clear()

    def _run_prefill(self) -> None:
        """The prefill thread (`Limits.prefill_thread`): the oldest admitted prompt's next chunk, again and again,
        on a CUDA stream of its own, while the scheduler's thread runs the decode steps; a prompt's last chunk
        takes its first token, and the request then joins the decoding requests. A fault here stops both threads
        (the scheduler's thread then fails every request)."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            with torch.inference_mode(), torch.cuda.stream(stream) if stream else contextlib.nullcontext():
                while True:
                    with self._cond:
                        self._drop_cancelled((self._prefilling,))
                        self._admit()
                        while not (self._stop or self.failure is not None or self._prefilling):
                            self._cond.wait()
                        if self._stop or self.failure is not None:
                            return
                        request = self._prefilling[0]
                    self._prefill_chunk(request)
        except BaseException as err:
            with self._cond:
                if self.failure is None:
                    self.failure = err
                self._cond.notify_all()
            raise

    def _has_work(self, beside: bool) -> bool:
        """Whether the scheduler's thread has a turn to run (called under the lock): decode steps, and prompts
        unless a prefill thread takes them."""
        return bool(self._decoding) if beside else not self._idle()

    def _idle(self) -> bool:
        return not (self._prefilling or self._decoding or self._waiting)

    def _admit(self) -> None:
        """Move waiting requests into the batch, in order, while the next one fits (called under the lock)."""
        lim = self.limits
        while self._waiting:
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                self._end(request, reason="cancelled")
                continue
            need = request.bytes
            if len(self._prefilling) + len(self._decoding) >= lim.max_batch:
                return
            if lim.host_bytes is not None and self._reserved_host + need.on_host > lim.host_bytes:
                return
            if lim.device_bytes is not None and self._reserved_device + need.on_device > lim.device_bytes:
                return
            if lim.host_bytes is not None and self.prefix is not None:
                # kept prefixes hold host memory too (a running request's host tier among it, counted twice
                # meanwhile): the least recently used go where this request needs their bytes
                self.prefix.evict(lim.host_bytes - self._reserved_host - need.on_host)
            self._waiting.popleft()
            self._reserved_host += need.on_host
            self._reserved_device += need.on_device
            request.admitted = time.perf_counter()
            self._prefilling.append(request)
            self._reserve_host_stores(request)

    def _reserve_host_stores(self, request: Request) -> None:
        """With the host pool on, have its worker make the request's host-tier stores from its admission (called
        under the lock), off the scheduler's thread: its first chunk then draws them instead of mapping and
        page-locking them while every stream waits. Every admitted request's at once: the worker's burst of new
        stores slows this thread's calls, and made while the first prompts prefill, before any stream decodes, it
        slows those prompts rather than a running stream's tokens (reserving only the next two prompts' measured
        worse: docs/serve.md § Host pool)."""
        pool = memory.host_pool()
        if pool is None or not request.config.host.huge_pages:
            return
        layer = host_stores(self.shape, request.config, len(request.prompt_ids), request.max_tokens)
        request.host_stores = pool.reserve(
            layer * self.shape.global_layers, pinned=self.device.type == "cuda"
        )

    def _drop_cancelled(self, groups) -> None:
        """End the cancelled requests of `groups` (called under the lock, by the thread that runs them)."""
        for group in groups:
            for request in [r for r in group if r.cancelled]:
                self._end(request, reason="cancelled")

    def _end(self, request: Request, reason: str | None = None, error: str | None = None) -> None:
        """Take a request out of the batch, free its cache and reservation, and tell its client (under the lock,
        or on the scheduler's thread)."""
        for group in (self._prefilling, self._decoding):
            if request in group:
                group.remove(request)
                self._reserved_host -= request.bytes.on_host
                self._reserved_device -= request.bytes.on_device
                seconds = time.perf_counter() - request.admitted
                self.stats.request_seconds = 0.8 * self.stats.request_seconds + 0.2 * seconds
        if request.host_stores is not None:  # it ended before its first chunk
            request.host_stores.release()
            request.host_stores = None
        if request.cache is not None:
            try:
                self.runner.detach(request.cache)  # its row of hot tiers, for the next request
            except Exception as err:
                # a failed device (a CUDA error stays): the client is answered all the same
                if error is None and reason != "cancelled":
                    error = f"its cache could not be freed: {_describe(err)}"
        request.cache = None  # the cache's tensors go with the last reference
        request.finish_reason = reason if error is None else "error"
        if self.stats.on_finish is not None:
            self.stats.on_finish(request, request.finish_reason)
        if error is not None:
            request.emit(("error", error))
        elif reason != "cancelled":
            tail = request.text.finish() if request.text is not None else ""
            if tail:
                request.emit(("text", tail))
            request.emit(("done", reason))
        else:
            request.emit(("done", "cancelled"))

    def _new_cache(self, request: Request) -> TandemCache:
        cache = TandemCache.for_model(self.model, request.config, pool=self.pool)
        self.runner.attach(cache)  # a row of the runner's pool of hot tiers, where it has one
        for kv in cache.tandem_layers():  # the host tier is reserved once, as sized at admission
            kv.capacity_hint = len(request.prompt_ids) + request.max_tokens
        self._live_caches.add(cache)
        return cache

    def _prefill_turn(self, decoding: int) -> None:
        """This turn's prompt chunks: the oldest admitted prompt's next chunk, then, with a token budget
        (`Limits.step_tokens`, less one token for each of the `decoding` requests), the next ones in admission
        order while they fit it. A prompt's chunks are the same whatever the turn holds (its tokens, and the
        prefixes it keeps, do not depend on the load)."""
        left = None if self.limits.step_tokens is None else self.limits.step_tokens - decoding
        ran = False
        while True:
            with self._cond:
                request = self._prefilling[0] if self._prefilling else None
            if request is None or request.cancelled:
                return
            tokens = self._next_chunk_tokens(request)
            if ran and (left is None or tokens > left):
                return
            self._prefill_chunk(request)
            ran = True
            if left is not None:
                left -= tokens

    def _next_chunk_tokens(self, request: Request) -> int:
        """The prompt tokens of the request's next chunk (fewer where its first starts from a kept prefix)."""
        total = len(request.prompt_ids)
        end = chunk_end(request.prefilled, total, self.limits.prefill_chunk, observed_tokens(request.config))
        return end - request.prefilled

    def _prefill_chunk(self, request: Request) -> None:
        start = time.perf_counter()  # a new request's cache, and the prefix it starts from, stall streams too
        stores, request.host_stores = request.host_stores, None
        try:
            # a new request's host tier draws the stores made ahead for it
            with stores.drawn() if stores is not None else contextlib.nullcontext():
                e, total, logits = self._run_chunk(request)
            seconds = time.perf_counter() - start
            if self.stats.on_prefill_chunk is not None:
                self.stats.on_prefill_chunk(seconds)
        except Exception as err:
            with self._cond:
                self._end(request, error=_describe(err))
            return
        if e < total:
            return
        token = choose_token(logits, request.temperature, request.top_p, request.draw_seed, request.generated)
        # its first token, before any decode step reads its tokens (it may end it)
        self._accept(request, token)
        with self._cond:
            if request in self._prefilling:
                self._prefilling.remove(request)
                self._decoding.append(request)
                self._cond.notify_all()  # a scheduler's thread waiting for decoding requests

    def _run_chunk(self, request: Request) -> tuple[int, int, torch.Tensor]:
        """The request's next prompt chunk (its cache made first, from a kept prefix where one fits): (its end,
        the prompt's length, the last position's logits on the CPU)."""
        if request.cache is None:
            request.cache = self._new_cache(request)
            request.text = TextStream(self.tokenizer, request.stop)
            # the draws' key: the request's seed, or a fresh one
            request.draw_seed = seed_key(request.seed if request.seed is not None else secrets.randbits(63))
            if self.prefix is not None and request.prefix_cache:
                request.cached_tokens = request.prefilled = start_from_prefix(
                    self.prefix, request.cache, request.prompt_ids, self.limits.prefill_chunk
                )
        total = len(request.prompt_ids)
        s = request.prefilled
        e = s + self._next_chunk_tokens(request)
        logits = self.runner.prefill_chunk(request.cache, request.prompt_ids[s:e], s, last=e == total)
        logits = logits[0].cpu()
        request.prefilled = e
        if self.prefix is not None and request.prefix_cache:
            keep_prefix(self.prefix, request.cache, request.prompt_ids, e, self.limits.prefill_chunk)
        return e, total, logits

    def _decode_step(self, batch: list[Request]) -> None:
        start = time.perf_counter()
        try:
            positions = [len(r.prompt_ids) + len(r.tokens) - 1 for r in batch]
            logits = self.runner.step([r.cache for r in batch], [r.tokens[-1] for r in batch], positions)
            tokens = choose_tokens(
                logits, [r.temperature for r in batch], [r.top_p for r in batch], [r.draw_seed for r in batch],
                [r.generated for r in batch],
            )  # fmt: skip
        except Exception as err:  # every cache of the step may hold half of it: end them all
            with self._cond:
                for request in batch:
                    self._end(request, error=_describe(err))
            return
        if self.stats.on_decode_step is not None:
            self.stats.on_decode_step(time.perf_counter() - start, len(batch), self.runner.last_step)
        for request, token in zip(batch, tokens, strict=True):
            self._accept(request, token)

    def _accept(self, request: Request, token: int) -> None:
        """Take the request's next token, release its text, end it if it is done."""
        now = time.perf_counter()
        if request.first_token is None:
            request.first_token = now
            if self.stats.on_first_token is not None:
                self.stats.on_first_token(now - request.submitted)
        elif self.stats.on_token_gap is not None:
            self.stats.on_token_gap(now - request.last_token)
        request.last_token = now
        request.generated += 1
        reason = None
        if token in self.eos:
            reason = "stop"
        else:
            request.tokens.append(token)
            with self.tokenizer_lock:
                piece = request.text.push(token)
            request.emit(("text", piece))
            if request.text.stopped:
                reason = "stop"
            elif len(request.tokens) >= request.max_tokens:
                reason = "length"
        if reason is not None:
            with self._cond:
                self._end(request, reason=reason)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _return_free_heap(device: torch.device | None = None) -> None:
    """Give freed host memory back to the OS once the last request has ended. glibc keeps freed memory for reuse,
    and caches smaller than a huge page (`cache.memory.host_zeros`), hot tiers and activations come from its heap;
    on CUDA, host tiers smaller than a huge page per layer are pinned blocks that torch's host allocator keeps for
    reuse. Without this the server's resident size stayed well above its level before a load, every cache freed
    (benchmarks/results/2026-11-27_cpu_serve). Once per idle spell."""
    if device is not None and device.type == "cuda":
        memory.empty_pinned_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _host_pool_wait() -> float | None:
    """How long an idle scheduler waits before it gives the host pool's free stores back: None (for ever) where
    the pool is off or holds none."""
    pool = memory.host_pool()
    return HOST_POOL_IDLE_SECONDS if pool is not None and pool.free_bytes else None


def _trim_host_pool() -> None:
    pool = memory.host_pool()
    if pool is not None:
        pool.trim()


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"
