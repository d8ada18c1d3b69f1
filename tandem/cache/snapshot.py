"""A batch-1 cache's state at a prefill's chunk boundary, taken to start another request's cache from it.

A prompt prefilled in chunks leaves, after each chunk, a state that depends only on the tokens so far and the
cache's settings: the sinks and the ring on the device, the older tokens' rows in the host tier, the policy's
bookkeeping of the evictions. A request whose prompt begins with the same tokens, prefilled in the same chunks,
passes through the same state at the same boundary: `restore` puts it there at once and only the tokens past it
are prefilled, with the same results as a cold prefill (`cache.prefix` keeps these states by their tokens).

What a `CachePrefix` holds and where:
- the host tier's rows in host memory (K/V or 8-bit codes and scales, valid flags, digests) are read where they
  are: rows once written never change, and the tier's `PrefixClaim` keeps any `clear` from zeroing them;
- everything else is copied into host memory when it is taken: the hot tier's slots (sinks and ring, in their
  slots, so that the same attention sums in the same order), hgca's attention history (later rewritten in place),
  the device's digests, certified bounds and key sketch (a pool's rows go to other requests), and the windows of
  sliding-window layers. A prefix holds no device memory.
`restore` copies all of it into a new cache's own tiers, or, where no tier writes into those host rows any more,
takes the host-memory buffers over (`HostTier.adopt`) and copies the rest: the request then writes its own rows
past the prefix's, which stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .host import BUFFERS, PrefixClaim, _rows_of
from .sliding import SlidingKV

# the host tier's buffers a prefix reads in place (host memory, rows written once); the others are copied
HOST_ROWS = ("keys", "values", "valid", "key_scale", "value_scale", "key_min", "key_max")


@dataclass
class LayerPart:
    """One global layer (`LayerKV`) at a chunk boundary: seq_len tokens, the first chunk `first_chunk` long (the
    tiers are made as its append made them); the hot tier's slot tensors and ring bookkeeping; the host tier's
    `rows` live rows in `host` (buffer name -> tensor, `HOST_ROWS` as the tier holds them, the rest copies of the
    live rows or blocks); the policy's own state (`Policy.prefix_state`)."""

    seq_len: int
    first_chunk: int
    dtype: torch.dtype
    device: torch.device
    sink_slots: int
    ring_blocks: int
    hot: dict[str, torch.Tensor]
    sink_used: int
    order: list[int]
    tail_fill: int
    free: list[int]
    allocated_blocks: int
    rows: int
    block_size: int
    host: dict[str, torch.Tensor]
    policy_state: object = None
    # the hold on the host tier's buffers that `host` reads in place (`HostTier.claim`): a prefix keeps those
    # buffers, not the tier itself (whose device-side tensors go with it)
    claim: PrefixClaim | None = None


@dataclass
class SlidingPart:
    """One sliding-window layer (`SlidingKV`): its window's keys, values, valid flags (host copies) and seq_len."""

    seq_len: int
    device: torch.device
    keys: torch.Tensor | None
    values: torch.Tensor | None
    valid: torch.Tensor | None


def take(kvs: list, first_chunk: int) -> list:
    """The state of a batch-1 cache's layers `kvs` (each a `LayerKV` or `SlidingKV`, in the model's order) at a
    chunk boundary of a prefill whose first chunk was `first_chunk` tokens. ValueError where a layer cannot be
    kept: not batch 1, failed, split across ranks, or holding staged rows."""
    parts = []
    try:
        for kv in kvs:
            parts.append(_take_sliding(kv) if isinstance(kv, SlidingKV) else _take_layer(kv, first_chunk))
        _synchronize(parts)
    except BaseException:
        release(parts)
        raise
    return parts


def adoptable(parts: list) -> bool:
    """Whether no tier writes into the host-memory buffers the parts read any more (the request that kept them
    ended, or its tiers moved to larger buffers): a restore may then take them over instead of copying them."""
    return all(
        part.claim is None or not part.claim.written(part.host["keys"])
        for part in parts
        if isinstance(part, LayerPart)
    )


def claims(parts: list) -> set[int]:
    """Identities of the holds on host tiers' buffers that the parts read (a prefix of the same request's shares
    them)."""
    return {id(part.claim) for part in parts if isinstance(part, LayerPart) and part.claim is not None}


def restore(kvs: list, parts: list, adopt: bool = False) -> None:
    """Put a new cache's layers `kvs` (before their first tokens; the same model's, in the same order) in the state
    `take` took, in tiers of their own. adopt: the host tiers take over the host-memory buffers the parts read
    (`adoptable` says when no tier writes into them), and the tiers' rows past the prefix go into them; else those
    rows are copied. Everything else is copied."""
    if len(kvs) != len(parts):
        raise ValueError(f"the prefix holds {len(parts)} layers, the cache {len(kvs)}")
    for kv, part in zip(kvs, parts, strict=True):
        if isinstance(kv, SlidingKV) != isinstance(part, SlidingPart):
            raise ValueError(f"layer {kv.layer_idx}: the prefix holds another kind of layer")
        if kv.initialized:
            raise ValueError("restore: the cache already holds tokens; a prefix starts a new cache")
        if isinstance(kv, SlidingKV):
            _restore_sliding(kv, part)
        else:
            _restore_layer(kv, part, adopt)


def nbytes(parts: list) -> int:
    """Host bytes the parts keep alive: their copies and the host tiers' buffers they read (whole capacity)."""
    seen, total = set(), 0
    for part in parts:
        tensors = (
            [part.keys, part.values, part.valid]
            if isinstance(part, SlidingPart)
            else [*part.hot.values(), *part.host.values()]
        )
        for tensor in tensors:
            if tensor is None:
                continue
            base = tensor.untyped_storage()
            if base.data_ptr() not in seen:
                seen.add(base.data_ptr())
                total += base.nbytes()
    return total


def copied_bytes(parts: list) -> int:
    """Bytes a restore that copies everything copies: the live rows and blocks of the host buffers, the rest whole."""
    total = 0
    for part in parts:
        if isinstance(part, SlidingPart):
            total += sum(t.nbytes for t in (part.keys, part.values, part.valid) if t is not None)
            continue
        total += sum(t.nbytes for t in part.hot.values())
        for name, tensor in part.host.items():
            row_dim, used = _rows_of(name, tensor, part.rows, part.block_size)
            total += tensor.narrow(row_dim, 0, used).nbytes
    return total


def release(parts: list) -> None:
    """The prefix is dropped: its host tiers may be emptied for other requests again once no prefix reads them."""
    for part in parts:
        if isinstance(part, LayerPart) and part.claim is not None:
            part.claim.readers -= 1


# ---- one layer ---------------------------------------------------------------------------------------------
def _take_layer(kv, first_chunk: int) -> LayerPart:
    kv.check_usable()
    hot, host = kv.hot, kv.host
    if hot is None:
        raise ValueError(f"layer {kv.layer_idx}: no tokens to keep")
    if hot.keys.shape[0] != 1 or host.split is not None or host.staged:
        raise ValueError(
            f"layer {kv.layer_idx}: only a batch-1 cache without a request split or staged rows is kept as a prefix"
        )
    host.wait()  # every eviction's copy has landed: the rows read below are final
    slots = hot.sink_slots + hot.allocated_blocks * hot.block_size
    hot_copy = {
        name: _host_copy(tensor.narrow(-1 if name == "valid" else 2, 0, slots))
        for name in ("keys", "values", "valid", "maw")
        if (tensor := getattr(hot, name)) is not None
    }
    rows, buffers = host.rows, {}
    for name in BUFFERS:
        tensor = getattr(host, name)
        if tensor is None:
            continue
        if name in HOST_ROWS:
            buffers[name] = tensor
            continue
        row_dim, used = _rows_of(name, tensor, rows, host.block_size)
        buffers[name] = _host_copy(tensor.narrow(row_dim, 0, used))
    if host.claim is None:
        host.claim = PrefixClaim(host)
    host.claim.readers += 1
    made = kv._hot_made_with
    return LayerPart(
        seq_len=kv.seq_len, first_chunk=first_chunk, dtype=hot.keys.dtype, device=hot.keys.device,
        sink_slots=made["sink_slots"], ring_blocks=made["ring_blocks"], hot=hot_copy, sink_used=hot.sink_used,
        order=list(hot.order), tail_fill=hot.tail_fill, free=list(hot.free),
        allocated_blocks=hot.allocated_blocks, rows=rows, block_size=host.block_size, host=buffers,
        policy_state=kv.policy.prefix_state(),
        claim=host.claim,
    )  # fmt: skip


@torch.inference_mode()
def _restore_layer(kv, part: LayerPart, adopt: bool) -> None:
    kv.make_tiers(1, part.first_chunk, 0, part.dtype, part.device, reserve_host=False)
    hot, host = kv.hot, kv.host
    if (hot.sink_slots, hot.ring_blocks) != (part.sink_slots, part.ring_blocks):
        raise ValueError(
            f"layer {kv.layer_idx}: the prefix was kept with {part.sink_slots} sink slots and {part.ring_blocks} "
            f"ring blocks, this cache makes {hot.sink_slots} and {hot.ring_blocks}: other settings"
        )
    while hot.allocated_blocks < part.allocated_blocks:
        hot._grow()
    for name, saved in part.hot.items():
        target = getattr(hot, name)
        target.narrow(-1 if name == "valid" else 2, 0, saved.shape[-1 if name == "valid" else 2]).copy_(
            saved, non_blocking=True
        )
    hot.sink_used, hot.order, hot.tail_fill = part.sink_used, list(part.order), part.tail_fill
    hot.free = list(part.free) + list(range(part.allocated_blocks, hot.allocated_blocks))
    hinted = kv.host_rows_hint()
    if adopt:
        host.adopt({name: part.host[name] for name in HOST_ROWS if name in part.host}, part.rows)
        part.claim.take(host)
        copied = {name: saved for name, saved in part.host.items() if name not in HOST_ROWS}
    else:
        host.reserve(max(part.rows, hinted), headroom=False)
        copied = part.host
    for name, saved in copied.items():
        target = getattr(host, name)
        if target is None:
            raise ValueError(
                f"layer {kv.layer_idx}: the prefix holds {name}, this cache's host tier keeps none"
            )
        row_dim, used = _rows_of(name, target, part.rows, host.block_size)
        target.narrow(row_dim, 0, used).copy_(saved.narrow(row_dim, 0, used), non_blocking=True)
    host.rows = part.rows
    # a taken-over tier that the request will outgrow: its own, larger buffers now, as a cold prefill has them
    host.reserve(hinted, headroom=False)
    kv.seq_len = part.seq_len
    kv.policy.restore_prefix_state(part.policy_state)
    if hot.keys.is_cuda:
        # the copies read pinned host memory that the prefix owns: done before it may be dropped
        torch.cuda.current_stream(hot.keys.device).synchronize()


def _take_sliding(kv: SlidingKV) -> SlidingPart:
    kv.check_usable()
    if kv.keys is not None and kv.keys.shape[0] != 1:
        raise ValueError(f"layer {kv.layer_idx}: only a batch-1 cache is kept as a prefix")
    copies = [None if t is None else _host_copy(t) for t in (kv.keys, kv.values, kv.valid)]
    device = kv.keys.device if kv.keys is not None else torch.device("cpu")
    return SlidingPart(kv.seq_len, device, *copies)


def _restore_sliding(kv: SlidingKV, part: SlidingPart) -> None:
    kv.keys, kv.values, kv.valid = (
        None if t is None else t.to(part.device, copy=True) for t in (part.keys, part.values, part.valid)
    )
    kv.seq_len = part.seq_len


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory (pinned, asynchronously, from a CUDA device: `_synchronize` waits)."""
    if not tensor.is_cuda:
        return tensor.clone()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return out.copy_(tensor, non_blocking=True)


def _synchronize(parts: list) -> None:
    devices = {part.device for part in parts if part.device.type == "cuda"}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


__all__ = [
    "LayerPart",
    "SlidingPart",
    "adoptable",
    "claims",
    "copied_bytes",
    "nbytes",
    "release",
    "restore",
    "take",
]
