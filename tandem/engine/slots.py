"""Slots: the hot tiers of a multi-request step's requests as rows of one device tensor per layer.

Each running request keeps its own batch-1 `TandemCache`: its own length, policy, budget and host tier. Its hot
tier (sinks and recent window), though, lives in a row of a pool that the runner allocated once for `size`
requests, so a decode step writes every request's new token with one call per layer and attends every request's
hot tier with one call per layer, over the pool's first rows, as a static batch does (`attention.rows.pooled_rows`).

A request takes the lowest free row before its prefill (`SlotPool.attach`) and gives it back when it ends or its
cache is collected; joining and leaving copy no KV. A request whose hot tier does not fit a row (a wider window
than the pool was made for, hgca's moving average, a window given as a fraction of the prompt) keeps its own and
decodes alone within the step.

The pool also keeps, per global layer, the rows' quest selection state on the device: the host tiers' digest
mirrors (`HostTier.mirror_storage`: row b is request b's mirror, grown with the longest host tier) and one recall
cache with a row per request (`recall_cache`). A step then ranks every quest request's host blocks with one scoring
and one top-k per layer, each row with its own block count (`step_blocks`), and plans and attends their device
shares in one plan and one attention (`attention.rows.PooledRows.rank` / `plan_recall`); only the copies into the
recall cache read each request's own host tier, one launch each.

The pool is sized when it is made: `size` rows x each global layer's `sink_tokens + (ceil(window / block_size) +
1) * block_size` slots, on the model's device, the memory the same requests' own hot tiers would take at their
longest; the mirrors and recall caches as the requests' own would be, made when the first host tier asks (a
growth of the mirrors that would not fit `MIRROR_HEADROOM` of the free memory leaves the growing tier its own).
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from functools import partial

import torch

from ..attention.rows import PooledRows
from ..cache.host import block_minmax
from ..cache.recall import RecallBudget, RecallCache, free_bytes
from ..integrations.hf import layer_windows
from ..models import attention_shape

# share of the device's free memory that growing the pooled digest mirrors of every layer may take
MIRROR_HEADROOM = 0.5


class SlotPool:
    """Rows of hot-tier storage for up to `size` requests' batch-1 caches of `model` built with `config`.

    Example:
        >>> pool = SlotPool.for_model(model, TandemConfig(), size=16)
        >>> cache = TandemCache.for_model(model, config)
        >>> row = pool.attach(cache)             # before its first tokens; None when every row is taken
    """

    def __init__(
        self, layers: list[int], num_kv_heads: int, head_dim: int, slots: int, size: int, dtype, device
    ):
        if size < 1:
            raise ValueError(f"size must be >= 1 (requests the pool holds), got {size}")
        self.size, self.slots, self.dtype, self.device = size, slots, dtype, torch.device(device)
        shape = (size, num_kv_heads, slots, head_dim)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.valid = {i: torch.zeros(size, slots, dtype=torch.bool, device=device) for i in layers}
        self.free = list(range(size))
        self._holders: dict[int, weakref.ref] = {}
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._placed: weakref.WeakKeyDictionary = (
            weakref.WeakKeyDictionary()
        )  # cache -> its tiers are in its row
        # a step's rows and their slots (the step's first m entries), at addresses a recorded step keeps
        self.step_rows = torch.zeros(size, dtype=torch.long, device=device)
        self.step_slots = torch.zeros(size, dtype=torch.long, device=device)
        # each request's quest blocks this step (0 for a row whose request selects none from the mirror)
        self.step_blocks = torch.zeros(size, dtype=torch.long, device=device)
        pin = self.device.type == "cuda"
        self._staged = torch.zeros(3, size, dtype=torch.long, pin_memory=pin)
        # per global layer, the rows' digest mirrors (`mirror`): key_min / key_max [size, Hkv, NB, D] and
        # block_valid [size, NB], made by the first host tier that asks and grown for longer ones
        self.mirrors: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._kv_shape = (num_kv_heads, head_dim)
        # per global layer, quest's recall cache for the pooled requests' device shares: a row per pool row
        # (`recall_cache`), sized as the requests' own would be for a batch of `size`
        self.recalls: dict[int, RecallCache] = {}
        self._recall_budget = RecallBudget(len(layers))
        # what the first layer of a step works out per request for the others (`RankedRows.layout`), per step
        self.step_memo: dict = {}
        # bumped when the mirrors or recall caches are made anew (a recorded step holds their addresses)
        self.generation = 0
        # whether the pool holds every layer's hot tier (no sliding-window layer keeps per-request state)
        self.every_layer = False
        self._period = 0  # steps staged so far: the pool's block period (`stage_evictions`)
        # held by a step over the pool's rows from its start to its end (`RowsRunner.step`) and by what changes
        # the rows or the mirrors (attach, detach, a mirror's growth), which a server's prefill thread may do
        # meanwhile
        self.lock = threading.RLock()
        self._by_period: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # `_staging_candidates`

    @classmethod
    def for_model(cls, model, config, size: int) -> SlotPool | None:
        """A pool for `model`'s global layers under `config`'s window, or None where `config` gives the window as
        a fraction of the prompt (a row's width is then unknown)."""
        if isinstance(config.window_tokens, float):
            return None
        text = model.config.get_text_config(decoder=True)
        num_layers, _, num_kv_heads, head_dim = attention_shape(text)
        windows = layer_windows(text)
        layers = [i for i in range(num_layers) if windows[i] is None]
        ring_blocks = math.ceil(config.window_tokens / config.block_size) + 1
        slots = config.sink_tokens + ring_blocks * config.block_size
        weight = next(model.parameters())
        pool = cls(layers, num_kv_heads, head_dim, slots, size, weight.dtype, weight.device)
        pool.every_layer = len(layers) == num_layers
        return pool

    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values(), *self.valid.values()]
        tensors += [t for mirror in self.mirrors.values() for t in mirror]
        return sum(t.nbytes for t in tensors) + sum(cache.nbytes() for cache in self.recalls.values())

    def attach(self, cache) -> int | None:
        """Give `cache` (a `TandemCache` before its first tokens) the lowest free row: its layers take their hot
        tiers there where they fit. Returns the row, or None when every row is taken (the cache keeps its own)."""
        with self.lock:
            return self._attach(cache)

    def _attach(self, cache) -> int | None:
        if cache in self._rows:
            return self._rows[cache]
        if cache.batch_size() is not None:
            raise ValueError(
                "attach a cache before its first tokens: its hot tier is placed when they arrive"
            )
        if not self.free:
            return None
        row = min(self.free)
        self.free.remove(row)
        self._rows[cache] = row
        self._holders[row] = weakref.ref(cache)
        with torch.inference_mode():  # (the pool's tensors were made by inference-mode steps)
            for kv in cache.tandem_layers():
                kv.hot_storage = partial(self._storage, row, kv.layer_idx)
                kv.mirror_storage = partial(self._mirror_storage, row, kv.layer_idx)
                mirror = self.mirrors.get(kv.layer_idx)
                if mirror is not None:
                    mirror[2][row].zero_()  # the last request's blocks are no blocks of this one
                recall = self.recalls.get(kv.layer_idx)
                if recall is not None:
                    recall.reset_row(row)
        weakref.finalize(cache, self._release, row, self._holders[row])
        return row

    def detach(self, cache) -> None:
        """Free `cache`'s row (no-op for a cache without one). The cache refuses further use from then on: the
        next request's tokens go where its hot tier was."""
        with self.lock:
            self._detach(cache)

    def _detach(self, cache) -> None:
        row = self._rows.pop(cache, None)
        placed = self._placed.pop(cache, None)
        if row is None:
            return
        try:
            for kv in cache.tandem_layers():
                if kv.recall_row is not None:
                    kv.collect_statistics()  # its row's counts, before the row goes to another request
                    kv.recall_row = None
        finally:  # the row goes back even where the counts could not be read (a failed device)
            if placed is not False:
                cache.mark_failed(
                    RuntimeError(
                        f"its request ended: row {row} of the hot-tier pool went back (SlotPool.detach)"
                    )
                )
            self._release(row, self._holders.get(row))

    def row(self, cache) -> int | None:
        """`cache`'s row where every one of its global layers keeps its hot tier there, else None (answered once
        its layers hold tokens: a hot tier stays where it was placed)."""
        row = self._rows.get(cache)
        if row is None:
            return None
        placed = self._placed.get(cache)
        if placed is None:
            layers = cache.tandem_layers()
            if any(kv.hot is None for kv in layers):
                return None
            placed = self._placed[cache] = all(
                kv.layer_idx in self.keys
                and kv.hot.keys.data_ptr() == self.keys[kv.layer_idx][row].data_ptr()
                for kv in layers
            )
        return row if placed else None

    def layer_rows(self, n: int, m: int) -> dict[int, PooledRows]:
        """Per global layer, the pool's first n rows for a step whose first m `step_rows` hold requests."""
        rows, slots, blocks = self.step_rows[:m], self.step_slots[:m], self.step_blocks[:n]
        return {
            i: PooledRows(
                self.keys[i][:n],
                self.values[i][:n],
                self.valid[i][:n],
                rows,
                slots,
                partial(self.mirror, i, n),
                blocks,
                partial(self.recall_cache, i),
                self.step_memo,
            )  # fmt: skip
            for i in self.keys
        }

    def recall_cache(self, layer: int, kv, k_max: int, width: int) -> RecallCache | None:
        """Layer `layer`'s recall cache for the pooled requests' device shares, sized as `kv` (a pooled request's
        layer) sizes its own for rankings k_max wide and a device share `width` blocks wide, with a row per pool
        row (per-row counts), and as many host blocks as the pooled mirrors hold. Made again when one of those
        changes (the rows' counts first folded into their layers' statistics), never while a graph records (None
        then: each request plans its own); None where its size comes to none (`RecallBudget`)."""
        host, num_kv_heads, head_dim = kv.host, *self._kv_shape
        factor = kv.gpu_cache
        if kv.config.quest.gpu_cache is None:
            element = host.dtype.itemsize
            factor = self._recall_budget.factor_for(
                factor, self.size, num_kv_heads, k_max, width, host.block_size, head_dim, element, self.device
            )  # fmt: skip
            if not factor:
                return None
        slots = RecallCache.slots_for(factor, k_max, width)
        num_blocks = self.mirrors[layer][0].shape[2]
        shape = (self.size, num_kv_heads, head_dim, host.dtype, self.device)
        cache = self.recalls.get(layer)
        if cache is not None and cache.matches(*shape, slots, num_blocks, k_max, width):
            return cache
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if cache is not None:
            self._fold_recall(cache)
        try:
            cache = RecallCache(*shape, host.block_size, slots, num_blocks, k_max, width, per_request=True)
        except torch.OutOfMemoryError as err:
            raise MemoryError(
                f"TandemConfig.quest.gpu_cache={factor}: quest's recall cache for {self.size} pooled requests does "
                f"not fit on {self.device}; pass a smaller gpu_cache, or gpu_cache=0 to turn it off"
            ) from err
        self.recalls[layer] = cache
        self.generation += 1
        return cache

    def _fold_recall(self, cache: RecallCache) -> None:
        """The counts of the layers whose device shares `cache` planned, into their statistics."""
        for holder in list(self._holders.values()):
            held = holder()
            for kv in held.tandem_layers() if held is not None else ():
                if kv.recall_row is not None and kv.recall_row[0] is cache:
                    kv.collect_statistics()
                    kv.recall_row = None

    def stage_evictions(self, caches, copies: list | None = None) -> int:
        """Stage the evicted ring blocks of the pooled requests `caches` that are due at this step of the pool's
        block period (`LayerKV.staging_due`; their layers leave staging to the pool, `own_staging`), per layer for
        all requests at once: their blocks gathered and digested in one call each, one copy of each into host
        memory and one wait for them, then each request's host tier takes its rows (`HostTier.stage_written`). A
        tier that stages its rows itself (8-bit codes, certified bounds) stages alone. Returns the blocks staged.

        copies: None, or a list that takes the host tiers' copies from the staging buffers as (destination, source)
        pairs (`HostTier.stage_written`), for the caller to make once the stream has passed the copies into the
        staging buffers queued here (nothing waits for them here), and before the staged rows become live (the
        evictions of the step after this one): a replayed step makes them while the GPU runs
        (`DecodeStep.replay`'s idle work), not before its launch.

        Staged one request and layer at a time, the blocks of B requests cost a dozen small device operations
        each per layer every block_size steps; here a layer's block of every request costs about as much as one
        (docs/serve.md § Measured)."""
        step, self._period = self._period, self._period + 1
        due: dict[tuple, list] = {}
        for cache in caches:
            for kv in self._staging_candidates(cache, step):
                if kv.staging_due(step):
                    key = (
                        (kv.layer_idx, kv.hot.block_size, kv.host.dtype)
                        if kv.host.takes_written_stage()
                        else None
                    )
                    due.setdefault(key, []).append(kv)
        for kv in due.pop(None, []):
            kv.host.stage(*kv.hot.block_view(kv.hot.order[0])[:3])
        staged = []
        for (_, block_size, _), kvs in due.items():
            staged.append(self._stage_batch(kvs, block_size))
        if staged and copies is None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copies into host memory have landed
        for kvs, parts in staged:
            for i, kv in enumerate(kvs):
                rows = slice(i, i + 1)
                digests = mirror = None
                if kv.host.keep_digest:
                    digests = (parts["key_min"][rows], parts["key_max"][rows])
                    if kv.host.mirror_device is not None:
                        mirror = (parts["min_dev"][rows], parts["max_dev"][rows], parts["block_valid"][rows])
                kv.host.stage_written(
                    parts["keys"][rows], parts["values"][rows], parts["valid"][rows], digests, mirror, copies
                )
        return sum(len(kvs) for kvs, _ in staged)

    def _staging_candidates(self, cache, step: int) -> list:
        """The layers of `cache` that may stage at this step of the block period (`LayerKV.staging_due` picks a
        layer's step by its index modulo the block size): a few of its layers rather than all of them."""
        groups = self._by_period.get(cache)
        if groups is None:
            layers = cache.tandem_layers()
            sizes = {kv.hot.block_size if kv.hot is not None else None for kv in layers}
            if len(sizes) != 1 or None in sizes:
                return layers  # not placed yet: every layer is asked
            block_size = sizes.pop()
            by_step: dict[int, list] = {}
            for kv in layers:
                by_step.setdefault(kv.layer_idx % block_size, []).append(kv)
            groups = self._by_period[cache] = (block_size, by_step)
        block_size, by_step = groups
        return by_step.get(step % block_size, [])

    def _stage_batch(self, kvs, block_size: int):
        """(kvs, parts): the oldest ring blocks of `kvs` (one layer of several requests) gathered, digested and
        queued into host memory (pinned on CUDA), by name."""
        views = [kv.hot.block_view(kv.hot.order[0]) for kv in kvs]
        keys = torch.cat([view[0] for view in views])
        values = torch.cat([view[1] for view in views])
        valid = torch.cat([view[2] for view in views])
        on_device = {"keys": keys, "values": values, "valid": valid}
        parts = {}
        if any(kv.host.keep_digest for kv in kvs):
            key_min, key_max = block_minmax(keys, valid, block_size)
            on_device["key_min"], on_device["key_max"] = key_min, key_max
            if any(kv.host.mirror_device is not None for kv in kvs):
                parts["min_dev"] = key_min.nan_to_num(posinf=0.0, neginf=0.0)
                parts["max_dev"] = key_max.nan_to_num(posinf=0.0, neginf=0.0)
                parts["block_valid"] = valid.view(valid.shape[0], -1, block_size).any(dim=-1)
        pin = self.device.type == "cuda"
        for name, t in on_device.items():
            if pin:
                parts[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            else:
                parts[name] = t
        return kvs, parts

    def own_staging(self, cache) -> None:
        """Leave the staging of `cache`'s evictions to the pool (`stage_evictions`): a pooled request's."""
        for kv in cache.tandem_layers():
            kv.stages_own_evictions = False

    def set_step(
        self, rows: list[int], slots: list[int], blocks: list[int] | None = None, width: int | None = None
    ) -> None:
        """The step's rows, the slot each writes its token to and, per row up to the last one, the blocks its
        request's selection keeps from the pooled mirror (`step_blocks`; 0 where it keeps none), queued in stream
        order before the step. `width`: a recorded step's count of rows and of requests, which the lists are
        padded to: the last request's entry repeated (its token written twice into its slot), no blocks."""
        self.step_memo.clear()
        if width is not None:
            rows = rows + rows[-1:] * (width - len(rows))
            slots = slots + slots[-1:] * (width - len(slots))
            if blocks is not None:
                blocks = blocks + [0] * (width - len(blocks))
        m = len(rows)
        self._staged[0, :m] = torch.tensor(rows)
        self._staged[1, :m] = torch.tensor(slots)
        on_cuda = self.device.type == "cuda"
        self.step_rows[:m].copy_(self._staged[0, :m], non_blocking=on_cuda)
        self.step_slots[:m].copy_(self._staged[1, :m], non_blocking=on_cuda)
        if blocks is not None:
            n = len(blocks)
            self._staged[2, :n] = torch.tensor(blocks)
            self.step_blocks[:n].copy_(self._staged[2, :n], non_blocking=on_cuda)

    def mirror(self, layer: int, n: int):
        """(key_min, key_max, block_valid) of layer `layer`'s pooled digest mirrors, their first n rows, or None
        before a host tier has made them. Read at each step: a longer host tier grows them (`_mirror_storage`)."""
        mirror = self.mirrors.get(layer)
        return None if mirror is None else tuple(t[:n] for t in mirror)

    def mirrored(self, cache, row: int) -> bool:
        """Whether `cache`'s host tiers keep their digest mirrors in row `row` of the pool's."""
        for kv in cache.tandem_layers():
            mirror, host = self.mirrors.get(kv.layer_idx), kv.host
            if mirror is None or host is None or host.key_min_dev is None:
                return False
            if host.key_min_dev.data_ptr() != mirror[0][row].data_ptr():
                return False
        return True

    # ---- internals -------------------------------------------------------------------------------------------
    def _storage(self, row: int, layer: int, slots: int, dtype, device, keep_maw: bool):
        keys = self.keys.get(layer)
        if keep_maw or keys is None or slots > self.slots or dtype != self.dtype or device != self.device:
            return None
        return keys[row : row + 1], self.values[layer][row : row + 1], self.valid[layer][row : row + 1], None

    def _mirror_storage(self, row: int, layer: int, blocks: int, dtype, device):
        """Row `row` of layer `layer`'s digest mirrors, `blocks` wide, for its request's host tier
        (`HostTier.mirror_storage`): made at the first ask, grown (by half again, at least to `blocks`) when a
        host tier outgrows them, the other rows' host tiers then pointed at the new tensors. None (the tier keeps
        its own mirror, and its request ranks alone) for a dtype or device other than the pool's, or where every
        layer's mirrors grown alike would take more than MIRROR_HEADROOM of the device's free memory."""
        if dtype != self.dtype or torch.device(device) != self.device:
            return None
        mirror = self.mirrors.get(layer)
        growing = mirror is None or blocks > mirror[0].shape[2]
        # a growth re-points other requests' tiers: not while a step over them runs (another thread's prefill)
        with self.lock if growing else contextlib.nullcontext():
            mirror = self.mirrors.get(layer)
            width = 0 if mirror is None else mirror[0].shape[2]
            if blocks > width:
                num_kv_heads, head_dim = self._kv_shape
                grown = max(blocks, width + width // 2)
                per_block = self.size * (2 * num_kv_heads * head_dim * dtype.itemsize + 1)
                free = free_bytes(self.device)
                if free is not None and (grown - width) * per_block * len(self.keys) > MIRROR_HEADROOM * free:
                    return None  # every layer's mirrors grown alike would not fit: this tier keeps its own
                key_min = torch.zeros(
                    self.size, num_kv_heads, grown, head_dim, dtype=dtype, device=self.device
                )
                key_max = torch.zeros_like(key_min)
                block_valid = torch.zeros(self.size, grown, dtype=torch.bool, device=self.device)
                if mirror is not None:
                    key_min[:, :, :width].copy_(mirror[0])
                    key_max[:, :, :width].copy_(mirror[1])
                    block_valid[:, :width].copy_(mirror[2])
                self.mirrors[layer] = (key_min, key_max, block_valid)
                self.generation += 1
                if mirror is not None:
                    self._repoint(layer, row, mirror[0])
                if self.device.type == "cuda":
                    # made on this thread's stream: done before a step on another stream reads them
                    torch.cuda.current_stream(self.device).synchronize()
                mirror = self.mirrors[layer]
            key_min, key_max, block_valid = mirror
            r = slice(row, row + 1)
            return key_min[r, :, :blocks], key_max[r, :, :blocks], block_valid[r, :blocks]

    def _repoint(self, layer: int, asking: int, old: torch.Tensor) -> None:
        """Point the host tiers of layer `layer` whose mirrors were in `old` (its key_min; rows other than
        `asking`, whose tier is growing) at the grown tensors."""
        key_min, key_max, block_valid = self.mirrors[layer]
        for row, holder in list(self._holders.items()):
            cache = holder()
            if row == asking or cache is None:
                continue
            for kv in cache.tandem_layers():
                host = kv.host
                if kv.layer_idx != layer or host is None or host.key_min_dev is None:
                    continue
                if host.key_min_dev.untyped_storage().data_ptr() != old.untyped_storage().data_ptr():
                    continue
                blocks = host.key_min_dev.shape[2]
                r = slice(row, row + 1)
                host.move_mirror(key_min[r, :, :blocks], key_max[r, :, :blocks], block_valid[r, :blocks])

    def _release(self, row: int, holder) -> None:
        if self._holders.get(row) is holder and row not in self.free:
            del self._holders[row]
            self.free.append(row)
