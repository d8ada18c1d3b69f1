"""One decode step's sparse attention over host blocks, shared between the CPU and the GPU through a task queue
(Fluxion §6.2's priority scheduler).

quest's static split (`gpu_share`) gives the device the same fraction of every (request, KV head) segment's
selected blocks, a fraction tuned per machine. Here the step's segments become pieces of at most `PIECE_BLOCKS`
blocks, listed largest segment first (its volume V(blk) is its block count), and the two sides take pieces until
none is left: the GPU from the front, the CPU from the back, so whichever side is faster takes more. Where they
meet, each piece is settled by a handshake of stores and fences (kernels/cpu/csrc/queue.cpp says why not atomics:
this host's H100 has no native atomics on host memory), so every piece is attended exactly once. The GPU's
pieces are merged on the GPU, the CPU's on the CPU, and the two results merge with the hot tier's by LSE as
before.

`TandemConfig.quest.scheduler` picks how the blocks are split:
- "queue": through the queue, the pieces assigned dynamically, as above;
- "share" (the default): not through the queue; the device attends gpu_share of every segment
  (`decode.device_part`).

The static baselines that `benchmarks/bench_scheduler.py` compares the queue with are not settings of the config
but a hook on the cache's layers: with `quest.scheduler="queue"`, a layer's `LayerKV.queue_split` (which starts as
the config's scheduler) set to one of `SCHEDULER_BASELINES` assigns that layer's pieces statically through the
same plan, `LayerKV.queue_share` giving the device's fraction:
- "cpu": all to the CPU (no parallel work);
- "heads": the GPU takes the first round(queue_share * segments) segments in the list (uniform by heads, whatever
  their volume);
- "volume": the GPU takes whole segments from the front until it holds queue_share of the blocks (length-based:
  the largest segments go to the GPU).

    for layer in cache.tandem_layers():  # the cache's config has quest.scheduler="queue"
        layer.queue_split, layer.queue_share = "heads", 0.3

Every assignment gives the same result within tolerance: only where a piece is attended changes.

The plan is a few tensor operations on the device (recorded in the step's graph) whose int32 result is copied
into pinned memory with q (`QueueBuffers.control`). On CPU tensors (CI) the same plan runs, and a thread plays
the GPU's part with the same protocol (`gpu_role_claim`) and the torch reference per piece.
"""

from __future__ import annotations

import math
import threading

import torch

from ..config import SCHEDULER_BASELINES
from ..kernels import ops
from ..kernels.cpu import ops as cpu_ops

QUEUE_SCHEDULERS = ("queue", *SCHEDULER_BASELINES)  # the splits that run through the queue's plan
# blocks per piece: 16 blocks of 16 rows are 256 rows, 128 KiB of bf16 K and V at head_dim 128: small enough that
# what the GPU's programs hold at once is a small part of a layer's reads, large enough that a piece's handshake
# (a PCIe round trip) is a small part of its time
PIECE_BLOCKS = 16
# the GPU worker's persistent programs (None: one per SM); each holds one piece at a time, so together they hold
# GPU_PROGRAMS * PIECE_BLOCKS blocks when the two sides meet (`benchmarks/bench_scheduler.py` varies it)
GPU_PROGRAMS: int | None = None


class QueueBuffers:
    """One layer's fixed buffers for the step's queue (a recorded graph reads and writes fixed addresses).

    plan:     [2 + P + nseg + 3P] int32 on the device: n, split, the pieces, each segment's length, then zeros
              (the flags' reset: the whole buffer is copied into `control` before the hand-off)
    control:  the same in pinned memory (on CPU tensors: the same tensor); the sides' flags and the GPU's
              decisions live in its last 3P entries
    cursor:   [1] int32 on the device: the GPU's next piece from the front
    part_out: [P, G, D] float32, part_lse [P, G]: the pieces the GPU took
    first, count: [nseg] int32: each segment's first piece in the list and its number of pieces
    """

    def __init__(self, batch, num_kv_heads, group, head_dim, width, device: torch.device) -> None:
        self.batch, self.num_kv_heads, self.group, self.width = batch, num_kv_heads, group, width
        self.nseg = batch * num_kv_heads
        self.pieces_max = max(1, math.ceil(width / PIECE_BLOCKS))
        self.capacity = self.nseg * self.pieces_max
        size = 2 + self.capacity + self.nseg + 3 * self.capacity
        self.plan = torch.zeros(size, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self.control = torch.zeros(size, dtype=torch.int32, pin_memory=True) if pin else self.plan
        self.cursor = torch.zeros(1, dtype=torch.int32, device=device)
        self.part_out = torch.zeros(self.capacity, group, head_dim, device=device)
        self.part_lse = torch.full((self.capacity, group), float("-inf"), device=device)
        self.first = torch.zeros(self.nseg, dtype=torch.int32, device=device)
        self.count = torch.zeros(self.nseg, dtype=torch.int32, device=device)
        self.out = torch.zeros(batch, num_kv_heads * group, head_dim, device=device)
        self.lse = torch.full((batch, num_kv_heads * group), float("-inf"), device=device)
        index = {"dtype": torch.long, "device": device}
        self._piece = torch.arange(self.pieces_max, **index)
        self._scatter = torch.empty(self.capacity + 1, dtype=torch.int32, device=device)
        self._call, self._call_key = None, None

    def matches(self, batch, num_kv_heads, group, head_dim, width, device) -> bool:
        have = (self.batch, self.num_kv_heads, self.group, self.part_out.shape[-1], self.width)
        return have == (batch, num_kv_heads, group, head_dim, width) and self.plan.device == device

    def flags(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gpu flags, cpu flags, decisions) [P] int32 views of `control`."""
        base = 2 + self.capacity + self.nseg
        p = self.capacity
        c = self.control
        return c[base : base + p], c[base + p : base + 2 * p], c[base + 2 * p : base + 3 * p]

    # ---- the plan (device tensors; recorded in the step's graph) ------------------------------------------------
    def make_plan(self, ids: torch.Tensor, k: torch.Tensor, limit: int, scheduler: str, share: float) -> None:
        """Write this step's plan into `plan`. ids: [B, Hkv, K] block ids, the step's valid ones (< limit) first;
        k: [1] int64, the step's blocks per segment (entries past it are not this step's)."""
        cap, nseg, pm = self.capacity, self.nseg, self.pieces_max
        lengths = torch.minimum((ids < limit).sum(dim=-1).reshape(nseg), k)
        pieces = (lengths + PIECE_BLOCKS - 1) // PIECE_BLOCKS
        order = torch.sort(lengths, descending=True, stable=True).indices
        ordered = pieces[order]
        cum = ordered.cumsum(0)
        start = cum - ordered
        entries = order[:, None] * pm + self._piece
        position = torch.where(self._piece < ordered[:, None], start[:, None] + self._piece, cap)
        self._scatter.scatter_(0, position.reshape(-1), entries.reshape(-1).to(torch.int32))
        total = cum[-1:]
        split = _split(scheduler, share, total, cum, lengths[order].cumsum(0), nseg)
        plan = self.plan
        plan[0:1].copy_(total)
        plan[1:2].copy_(split)
        plan[2 : 2 + cap].copy_(self._scatter[:cap])
        plan[2 + cap : 2 + cap + nseg].copy_(lengths)
        self.first.scatter_(0, order, start.to(torch.int32))
        self.count.copy_(pieces)

    def stage(self, non_blocking: bool) -> None:
        """Queue the plan's copy into pinned memory (with q's, before the hand-off); it also zeroes the flags."""
        if self.control is not self.plan:
            self.control.copy_(self.plan, non_blocking=non_blocking)
        else:
            self.control[2 + self.capacity + self.nseg :].zero_()

    # ---- the GPU's side ----------------------------------------------------------------------------------------
    def gpu_part(
        self, layer, q: torch.Tensor, ids: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, Hq, D], lse [B, Hq]) float32 of the pieces the GPU takes (0, -inf where it took none)."""
        host = layer.host
        if q.is_cuda:
            self.cursor.zero_()
            self.part_lse.fill_(float("-inf"))
            ops.queue_gpu_attention(
                q, host.keys, host.values, host.valid, ids, self.plan, self.control, self.cursor,
                self.part_out, self.part_lse, self.first, self.count, self.out, self.lse,
                host.capacity // host.block_size, self.pieces_max, PIECE_BLOCKS, host.block_size, scale,
                GPU_PROGRAMS,
            )  # fmt: skip
        return self.out, self.lse

    # ---- the CPU's side ----------------------------------------------------------------------------------------
    def cpu_call(self, layer, q_host: torch.Tensor, ids_host: torch.Tensor, out, lse, scale: float):
        """The compiled CPU worker (`cpu.QueueAttention`) for these buffers, rebuilt when the host tier or the ids'
        buffer moves; None without the compiled kernels."""
        host = layer.host
        key = (id(host), host.generation, ids_host.data_ptr(), q_host.data_ptr(), scale)
        if key != self._call_key:
            self._call = ops.queue_attention_call(
                q_host, host.keys, host.values, ids_host, scale, host.block_size, out, lse, host.valid,
                self.control, self.capacity, self.pieces_max, PIECE_BLOCKS, layer.config.host.threads,
                **host.scales(),
            )  # fmt: skip
            self._call_key = key
        return self._call


def _split(scheduler: str, share: float, total, cum, volume, nseg: int) -> torch.Tensor:
    """[1] int64: the GPU's pieces are [0, split); split >= n means the two sides meet wherever they do."""
    if scheduler == "queue":
        return total + 1
    if scheduler == "cpu":
        return torch.zeros_like(total)
    if scheduler == "heads":
        segments = min(nseg, math.floor(share * nseg + 0.5))
        return cum[segments - 1 : segments] if segments else torch.zeros_like(total)
    if scheduler == "volume":
        # whole segments from the front, as many as bring the GPU's blocks nearest to share of all blocks (a
        # segment goes to the GPU where at least half of it lies within that share)
        own = torch.diff(volume, prepend=torch.zeros_like(volume[:1]))
        within = (volume - own / 2 <= share * volume[-1:]).sum().clamp(max=nseg)
        padded = torch.cat([torch.zeros_like(total), cum])
        return padded.gather(0, within.reshape(1))  # no host read: the plan is recorded in a graph
    raise ValueError(f"scheduler must be one of {', '.join(QUEUE_SCHEDULERS)}, got {scheduler!r}")


class GpuRole:
    """A thread that plays the GPU's part of a step's queue on CPU tensors (tests and CI): it takes pieces from
    the front with the GPU's protocol (`cpu.queue_gpu_claim`: flag, fence, the CPU's flag, decision) and attends
    each with the torch reference into the buffers' part slots. `join` waits for it and raises what it raised;
    `finish_gpu_role` then merges its pieces.

    started: set once the thread took its first piece (or found none), so a caller can let it begin first."""

    def __init__(
        self, buffers: QueueBuffers, layer, q: torch.Tensor, ids: torch.Tensor, scale: float
    ) -> None:
        buffers.part_lse.fill_(float("-inf"))
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.taken: list[int] = []
        inference = torch.is_inference_mode_enabled()  # thread-local: the buffers may be inference tensors
        cursor = torch.zeros(1, dtype=torch.int32)

        def work() -> None:
            try:
                with torch.inference_mode(inference):
                    while True:
                        u = cpu_ops.queue_gpu_claim(buffers.control, buffers.capacity, buffers.nseg, cursor)
                        self.started.set()
                        if u < 0:
                            return
                        out, lse = piece_attention(buffers, layer, q, ids, u, scale)
                        buffers.part_out[u] = out
                        buffers.part_lse[u] = lse
                        self.taken.append(u)
            except BaseException as error:  # re-raised by join
                self.error = error
            finally:
                self.started.set()

        self.thread = threading.Thread(target=work, name="tandem-gpu-role", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"the GPU's side of the task queue failed: {self.error}") from self.error


def piece_attention(buffers: QueueBuffers, layer, q, ids, u: int, scale: float):
    """(out [G, D], lse [G]) float32 of piece u of the plan in `control`, by the torch reference."""
    entry = int(buffers.control[2 + u])
    seg, piece = divmod(entry, buffers.pieces_max)
    b, h = divmod(seg, buffers.num_kv_heads)
    length = int(buffers.control[2 + buffers.capacity + seg])
    lo, hi = piece * PIECE_BLOCKS, min((piece + 1) * PIECE_BLOCKS, length)
    host = layer.host
    blocks = ids[b, h, lo:hi]
    rows = (blocks[:, None] * host.block_size + torch.arange(host.block_size)).reshape(-1)
    rows = rows[(rows < host.keys.shape[2])]
    g = buffers.group
    qg = q[b, h * g : (h + 1) * g]
    out, lse = ops.attention_lse(
        qg[None, :, None], host.keys[b, h, rows][None, None], host.values[b, h, rows][None, None], scale,
        host.valid[b, rows][None],
    )  # fmt: skip
    return out[0, :, 0], lse[0, :, 0]


def finish_gpu_role(buffers: QueueBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) [B, Hq, D] / [B, Hq] of the pieces the GPU's stand-in took: the combine kernel's reference."""
    out, lse = buffers.out, buffers.lse
    g = buffers.group
    for seg in range(buffers.nseg):
        b, h = divmod(seg, buffers.num_kv_heads)
        first, count = int(buffers.first[seg]), int(buffers.count[seg])
        seg_out = torch.zeros_like(buffers.part_out[0])
        seg_lse = torch.full_like(buffers.part_lse[0], float("-inf"))
        for p in range(first, first + count):
            seg_out, seg_lse = ops.merge_lse(seg_out, seg_lse, buffers.part_out[p], buffers.part_lse[p])
        out[b, h * g : (h + 1) * g] = seg_out
        lse[b, h * g : (h + 1) * g] = seg_lse
    return out, lse
