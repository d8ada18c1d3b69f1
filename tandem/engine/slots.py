"""Slots: the hot tiers of a multi-request step's requests as rows of one device tensor per layer.

Each running request keeps its own batch-1 `TandemCache`: its own length, policy, budget and host tier. Its hot
tier (sinks and recent window), though, lives in a row of a pool that the runner allocated once for `size`
requests, so a decode step writes every request's new token with one call per layer and attends every request's
hot tier with one call per layer, over the pool's first rows, as a static batch does (`attention.rows.decode_rows`).

A request takes the lowest free row before its prefill (`SlotPool.attach`) and gives it back when it ends or its
cache is collected; joining and leaving copy no KV. A request whose hot tier does not fit a row (a wider window
than the pool was made for, hgca's moving average, a window given as a fraction of the prompt) keeps its own and
decodes alone within the step.

The pool is sized when it is made: `size` rows x each global layer's `sink_tokens + (ceil(window / block_size) +
1) * block_size` slots, on the model's device, the memory the same requests' own hot tiers would take at their
longest.
"""

from __future__ import annotations

import math
import weakref
from functools import partial

import torch

from ..attention.rows import PooledRows
from ..cache.host import block_minmax
from ..integrations.hf import layer_windows
from ..models import attention_shape


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
        pin = self.device.type == "cuda"
        self._staged = torch.zeros(2, size, dtype=torch.long, pin_memory=pin)
        self._period = 0  # steps staged so far: the pool's block period (`stage_evictions`)

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
        return cls(layers, num_kv_heads, head_dim, slots, size, weight.dtype, weight.device)

    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values(), *self.valid.values()]
        return sum(t.nbytes for t in tensors)

    def attach(self, cache) -> int | None:
        """Give `cache` (a `TandemCache` before its first tokens) the lowest free row: its layers take their hot
        tiers there where they fit. Returns the row, or None when every row is taken (the cache keeps its own)."""
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
        for kv in cache.tandem_layers():
            kv.hot_storage = partial(self._storage, row, kv.layer_idx)
        weakref.finalize(cache, self._release, row, self._holders[row])
        return row

    def detach(self, cache) -> None:
        """Free `cache`'s row (no-op for a cache without one). The cache refuses further use from then on: the
        next request's tokens go where its hot tier was."""
        row = self._rows.pop(cache, None)
        placed = self._placed.pop(cache, None)
        if row is None:
            return
        if placed is not False:
            cache.mark_failed(
                RuntimeError(f"its request ended: row {row} of the hot-tier pool went back (SlotPool.detach)")
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
        rows, slots = self.step_rows[:m], self.step_slots[:m]
        return {
            i: PooledRows(self.keys[i][:n], self.values[i][:n], self.valid[i][:n], rows, slots)
            for i in self.keys
        }

    def stage_evictions(self, caches) -> int:
        """Stage the evicted ring blocks of the pooled requests `caches` that are due at this step of the pool's
        block period (`LayerKV.staging_due`; their layers leave staging to the pool, `own_staging`), per layer for
        all requests at once: their blocks gathered and digested in one call each, one copy of each into host
        memory and one wait for them, then each request's host tier takes its rows (`HostTier.stage_written`). A
        tier that stages its rows itself (8-bit codes, certified bounds) stages alone. Returns the blocks staged.

        Staged one request and layer at a time, the blocks of B requests cost a dozen small device operations
        each per layer every block_size steps; here a layer's block of every request costs about as much as one
        (docs/serve.md § Measured)."""
        step, self._period = self._period, self._period + 1
        due: dict[tuple, list] = {}
        for cache in caches:
            for kv in cache.tandem_layers():
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
        if staged and self.device.type == "cuda":
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
                    parts["keys"][rows], parts["values"][rows], parts["valid"][rows], digests, mirror
                )
        return sum(len(kvs) for kvs, _ in staged)

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

    def set_step(self, rows: list[int], slots: list[int]) -> None:
        """The step's rows and the slot each writes its token to (queued in stream order before the step)."""
        m = len(rows)
        self._staged[0, :m] = torch.tensor(rows)
        self._staged[1, :m] = torch.tensor(slots)
        on_cuda = self.device.type == "cuda"
        self.step_rows[:m].copy_(self._staged[0, :m], non_blocking=on_cuda)
        self.step_slots[:m].copy_(self._staged[1, :m], non_blocking=on_cuda)

    # ---- internals -------------------------------------------------------------------------------------------
    def _storage(self, row: int, layer: int, slots: int, dtype, device, keep_maw: bool):
        keys = self.keys.get(layer)
        if keep_maw or keys is None or slots > self.slots or dtype != self.dtype or device != self.device:
            return None
        return keys[row : row + 1], self.values[layer][row : row + 1], self.valid[layer][row : row + 1], None

    def _release(self, row: int, holder) -> None:
        if self._holders.get(row) is holder and row not in self.free:
            del self._holders[row]
            self.free.append(row)
