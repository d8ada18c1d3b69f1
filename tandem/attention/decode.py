"""Decode attention of one layer, with the CPU part running while the GPU attends the hot tier.

Order on the GPU stream: the new token's KV into the hot tier -> q into a pinned buffer -> hot-tier attention
-> (with a device share) attention over a share of the selected host blocks, read by the GPU from pinned memory.
The CPU starts as soon as q's copy has landed (it waits on that copy, never on the device): the policy selects
host rows, the CPU kernel attends them, and (out, lse) return through pinned buffers to be merged on the GPU.
Only q, the CPU output and its LSE cross PCIe, plus the device share's selected rows, read in place.

The calling thread runs the CPU part: it waits for q's copy, computes, and queues the copy back
(`one_cache`, `overlapped`). The parts are plain functions: `prepare` (buffers, the device-side ranking and
recall plan), `hot_part`, `device_part` and the CPU part (`cpu_part`, or `CpuPart` to run later). Every caller
enters through one function, `rows.decode_attention`, which runs them here over one cache (`one_cache`) or in
`rows` over the requests of a multi-request step: with a fixed-address step's `StepContext` (`context.py`) the
token goes to a reserved slot and the CPU part goes through the context's hooks, which a runner that records its
steps (`tandem.engine`) runs at replay; nothing here knows about graphs.
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch

from ..kernels import ops
from ..kernels.cpu import ops as cpu_ops
from ..policies import Selection
from . import queue as queue_module
from .host import _record_counts, _record_selection, all_blocks, host_attention, live_blocks


class DecodeBuffers:
    """One layer's fixed buffers for a decode step, so a captured graph reads and writes fixed addresses.

    q_host:   [B, Hq, D] model dtype   q on the host (pinned when the hot tier is on CUDA)
    out_host: [B, Hq, D] float32       the CPU part's output, lse_host [B, Hq] its LSE
    out_dev / lse_dev                  the same on the hot tier's device (aliases of the host ones on CPU)
    q_cpu:    this step's q as the CPU part takes it, on the device: the step's q, or with a request split
              (`LayerKV.split`) every rank's heads of this rank's requests; B and Hq above are those of q_cpu
    """

    layout_skips = ("q_cpu",)  # each step's own q, set as it runs (`engine.step.read_layout`)

    def __init__(self, batch: int, num_q_heads: int, head_dim: int, dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.pin = pin
        self.q_host = torch.zeros(batch, num_q_heads, head_dim, dtype=dtype, pin_memory=pin)
        self.from_device = None  # the policy's device_select result, copied next to q (pinned)
        self.out_host = torch.zeros(batch, num_q_heads, head_dim, pin_memory=pin)
        self.lse_host = torch.full((batch, num_q_heads), float("-inf"), pin_memory=pin)
        if pin:
            self.out_dev = torch.zeros(batch, num_q_heads, head_dim, device=device)
            self.lse_dev = torch.full((batch, num_q_heads), float("-inf"), device=device)
            self.q_copied = torch.cuda.Event()
        else:
            self.out_dev, self.lse_dev, self.q_copied = self.out_host, self.lse_host, None
        self.share_count = torch.zeros(1, dtype=torch.long, device=device)  # device share, eager decoding
        self.q_cpu = None
        self.split = None  # the layer's request split, or None
        self.recall_planned = False  # this step's from_device is a recall plan's CPU list
        self.queue = (
            None  # this step's task queue (`queue.QueueBuffers`) with queue_split != "share", else None
        )
        self._ranked_call, self._ranked_key = None, None
        self._prepared_call, self._prepared_key = None, None
        self._all_blocks, self._all_key = None, None
        self._hot_call, self._hot_key, self._hot_bufs = None, None, None
        self._merge, self._merge_key = None, None  # the prepared merge into the hot call's buffers

    def all_blocks(self, host, num_kv_heads: int) -> Selection:
        """Every live block of the host tier as a block selection whose index and length tensors stay the same
        step after step (made again when the host tier moves), so one prepared compiled call serves `full`."""
        capacity = host.capacity // host.block_size
        key = (id(host), host.generation, capacity)
        if key != self._all_key:
            self._all_blocks, self._all_key = all_blocks(host, num_kv_heads, capacity), key
        self._all_blocks.lengths.fill_(live_blocks(host))
        return self._all_blocks

    def stage(self, selected: torch.Tensor | None, non_blocking: bool) -> None:
        """Queue the copy of the policy's device-side selection into host memory (same stream as q's)."""
        if selected is None:
            self.from_device = None
            return
        if self.from_device is None or self.from_device.shape != selected.shape:
            # allocated in the eager warm-up steps; a captured step finds it (same shape, same address)
            self.from_device = torch.empty(selected.shape, dtype=selected.dtype, pin_memory=self.pin)
        self.from_device.copy_(selected, non_blocking=non_blocking)

    def ranked_call(self, layer, scale: float):
        """The compiled attention over ranks of `from_device`, prepared for these buffers and the layer's host
        tier (rebuilt when either moves), or None without the compiled kernels."""
        host = layer.host
        key = (id(host), host.generation, self.from_device.data_ptr(), self.from_device.shape, scale)
        if key != self._ranked_key:
            self._ranked_call = ops.ranked_attention_call(
                self.q_host, host.keys, host.values, self.from_device, scale, host.block_size,
                self.out_host, self.lse_host, host.valid, layer.config.host.threads, **host.scales(),
            )  # fmt: skip
            self._ranked_key = key
        return self._ranked_call

    def prepared_call(self, layer, selection, scale: float):
        """The compiled attention over `selection`'s index lists, prepared for these buffers (rebuilt when the
        lists or the host tier move), or None (then the general launcher runs). For policies whose selection
        persists across steps (`Policy.keeps_selection`)."""
        if selection.kind not in ("rows", "blocks"):
            return None
        host, indices, lengths = layer.host, selection.indices, selection.lengths
        key = (id(host), host.generation, selection.kind, indices.data_ptr(), indices.stride(),
               lengths.data_ptr(), selection.block_size, scale)  # fmt: skip
        if key != self._prepared_key:
            self._prepared_call = ops.prepared_attention_call(
                self.q_host, host.keys, host.values, indices, lengths, scale, self.out_host, self.lse_host,
                host.valid, selection.block_size, layer.config.host.threads, **host.scales(),
            )  # fmt: skip
            self._prepared_key = key
        return self._prepared_call

    def hot_call(self, layer, q3: torch.Tensor, scale: float):
        """With the hot tier in host memory: (call, q, out, lse), the compiled attention over every hot slot
        (the ring's invalid slots masked) prepared for fixed buffers, rebuilt when the hot tier moves; call
        attends `q` into out / lse. None without the compiled kernels."""
        hot = layer.hot
        key = (id(hot), hot.generation, hot.keys.data_ptr(), tuple(q3.shape), q3.dtype, scale)
        if key != self._hot_key:
            call, q, out, lse = prepared_hot_call(
                q3, hot.keys, hot.values, hot.valid, scale, layer.config.host.threads
            )
            self._hot_bufs = (q, out, lse)
            self._hot_call, self._hot_key = call, key
        if self._hot_call is None:
            return None
        return (self._hot_call, *self._hot_bufs)

    def _holds(self, out: torch.Tensor) -> bool:
        """Whether `out` is the hot call's own output buffer (`hot_part(in_place=True)`; its LSE goes with it)."""
        return self._hot_bufs is not None and out is self._hot_bufs[1]

    def returned(self, out: torch.Tensor) -> torch.Tensor:
        """`out` as a step returns it: a copy where it is the hot call's own buffer, which its next call
        overwrites."""
        return out.clone() if self._holds(out) else out

    def merge_cpu_result(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge the CPU part's (out, lse) into the step's (out, lse) in place (`ops.merge_lse_`); one prepared
        compiled call where those are the hot call's own buffers and the CPU part's are this step's."""
        held = self._holds(out) and lse is self._hot_bufs[2]
        if not held or self.split is not None or not ops.native_cpu_available():
            ops.merge_lse_(out, lse, *self.cpu_result())
            return
        key = (out.data_ptr(), self.out_host.data_ptr())
        if key != self._merge_key:
            self._merge, self._merge_key = cpu_ops.PreparedMerge(out, lse, self.out_host, self.lse_host), key
        self._merge()

    def matches(self, q: torch.Tensor) -> bool:
        return self.q_host.shape == q.shape and self.q_host.dtype == q.dtype

    def cpu_result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of the CPU part on the device, in the step's layout: with a request split the other ranks
        send back this rank's heads of their requests (an all-to-all)."""
        if self.split is None:
            return self.out_dev, self.lse_dev
        return self.split.to_heads(self.out_dev), self.split.to_heads(self.lse_dev)


def prepared_hot_call(q3: torch.Tensor, keys, values, valid, scale: float, threads: int | None):
    """(call, q, out, lse): the compiled attention of fixed buffers q [B, Hq, D] into out / lse over every slot of
    hot tiers in host memory (keys / values [B, Hkv, S, D], invalid slots masked by valid [B, S]), or call None
    without the compiled kernels. The call keeps its index lists alive."""
    batch, num_kv_heads, slots = keys.shape[:3]
    q = torch.zeros_like(q3)
    out = torch.zeros(q3.shape, dtype=torch.float32)
    lse = torch.full(q3.shape[:2], float("-inf"))
    indices = torch.arange(slots).expand(batch, num_kv_heads, slots).contiguous()
    lengths = torch.full((batch, num_kv_heads), slots, dtype=torch.long)
    call = ops.prepared_attention_call(
        q, keys, values, indices, lengths, scale, out, lse, valid, None, threads
    )  # fmt: skip
    return call, q, out, lse


def one_cache(layer, q, k_new, v_new, valid_new, scale: float, pool, context=None) -> torch.Tensor:
    """`rows.decode_attention` over one cache: one query per row over everything `layer` caches plus the new
    token (the HF drop-in, the engine's eager and recorded steps, a request whose hot tier is not pooled).

    q: [B, Hq, 1, D]; k_new / v_new: [B, Hkv, 1, D]; valid_new: [B, 1] bool.
    context: a fixed-address step's `StepContext` (`attention.context`): the token goes to its reserved `slot`
    (valid), the device share's block count is its `device_blocks`, and the CPU part goes through its hooks,
    deferred while it `defers_host_work`. None: the token is appended here, and everything runs at once.
    Returns [B, Hq, 1, D] float32.
    """
    if context is None:
        layer.append(k_new, v_new, valid_new)
    else:
        layer.hot.write_slot(context.slot, k_new, v_new)
    q3 = q[:, :, 0]
    bufs, ranked, plan = prepare(layer, q3, scale)
    if context is None:
        out = overlapped(layer, bufs, q3, ranked, plan, scale, pool)
    elif not (context.defers_host_work and q.is_cuda):
        out = overlapped(
            layer, bufs, q3, ranked, plan, scale, pool, context.device_blocks, context.add_host_seconds
        )
    else:
        out = _deferred(layer, bufs, q3, ranked, plan, scale, pool, context)
    return out[:, :, None]


def _deferred(layer, bufs, q3, ranked, plan, scale: float, pool, context) -> torch.Tensor:
    """`overlapped`'s order with the CPU part handed to `context` to run later (a recorded step): q's copy and
    its `q_ready`, the hot tier and the device share, the CPU part as `host_work`, its result's copy and the
    merge queued behind it. A layer with no CPU part (a policy that never attends the host tier, or a device
    that attends the whole selection) hands off nothing: its statistics are `after_replay` work."""
    if not layer.policy.attends_host:
        out, _ = hot_part(layer, q3, scale)
        context.after_replay(partial(record_no_host_part, layer))
        return out
    if device_only(layer, plan):
        out, lse = hot_part(layer, q3, scale)
        device_part(layer, bufs, q3, ranked, out, lse, scale, context.device_blocks, plan)
        context.after_replay(partial(record_no_host_part, layer))
        return out
    bufs.q_host.copy_(bufs.q_cpu, non_blocking=True)
    context.q_ready(bufs.q_copied.record)
    out, lse = hot_part(layer, q3, scale)
    device_part(layer, bufs, q3, ranked, out, lse, scale, context.device_blocks, plan)
    context.host_work(CpuPart(layer, bufs, scale, pool, context.waits_for_copy, context.add_host_seconds))
    bufs.out_dev.copy_(bufs.out_host, non_blocking=True)
    bufs.lse_dev.copy_(bufs.lse_host, non_blocking=True)
    ops.merge_lse_(out, lse, *bufs.cpu_result())
    layer.policy.after_attention(layer, out, lse)
    return out


def prepare(layer, q3: torch.Tensor, scale: float, stage: bool = True, ranked=None, plan=None):
    """(bufs, ranked, plan) of one step of `layer` for q3 [B, Hq, D]: its fixed buffers (`DecodeBuffers`), the
    policy's device-side ranking of host blocks (or None), the recall cache's plan (or None), with the ranking's
    (or the plan's CPU list's) copy into host memory queued. `stage` False: the caller copies the ranking itself
    (`bufs.stage`, or with other requests' as one: `rows.RankedRows`). `ranked` / `plan`: the ranking and the
    recall plan, where the caller made them (with other requests': `rows.PooledRows`), else the policy's
    `device_select` and the layer's own recall cache make them."""
    layer.attention_scale = scale
    if ranked is None:
        ranked = layer.policy.device_select(layer, q3)
    q_cpu, ranked_cpu = q3, ranked
    split = layer.split if layer.policy.attends_host else None
    if split is not None:
        # PnG-KV's DP mapping: this rank's CPU attends every head of its own requests
        q_cpu = split.to_requests(q3)
        ranked_cpu = split.to_requests(ranked) if ranked is not None else None
    bufs = layer.decode_buffers
    if bufs is None or not bufs.matches(q_cpu):
        bufs = layer.decode_buffers = DecodeBuffers(*q_cpu.shape, q_cpu.dtype, q_cpu.device)
    bufs.q_cpu, bufs.split = q_cpu, split
    bufs.queue = _queue_plan(layer, q3, ranked)
    if plan is not None:
        bufs.recall_planned = True
    elif bufs.queue is None:
        plan = _recall_plan(layer, bufs, ranked)
    if stage:
        bufs.stage(cpu_list(ranked_cpu, plan), q3.is_cuda)
    if bufs.queue is not None:
        bufs.queue.stage(q3.is_cuda)
    return bufs, ranked, plan


def cpu_list(ranked, plan):
    """The device's selection that the CPU part reads: the ranking, or with a recall plan the plan's CPU list."""
    return ranked if plan is None else plan.cpu_ids


def _queue_plan(layer, q3: torch.Tensor, ranked):
    """With the layer's `queue_split` not "share", this step's task queue with its plan made on ranked's device
    (`queue.QueueBuffers`); else None."""
    split = layer.queue_split
    if split == "share" or ranked is None:
        return None
    if layer.config.quest.scheduler != "queue":
        raise ValueError(
            f"LayerKV.queue_split={split!r} needs TandemConfig.quest.scheduler='queue' (a baseline replaces the "
            "queue's split, and the config's checks of the queue cover it), got "
            f"{layer.config.quest.scheduler!r}"
        )
    if not ops.native_cpu_available():
        raise RuntimeError(
            "TandemConfig.quest.scheduler='queue' needs the compiled CPU kernels (see `tandem.kernels.cpu`); "
            "use scheduler='share'"
        )
    batch, num_q_heads, head_dim = q3.shape
    group = num_q_heads // layer.num_kv_heads
    width = ranked.shape[-1]
    qb = layer.queue_buffers
    if qb is None or not qb.matches(batch, layer.num_kv_heads, group, head_dim, width, ranked.device):
        qb = layer.queue_buffers = queue_module.QueueBuffers(
            batch, layer.num_kv_heads, group, head_dim, width, ranked.device
        )
    k = layer.policy.step_blocks(layer, ranked.device)
    qb.make_plan(ranked, k, ranked_limit(layer.host), split, layer.queue_share)
    return qb


def hot_part(
    layer, q3: torch.Tensor, scale: float, bufs: DecodeBuffers | None = None, in_place: bool = False
):
    """(out [B, Hq, D], lse [B, Hq]) float32 of q3 over the hot tier (HGCA's moving average updated in place).
    With `bufs` and the hot tier in host memory (no moving average to keep), one prepared compiled call attends
    it (`DecodeBuffers.hot_call`), as the host tier's rows are attended; `in_place`: return that call's own
    buffers, which its next call overwrites (the caller copies what it keeps: `DecodeBuffers.returned`), else
    copies."""
    hot = layer.hot
    if bufs is not None and not q3.is_cuda and not layer.policy.needs_maw:
        prepared = bufs.hot_call(layer, q3, scale)
        if prepared is not None:
            call, q, out, lse = prepared
            q.copy_(q3)
            call()
            return (out, lse) if in_place else (out.clone(), lse.clone())
    maw_args = {}
    if layer.policy.needs_maw:
        maw_args = {"maw": hot.maw, "alpha": layer.config.hgca.maw_alpha}  # Algorithm 1, line 8
    return ops.hot_attention(q3, hot.keys, hot.values, hot.valid, scale, **maw_args)


def overlapped(
    layer, bufs, q3, ranked, plan, scale: float, pool, count=None, on_seconds=None
) -> torch.Tensor:
    """One step's attention [B, Hq, D] float32, run as it is queued: on CUDA, q's copy to the host first, then
    the hot tier and the device share on the GPU while this thread runs the CPU part; then the merge.

    count: the device share's block count as a device tensor set by the caller (a `tandem.engine` step), or None
    (eager: set here from the policy). on_seconds: called with the CPU part's seconds.
    """
    if not q3.is_cuda:
        # the hot tier's (out, lse) may be the prepared call's own buffers: merged into in place, and the result
        # returned as a copy
        out, lse = hot_part(layer, q3, scale, bufs, in_place=True)
        device_part(layer, bufs, q3, ranked, out, lse, scale, count, plan)
        if nothing_offloaded(layer):
            # nothing offloaded yet (a short context): the CPU part's (0, -inf) would leave (out, lse) as they are
            # (every rank of a request split agrees: their host tiers hold the same rows)
            layer.policy.after_attention(layer, out, lse)
            return bufs.returned(out)
        bufs.q_host.copy_(bufs.q_cpu)
        role = None
        if bufs.queue is not None:
            # no GPU: a thread plays its side of the queue with the same protocol (tests, CI); the CPU part
            # starts once it holds its first piece, so both sides take some
            role = queue_module.GpuRole(bufs.queue, layer, q3, ranked, scale)
            role.started.wait(timeout=1.0)
        try:
            cpu_part(layer, bufs, scale, pool, on_seconds=on_seconds)
        finally:
            if role is not None:
                role.join()
        if role is not None:
            ops.merge_lse_(out, lse, *queue_module.finish_gpu_role(bufs.queue))
        bufs.merge_cpu_result(out, lse)
        layer.policy.after_attention(layer, out, lse)
        return bufs.returned(out)
    else:
        bufs.q_host.copy_(bufs.q_cpu, non_blocking=True)
        bufs.q_copied.record()
        # queued behind q's copy: the GPU attends the hot tier while this thread runs the CPU part
        out, lse = hot_part(layer, q3, scale)
        device_part(layer, bufs, q3, ranked, out, lse, scale, count, plan)
        cpu_part(layer, bufs, scale, pool, on_seconds=on_seconds)
        bufs.out_dev.copy_(bufs.out_host, non_blocking=True)
        bufs.lse_dev.copy_(bufs.lse_host, non_blocking=True)
    ops.merge_lse_(out, lse, *bufs.cpu_result())
    layer.policy.after_attention(layer, out, lse)
    return out


def share_width(layer, ranked) -> int:
    """Width of the device share's slice of the ranked ids: ceil(gpu_share * k_max), fixed for a graph."""
    if ranked is None or layer.gpu_share == 0:
        return 0
    return min(ranked.shape[-1], math.ceil(layer.gpu_share * ranked.shape[-1]))


def _recall_plan(layer, bufs: DecodeBuffers, ranked):
    """With a recall cache (`gpu_cache`), split this step's selection between the cache, the device's reads
    from host memory (`gpu_share` of the blocks not cached) and the CPU (`tandem.cache.recall`); None without
    one."""
    width = share_width(layer, ranked)
    recall = layer.recall_cache(ranked, width) if width else None
    bufs.recall_planned = recall is not None
    if recall is None:
        return None
    k = layer.policy.step_blocks(layer, ranked.device)
    return recall.plan(ranked, k, layer.gpu_share)


def device_part(layer, bufs: DecodeBuffers, q, ranked, out, lse, scale: float, count=None, plan=None) -> None:
    """The device's share of the host tier: attend the first `policy.device_share(layer)` selected blocks of each
    KV head on q's device, reading K/V from pinned host memory in place, and merge them into (out, lse).

    ranked: the policy's device_select result [B, Hkv, k_max] (this step's selection first), invalid picks >= the
    block count.
    The slice read has the fixed width ceil(gpu_share * k_max) (a captured graph keeps its shapes); how many
    of it count this step is a device tensor: `count` (a `tandem.engine` step's, set before the step), or with
    count None (eager) `bufs.share_count`, set here. The CPU part skips the same ranks.
    With a recall `plan` (`_recall_plan`) the device's blocks are the plan's instead: the share of the blocks not
    in the recall cache is first copied into it, then attended with the cache's hits, from device memory.
    """
    host = layer.host
    if bufs.queue is not None:
        # on CPU tensors `overlapped` runs a thread instead
        if q.is_cuda and layer.queue_split != "cpu":
            if count is None and host.last_event is not None:
                torch.cuda.current_stream(q.device).wait_event(host.last_event)
            ops.merge_lse_(out, lse, *bufs.queue.gpu_part(layer, q, ranked, scale))
        return
    width = share_width(layer, ranked)
    if width == 0:
        return
    if count is None and q.is_cuda and host.last_event is not None:
        # rows evicted this step are still being copied into host memory on the side stream (an engine step
        # made the stream wait for them before it began)
        torch.cuda.current_stream(q.device).wait_event(host.last_event)
    if plan is not None:
        recall = layer.recall
        recall.fill(host, plan)
        keys, values, valid = recall.store()
        o_dev, lse_dev = ops.host_block_attention(
            q, keys, values, plan.gpu_ids, recall.gpu_lengths, host.block_size, valid, scale
        )
    else:
        if count is None:
            count = bufs.share_count.fill_(layer.policy.device_share(layer))
        ids = ranked[..., :width]
        lengths = torch.minimum((ids < ranked_limit(host)).sum(dim=-1), count)
        o_dev, lse_dev = ops.host_block_attention(
            q, host.keys, host.values, ids, lengths, host.block_size, host.valid, scale, **host.scales()
        )
    ops.merge_lse_(out, lse, o_dev, lse_dev)


def ranked_limit(host) -> int:
    """Block ids at or past this are device_select's invalid picks."""
    return host.capacity // host.block_size


class NativePart:
    """A hand-off's CPU part as one compiled call, for the engine's hand-off server (`tandem.engine.handoff`).

    task:   the call (a `HandoffTask` of the compiled CPU library), laid out for this step
    finish: called once the task has run: raises the error its `result` means, else records what it did
    """

    __slots__ = ("task", "finish")

    def __init__(self, task, finish) -> None:
        self.task, self.finish = task, finish


class CpuPart:
    """One layer's CPU part in a captured decode step, run at replay by the engine's host side.

    Calling it runs `cpu_part` (Python). `native()` instead lays out this step's part as one compiled call for
    the engine's hand-off server (`NativePart`), where it is one: quest's ranked attention
    (`cpu.RankedAttention`), or nothing to attend (an empty host tier, or a policy that never attends it). The
    bookkeeping that precedes the call in `host_part` runs in `native()`, the statistics after it in `finish`.
    """

    def __init__(
        self, layer, bufs: DecodeBuffers, scale: float, pool, wait_copy: bool, on_seconds=None
    ) -> None:
        self.layer, self.bufs, self.scale, self.pool, self.wait_copy, self.on_seconds = (
            layer, bufs, scale, pool, wait_copy, on_seconds
        )  # fmt: skip
        self._empty = None

    def __call__(self) -> None:
        cpu_part(self.layer, self.bufs, self.scale, self.pool, self.wait_copy, self.on_seconds)

    def native(self):
        """This step's `NativePart`, or None where the part must run in Python."""
        layer, bufs = self.layer, self.bufs
        host = layer.host
        empty = nothing_offloaded(layer)
        if empty or not layer.policy.attends_host:
            if self._empty is None:
                self._empty = cpu_ops.empty_task(bufs.out_host, bufs.lse_host)
            return NativePart(self._empty, self._finish_nothing if empty else self._finish_empty)
        host.wait()
        if bufs.queue is not None:
            call = _queue_call(layer, bufs, self.scale)
            task = call.task()
            return NativePart(task, partial(self._finish_queue, call, task))
        _, call, ranks = _ranked_call(layer, bufs, self.scale)
        if call is None:
            return None
        task = call.task(*ranks, host.valid_rows())
        return NativePart(task, partial(self._finish_ranked, call, task, *ranks))

    def _finish_ranked(self, call, task, skip: int, count: int) -> None:
        _record_counts(self.layer, *call.result(task.result, skip, count))
        self._timed(task)

    def _finish_queue(self, call, task) -> None:
        _record_queue(self.layer, *call.result(task.result))
        self._timed(task)

    def _finish_empty(self) -> None:
        record_no_host_part(self.layer)  # as host_part's select() -> NONE
        self._timed(self._empty)

    def _finish_nothing(self) -> None:
        self._timed(self._empty)

    def _timed(self, task) -> None:
        if self.on_seconds is not None:
            self.on_seconds(task.nanoseconds * 1e-9)


def cpu_part(
    layer,
    bufs: DecodeBuffers,
    scale: float,
    pool,
    wait_copy: bool = True,
    on_seconds=None,
) -> None:
    """Wait for q's copy to land (an event, not the device; nothing to wait for on CPU tensors, or when the
    caller already has: `wait_copy` False), then run the CPU half; `on_seconds` receives its time."""
    if wait_copy and bufs.q_copied is not None:
        bufs.q_copied.synchronize()
    start = time.perf_counter()
    host_part(layer, bufs, scale, pool, wait=True)
    if on_seconds is not None:
        on_seconds(time.perf_counter() - start)


def record_no_host_part(layer) -> None:
    """A replayed step's statistics for a layer whose CPU attended no host row: its policy attends none (what
    `host_part` records), or its device attended the whole selection (what the CPU part over an empty list records;
    the rows the device attended are the recall cache's device-side counts, `LayerKV.collect_statistics`): no
    rows attended, the available ones counted."""
    if nothing_offloaded(layer):
        return
    host = layer.host
    host.wait()  # the count reads the valid flags of rows evicted this step
    _record_counts(layer, 0, 0, host.valid_total() * host.num_kv_heads)  # what _record_selection(NONE) counts


def record_every_row(layer) -> None:
    """A step's statistics where the CPU attends every live host row: what `_record_selection` counts then, each
    real row read once per KV head."""
    rows = layer.host.valid_total() * layer.host.num_kv_heads
    _record_counts(layer, rows, 0, rows)


def device_only(layer, plan) -> bool:
    """The recall plan leaves the CPU nothing (a device share of 1): every selected block is a hit or copied in."""
    return plan is not None and layer.gpu_share >= 1.0


def nothing_offloaded(layer) -> bool:
    """No host row to attend: no host tier yet, or an empty one."""
    return layer.host is None or layer.host.rows == 0


def _ranked_call(layer, bufs: DecodeBuffers, scale: float):
    """(skip, call, ranks) of this step's CPU part: `skip` ranks of the device's ranking that device_part attended
    (with a recall plan the CPU's list holds only its own blocks: 0), and, where the policy keeps exactly ranks
    `ranks` = (skip, count) of it, the compiled call over them (`cpu.RankedAttention`); else call, ranks = None."""
    ranked = bufs.from_device
    if ranked is None:
        return 0, None, None
    skip = layer.policy.device_share(layer) if not bufs.recall_planned else 0
    ranks = layer.policy.ranked_range(layer, ranked, skip)
    call = bufs.ranked_call(layer, scale) if ranks is not None else None
    return skip, call, ranks if call is not None else None


def _queue_call(layer, bufs: DecodeBuffers, scale: float):
    """The compiled CPU side of this step's task queue (`cpu.QueueAttention`) for the layer's buffers."""
    return bufs.queue.cpu_call(layer, bufs.q_host, bufs.from_device, bufs.out_host, bufs.lse_host, scale)


def _record_queue(layer, rows: int, cpu_rows: int) -> None:
    """A queue step's statistics: the rows of every piece, of which the device read those the CPU did not."""
    host = layer.host
    _record_counts(layer, rows, rows - cpu_rows, host.valid_total() * host.num_kv_heads)


def host_part(layer, bufs: DecodeBuffers, scale: float, pool, wait: bool) -> None:
    """The CPU half of a decode step: select host rows for `bufs.q_host`, attend them, fill out/lse_host.

    `wait`: first wait for the host tier's pending copies into host memory. (A request of several whose step
    attends every host row, `Policy.every_row_step`, is attended with the others instead: `rows.pooled_rows`.)
    """
    host = layer.host
    if nothing_offloaded(layer):
        bufs.out_host.zero_()
        bufs.lse_host.fill_(float("-inf"))
        return
    if wait:
        host.wait()
    if bufs.queue is not None:
        _record_queue(layer, *_queue_call(layer, bufs, scale)())
        return
    q_host = bufs.q_host[:, :, None]
    ranked = bufs.from_device
    skip, call, ranks = _ranked_call(layer, bufs, scale)
    if call is not None:
        # the policy keeps ranks [skip, count) of the device's ranking: one compiled call sorts them, attends
        # them into out/lse_host and counts the rows (the same as select + host_attention below, less Python)
        _record_counts(layer, *call(*ranks, host.valid_rows()))
        return
    selection = layer.policy.select(layer, q_host, ranked, skip)
    keeps = layer.policy.keeps_selection
    every_row = selection.kind == "all" and not skip and ops.native_cpu_available()
    if every_row:
        # every host row: one prepared compiled call over all blocks (the padding rows are invalid)
        selection, keeps = bufs.all_blocks(host, host.num_kv_heads), True
    call = bufs.prepared_call(layer, selection, scale) if keeps and not skip else None
    if call is not None:
        call()  # attends into out / lse_host
        if every_row:
            record_every_row(layer)
        else:
            _record_selection(layer, selection)
        return
    out, lse = host_attention(layer, q_host, selection, scale, pool)
    bufs.out_host.copy_(out[:, :, 0])
    bufs.lse_host.copy_(lse[:, :, 0])
    device_rows = None
    if skip:
        device_rows = (ranked[..., :skip] < ranked_limit(host)).sum(dim=-1) * host.block_size
    _record_selection(layer, selection, device_rows)
    return False
