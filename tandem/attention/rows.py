"""A layer's decode attention, every caller's one function (`decode_attention`): over one cache (the HF drop-in,
the engine's steps: `decode.one_cache`), or over the requests of a multi-request step, each over its own cache
(`pooled_rows`): the same parts, with the work that can be shared done once for all.

The requests' hot tiers are rows of one pool (`PooledRows`, kept by `tandem.engine.slots`): their new tokens are
written and their hot tiers attended with one call per layer. The quest requests whose digest mirrors are rows of
the pool's are ranked with one scoring and one top-k per layer (`PooledRows.rank`), and their device shares planned
and attended over the pool's recall cache in one plan and one attention (`PooledRows.plan_recall`). Their host
tiers stay their own; the CPU parts of the
requests whose policy keeps a range of the device's ranking (quest) go to the host as one hand-off per layer
(`RankedRows`: one copy of q and of the rankings, one compiled call over each request's own host tier, one copy
back and one merge), and on CPU tensors the requests whose policy attends every host row are attended in one call
(`PooledRows.attend_every_row`). The rest hand off one by one, as over one cache.
"""

from __future__ import annotations

import time
import weakref
from functools import partial

import torch

from ..cache.recall import RecallPlan
from ..kernels import ops
from ..policies.quest import rank_blocks
from .decode import (
    CpuPart,
    NativePart,
    cpu_list,
    cpu_part,
    device_only,
    device_part,
    nothing_offloaded,
    one_cache,
    prepare,
    prepared_hot_call,
    record_every_row,
    record_no_host_part,
    share_width,
)
from .host import _record_counts, live_blocks


class PooledRows:
    """The hot tiers of a multi-request step's first rows as one batch, for `pooled_rows`: row b is request b's
    batch-1 hot tier, kept in a shared pool (`tandem.engine.slots`).

    keys / values: [n, Hkv, S, D] and valid [n, S], the pool's first n rows (views)
    rows / slots:  [m] int64 on the device: the rows holding a request this step and the hot-tier slot each
                   writes its new token to (the rows of the batch past them attend nothing here)
    mirror:        None, or a callable giving the rows' pooled digest mirrors (key_min, key_max [n, Hkv, NB, D],
                   block_valid [n, NB]) or None, read at each step (they grow); with blocks [n] int64 on the
                   device, each row's quest blocks this step: `rank` ranks the requests' host blocks at once
    recall:        None, or a callable (layer, k_max, width) -> the pool's recall cache for this layer (a
                   `RecallCache` with a row per pool row and per-row counts), or None where it has none that
                   fits: `plan_recall` plans the ranked requests' device shares at once
    memo:          a dict the batch's layers share, cleared before each step (`RankedRows.layout`)
    """

    __slots__ = (
        "keys",
        "values",
        "valid",
        "rows",
        "slots",
        "_written",
        "_hot",
        "_hot_key",
        "_all",
        "_all_key",
        "ranked",
        "mirror",
        "blocks",
        "recall",
        "uniform",
        "recall_used",
    )

    def __init__(
        self, keys, values, valid, rows, slots, mirror=None, blocks=None, recall=None, memo=None
    ) -> None:
        self.keys, self.values, self.valid, self.rows, self.slots = keys, values, valid, rows, slots
        self.mirror, self.blocks, self.recall = mirror, blocks, recall
        self._written = torch.ones_like(rows, dtype=torch.bool)  # the flags `write` sets
        self._hot, self._hot_key = None, None
        self._all, self._all_key = None, None
        # the step's joint hand-off of the requests that keep a ranked range
        self.ranked = RankedRows(memo)
        # set by each `pooled_rows`: every request of the rows ranked here and joined the hand-off (none decoded
        # alone, handed off alone or without a part), and none read its own tensors on the device; and the recall
        # cache that planned them (or None). A recorded step of such rows can then serve other requests (`rebind`)
        self.uniform, self.recall_used = False, None

    def rank(self, layers, q3: torch.Tensor, members) -> tuple[torch.Tensor | None, set]:
        """(ranking, ranked): the device-side ranking [n, Hkv, W] of every request among rows `members` whose
        policy ranks its blocks by the host tier's digest mirror (`Policy.ranks_by_mirror`) and whose mirror is
        its row of the pool's, made by one scoring and one top-k for all of them (`quest.rank_blocks`, each row
        with its own block count; W the widest of their rankings over the pool's mirror), and the rows it
        ranked; (None, empty) where none does. Row b's ranking is what its policy's device_select gives, over a
        wider mirror (the blocks past its own are never valid)."""
        mirror = self.mirror() if self.mirror is not None else None
        if mirror is None:
            return None, set()
        key_min = mirror[0]
        ranked = set()
        for b in members:
            host = layers[b].host
            if not layers[b].policy.ranks_by_mirror or host is None or host.key_min_dev is None:
                continue
            if host.key_min_dev.data_ptr() == key_min[b].data_ptr():
                ranked.add(b)
        if not ranked:
            return None, ranked
        num_blocks = key_min.shape[2]
        width = max(layers[b].policy.ranking_width(num_blocks) for b in ranked)
        return rank_blocks(q3, *mirror, self.blocks, width), ranked

    def plan_recall(self, layers, ranking: torch.Tensor | None, ranked: set):
        """(cache, plan, planned): one recall plan for the device shares of the requests `rank` ranked, over the
        pool's recall cache for this layer (`RecallCache.plan_rows`, each row with its own block count), where
        every request of the first n rows that ranks by its mirror was ranked, has a recall cache and a device
        share, and shares the first one's share, cache size, block size and host dtype; else (None, None, empty):
        each plans its own. A planned request's layer counts its row's statistics (`LayerKV.recall_row`)."""
        nothing = None, None, set()
        if ranking is None or self.recall is None:
            return nothing
        first = layers[min(ranked)]
        width = share_width(first, ranking)
        if not (first.gpu_cache and width) or first.host is None:
            return nothing
        group = (first.gpu_share, first.config.quest.gpu_cache, first.host.block_size, first.host.dtype)
        for b, layer in enumerate(layers[: ranking.shape[0]]):
            # every row that ranks (a block count this step) must be planned here, or none is
            if layer is None or not layer.policy.ranks_by_mirror or layer.host is None:
                continue
            host = layer.host
            if host.key_min_dev is None:
                continue
            if b not in ranked or not layer.gpu_cache:
                return nothing
            if (layer.gpu_share, layer.config.quest.gpu_cache, host.block_size, host.dtype) != group:
                return nothing
        cache = self.recall(first, ranking.shape[-1], width)
        if cache is None:
            return nothing
        for b in ranked:
            layers[b].recall_row = (cache, b)
        return cache, cache.plan_rows(ranking, self.blocks, first.gpu_share), ranked

    def attend_recalled(self, layers, cache, plan, planned, q3, out, lse, scale: float) -> None:
        """The planned requests' device shares: each one's blocks planned to be copied in from its own host tier
        (`RecallCache.fill_rows`, one launch for all), then one attention over the cache's hits and copies for all
        rows, merged into (out, lse) [n, Hq, D] / [n, Hq] (rows not planned attend nothing)."""
        cache.fill_rows({b: layers[b].host for b in planned}, plan)
        n = q3.shape[0]
        keys, values, valid = cache.store()
        block_size = cache.block_size
        o_dev, lse_dev = ops.host_block_attention(
            q3, keys[:n], values[:n], plan.gpu_ids, cache.gpu_lengths[:n], block_size, valid[:n], scale
        )
        ops.merge_lse_(out, lse, o_dev, lse_dev)

    def rebind(self, layers, members: list[int], changed: set | None = None) -> None:
        """Let a step recorded over these rows (`uniform`) serve the requests whose layers are `layers` (per row,
        None where the row holds none) at rows `members`: their joint hand-off, their rows' counts of the recall
        cache and its table of their host tiers (host side, and the table's copy queued before the replay).
        `changed`: the rows whose request or tiers changed since the step last served (None: every row)."""
        self.ranked.rebind(layers, members, changed)
        cache = self.recall_used
        if cache is not None:
            for b in members if changed is None else changed & set(members):
                layers[b].recall_row = (cache, b)
            cache.table_for({b: layers[b].host for b in members}, self.keys.shape[0])

    def attend_every_row(self, layers, gathered, q3: torch.Tensor, scale: float, threads: int | None):
        """(out [n, Hq, D], lse [n, Hq]) float32 of q3 [n, Hq, D] over every live host row of the requests at
        rows `gathered` (their `LayerKV`s in `layers`), each over its own host tier, in one prepared compiled
        call (`ops.stores_attention_call`, made again when a row's store changes); the other rows attend nothing
        (out 0, lse -inf). On CPU tensors, with the compiled kernels."""
        n = q3.shape[0]
        hosts = [layers[b].host if b in gathered else None for b in range(n)]
        key = (
            tuple(h.address() if h is not None else None for h in hosts),
            tuple(q3.shape),
            q3.dtype,
            scale,
            threads,
        )
        if key != self._all_key:
            self._all, self._all_key = _every_row_call(hosts, q3, scale, threads), key
        call, q, out, lse, lengths = self._all
        for b, host in enumerate(hosts):
            lengths[b] = live_blocks(host) if host is not None else 0
        q.copy_(q3)
        call()
        return out, lse

    def attend(self, q3: torch.Tensor, scale: float, threads: int | None):
        """(out [n, Hq, D], lse [n, Hq]) float32 of q3 [n, Hq, D] over the rows' hot tiers: on CPU tensors one
        prepared compiled call (made once, as `DecodeBuffers.hot_call` is for one cache), else `ops.hot_attention`."""
        if q3.is_cuda or not ops.native_cpu_available():
            return ops.hot_attention(q3, self.keys, self.values, self.valid, scale)
        key = (tuple(q3.shape), q3.dtype, scale, threads)
        if key != self._hot_key:
            self._hot = prepared_hot_call(q3, self.keys, self.values, self.valid, scale, threads)
            self._hot_key = key
        call, q, out, lse = self._hot
        if call is None:
            return ops.hot_attention(q3, self.keys, self.values, self.valid, scale)
        q.copy_(q3)
        call()
        return out.clone(), lse.clone()

    def write(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Each request's new token [n, Hkv, 1, D] (row b's at rows) into its slot, valid."""
        rows, slots = self.rows, self.slots
        self.keys.transpose(1, 2).index_put_((rows, slots), k_new[rows, :, 0])
        self.values.transpose(1, 2).index_put_((rows, slots), v_new[rows, :, 0])
        self.valid.index_put_((rows, slots), self._written)


class RankedRows:
    """The CPU parts of a pooled step's requests whose policy keeps a range of the device's ranking (quest at a fixed
    budget, `Policy.keeps_ranked_range`), as one hand-off per layer: q and every such request's ranking go to the
    host in one copy each, one compiled call attends each request's ranks over its own host tier
    (`cpu.RankedRowsAttention`), and (out, lse) come back in one copy, merged once. One per layer of a batch (a
    `PooledRows`'s).

    Per step: `begin(layers)`, `admits(b, layer, bufs, ranked, plan)` for each request (True: it joins), then
    `publish(q3)` queues the copies; the host runs the part (`part()`, a `CpuPart`-like action), after which
    `result()` is (out, lse) [n, Hq, D] / [n, Hq] on the device, rows that did not join at (0, -inf).

    q_host [n, Hq, D] (pinned on CUDA), ranked_dev [n, Hkv, W] int64 (the joined rows' rankings, the rest -1: no
    block), ranked_host its copy, out_host / lse_host the call's output, out_dev / lse_dev their copy on the device.
    """

    def __init__(self, memo: dict | None = None) -> None:
        # what `layout` worked out per request this step, shared with the batch's other layers (cleared per step)
        self.memo = memo if memo is not None else {}
        self.members: list[int] = []  # this step's joined rows, in order
        self._layers, self._rankings, self._planned = {}, {}, {}
        self._key = self._call_key = self._tiers = self._fallback = self._fallback_row = None
        self.call = None
        self._retired = []  # buffers replaced while a graph was recorded (freeing pinned memory breaks a capture)
        self._params = None  # (softmax scale, block size, threads) of the joined requests, fixed at `publish`
        # the part made last (`part`), which a recorded step replays: held weakly (the recording holds it, and a
        # part holds this object: a cycle would leave the requests' host tiers to the garbage collector)
        self.last_part = None

    def begin(self, layers) -> None:
        self.members, self._rankings, self._planned = [], {}, {}
        self._layers = layers

    def admits(self, b: int, layer, bufs, ranked, plan) -> bool:
        """Whether request b's CPU part joins this step's hand-off: a ranking kept by range (or a recall plan's
        CPU list), no task queue or request split, the compiled kernels, and the host tier's format, block size,
        threads and scale of the first joined request."""
        if ranked is None or bufs.queue is not None or bufs.split is not None:
            return False
        if not (layer.policy.keeps_ranked_range and ops.native_cpu_available()):
            return False
        if self.members:
            first = self._layers[self.members[0]]
            if _group(first) != _group(layer):
                return False
        self.members.append(b)
        # with a recall plan the CPU's blocks are the plan's list, all of it the CPU's (`decode._ranked_call`)
        self._rankings[b] = cpu_list(ranked, plan)
        self._planned[b] = plan is not None
        return True

    def publish(self, q3: torch.Tensor, shared=()) -> None:
        """Queue the joined rows' rankings and q [n, Hq, D] into host memory (one copy each); the caller records
        `q_copied` after them (eagerly, or through a recorded step's `context.q_ready`). `shared`: pairs (lists
        [n, Hkv, W], rows) of the CPU's lists of several rows made at once (`PooledRows.rank`, `plan_recall`):
        the pair that serves the most joined rows is copied as one (rows that did not join read none of it: they
        keep no ranks), the other rows one by one."""
        width = max(r.shape[-1] for r in self._rankings.values())
        first = self._rankings[self.members[0]]
        key = (tuple(q3.shape), q3.dtype, q3.device, first.shape[1], width)
        if key != self._key:
            self._buffers(q3, first.shape[1], width)
            self._key = key
        layer = self._layers[self.members[0]]
        self._params = (layer.attention_scale, layer.host.block_size, layer.config.host.threads)
        self._prepare_call()
        whole = set()
        for lists, rows in shared:
            # a row is served where its CPU list is that row of `lists` (not its own recall plan's)
            served = {
                b for b in self.members if b in rows and self._rankings[b].data_ptr() == lists[b].data_ptr()
            }
            if len(served) > len(whole):
                whole, source = served, lists
        if whole:
            self.ranked_dev[:, :, : source.shape[-1]].copy_(source)
        for b in self.members:
            if b in whole:
                continue
            ranked = self._rankings[b]
            self.ranked_dev[b, :, : ranked.shape[-1]].copy_(ranked[0])
        on_cuda = q3.is_cuda
        self.q_host.copy_(q3, non_blocking=on_cuda)
        self.ranked_host.copy_(self.ranked_dev, non_blocking=on_cuda)

    def part(self, wait_copy: bool, on_seconds):
        part = RankedRowsPart(self, wait_copy, on_seconds)
        self.last_part = weakref.ref(part)
        return part

    def rebind(self, layers, members: list[int], changed: set | None = None) -> None:
        """Serve other requests with the same recorded step: `layers` per row, `members` the rows that join (each
        planned as the recorded ones were); the compiled call follows their host tiers (re-pointed in the rows
        `changed`, or None: every row). Host side only."""
        planned = self._planned[self.members[0]] if self.members else False
        self._layers, self.members = layers, list(members)
        self._planned = dict.fromkeys(self.members, planned)
        if self.members:
            self._prepare_call(changed)
        part = self.last_part() if self.last_part is not None else None
        if part is not None:
            part.members, part.layers, part.planned = list(self.members), self._layers, dict(self._planned)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of the part on the device (queued copies on CUDA)."""
        if self.pin:
            self.out_dev.copy_(self.out_host, non_blocking=True)
            self.lse_dev.copy_(self.lse_host, non_blocking=True)
        return self.out_dev, self.lse_dev

    # ---- internals -------------------------------------------------------------------------------------------
    def _buffers(self, q3: torch.Tensor, num_kv_heads: int, width: int) -> None:
        pin = q3.is_cuda
        recording = pin and torch.cuda.is_current_stream_capturing()
        if recording and self._key is not None:
            self._retired.append((self.q_host, self.ranked_host, self.out_host, self.lse_host, self.call))
        elif not recording:
            self._retired = []
        n = q3.shape[0]
        self.pin = pin
        self.q_host = torch.zeros(q3.shape, dtype=q3.dtype, pin_memory=pin)
        self.ranked_dev = torch.full((n, num_kv_heads, width), -1, dtype=torch.long, device=q3.device)
        self.ranked_host = torch.full((n, num_kv_heads, width), -1, dtype=torch.long, pin_memory=pin)
        self.out_host = torch.zeros(q3.shape, dtype=torch.float32, pin_memory=pin)
        self.lse_host = torch.full(q3.shape[:2], float("-inf"), pin_memory=pin)
        if pin:
            self.out_dev = torch.zeros(q3.shape, dtype=torch.float32, device=q3.device)
            self.lse_dev = torch.full(q3.shape[:2], float("-inf"), device=q3.device)
            self.q_copied = torch.cuda.Event()
        else:
            self.out_dev, self.lse_dev, self.q_copied = self.out_host, self.lse_host, None
        self.available = torch.zeros(n, dtype=torch.long)
        self.call, self._call_key = None, None

    def _prepare_call(self, changed: set | None = None) -> None:
        """The compiled call over the joined rows' host tiers, made when the buffers or the group's parameters
        change; where only the rows' tiers do (a request joined, left, or its tier moved), the call's rows are
        re-pointed (`ops.ranked_rows_set_store`): the rows `changed` where the caller knows them, else every row
        whose store differs. Rows that did not join read one joined request's store (the fallback, kept while it
        joins) with no ranks, so that the call holds no tier of a request that left. Rows that left keep -1
        rankings."""
        members = set(self.members)
        fallback = self._fallback
        if (
            fallback is None
            or self._fallback_row not in members
            or self._layers[self._fallback_row].host is not fallback
        ):
            self._fallback_row = self.members[-1]
            fallback = self._fallback = self._layers[self._fallback_row].host
            changed = None  # every row without a request reads the new fallback
        spare = ("fallback", fallback.address())
        key = (self._key, self._params)
        incremental = key == self._call_key and changed is not None
        rows = sorted(changed) if incremental else range(self.q_host.shape[0])
        hosts = {b: self._layers[b].host if b in members else None for b in rows}
        tiers = list(self._tiers) if incremental else [None] * len(rows)
        for b, host in hosts.items():
            tiers[b] = host.address() if host is not None else spare
        tiers = tuple(tiers)
        if key == self._call_key and tiers == self._tiers:
            return
        if self._call_key is not None and self._tiers != tiers:
            self.ranked_dev.fill_(-1)  # a row that joined before and not now names no block
            self.ranked_host.fill_(-1)
        if key == self._call_key:
            for b, host in hosts.items():
                if tiers[b] == self._tiers[b]:
                    continue
                store = _host_stores([host], fallback)[0]
                if host is not None:
                    ops.ranked_rows_set_store(self.call, b, store)
                else:
                    self.call.set_store(b, store)  # the fallback's store, checked as its own row's
            self._tiers = tiers
            return
        stores = _host_stores(list(hosts.values()), fallback)
        scale, block_size, threads = self._params
        self.call = ops.ranked_rows_call(
            self.q_host, stores, self.ranked_host, scale, block_size, self.out_host, self.lse_host, threads
        )  # fmt: skip
        self._call_key, self._tiers = key, tiers
        # numpy views: the host side fills them per request at each step without a tensor op each
        self._skips, self._counts = self.call.skips.numpy(), self.call.counts.numpy()
        self._available, self._stats = self.available.numpy(), self.call.row_stats.numpy()
        self._ranked_rows = list(self.ranked_host.split(1))  # row b as its own [1, Hkv, W] ranking

    def layout(self) -> None:
        """This step's ranks and available rows per joined request (on the host, before the call). A request's
        layers move in lockstep, so what its first layer works out is kept for the others in `memo` (the step's,
        shared by a batch's layers: `PooledRows`), keyed by what it depends on."""
        self._skips[:] = 0
        self._counts[:] = 0
        skips, counts, available, ranked = self._skips, self._counts, self._available, self._ranked_rows
        memo, width = self.memo, self.ranked_host.shape[-1]
        for b in self.members:
            layer = self._layers[b]
            host = layer.host
            host.wait()
            key = (b, self._planned[b], host.rows, width, id(layer.config))
            known = memo.get(key)
            if known is None:
                skip = 0 if self._planned[b] else layer.policy.device_share(layer)
                known = memo[key] = (*layer.policy.ranked_range(layer, ranked[b], skip), host.valid_total())
            skips[b], counts[b], available[b] = known

    def finish(self) -> None:
        """Each joined request's statistics from the call's per-request counts."""
        stats = self._stats.tolist()
        for b in self.members:
            _record_counts(self._layers[b], *stats[b])


def _group(layer) -> tuple:
    """What requests whose CPU parts run as one call must share: the host tier's format, block size and KV heads,
    the CPU threads and the softmax scale."""
    host = layer.host
    return (
        host.keys.dtype,
        host.block_size,
        host.num_kv_heads,
        layer.config.host.threads,
        layer.attention_scale,
    )


class RankedRowsPart:
    """`RankedRows`' host side of one step, as `decode.CpuPart` is one request's: calling it waits for the copies
    (unless the step's hand-off already did) and runs the call from Python; `native()` lays it out as a task for
    the engine's hand-off server."""

    def __init__(self, rows: RankedRows, wait_copy: bool, on_seconds) -> None:
        self.rows, self.wait_copy, self.on_seconds = rows, wait_copy, on_seconds
        # what this step's part reads, fixed when it is made (a recorded step replays the same part)
        self.members, self.layers, self.planned = list(rows.members), rows._layers, dict(rows._planned)

    def __call__(self) -> None:
        rows = self._restore()
        if self.wait_copy and rows.q_copied is not None:
            rows.q_copied.synchronize()
        start = time.perf_counter()
        rows.layout()
        rows.call(rows.available)
        rows.finish()
        if self.on_seconds is not None:
            self.on_seconds(time.perf_counter() - start)

    def native(self):
        rows = self._restore()
        rows.layout()
        task = rows.call.task(rows.available)
        return NativePart(task, partial(self._finish, rows, task))

    def _finish(self, rows: RankedRows, task) -> None:
        rows.call.result(task.result)
        rows.finish()
        if self.on_seconds is not None:
            self.on_seconds(task.nanoseconds * 1e-9)

    def _restore(self) -> RankedRows:
        rows = self.rows
        rows.members, rows._layers, rows._planned = self.members, self.layers, self.planned
        return rows


def _host_stores(hosts, fallback) -> list[tuple]:
    """Per row, its host tier's store as the compiled calls over several stores take it (keys, values, valid,
    k_scale, v_scale); a row without one (None) points at `fallback`'s, which it never reads."""
    stores = []
    for host in hosts:
        host = host if host is not None else fallback
        scales = host.scales()
        stores.append((host.keys, host.values, host.valid, scales.get("k_scale"), scales.get("v_scale")))
    return stores


def _every_row_call(hosts, q3: torch.Tensor, scale: float, threads: int | None):
    """(call, q, out, lse, lengths): `PooledRows.attend_every_row`'s prepared call over `hosts` (None: a row that
    attends nothing, given the first host tier's store to point at) with its own buffers; lengths [n, Hkv] is
    read at each call."""
    first = next(h for h in hosts if h is not None)
    num_kv_heads, block_size = first.num_kv_heads, first.block_size
    stores = _host_stores(hosts, first)
    width = max(host.capacity // block_size for host in hosts if host is not None)
    indices = torch.arange(width, dtype=torch.long).expand(q3.shape[0], num_kv_heads, width).contiguous()
    lengths = torch.zeros(q3.shape[0], num_kv_heads, dtype=torch.long)
    q = torch.zeros_like(q3)
    out = torch.zeros(q3.shape, dtype=torch.float32)
    lse = torch.full(q3.shape[:2], float("-inf"))
    call = ops.stores_attention_call(q, stores, indices, lengths, scale, out, lse, block_size, threads)
    return call, q, out, lse, lengths


def batches(layer) -> bool:
    """Whether `pooled_rows` takes `layer`'s request into the pooled batch (else it decodes alone): a policy
    that keeps no moving average of the hot tier (a pool holds none), and no task queue or request split."""
    return not layer.policy.needs_maw and layer.queue_split == "share" and layer.split is None


def decode_attention(
    layers, q, k_new, v_new, valid_new, scale: float, pools, contexts, pooled: PooledRows | None = None
) -> torch.Tensor:
    """A layer's decode attention: one query per row over its cache plus the new token. Every caller's one
    function: the HF drop-in (`hybrid.attend`), the engine's steps and the server's multi-request steps
    (`engine.forward`).

    layers / pools / contexts: one cache's `LayerKV` whatever its batch (every row of q attends it), its CPU task
        pool and its step context; or, for a multi-request step, one of each per row of q (row b attends
        layers[b]; None for a row no request decodes). A context of None decodes eagerly: the token is appended
        and everything runs at once; a `StepContext` places it in its reserved slot and passes the CPU part to its
        hooks (a recorded step's).
    pooled: a multi-request step's first rows as one pool of hot tiers (`PooledRows`), whose tokens are written,
        hot tiers attended and CPU parts handed off together (`pooled_rows`); None: each cache's hot tier is its
        own (`decode.one_cache`).
    q: [B, Hq, 1, D]; k_new / v_new: [B, Hkv, 1, D]; valid_new: [B, 1] bool. Returns [B, Hq, 1, D] float32.
    """
    if pooled is not None:
        return pooled_rows(layers, pooled, q, k_new, v_new, valid_new, scale, pools, contexts)
    if len(layers) == 1:
        return one_cache(layers[0], q, k_new, v_new, valid_new, scale, pools[0], contexts[0])
    if len(layers) != q.shape[0]:
        raise ValueError(f"{len(layers)} caches for a batch of {q.shape[0]}: one cache, or one per row")
    outs = []
    for b, (layer, pool, context) in enumerate(zip(layers, pools, contexts, strict=True)):
        row = slice(b, b + 1)
        outs.append(one_cache(layer, q[row], k_new[row], v_new[row], valid_new[row], scale, pool, context))
    return torch.cat(outs)


def pooled_rows(layers, pooled: PooledRows, q, k_new, v_new, valid_new, scale: float, pools, contexts):
    """`decode_attention` for the requests of a multi-request step, each over its own cache, with the first rows'
    hot tiers pooled: `decode.one_cache` for each, with the work that can be shared done once for all.

    layers:   per batch row, the request's `LayerKV`, or None for a row no request decodes this step
    pooled:   the batch's first n rows' hot tiers as one pool (`PooledRows`): their tokens are written in one call
              and attended in one call, and the device waits once for all their CPU parts; rows past n (requests
              whose hot tier is their own) and rows that `batches` refuses decode alone through `one_cache`
    q:        [N, Hq, 1, D]; k_new / v_new: [N, Hkv, 1, D]; valid_new: [N, 1]
    pools / contexts: per row, its cache's CPU task pool and `StepContext` (a row's reserved slot, device share)
    Returns [N, Hq, 1, D] float32; the rows that hold no request hold garbage.

    Order on the device: the tokens into the pool; per pooled request its selection and, unless it joins the
    step's `RankedRows`, q's copy to the host, after which its CPU part may start (one hand-off each, in row
    order, so the host starts the first request's part while the device selects for the next); then the joined
    requests' q and rankings in one copy each and their one hand-off; the hot tiers' attention and the device
    shares; one wait for the last CPU part (the host runs them in order); the merges (the joined requests' in
    one). On CPU tensors, the pooled requests whose step attends every host row with nothing to select
    (`Policy.every_row_step`: the default there) skip the per-request selection, buffers and CPU part: they are
    attended in one call, each over its own host tier (`PooledRows.attend_every_row`), and merged once.
    """
    n = pooled.keys.shape[0]
    together = [b for b in range(n) if layers[b] is not None and batches(layers[b])]
    joined = set(together)
    alone = [b for b in range(len(layers)) if layers[b] is not None and b not in joined]
    q3 = q[:, :, 0]
    pooled.write(k_new, v_new)
    context = contexts[together[0]] if together else None
    deferred = context is not None and context.defers_host_work and q.is_cuda
    # with a step that signals each hand-off (`waits_for_copy` False), each request's CPU part is handed off as
    # soon as its q has been copied; else (a recording cut at each hand-off) all of them once after every copy
    each = deferred and not context.waits_for_copy
    parts, host, cpu_parts = {}, [], []
    ranked_rows = pooled.ranked
    ranked_rows.begin(layers)
    # the quest requests' rankings over their pooled digest mirrors, in one scoring and one top-k
    ranking, by_pool = pooled.rank(layers, q3[:n], together)
    # and the device shares of those with a recall cache, in one plan over the pool's recall cache
    recall, recall_plan, by_recall = pooled.plan_recall(layers, ranking, by_pool)
    # on CPU tensors, the requests whose step attends every host row with nothing to select (the default there):
    # their policy's own bookkeeping and statistics here, their rows attended with the others' in one call below
    all_rows = set()
    if not q.is_cuda and ops.native_cpu_available():
        for b in together:
            layer = layers[b]
            if not nothing_offloaded(layer) and layer.policy.every_row_step(layer, q3[b : b + 1]):
                layer.attention_scale = scale
                layer.host.wait()
                record_every_row(layer)
                all_rows.add(b)
    for b in together:
        if b in all_rows:
            continue
        given = ranking[b : b + 1] if b in by_pool else None
        given_plan = _plan_row(recall_plan, b) if b in by_recall else None
        parts[b] = bufs, ranked, plan = prepare(
            layers[b], q3[b : b + 1], scale, stage=False, ranked=given, plan=given_plan
        )
        hands_off = _hands_off(layers[b], plan, q.is_cuda)
        if hands_off and ranked_rows.admits(b, layers[b], bufs, ranked, plan):
            continue  # its CPU part goes to the host with the other joined requests', after this loop
        bufs.stage(cpu_list(ranked, plan), q.is_cuda)
        if not hands_off:
            continue
        host.append(b)
        if not q.is_cuda:
            bufs.q_host.copy_(bufs.q_cpu)
            continue
        bufs.q_host.copy_(bufs.q_cpu, non_blocking=True)
        if each:
            if cpu_parts:  # the previous request's part: its host work, which the device does not wait for
                context.host_work(cpu_parts[-1], wait=False)
            context.q_ready(bufs.q_copied.record)
        elif not deferred:
            bufs.q_copied.record()
        if deferred:
            cpu_parts.append(
                CpuPart(
                    layers[b], bufs, scale, pools[b], context.waits_for_copy, contexts[b].add_host_seconds
                )
            )
    ranked_part = None
    if ranked_rows.members:
        # one copy of q and of the joined requests' rankings, one hand-off (after the single requests' parts)
        shared = [(recall_plan.cpu_ids, by_recall)] if by_recall else []
        ranked_rows.publish(q3[:n], shared + [(ranking, by_pool)])
        first = ranked_rows.members[0]
        wait_copy = context.waits_for_copy if deferred else True
        ranked_part = ranked_rows.part(wait_copy, contexts[first].add_host_seconds)
        if each:
            if cpu_parts:
                context.host_work(cpu_parts[-1], wait=False)
            context.q_ready(ranked_rows.q_copied.record)
        elif not deferred and q.is_cuda:
            ranked_rows.q_copied.record()
        if deferred:
            cpu_parts.append(ranked_part)
    if deferred and cpu_parts and not each:
        events = [parts[b][0].q_copied for b in host]
        if ranked_part is not None:
            events.append(ranked_rows.q_copied)
        context.q_ready(lambda: [event.record() for event in events])
    threads = layers[together[0]].config.host.threads if together else None
    out, lse = pooled.attend(q3[:n], scale, threads)
    if by_recall:
        pooled.attend_recalled(layers, recall, recall_plan, by_recall, q3[:n], out, lse, scale)
    for b in together:
        if b in by_recall or b in all_rows:
            continue
        bufs, ranked, plan = parts[b]
        row = slice(b, b + 1)
        device_part(
            layers[b], bufs, q3[row], ranked, out[row], lse[row], scale, contexts[b].device_blocks, plan
        )
    if cpu_parts:
        # the device waits for the last part (the host runs them in order), or, cut at the hand-off, for all
        context.host_work(cpu_parts[-1] if each else partial(_run_all, cpu_parts))
    if not deferred:
        for b in host:
            cpu_part(layers[b], parts[b][0], scale, pools[b], on_seconds=contexts[b].add_host_seconds)
        if ranked_part is not None:
            ranked_part()
    if all_rows:
        # the requests that attend every host row, in one call (each over its own host tier), not one call each
        start = time.perf_counter()
        every = pooled.attend_every_row(layers, all_rows, q3[:n], scale, threads)
        ops.merge_lse_(out, lse, *every)
        contexts[min(all_rows)].add_host_seconds(time.perf_counter() - start)
    for b in host:
        bufs, row = parts[b][0], slice(b, b + 1)
        if q.is_cuda:
            bufs.out_dev.copy_(bufs.out_host, non_blocking=True)
            bufs.lse_dev.copy_(bufs.lse_host, non_blocking=True)
        ops.merge_lse_(out[row], lse[row], *bufs.cpu_result())
    if ranked_part is not None:
        ops.merge_lse_(out, lse, *ranked_rows.result())
    members = set(ranked_rows.members)
    occupied = {b for b in range(n) if layers[b] is not None}
    # a recorded step reads no request's own tensors where every row's device share went through the pool's
    # recall cache or is empty, and no certificate is counted on the device
    own_tensors = any(
        layers[b].policy.certifier is not None or (b not in by_recall and share_width(layers[b], parts[b][1]))
        for b in together
        if b not in all_rows
    )
    together_ranked = bool(occupied) and members == occupied and occupied <= by_pool
    pooled.uniform = together_ranked and not (alone or host or own_tensors)
    pooled.recall_used = recall if by_recall else None
    for b in together:
        layer, row = layers[b], slice(b, b + 1)
        layer.policy.after_attention(layer, out[row], lse[row])
        if b in host or b in members or b in all_rows:
            continue
        if deferred:
            context.after_replay(partial(record_no_host_part, layer))
        else:
            record_no_host_part(layer)  # what its CPU part would have recorded: no rows, the available ones
    result = out[:, :, None]
    if alone:
        result = torch.cat([result, q.new_zeros(len(layers) - n, *result.shape[1:], dtype=out.dtype)])
        for b in alone:
            row = slice(b, b + 1)
            result[row] = one_cache(
                layers[b], q[row], k_new[row], v_new[row], valid_new[row], scale, pools[b], contexts[b]
            )
    return result


def _plan_row(plan: RecallPlan, b: int) -> RecallPlan:
    """Row b of a recall plan of several requests, as its own plan."""
    r = slice(b, b + 1)
    return RecallPlan(plan.cpu_ids[r], plan.src[r], plan.dst[r], plan.counts[r], plan.gpu_ids[r])


def _run_all(parts) -> None:
    for part in parts:
        part()


def _hands_off(layer, plan, on_cuda: bool) -> bool:
    """Whether the layer's step has a CPU part: its policy attends the host tier, the device does not attend the
    whole selection, and (on CPU tensors, where nothing is recorded) some row is offloaded."""
    if not layer.policy.attends_host or device_only(layer, plan):
        return False
    return on_cuda or not nothing_offloaded(layer)
