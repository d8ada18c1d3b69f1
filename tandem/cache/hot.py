"""Hot tier: sinks + the recent window of one layer on the compute device, in a preallocated ring of blocks."""

from __future__ import annotations

import torch


class HotTier:
    """Device storage: `sink_slots` slots for the first tokens, then up to `ring_blocks` blocks of `block_size`
    slots used as a FIFO ring for the recent window. The ring is allocated for `initial_blocks` and doubles (up to
    `ring_blocks`) when a new block is needed and none is free, so a short sequence with a wide window does not
    hold the whole window's memory. Growing moves the storage: `generation` counts the moves (a recorded CUDA
    graph reads the old addresses and must be recorded again).

    Storage:
        keys, values: [B, Hkv, slots, D]
        valid:        [B, slots] bool     True where a slot holds a real (non-padding) token
        maw:          [B, Hq, slots] float32   moving average of attention weights (hgca only)

    The physical slot order is not the token order (the ring wraps); attention over the hot tier is
    order-free, and `ordered_ring()` gives the token order when blocks leave for the host tier.

    storage: None, or (keys, values, valid, maw) to hold the tier instead of its own tensors: a batch-1 row of a
    pool that several requests' tiers share (`tandem.engine.slots`), at least `sink_slots + ring_blocks *
    block_size` slots wide (maw None unless `keep_maw`). The whole ring is then allocated at once (it never
    grows, so the storage never moves), and the storage is cleared here: the pool row's last user left its
    tokens there.
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        sink_slots: int,
        ring_blocks: int,
        block_size: int,
        keep_maw: bool,
        initial_blocks: int | None = None,
        storage: tuple | None = None,
    ) -> None:
        self.sink_slots, self.ring_blocks, self.block_size = sink_slots, ring_blocks, block_size
        allocated = ring_blocks if initial_blocks is None else max(1, min(ring_blocks, initial_blocks))
        if storage is not None:
            allocated = ring_blocks
        self.allocated_blocks = allocated
        self.generation = 0
        slots = sink_slots + allocated * block_size
        if storage is not None:
            self.keys, self.values, self.valid, self.maw = storage
            wanted = (batch, num_kv_heads, slots, head_dim)
            held = tuple(self.keys.shape)
            if (
                self.keys.dtype != dtype
                or self.keys.device != device
                or held[:2] != wanted[:2]
                or held[2] < slots
                or held[3] != head_dim
                or (self.maw is None) == keep_maw
            ):
                raise ValueError(
                    f"the hot tier's storage holds {held} {self.keys.dtype} on {self.keys.device} (maw: "
                    f"{self.maw is not None}); it needs at least {wanted} {dtype} on {device} (maw: {keep_maw})"
                )
            for tensor in storage:
                if tensor is not None:
                    tensor.zero_()  # the row's last user left its tokens (and a free row's step writes) here
        else:
            # zeros, not empty: unused slots are masked, but must never hold NaN/Inf that a matmul could spread
            self.keys = torch.zeros(batch, num_kv_heads, slots, head_dim, dtype=dtype, device=device)
            self.values = torch.zeros_like(self.keys)
            self.valid = torch.zeros(batch, slots, dtype=torch.bool, device=device)
            self.maw = torch.zeros(batch, num_q_heads, slots, device=device) if keep_maw else None
        self._empty()

    def _empty(self) -> None:
        """No token held: every sink slot and ring block free."""
        self.sink_used = 0
        self.order: list[int] = []  # ring blocks holding tokens, oldest first
        self.tail_fill = 0  # tokens in the newest block
        self.free: list[int] = list(range(self.allocated_blocks))
        self._reuse_after: dict[int, torch.cuda.Event] = {}  # block -> event of its copy to the host

    def clear(self) -> None:
        """Empty, as a new tier of this shape would be: every slot zeroed and free, the storage (the addresses a
        recorded step reads) and its allocation kept. The caller has waited for the copies that read the ring."""
        with torch.inference_mode():  # (a decode step may have made them inference tensors)
            for tensor in (self.keys, self.values, self.valid, self.maw):
                if tensor is not None:
                    tensor.zero_()
        self._empty()

    @property
    def ring_tokens(self) -> int:
        return (len(self.order) - 1) * self.block_size + self.tail_fill if self.order else 0

    def block_start(self, block: int) -> int:
        return self.sink_slots + block * self.block_size

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Store tokens [B, Hkv, n, D] in consecutive slots from `slot`."""
        n = keys.shape[2]
        self.keys[:, :, slot : slot + n].copy_(keys)
        self.values[:, :, slot : slot + n].copy_(values)
        self.valid[:, slot : slot + n].copy_(valid)
        if self.maw is not None:
            self.maw[:, :, slot : slot + n].zero_()

    def write_slot(self, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one new token per request [B, Hkv, 1, D], valid, at the slot the device tensor `slot` [1] holds
        (reserved beforehand: a recorded step writes wherever its slot points at replay)."""
        self.keys.index_copy_(2, slot, keys)
        self.values.index_copy_(2, slot, values)
        self.valid.index_fill_(1, slot, True)
        if self.maw is not None:
            self.maw.index_fill_(2, slot, 0.0)

    def take_free_block(self) -> int:
        return self.take_free_blocks(1)[0]

    def take_free_blocks(self, count: int) -> list[int]:
        """The next `count` free blocks, oldest freed first (the ring grows as needed), their slots marked empty:
        one fill per run of consecutive blocks (`block_runs`), so a prompt's ring costs a few device calls."""
        while len(self.free) < count:
            self._grow()
        blocks, self.free[:count] = self.free[:count], []
        for block in blocks:
            event = self._reuse_after.pop(block, None)
            if event is not None:
                # the GPU (not the CPU) waits until the block's copy to the host has read it
                torch.cuda.current_stream(self.keys.device).wait_event(event)
        for block, run in self.block_runs(blocks):  # their stale entries live in the host tier
            start = self.block_start(block)
            self.valid[:, start : start + run * self.block_size] = False
        return blocks

    @staticmethod
    def block_runs(blocks: list[int]) -> list[tuple[int, int]]:
        """(first block, count) of each run of consecutive block indices in `blocks`, in order: blocks whose
        slots are adjacent, read or written as one slice."""
        runs: list[list[int]] = []
        for block in blocks:
            if runs and runs[-1][0] + runs[-1][1] == block:
                runs[-1][1] += 1
            else:
                runs.append([block, 1])
        return [(first, count) for first, count in runs]

    def _grow(self) -> None:
        """Double the ring's allocation (at most `ring_blocks`); the slots keep their indices."""
        if self.allocated_blocks >= self.ring_blocks:
            raise RuntimeError(
                "the hot tier's ring is full: the oldest block must leave for the host tier first"
            )
        new_blocks = min(self.ring_blocks, 2 * self.allocated_blocks)
        if self.keys.is_cuda:
            # blocks still being copied to the host are read from the old storage: the stream that will reuse its
            # memory waits for those copies first
            stream = torch.cuda.current_stream(self.keys.device)
            for event in self._reuse_after.values():
                stream.wait_event(event)
        slots = self.sink_slots + new_blocks * self.block_size
        # each tensor and its slot dimension (keys, values: [B, Hkv, slots, D]; valid: [B, slots]; maw: [B, Hq, slots])
        grown = {}
        try:  # every new tensor is had before any old one is replaced: a failure leaves the tier as it was
            for name, dim in (("keys", 2), ("values", 2), ("valid", 1), ("maw", 2)):
                old = getattr(self, name)
                if old is not None:
                    shape = list(old.shape)
                    shape[dim] = slots
                    grown[name] = (dim, old.new_zeros(shape))
        except torch.OutOfMemoryError as err:
            grown.clear()
            old_bytes = sum(t.nbytes for t in (self.keys, self.values, self.valid, self.maw) if t is not None)
            raise MemoryError(
                f"the hot tier's ring could not grow from {self.allocated_blocks} to {new_blocks} blocks "
                f"({old_bytes * (slots / self.keys.shape[2] - 1) / 2**20:.0f} MiB more for this layer on "
                f"{self.keys.device}, which is full); a smaller TandemConfig.window_tokens keeps the ring smaller"
            ) from err
        for name, (dim, new) in grown.items():
            old = getattr(self, name)
            new.narrow(dim, 0, old.shape[dim]).copy_(old)
            setattr(self, name, new)
        self.free.extend(range(self.allocated_blocks, new_blocks))
        self.allocated_blocks = new_blocks
        self.generation += 1

    def release(self, blocks: list[int], event: torch.cuda.Event | None) -> None:
        for block in blocks:
            if event is not None:
                self._reuse_after[block] = event
            self.free.append(block)

    def ordered_ring(self):
        """(keys, values, valid, maw) of the ring's tokens in token order, as new tensors."""
        if not self.order:
            return None
        parts, left = [], self.ring_tokens  # only the newest block, the last of the last run, may be partial
        for block, run in self.block_runs(self.order):
            start, n = self.block_start(block), min(run * self.block_size, left)
            parts.append(slice(start, start + n))
            left -= n
        keys = torch.cat([self.keys[:, :, s] for s in parts], dim=2)
        values = torch.cat([self.values[:, :, s] for s in parts], dim=2)
        valid = torch.cat([self.valid[:, s] for s in parts], dim=1)
        maw = torch.cat([self.maw[:, :, s] for s in parts], dim=2) if self.maw is not None else None
        return keys, values, valid, maw

    def block_view(self, block: int):
        s = slice(self.block_start(block), self.block_start(block) + self.block_size)
        maw = self.maw[:, :, s] if self.maw is not None else None
        return self.keys[:, :, s], self.values[:, :, s], self.valid[:, s], maw

    def valid_counts(self) -> torch.Tensor:
        """[B] number of real tokens in the hot tier per request."""
        return self.valid.sum(dim=1)

    def nbytes(self) -> int:
        tensors = [self.keys, self.values, self.valid] + ([self.maw] if self.maw is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)
