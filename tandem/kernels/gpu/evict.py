"""Launcher of the host tier's row writes (`evict_kernels`): evicted rows' K / V / valid flags into pinned host
memory with their blocks' key digests, on the host and mirrored on the device, in one launch, where the copies and
reductions it replaces were a dozen launches and copies per evicted block (`cache.host.HostTier`)."""

from __future__ import annotations

import torch

from ._common import (
    FLOAT_DTYPES,
    _block_d,
    _check,
    _check_on,
    _check_readable,
    _check_tensor,
    _guard,
    _run_device,
    _unit_last_stride,
)

try:
    from . import evict_kernels as _kernels
except ImportError:  # the torch reference remains usable without triton
    _kernels = None


def write_rows(
    keys, values, valid, dst_keys, dst_values, dst_valid, block_size: int, digests=None, mirror=None
):
    """Rows [B, Hkv, n, D] (keys, values; valid [B, n] bool) on the device into dst_keys / dst_values [B, Hkv, n, D]
    and dst_valid [B, n] (pinned host memory, or the device), n a multiple of block_size (a power of two). See
    `reference.write_rows`.

    digests: (key_min, key_max) [B, Hkv, n / block_size, D], pinned or on the device, written with each block's
             per-dim min / max of the valid rows' keys (+inf / -inf where none is valid), or None
    mirror:  with digests, (key_min_dev, key_max_dev, block_valid) on the device: the digests with 0 where no row
             is valid, and block_valid [B, n / block_size] bool, whether a block has a valid row; or None
    """
    device = _run_device("keys", keys)
    batch, heads, n, head_dim = keys.shape if keys.dim() == 4 else (None,) * 4
    _check_tensor("keys", keys, "[B, Hkv, n, D]", (None, None, None, None), FLOAT_DTYPES)
    _check(
        isinstance(block_size, int) and block_size >= 1 and block_size & (block_size - 1) == 0,
        f"block_size must be a power of two, got {block_size}",
    )
    _check(n % block_size == 0, f"keys must hold whole blocks of {block_size} rows, got {n}")
    shape = (batch, heads, n, head_dim)
    for name, t in (("values", values), ("dst_keys", dst_keys), ("dst_values", dst_values)):
        _check_tensor(name, t, "[B, Hkv, n, D]", shape, (keys.dtype,))
    for name, t in (("valid", valid), ("dst_valid", dst_valid)):
        _check_tensor(name, t, "[B, n]", (batch, n), (torch.bool,))
        _check(t.stride(1) == 1, f"{name} must be contiguous along its rows")
    for name, t in (("values", values), ("valid", valid)):
        _check_on(name, t, device)
    for name, t in (("dst_keys", dst_keys), ("dst_values", dst_values), ("dst_valid", dst_valid)):
        _check_readable(name, t, device)
    tensors = [_unit_last_stride(name, t, may_copy=False) for name, t in
               (("keys", keys), ("values", values), ("dst_keys", dst_keys), ("dst_values", dst_values))]  # fmt: skip
    blocks = n // block_size
    digest_shape = (batch, heads, blocks, head_dim)
    key_min = key_max = key_min_dev = key_max_dev = block_valid = None
    if digests is not None:
        key_min, key_max = digests
        for name, t in (("key_min", key_min), ("key_max", key_max)):
            _check_tensor(name, t, "[B, Hkv, n / block_size, D]", digest_shape, FLOAT_DTYPES)
            _check_readable(name, t, device)
            _check(
                key_min.stride() == t.stride() and t.stride(-1) == 1, f"{name} must share key_min's strides"
            )
    _check(mirror is None or digests is not None, "mirror needs digests")
    if mirror is not None:
        key_min_dev, key_max_dev, block_valid = mirror
        for name, t in (("key_min_dev", key_min_dev), ("key_max_dev", key_max_dev)):
            _check_tensor(name, t, "[B, Hkv, n / block_size, D]", digest_shape, FLOAT_DTYPES)
            _check_on(name, t, device)
            _check(
                key_min_dev.stride() == t.stride() and t.stride(-1) == 1,
                f"{name} must share key_min_dev's strides",
            )
        _check_tensor("block_valid", block_valid, "[B, n / block_size]", (batch, blocks), (torch.bool,))
        _check_on("block_valid", block_valid, device)
        _check(block_valid.stride(1) == 1, "block_valid must be contiguous along its blocks")
    if batch == 0 or heads == 0 or n == 0:
        return
    keys, values, dst_keys, dst_values = tensors
    dummy = keys  # never read or written when its flag is off
    g = key_min.stride() if key_min is not None else (0, 0, 0, 1)
    e = key_min_dev.stride() if key_min_dev is not None else (0, 0, 0, 1)
    with _guard(device):
        _kernels.write_rows_kernel[(batch * heads, blocks)](
            keys, values, valid.view(torch.uint8), dst_keys, dst_values, dst_valid.view(torch.uint8),
            key_min if key_min is not None else dummy, key_max if key_max is not None else dummy,
            key_min_dev if key_min_dev is not None else dummy, key_max_dev if key_max_dev is not None else dummy,
            block_valid.view(torch.uint8) if block_valid is not None else dummy,
            heads, head_dim,
            *keys.stride()[:3], *values.stride()[:3], valid.stride(0),
            *dst_keys.stride()[:3], *dst_values.stride()[:3], dst_valid.stride(0),
            *g[:3], *e[:3], block_valid.stride(0) if block_valid is not None else 0,
            BLOCK_SIZE=block_size, BLOCK_D=_block_d(head_dim),
            HAS_DIGEST=digests is not None, HAS_MIRROR=mirror is not None,
        )  # fmt: skip
