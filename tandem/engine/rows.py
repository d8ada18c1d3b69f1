"""Decode steps over a batch of requests that each keep their own `TandemCache` (the server's running batch).

Each request has its own batch-1 cache: its own length, policy and budget, and its own host tier. One step runs
the model's matmuls once for all of them, and each layer attends row b over request b's cache through the one
decode function (`attention.rows.decode_attention`), with that request's `RowContext`: its reserved slot and device
share, and the step's hand-off hooks. Requests join or leave between steps; no KV is copied.

With `slots` (and Tandem's own decode forward) the requests' hot tiers live in one pool (`slots.SlotPool`): a
request attached before its prefill takes a row, and a step lays its batch out by rows (row b is the pool's row
b, a row without a request in the step decodes nothing), so each layer writes and attends every pooled request's
hot tier in one call and waits once for their CPU parts (`attention.rows.pooled_rows`).

On CUDA a new batch runs `record_after` eager steps, then is recorded as one step (`step.DecodeStep`: one graph
with a hand-off per layer and request, one per layer for the pooled quest requests together) and replayed while it
stays the same. A recording reads its requests' caches, so a request that joins or leaves ends it, except where
every request of the recorded batch was a pooled one whose step is all the pool's (quest's joined path: the
device reads only the pool's rows and tensors): then the batches that follow within its rows, of pooled requests
of the same config, replay it, its host-side parts re-pointed at them (`_rebind`), with no eager step and no new
recording; such batches are laid out over a power-of-two count of rows (`_width`). A batch of pooled requests that
changed within the rows of an eager step not yet recorded is recorded at once (`_record_grown`): a filling
server's batch changes at every step and would otherwise never be. The pool stages its requests' evicted blocks
for all of them at once (`SlotPool.stage_evictions`).
"""

from __future__ import annotations

import contextlib
import weakref
from functools import partial

import torch

from ..attention.context import StepContext
from ..attention.rows import RankedRowsPart
from ..config import TandemConfig
from ..integrations.hf import TandemCache, generate_cache_kwargs
from ..integrations.rows import RowsCache
from . import handoff as handoff_module
from .prefill import run_chunk
from .runner import StepOptions, device_memory_error
from .sampling import sample
from .slots import SlotPool
from .step import DecodeStep

# eager steps of a new batch before it is recorded (CUDA graphs): one allocates what a newly joined request's layers
# need; a step that records costs no more than an eager one (benchmarks/results/2026-11-28_h200_rows_steps/)
RECORD_AFTER = 1


class RowContext(StepContext):
    """One request's part of a multi-request step: the slot and device share its layers read (its own tensors,
    which a recorded step reads at replay), and the step's hand-off hooks and host-time count."""

    def __init__(self, step: DecodeStep) -> None:
        super().__init__(step.device)
        self.step = step
        self.waits_for_copy = step.waits_for_copy

    def add_host_seconds(self, seconds: float) -> None:
        self.step.add_host_seconds(seconds)

    def q_ready(self, record_event) -> None:
        self.step.q_ready(record_event)

    def host_work(self, action, wait: bool = True) -> None:
        self.step.host_work(action, wait)

    def after_replay(self, action) -> None:
        self.step.after_replay(action)


class RowsRunner:
    """Decode steps of a changing batch of requests, each over its own prefilled batch-1 `TandemCache`.

    The options are `TandemRunner`'s (use_graphs, handoff, fused, forward: `runner.StepOptions`); record_after:
    the eager steps of a new batch before it is recorded. slots: the requests whose hot tiers share one pool
    (`slots.SlotPool`, made here for caches of `config`; 0: none), with Tandem's own decode forward only (else
    no pool is made); a cache takes a row through `attach` before its prefill.

    Example:
        >>> runner = RowsRunner(model, slots=16)
        >>> runner.attach(cache_a), runner.attach(cache_b)   # before their prefills
        >>> logits = runner.step([cache_a, cache_b], tokens=[17, 42], positions=[300, 1024])  # [2, V]
    """

    def __init__(
        self,
        model,
        use_graphs: bool | str = "auto",
        handoff: str = "auto",
        fused: bool | str = "auto",
        forward: str = "auto",
        record_after: int = RECORD_AFTER,
        slots: int = 0,
        config=None,
    ) -> None:
        if record_after < 1:
            raise ValueError(f"record_after must be >= 1, got {record_after}")
        if slots < 0:
            raise ValueError(
                f"slots must be >= 0 (requests whose hot tiers share a pool; 0: none), got {slots}"
            )
        options = StepOptions(model, use_graphs, handoff, fused, forward)
        self.model, self.device = model, options.device
        self.use_graphs, self.handoff, self.forward = options.use_graphs, options.handoff, options.forward
        self.fused_layers, self.decoder = options.fused_layers, options.decoder()
        self.record_after = record_after
        self.cache_arg = next(iter(generate_cache_kwargs(model, None)))  # `past_key_values` or `cache`
        self._contexts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # the caches of the batch the current step object serves, held weakly: a recording is theirs alone (a new
        # cache at a freed one's address is another batch)
        self._batch: list[weakref.ref] = []
        self._step: DecodeStep | None = None
        self._steps_same = 0  # consecutive steps over the same batch
        self._ids = self._positions = self._logits = None
        self.recordings = 0  # batches recorded (CUDA graphs)
        self.pool = None
        if slots and self.decoder is not None:
            self.pool = SlotPool.for_model(model, config if config is not None else TandemConfig(), slots)
        self._rows = None  # the step's layout by rows, with a pool (`_layout`)
        # (rows, config, pool generation) of a recorded step that other requests of the pool may replay (`_rebind`),
        # or None
        self._bucket = None
        self._mirrored = weakref.WeakKeyDictionary()  # what `_rebindable` found each cache's mirrors in
        self._served = None  # what the recorded step serves, per row (`_served_rows`)
        self.rebinds = 0  # batches served by a recorded step of other requests
        # how the last step ran: "eager" (no recording: graphs off, the CPU, a new batch's first steps), "recorded"
        # (recorded, then replayed), "rebound" (a recording re-pointed at this batch's requests or moved tiers,
        # then replayed) or "replayed"; None before the first step
        self.last_step: str | None = None
        self._order = self._order_key = (
            None  # each caller's row, on the device, and as the list it was made from
        )

    @torch.inference_mode()
    def step(self, caches: list[TandemCache], tokens, positions) -> torch.Tensor:
        """One decode step: row b feeds tokens[b] at positions[b] to caches[b] (each a prefilled batch-1
        `TandemCache`, in any order, each at most once). Returns the logits [B, V] on the model's device, valid
        until the next step. An error leaves every cache of the step refusing further use. With a pool, the step
        holds its lock to its end: another thread's attach, detach or prefill that grows the pool waits for it."""
        with self.pool.lock if self.pool is not None else contextlib.nullcontext():
            return self._one_step(caches, tokens, positions)

    def _one_step(self, caches: list[TandemCache], tokens, positions) -> torch.Tensor:
        if not caches:
            raise ValueError("caches must hold at least one prefilled TandemCache, got none")
        if len({id(cache) for cache in caches}) != len(caches):
            raise ValueError("caches must hold each TandemCache once: a request has one row in a step")
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1, 1)
        positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1, 1)
        if tokens.shape[0] != len(caches) or positions.shape[0] != len(caches):
            raise ValueError(
                f"tokens and positions need one entry per cache ({len(caches)}), got {tokens.shape[0]} and "
                f"{positions.shape[0]}"
            )
        for b, cache in enumerate(caches):
            _check_row(cache, b)
        rows, order = self._layout(caches)
        self.last_step, rebound = None, False
        if not self._same_batch(rows):
            rebound = self._rebind(rows)
            if not rebound and not self._record_grown(rows):
                self._new_batch(rows, caches)
        else:
            self._steps_same += 1
        if order is not None:
            tokens, positions = _by_row(tokens, order, len(rows)), _by_row(positions, order, len(rows))
        step = self._step
        contexts = [self._context(cache, step) for cache in caches]
        fused = self.fused_layers or contextlib.nullcontext()
        try:
            for cache, context in zip(caches, contexts, strict=True):
                cache.step_context = context
            with fused:
                self._run(step, caches, rows, contexts, tokens, positions, rebound)
        except BaseException as err:
            for cache in caches:
                cache.mark_failed(err)  # part of the step may have run
            self.release()
            if isinstance(err, torch.OutOfMemoryError):
                raise device_memory_error(
                    err, self.device, f"a decode step of {len(caches)} requests",
                    "a smaller batch (--max-batch) or window_tokens, or use_graphs=False",
                ) from err  # fmt: skip
            raise
        finally:
            for cache in caches:
                cache.step_context = None
        if order is not None:
            if order != self._order_key:  # the callers' order of the same rows may change from step to step
                self._order, self._order_key = torch.tensor(order, device=self.device), order
            return self._logits[self._order]
        return self._logits

    def attach(self, cache: TandemCache) -> int | None:
        """Give `cache` (before its first tokens) a row of the runner's pool of hot tiers: its steps then share
        each layer's hot-tier attention and hand-off with the other pooled requests. Returns the row, or None
        (no pool, or every row taken: the cache keeps its own hot tier and decodes alone within a step)."""
        return self.pool.attach(cache) if self.pool is not None else None

    def detach(self, cache: TandemCache) -> None:
        """Free `cache`'s row of the pool when its request ends (also done when the cache is collected)."""
        if self.pool is not None:
            self.pool.detach(cache)

    @torch.inference_mode()
    def prefill_chunk(self, cache: TandemCache, input_ids, start: int, last: bool) -> torch.Tensor:
        """One chunk of a request's prompt into its batch-1 `cache`: input_ids [1, t] at positions start ..
        start + t - 1 (`prefill.chunk_end` says where a chunk ends). Returns the last position's logits [1, V],
        float32 on the model's device. `last`: the prompt's final chunk (hgca observes its queries). An error leaves
        the cache refusing further use."""
        if not isinstance(cache, TandemCache):
            raise ValueError(f"cache must be a TandemCache, got {type(cache).__name__}")
        if start != cache.get_seq_length():
            raise ValueError(
                f"start must be the tokens the cache holds ({cache.get_seq_length()}): a chunk continues its prompt, "
                f"got {start}"
            )
        input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        positions = torch.arange(start, start + input_ids.shape[1], device=self.device)[None]
        try:
            with self.fused_layers or contextlib.nullcontext():
                return run_chunk(self.model, cache, {self.cache_arg: cache}, input_ids, positions, last=last)
        except torch.OutOfMemoryError as err:
            raise device_memory_error(
                err, self.device, f"a prefill chunk of {input_ids.shape[1]} tokens",
                "a smaller prefill chunk (--prefill-chunk) or window_tokens",
            ) from err  # fmt: skip

    def release(self) -> None:
        """Drop the recorded step and what it holds of the caches (call when the batch empties, so that the last
        requests' caches are freed)."""
        if self._step is not None:
            self._step.close()
        self._step, self._batch, self._steps_same, self._bucket, self._served = None, [], 0, None, None
        self._ids = self._positions = self._logits = self._rows = None

    # ---- internals -------------------------------------------------------------------------------------------
    def _layout(self, caches):
        """(rows, order): the step's batch by rows and, with pooled requests, order[i] = caches[i]'s row (else
        None: the rows are the caches as given). The pooled requests sit at their pool rows (rows without a
        request in between hold None), the others after them."""
        pooled = {}
        if self.pool is not None:
            for i, cache in enumerate(caches):
                row = self.pool.row(cache)
                if row is not None:
                    pooled[i] = row
        if not pooled:
            return list(caches), None
        n = max(pooled.values()) + 1
        if self.use_graphs and len(pooled) == len(caches):
            n = self._width(n)  # a recording then serves the batches that follow within its rows (`_rebind`)
        rows, order = [None] * n, []
        for i, cache in enumerate(caches):
            if i in pooled:
                rows[pooled[i]] = cache
                order.append(pooled[i])
            else:
                order.append(len(rows))
                rows.append(cache)
        return rows, order

    def _width(self, needed: int) -> int:
        """The rows laid out for a step whose requests are all pooled, the last of them in row needed - 1: the
        next power of two (at most the pool's rows), or the recorded step's rows while they are fewer than four
        times that. A batch that shrinks a little replays its recording; one that shrank to a quarter records
        anew, so that a few requests do not pay a wide step."""
        width = min(1 << (needed - 1).bit_length(), self.pool.size)
        recorded = self._bucket[0] if self._bucket is not None else 0
        return recorded if width <= recorded < 4 * width else width

    def _same_batch(self, rows) -> bool:
        # a dead reference never matches: a row whose request was freed is not the empty row of a later step
        return len(rows) == len(self._batch) and all(
            (ref is None and cache is None) or (ref is not None and cache is not None and ref() is cache)
            for ref, cache in zip(self._batch, rows, strict=True)
        )

    def _new_batch(self, rows, caches) -> None:
        """A step object for a new batch laid out as `rows`, with a flag per hand-off (request and layer) when it
        will be recorded."""
        self.release()
        self._rows = None
        pooled = [r for r, cache in enumerate(rows) if cache is not None and self._pooled(cache, r)]
        flags = None
        if self.use_graphs and self.handoff == "memops":
            # a hand-off per request and layer at most, for as many requests as rows (`_record_grown`)
            flags = handoff_module.HostFlags(len(rows) * len(caches[0].tandem_layers()), self.device)
        self._step = DecodeStep(self.device, flags)
        self._batch = [weakref.ref(cache) if cache is not None else None for cache in rows]
        self._steps_same = 1
        self._ids = torch.zeros(len(rows), 1, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(len(rows), 1, dtype=torch.long, device=self.device)
        self._order = self._order_key = None
        if pooled:
            # as many step rows as rows (the requests' entries padded, `SlotPool.set_step`): a recording then
            # serves any requests of up to that many rows
            n = len(rows) if len(pooled) == len(caches) else pooled[-1] + 1
            self._rows = (pooled, self.pool.layer_rows(n, n))
            for r in pooled:
                self.pool.own_staging(rows[r])

    def _rebind(self, rows) -> bool:
        """Serve the batch laid out as `rows` with the recorded step of other requests (`_bucket`), where it can
        (`_rebindable`): its hand-offs and the recall caches' tables then follow these requests (host side), and
        the step replays without an eager step or a new recording. Returns whether it does."""
        if self._step is None or not self._step.segments or not self._rebindable(rows):
            return False
        self._serve(rows)
        self._take_batch(rows)
        self.rebinds += 1
        return True

    def _record_grown(self, rows) -> bool:
        """Record the batch laid out as `rows` now, with the step object of the batch before it: where that one ran
        eagerly and was not recorded, over as many rows, and both are all pooled requests of one config. While
        requests join a growing batch at every step no batch repeats, so none would be recorded, and each step
        would run eagerly; once this one is recorded, the batches that follow within its rows replay it
        (`_rebind`). Returns whether it does."""
        step, before = self._step, self._rows
        if (
            not self.use_graphs
            or step is None
            or step.segments
            or before is None
            or len(rows) != len(self._batch)
        ):
            return False
        held = [ref() for ref in self._batch if ref is not None]
        if not held or any(cache is None for cache in held) or len(before[0]) != len(held):
            return False  # a request of the last batch was freed, or it held requests outside the pool
        if not self._pooled_of(rows, held[0].tandem_layers()[0].config):
            return False
        pooled = [r for r, cache in enumerate(rows) if cache is not None]
        for r in pooled:
            self.pool.own_staging(rows[r])
        self._rows = (pooled, before[1])
        self._take_batch(rows)
        return True

    def _take_batch(self, rows) -> None:
        """The step object now serves the batch laid out as `rows`, recorded (or to be recorded) at its next run."""
        self._batch = [weakref.ref(cache) if cache is not None else None for cache in rows]
        self._steps_same = self.record_after + 1
        self._order = self._order_key = None

    def _pooled_of(self, rows, config) -> bool:
        """Whether every request of the batch laid out as `rows` has its hot tier at its row of the pool and
        `config`."""
        return all(
            cache is None or (self._pooled(cache, r) and cache.tandem_layers()[0].config == config)
            for r, cache in enumerate(rows)
        )

    def _rebindable(self, rows) -> bool:
        """Whether the recorded step (`_bucket`) can serve the batch laid out as `rows`: that step's rows all
        joined the pooled quest path (`PooledRows.uniform`: the device read only the pool's rows and tensors),
        these are as many rows, of pooled requests of the same config whose digest mirrors are rows of the
        pool's, and the pool's tensors have not moved since."""
        if self._bucket is None:
            return False
        width, config, generation = self._bucket
        if len(rows) != width or self.pool.generation != generation or not self._pooled_of(rows, config):
            return False
        for r, cache in enumerate(rows):
            if cache is None:
                continue
            # the mirrors' check, once per cache while its host tiers and the pool's tensors stay where they are
            key = (generation, r, self._generations([cache]))
            if self._mirrored.get(cache) != key:
                if not self.pool.mirrored(cache, r):
                    return False
                self._mirrored[cache] = key
        return True

    def _serve(self, rows) -> None:
        """Point the recorded step's host-side parts at the requests in `rows` (`PooledRows.rebind`): the rows
        whose request changed, or whose tiers moved, since the step last served (`_served`)."""
        pooled = [r for r, cache in enumerate(rows) if cache is not None]
        served = self._served_rows(rows)
        before = self._served
        changed = None
        if before is not None and len(before) == len(rows):
            changed = {r for r in range(len(rows)) if not _same_row(served[r], before[r])}
        by_layer = {}
        for r in pooled:
            for kv in rows[r].tandem_layers():
                by_layer.setdefault(kv.layer_idx, [None] * len(rows))[r] = kv
            if changed is None or r in changed:
                self.pool.own_staging(rows[r])
        for i, pooled_rows in self._rows[1].items():
            pooled_rows.rebind(by_layer[i], pooled, changed)
        self._rows = (pooled, self._rows[1])
        self._served = served
        self._step.generations = [g for r in pooled for g in served[r][1]]

    def _served_rows(self, rows) -> list:
        """Per row, (a weak reference to its request's cache, its tiers' generations), or None: what a recorded
        step was made to serve, which `_serve` compares to re-point only what changed."""
        return [None if cache is None else (weakref.ref(cache), self._generations([cache])) for cache in rows]

    def _recorded(self, rows, caches):
        """After a recording: the bucket (`_rebind`) it may serve, or None."""
        step = self._step
        if self._rows is None or step.flags is None or step.after or not self.pool.every_layer:
            return None
        if not all(cache is None or self._pooled(cache, r) for r, cache in enumerate(rows)):
            return None
        if not all(isinstance(action, RankedRowsPart) for action in step.actions):
            return None
        if not all(pooled_rows.uniform for pooled_rows in self._rows[1].values()):
            return None
        return len(rows), caches[0].tandem_layers()[0].config, self.pool.generation

    @staticmethod
    def _generations(caches) -> list:
        """The host and hot tiers' buffer generations of `caches` (in row order), which a recording reads."""
        return [(kv.host.generation, kv.hot.generation) for c in caches for kv in c.tandem_layers()]

    def _pooled(self, cache, row: int) -> bool:
        return self.pool is not None and row < self.pool.size and self.pool.row(cache) == row

    def _context(self, cache: TandemCache, step: DecodeStep) -> RowContext:
        """The cache's context for `step`: made once per batch, so a recording reads the same slot tensors at
        every replay."""
        context = self._contexts.get(cache)
        if context is None or context.step is not step:
            context = self._contexts[cache] = RowContext(step)
        return context

    def _run(self, step: DecodeStep, caches, rows, contexts, tokens, positions, rebound: bool) -> None:
        """The step over `rows` (`rebound`: its recording was re-pointed at them by `_rebind`); sets `last_step`."""
        if self.decoder is not None:
            self.decoder.check_weights()
        slots = {}
        for cache, context in zip(caches, contexts, strict=True):
            # the copies each cache queues into host memory run while the next cache is prepared: the step
            # waits for them after all of them, not once per cache
            slots[id(cache)] = step.prepare(cache.tandem_layers(), context, wait=False)
        copies = []  # the staged rows' host copies: made during a replay while the GPU runs, else now
        if self._rows is not None:
            self.pool.stage_evictions([rows[r] for r in self._rows[0]], copies)
        if step.flags is not None:
            for cache in caches:
                step.wait_for_copies(cache.tandem_layers())
        if self._rows is not None:
            pooled = self._rows[0]
            blocks = [0] * (pooled[-1] + 1)  # each row's quest blocks this step, for the pooled ranking
            for r in pooled:
                kv = rows[r].tandem_layers()[0]
                if kv.policy.ranks_by_mirror and kv.host is not None and kv.host.key_min_dev is not None:
                    blocks[r] = kv.policy.blocks_this_step(kv)
            width = next(iter(self._rows[1].values())).keys.shape[0]  # the step rows `layer_rows` made
            self.pool.set_step(pooled, [slots[id(rows[r])] for r in pooled], blocks, width)
        self._ids.copy_(tokens)
        self._positions.copy_(positions)
        if self.use_graphs and self._steps_same > self.record_after:
            kind = "rebound" if rebound else "replayed"
            generations = self._generations([cache for cache in rows if cache is not None])
            if step.segments and generations != step.generations and self._rebindable(rows):
                self._serve(rows)  # host tiers moved: the hand-offs' calls and the recall tables follow
                kind = "rebound"
            elif not step.segments or generations != step.generations:
                step.capture(lambda: self._body(rows, contexts, step))
                step.generations = generations
                self.recordings += 1
                self._bucket = self._recorded(rows, caches)
                self._served = self._served_rows(rows) if self._bucket is not None else None
                kind = "recorded"
            # `copies` holds the pinned staging buffers until the launch has returned: freeing pinned memory
            # during it is a CUDA call on this thread (`DecodeStep.prepare`)
            step.replay(_host_copies(copies))
        else:
            if copies and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the staging buffers have landed
            for work in _host_copies(copies):
                work()
            self._body(rows, contexts, step)
            kind = "eager"
        self.last_step = kind
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _body(self, rows, contexts, step: DecodeStep) -> None:
        """The step at fixed addresses: the forward of every row into `self._logits`."""
        for context in contexts:
            context.defers_host_work = step.defers_host_work
        if self.decoder is not None:
            pooled = self._rows[1] if self._rows is not None else None
            self._logits = self.decoder(self._ids, self._positions, rows, pooled)
            return
        caches = rows
        out = self.model(
            input_ids=self._ids, position_ids=self._positions, use_cache=True, logits_to_keep=1,
            **{self.cache_arg: RowsCache(caches)},
        )  # fmt: skip
        self._logits = out.logits[:, -1]


def _host_copies(pairs, per_call: int = 5) -> list:
    """(destination, source) pairs of host tensors as callables of `per_call` copies each (about one host tier's
    staged rows and digests): pieces short enough to fit between a replayed step's hand-offs."""
    return [partial(_copy, pairs[i : i + per_call]) for i in range(0, len(pairs), per_call)]


def _copy(pairs) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def choose_tokens(logits: torch.Tensor, temperature, top_p, seed, step) -> list[int]:
    """Each row's token from logits [B, V] on their device: the argmax where its temperature is 0, else the
    engine's draw (`sampling.sample`) for its seed (int64 key) at its step. The parameters: B numbers each."""
    row = dict(device=logits.device)
    if all(t == 0 for t in temperature):
        return logits.argmax(dim=-1).tolist()
    return sample(
        logits,
        torch.tensor([float(t) for t in temperature], **row),
        torch.tensor([float(p) for p in top_p], **row),
        torch.tensor(list(seed), dtype=torch.int64, **row),
        torch.tensor(list(step), dtype=torch.int64, **row),
        nucleus=any(p < 1 for p in top_p),
    ).tolist()


def _same_row(now, before) -> bool:
    """Whether a row of `_served_rows` holds what it held: the same request (alive), its tiers unmoved."""
    if now is None or before is None:
        return now is before
    return now[0]() is before[0]() is not None and now[1] == before[1]


def _by_row(values: torch.Tensor, order: list[int], rows: int) -> torch.Tensor:
    """values [len(order), 1] (one per cache) placed at their rows of a [rows, 1] batch (0 in rows without one)."""
    placed = torch.zeros(rows, 1, dtype=values.dtype)
    placed[order] = values
    return placed


def _check_row(cache, b: int) -> None:
    if not isinstance(cache, TandemCache):
        raise ValueError(f"caches[{b}] is a {type(cache).__name__}, not a TandemCache")
    tokens = cache.get_seq_length()
    if not tokens:
        raise ValueError(f"caches[{b}] is empty: prefill it before decoding")
    if cache.batch_size() != 1:
        raise ValueError(f"caches[{b}] holds a batch of {cache.batch_size()}; a row's cache holds one")
    limit = cache.layers[0].max_positions
    if limit is not None and tokens + 1 > limit:
        raise ValueError(
            f"caches[{b}]: context of {tokens + 1} tokens exceeds the model's maximum of {limit} positions"
        )
