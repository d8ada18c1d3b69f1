"""Launchers of quest's recall-cache kernels (`recall_kernels`): one step's plan and the copy of host blocks
into the device cache's slots. Each validates its inputs, then launches.
"""

from __future__ import annotations

import torch

from ._common import (
    FLOAT_DTYPES,
    MAX_HEAD_DIM,
    QUANT_CODES,
    _as_codes,
    _block_d,
    _check,
    _check_on,
    _check_readable,
    _check_real,
    _check_tensor,
    _guard,
    _kv_scales,
    _positive_int,
    _run_device,
    interpreted,
)

try:
    import triton

    from . import recall_kernels as _kernels
except ImportError:  # the torch references remain usable without triton
    triton = None
    _kernels = None


def recall_plan(ids, k, share, state, out, block_size):
    """One step's plan for quest's recall cache, and its bookkeeping, in place: `reference.recall_plan`'s
    algorithm as one program per (request, KV head). All tensors contiguous on one device; ids / k / the state's
    int tensors int64, `ref` int8 (see `reference.recall_plan` for the layouts; k and the counters may be one per
    request, [B] and [B, 2])."""
    device = _run_device("ids", ids)
    _check_tensor("ids", ids, "[B, Hkv, K]", (None, None, None), (torch.int64,))
    batch, heads, width_k = ids.shape
    slots = state["slot_block"].shape[-1]
    width = out["src"].shape[-1]
    num_blocks = state["block_slot"].shape[-1]
    limit = int(state["limit"])
    _check(0 <= limit < num_blocks, f"limit must lie in [0, {num_blocks}), got {limit}")
    _check(slots >= width_k + width, f"need at least K + W = {width_k + width} slots, got {slots}")
    _check_real("share", share, 0.0, 1.0)
    per_request = batch > 1 and k.dim() == 1 and k.shape[0] == batch
    counted = state["counters"]
    per_row_counts = counted.dim() == 2
    shapes = {
        "k": (k, (batch,) if per_request else (1,)),
        "block_slot": (state["block_slot"], (batch, heads, num_blocks)),
        "slot_block": (state["slot_block"], (batch, heads, slots)),
        "last": (state["last"], (batch, heads, slots)),
        "hand": (state["hand"], (batch, heads)),
        "step": (state["step"], (batch, heads)),
        "counters": (counted, (batch, 2) if per_row_counts else (2,)),
        "cpu": (out["cpu"], (batch, heads, width_k)),
        "src": (out["src"], (batch, heads, width)),
        "dst": (out["dst"], (batch, heads, width)),
        "counts": (out["counts"], (batch, heads)),
        "gpu": (out["gpu"], (batch, heads, width_k + width)),
    }
    for name, (t, shape) in shapes.items():
        _check_tensor(name, t, str(list(shape)), shape, (torch.int64,))
    _check_tensor("ref", state["ref"], "[B, Hkv, S]", (batch, heads, slots), (torch.int8,))
    for name, t in [("ids", ids), ("ref", state["ref"])] + [(n, t) for n, (t, _) in shapes.items()]:
        _check_on(name, t, device)
        _check(t.is_contiguous(), f"{name} must be contiguous")
    if batch == 0 or heads == 0:
        return
    block_s = 1 << (
        min(slots, 1024).bit_length() - 1
    )  # a power of two <= S: a chunk never holds a slot twice
    with _guard(device):
        _kernels.recall_plan_kernel[(batch, heads)](
            ids, k, state["block_slot"], state["slot_block"], state["last"], state["ref"], state["hand"],
            state["step"], out["cpu"], out["src"], out["dst"], out["counts"], out["gpu"], counted,
            float(share), int(per_request), 2 if per_row_counts else 0, width_k, width, slots, num_blocks, limit,
            heads, int(block_size),
            BLOCK_K=min(1024, triton.next_power_of_2(max(width_k, 1))), BLOCK_S=block_s,
            BLOCK_W=min(1024, triton.next_power_of_2(max(width, 1))), num_warps=4,
        )  # fmt: skip


def recall_blocks(
    src_keys, src_values, src_valid, keys, values, valid, src_ids, dst_ids, counts, block_size, slots,
    *, src_k_scale=None, src_v_scale=None,
):  # fmt: skip
    """Copy selected blocks of a host KV store into the slots of a device-resident block cache.

    src_keys, src_values : [B, Hkv, T, D] in pinned host memory (read zero-copy) or on the cache's device;
        src_valid [B, T] bool next to them. Or int8 / float8_e4m3fn codes with `src_k_scale`, `src_v_scale`
        ([B, Hkv, T // G] float32, as `host_block_attention` reads them): decoded to the cache's dtype on the way
    keys, values : [B, Hkv * slots * block_size, D] the cache on the device (slot s of head h holds rows
        [(h * slots + s) * block_size, ... + block_size)); valid [B, Hkv * slots * block_size] bool
    src_ids, dst_ids : [B, Hkv, W] int64 host block ids and target slots; counts [B, Hkv] int64: the first
        counts[b, h] entries are copied, the rest ignored. Rows of a block past T are marked not valid.
    """
    device = _run_device("keys", keys)
    src_dtypes = FLOAT_DTYPES + tuple(QUANT_CODES)
    _check_tensor("src_keys", src_keys, "[B, Hkv, T, D]", (None, None, None, None), src_dtypes)
    batch, num_kv_heads, num_rows, head_dim = src_keys.shape
    _check_tensor("src_values", src_values, "[B, Hkv, T, D]", tuple(src_keys.shape), (src_keys.dtype,))
    _check_tensor("src_valid", src_valid, "[B, T]", (batch, num_rows), (torch.bool,))
    quant = QUANT_CODES.get(src_keys.dtype, 0)
    cache_dtypes = FLOAT_DTYPES if quant else (src_keys.dtype,)
    width = _check_cache(
        keys, values, valid, src_ids, dst_ids, counts, (batch, num_kv_heads, head_dim), cache_dtypes, block_size,
        slots, device,
    )  # fmt: skip
    for name, t in (("src_keys", src_keys), ("src_values", src_values), ("src_valid", src_valid)):
        _check_readable(name, t, device)
        _check(
            t.stride(-1) == 1, f"{name} must be contiguous in its last dimension, got strides {t.stride()}"
        )
    _, scale_group = _kv_scales(src_keys, src_k_scale, src_v_scale, device, ("src_k_scale", "src_v_scale"))
    if batch == 0 or width == 0:
        return
    block_d, block_r = _copy_blocks(head_dim, block_size)
    if not quant:  # placeholders, never read
        src_k_scale = src_v_scale = counts
    scale_strides = (*src_k_scale.stride()[:2], *src_v_scale.stride()[:2]) if quant else (0, 0, 0, 0)
    with _guard(device):
        _kernels.recall_blocks_kernel[(batch, num_kv_heads, width)](
            _as_codes(src_keys), _as_codes(src_values), src_valid.view(torch.uint8), keys, values,
            valid.view(torch.uint8), src_ids, dst_ids, counts, src_k_scale, src_v_scale, counts,
            num_rows, int(slots), scale_group,
            *src_keys.stride()[:3], *src_values.stride()[:3], src_valid.stride(0),
            keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), valid.stride(0),
            *src_ids.stride()[:2], *dst_ids.stride()[:2], *counts.stride(), *scale_strides,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_SIZE=int(block_size), QUANT=quant,
            RNE_BF16=interpreted() and keys.dtype == torch.bfloat16, TABLE=False, num_warps=4,
        )  # fmt: skip


def store_table(stores, base) -> torch.Tensor:
    """[B, 5] int64 on the host: `recall_blocks_table`'s table of the stores (keys, values, valid) of B requests
    (None: a request with none, which copies nothing), each [1, Hkv, T_b, D] / [1, T_b] contiguous, relative to
    `base`: the (keys, values, valid) of the cache they are copied into, of the stores' dtype."""
    size = base[0].element_size()
    rows = []
    for store in stores:
        if store is None:
            rows.append((0, 0, 0, 0, 0))
            continue
        keys, values, valid = store
        rows.append((
            (keys.data_ptr() - base[0].data_ptr()) // size,
            (values.data_ptr() - base[1].data_ptr()) // size,
            valid.data_ptr() - base[2].data_ptr(),
            keys.stride(1),
            keys.shape[2],
        ))  # fmt: skip
    return torch.tensor(rows, dtype=torch.long)


def recall_blocks_table(stores, table, keys, values, valid, src_ids, dst_ids, counts, block_size, slots):
    """`recall_blocks` where request b reads its own host store: stores[b] = (keys [1, Hkv, T_b, D], values, valid
    [1, T_b]) in pinned host memory (or on the cache's device), or None (it copies nothing), all of one dtype and
    head_dim, contiguous; table [B, 5] int64 on the cache's device, `store_table(stores, (keys, values, valid))`.
    The kernel reads each store at its offset from the cache's own tensors, so a recorded launch serves other
    stores once the table names them. One launch for all requests, where `recall_blocks` would be one per
    request."""
    device = _run_device("keys", keys)
    live = [s for s in stores if s is not None]
    _check(live, "stores must hold at least one store")
    base = live[0]
    for b, store in enumerate(stores):
        if store is None:
            continue
        k, v, m = store
        _check_tensor(f"stores[{b}] keys", k, "[1, Hkv, T, D]", (1, base[0].shape[1], None, base[0].shape[3]),
                      FLOAT_DTYPES)  # fmt: skip
        _check(k.dtype == base[0].dtype, f"stores[{b}] keys must be {base[0].dtype}, got {k.dtype}")
        _check_tensor(f"stores[{b}] values", v, "[1, Hkv, T, D]", tuple(k.shape), (k.dtype,))
        _check_tensor(f"stores[{b}] valid", m, "[1, T]", (1, k.shape[2]), (torch.bool,))
        for name, t in (("keys", k), ("values", v), ("valid", m)):
            _check_readable(f"stores[{b}] {name}", t, device)
            _check(t.is_contiguous(), f"stores[{b}] {name} must be contiguous")
    batch, num_kv_heads, head_dim = keys.shape[0], base[0].shape[1], base[0].shape[3]
    _check(
        len(stores) == batch, f"stores must hold one entry per row of the cache ({batch}), got {len(stores)}"
    )
    _check_tensor("table", table, "[B, 5]", (batch, 5), (torch.int64,))
    _check_on("table", table, device)
    width = _check_cache(
        keys, values, valid, src_ids, dst_ids, counts, (batch, num_kv_heads, head_dim), (base[0].dtype,),
        block_size, slots, device,
    )  # fmt: skip
    if batch == 0 or width == 0:
        return
    block_d, block_r = _copy_blocks(head_dim, block_size)
    row_stride = base[0].stride(2)
    with _guard(device):
        _kernels.recall_blocks_kernel[(batch, num_kv_heads, width)](
            keys, values, valid.view(torch.uint8), keys, values, valid.view(torch.uint8), src_ids, dst_ids,
            counts, counts, counts, table, 0, int(slots), 1,
            0, 0, row_stride, 0, 0, row_stride, 0,
            keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), valid.stride(0),
            *src_ids.stride()[:2], *dst_ids.stride()[:2], *counts.stride(), 0, 0, 0, 0,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_SIZE=int(block_size), QUANT=0,
            RNE_BF16=interpreted() and keys.dtype == torch.bfloat16, TABLE=True, num_warps=4,
        )  # fmt: skip


def _check_cache(
    keys, values, valid, src_ids, dst_ids, counts, shape, dtypes, block_size, slots, device
) -> int:
    """The copy's cache side and plan (`recall_blocks`' layouts) for (batch, Hkv, head_dim) = `shape`, on `device`,
    contiguous in their last dimension; returns W."""
    batch, num_kv_heads, head_dim = shape
    _check(1 <= head_dim <= MAX_HEAD_DIM, f"head_dim must lie in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if not (_positive_int(block_size) and _positive_int(slots)):
        raise ValueError(f"block_size and slots must be positive ints, got {block_size!r} / {slots!r}")
    cache_rows = num_kv_heads * slots * block_size
    layout = "[B, Hkv * slots * block_size, D]"
    _check_tensor("keys", keys, layout, (batch, cache_rows, head_dim), dtypes)
    _check_tensor("values", values, layout, (batch, cache_rows, head_dim), (keys.dtype,))
    _check_tensor("valid", valid, "[B, Hkv * slots * block_size]", (batch, cache_rows), (torch.bool,))
    width = src_ids.shape[-1] if src_ids.dim() == 3 else None
    _check_tensor("src_ids", src_ids, "[B, Hkv, W]", (batch, num_kv_heads, None), (torch.int64,))
    _check_tensor("dst_ids", dst_ids, "[B, Hkv, W]", (batch, num_kv_heads, width), (torch.int64,))
    _check_tensor("counts", counts, "[B, Hkv]", (batch, num_kv_heads), (torch.int64,))
    tensors = (("keys", keys), ("values", values), ("valid", valid), ("src_ids", src_ids), ("dst_ids", dst_ids),
               ("counts", counts))  # fmt: skip
    for name, t in tensors:
        _check_on(name, t, device)
        _check(
            t.stride(-1) == 1, f"{name} must be contiguous in its last dimension, got strides {t.stride()}"
        )
    return width


def _copy_blocks(head_dim: int, block_size: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_R) of `recall_blocks_kernel`: the head's lanes, and rows per pass of a block."""
    block_d = _block_d(head_dim)
    return block_d, min(triton.next_power_of_2(int(block_size)), max(1, 8192 // block_d))
