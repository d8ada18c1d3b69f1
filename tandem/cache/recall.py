"""Quest's recall cache: recently selected host blocks kept on the compute device (PNM-KV's steady blocks).

Consecutive decode steps select mostly the same blocks (how often, on the default model and on random weights, and
how much of the attended rows this cache serves: docs/engine.md § Quest, "The recall cache";
`benchmarks/bench_selection_overlap.py`). Each step, the selected blocks found in the cache are attended
from device memory; of the others the device takes its share (`gpu_share`), copying them from pinned host memory
into slots a clock hand frees, and the CPU attends the rest. The selection is quest's own, so the result is the
same as without the cache; only where each block is read from changes.

All state lives on the compute device and the plan is one kernel launch per layer (`ops.recall_plan`; no host
reads, fixed buffers), so a decode step that uses the cache is recorded in its CUDA graph; on CPU tensors the
reference's loops run the same algorithm (tests).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from ..kernels import ops
from .memory import available_host_bytes


@dataclass
class RecallPlan:
    """Where one step's selected blocks are attended.

    cpu_ids:   [B, Hkv, K] the CPU's blocks (selected, not cached, not recalled); other entries an invalid
               pick (`limit`), which the CPU part drops
    src, dst:  [B, Hkv, W] host blocks the device reads and copies in this step, and the cache slots they go to
    counts:    [B, Hkv] how many entries of src / dst are live
    gpu_ids:   [B, Hkv, K + W] cache blocks the device attends (hits, then this step's recalls), as ids of the
               flat store (`RecallCache.store`); dead entries point past it
    """

    cpu_ids: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    counts: torch.Tensor
    gpu_ids: torch.Tensor


class RecallCache:
    """One layer's cache of host blocks on the compute device, and the bookkeeping that keeps it in step with
    quest's selection (`ops.recall_plan`: one Triton program per request and KV head on CUDA).

    keys, values: [B, Hkv * S * bs, D]  slot s of KV head h holds rows [(h * S + s) * bs, (h * S + s + 1) * bs):
                                        flat over the heads, so that one [B, rows] mask marks padding rows of
                                        every head (`store` views it as [B, Hkv, rows, D] with head stride 0)
    valid:        [B, Hkv * S * bs] bool
    state:        block_slot [B, Hkv, nblk + 1] (slot of each host block, -1 if none), slot_block [B, Hkv, S]
                  (block in each slot, -1 while empty), last [B, Hkv, S] (step of the last hit or fill), ref
                  [B, Hkv, S] int8 and hand [B, Hkv] (a clock: a slot is replaced once the hand has passed it
                  with no hit since), step [B, Hkv], counters [2] (rows of hits, rows copied in, summed until
                  `take_counts`; [B, 2] with `per_request`: each row's, for `take_row_counts`, where the rows are
                  the requests of a pool, `tandem.engine.slots`)
    A step's plan is written into fixed buffers (`RecallPlan`'s tensors), so a recorded graph replays it.
    """

    def __init__(
        self, batch, num_kv_heads, head_dim, dtype, device, block_size, slots, num_blocks, k_max, width,
        per_request: bool = False,
    ):  # fmt: skip
        self.batch, self.num_kv_heads, self.block_size = batch, num_kv_heads, block_size
        self.slots, self.num_blocks, self.k_max, self.width = slots, num_blocks, k_max, width
        rows = num_kv_heads * slots * block_size
        self.keys = torch.zeros(batch, rows, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.valid = torch.zeros(batch, rows, dtype=torch.bool, device=device)
        index = {"dtype": torch.long, "device": device}
        grid = (batch, num_kv_heads)
        self.state = {
            "block_slot": torch.full((*grid, num_blocks + 1), -1, **index),
            "slot_block": torch.full((*grid, slots), -1, **index),
            "last": torch.full((*grid, slots), -1, **index),
            "ref": torch.zeros((*grid, slots), dtype=torch.int8, device=device),
            "hand": torch.zeros(grid, **index),
            "step": torch.zeros(grid, **index),
            "counters": torch.zeros((batch, 2) if per_request else (2,), **index),
            "limit": num_blocks,
        }
        self.out = {
            "cpu": torch.zeros((*grid, k_max), **index),
            "src": torch.zeros((*grid, width), **index),
            "dst": torch.zeros((*grid, width), **index),
            "counts": torch.zeros(grid, **index),
            "gpu": torch.zeros((*grid, k_max + width), **index),
        }
        self.gpu_lengths = torch.full(grid, k_max + width, **index)
        # `fill_rows`' table of the rows' host stores (CUDA), its staging in pinned memory, and what it was made for
        pin = torch.device(device).type == "cuda"
        self._table = torch.zeros(batch, 5, **index) if pin else None
        self._table_host = torch.zeros(batch, 5, dtype=torch.long, pin_memory=pin) if pin else None
        self._table_rows: list = []  # what each row of the table names (`table_for`)

    @staticmethod
    def slots_for(gpu_cache: float, k_max: int, width: int) -> int:
        """Slots per KV head: `gpu_cache` times the budget, and at least room for a whole step's blocks plus
        the ones copied in (so a step's copies never displace its own hits)."""
        return max(math.ceil(gpu_cache * k_max), k_max + width)

    def matches(self, batch, num_kv_heads, head_dim, dtype, device, slots, num_blocks, k_max, width) -> bool:
        k = self.keys
        have = (k.shape[0], self.num_kv_heads, k.shape[2], k.dtype, k.device, self.slots, self.num_blocks)
        want = (batch, num_kv_heads, head_dim, dtype, device, slots, num_blocks)
        return have == want and (self.k_max, self.width) == (k_max, width)

    def store(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, valid) as `ops.host_block_attention` reads a store: [B, Hkv, Hkv * S * bs, D] with
        head stride 0 (`plan`'s gpu_ids carry each head's slot offset)."""
        shape = (self.batch, self.num_kv_heads, *self.keys.shape[1:])
        return self.keys[:, None].expand(shape), self.values[:, None].expand(shape), self.valid

    def plan(self, ids: torch.Tensor, k, share: float) -> RecallPlan:
        """Split this step's selection and update the bookkeeping (the copies are `fill`'s).

        ids: [B, Hkv, k_max] quest's device_select result; its first `k` entries (a [1] int64 tensor on the
             device, or an int) are the step's blocks, ids >= `num_blocks` invalid picks. The device copies in
             `share` of the blocks not cached (rounded, at most `width`); the CPU attends the rest.
        """
        if not torch.is_tensor(k):
            k = torch.tensor([k], dtype=torch.long, device=ids.device)
        return self.plan_rows(ids, k, share)

    def fill(self, host, plan: RecallPlan) -> None:
        """Copy the planned host blocks into their slots (the device reads pinned host memory in place)."""
        ops.recall_blocks(
            host.keys, host.values, host.valid, self.keys, self.values, self.valid,
            plan.src, plan.dst, plan.counts, self.block_size, self.slots,
            src_k_scale=host.key_scale, src_v_scale=host.value_scale,
        )  # fmt: skip

    def nbytes(self) -> int:
        tensors = [
            self.keys,
            self.values,
            self.valid,
            *(t for t in self.state.values() if torch.is_tensor(t)),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def take_counts(self) -> tuple[int, int]:
        """(rows of hits, rows copied in) since the last call (the device attends both from the cache; only the
        copies crossed PCIe); reads the device once."""
        counters = self.state["counters"]
        cached, recalled = (counters.sum(dim=0) if counters.dim() == 2 else counters).tolist()
        with torch.inference_mode():  # the decode loop may have made the counters inference tensors
            counters.zero_()
        return cached, recalled

    def take_row_counts(self, row: int) -> tuple[int, int]:
        """`take_counts` of row `row` alone (`per_request`)."""
        counters = self.state["counters"][row]
        cached, recalled = counters.tolist()
        with torch.inference_mode():
            counters.zero_()
        return cached, recalled

    def reset_row(self, row: int) -> None:
        """Row `row` empty, as a new cache's: no block cached, the clock at its start, nothing counted."""
        with torch.inference_mode():
            for name in ("block_slot", "slot_block", "last"):
                self.state[name][row].fill_(-1)
            for name in ("ref", "hand", "step"):
                self.state[name][row].zero_()
            if self.state["counters"].dim() == 2:
                self.state["counters"][row].zero_()
            self.valid[row].zero_()

    def clear(self) -> None:
        """Every row empty (`reset_row`) and nothing counted, in place: a recorded step keeps its addresses."""
        for row in range(self.batch):
            self.reset_row(row)
        with torch.inference_mode():
            self.state["counters"].zero_()

    def plan_rows(self, ids: torch.Tensor, k: torch.Tensor, share: float) -> RecallPlan:
        """`plan` of the first n = ids.shape[0] rows, with one block count k [1] for all or one each, [n] (the rows
        of a pool)."""
        n = ids.shape[0]
        # every state tensor is per row but the summed counters [2] (without `per_request`)
        state = {name: t[:n] if torch.is_tensor(t) and t.dim() > 1 else t for name, t in self.state.items()}
        out = {name: t[:n] for name, t in self.out.items()}
        ops.recall_plan(ids.contiguous(), k, share, state, out, self.block_size)
        return RecallPlan(out["cpu"], out["src"], out["dst"], out["counts"], out["gpu"])

    def fill_rows(self, hosts: dict, plan: RecallPlan) -> None:
        """`fill` of the first n rows of a `plan_rows` plan, row b from its own host tier hosts[b] (batch 1; rows
        without one copy nothing): one launch for all of them where the tiers store the model's dtype (with Triton,
        through a table of their addresses kept here, made again when one of them moves), else one per row."""
        n = plan.src.shape[0]
        if any(host.quant for host in hosts.values()):
            for b, host in hosts.items():
                r = slice(b, b + 1)
                ops.recall_blocks(
                    host.keys, host.values, host.valid, self.keys[r], self.values[r], self.valid[r],
                    plan.src[r], plan.dst[r], plan.counts[r], self.block_size, self.slots,
                    src_k_scale=host.key_scale, src_v_scale=host.value_scale,
                )  # fmt: skip
            return
        stores = _stores(hosts, range(n))
        ops.recall_blocks_rows(
            stores, self.keys[:n], self.values[:n], self.valid[:n], plan.src, plan.dst, plan.counts,
            self.block_size, self.slots, table=self.table_for(hosts, n),
        )  # fmt: skip

    def table_for(self, hosts: dict, n: int) -> torch.Tensor | None:
        """`fill_rows`' table of the first n rows' host stores (hosts[b]: row b's tier) on the cache's device
        (CUDA only; None on CPU tensors): the rows whose tier changed or moved are laid out again, staged in pinned
        memory, then copied in stream order (a recorded step that copies them reads the same buffer)."""
        if self.keys.device.type != "cuda":
            return None
        rows = [hosts[b].address() if b in hosts else None for b in range(n)]
        changed = [b for b in range(n) if b >= len(self._table_rows) or rows[b] != self._table_rows[b]]
        if changed:
            from ..kernels.gpu import store_table

            base = (self.keys, self.values, self.valid)
            self._table_host[changed] = store_table(_stores(hosts, changed), base)
            self._table[:n].copy_(self._table_host[:n], non_blocking=True)
            self._table_rows = rows
        return self._table[:n]


def _stores(hosts: dict, rows) -> list:
    """Per row of `rows`, its host tier's (keys, values, valid), or None for a row without one."""
    return [(hosts[b].keys, hosts[b].values, hosts[b].valid) if b in hosts else None for b in rows]


# share of the device's free memory that the default-sized caches of all layers may take together
HEADROOM = 0.5


class RecallBudget:
    """The size of the default-sized recall caches (`TandemConfig.quest.gpu_cache` left None) of one `TandemCache`'s
    layers: `DEFAULT_GPU_CACHE` times the budget where the layers' caches together fit in HEADROOM of the device's
    free memory, else as many slots as fit (at least a step's blocks plus the device's copies), else none. Decided
    when the first layer makes its cache (the others have made their hot tiers and digest mirrors by then: the
    engine's first decode step), and kept for every layer and later remakes of the same batch shape (a cache
    reset for another batch decides again). A size the user set is taken as given (a `MemoryError` names it if
    it does not fit)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.factor: float | None = None  # the decided multiple of the budget; 0 = off
        self._key = None

    def factor_for(
        self, requested: float, batch, num_kv_heads, k_max, width, block_size, head_dim, element_size, device
    ) -> float:
        key = (batch, num_kv_heads, block_size, head_dim, element_size, device)
        if self.factor is not None and key == self._key:
            return self.factor
        self._key = key
        free = free_bytes(device)
        # per slot and (request, KV head): its K and V rows, their validity, slot_block + last (int64) and ref
        # (int8); the per-host-block map (8 bytes a block) is left out: ~1/1000 of the rest at 4x the budget
        per_slot = batch * num_kv_heads * (2 * block_size * head_dim * element_size + block_size + 17)
        wanted = RecallCache.slots_for(requested, k_max, width)
        if free is None or self.num_layers * wanted * per_slot <= HEADROOM * free:
            self.factor = requested
            return requested
        fits = int(HEADROOM * free / (self.num_layers * per_slot))
        self.factor = fits / k_max if fits >= k_max + width else 0.0
        gib = free / 2**30
        if self.factor:
            what = f"kept {self.factor:.2f}x the budget ({fits} blocks per KV head) instead of {requested}x"
        else:
            what = "turned it off: not even one step's blocks fit"
        warnings.warn(
            f"tandem: quest's recall cache (gpu_cache) {what}, so that {self.num_layers} layers' caches take at most "
            f"{HEADROOM:.0%} of the {gib:.1f} GiB free on {device}; pass gpu_cache=N to choose its size",
            stacklevel=2,
        )
        return self.factor


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on `device` can use: the driver's free memory plus what torch's caching allocator
    holds unused (CUDA); the host's available memory (CPU); None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return available_host_bytes()
    return None
