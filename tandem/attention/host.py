"""CPU side of hybrid attention: a policy's selection of host rows, attended by the CPU kernels."""

from __future__ import annotations

import torch

from ..kernels import ops
from ..policies import Selection
from .tasks import TaskPool

KEY_CHUNK = 4096  # keys per step of the chunked dense paths: bounds the logits buffer


def host_attention(layer, q_host: torch.Tensor, selection: Selection, scale: float, pool: TaskPool):
    """Attention of q_host [B, Hq, Lq, D] (CPU) over the host rows named by `selection`: (out, lse) fp32."""
    host = layer.host
    batch, num_q_heads, q_len, head_dim = q_host.shape
    if selection.kind == "none" or host.rows == 0:
        return torch.zeros(batch, num_q_heads, q_len, head_dim), torch.full(
            (batch, num_q_heads, q_len), float("-inf")
        )
    threads = layer.config.host.threads
    if selection.kind == "all" and q_len == 1 and ops.native_cpu_available():
        selection = all_blocks(host, host.num_kv_heads)  # the compiled kernel over every live block
    if selection.kind != "all" and ops.native_cpu_available():
        # the compiled kernel splits (request, head, chunk) work over its own threads
        return ops.sparse_attention_lse(
            q_host,
            host.keys,
            host.values,
            selection.indices,
            selection.lengths,
            scale,
            key_mask=host.valid,
            block_size=selection.block_size,
            num_threads=threads,
            **host.scales(),
        )
    out = torch.zeros(batch, num_q_heads, q_len, head_dim)
    lse = torch.full((batch, num_q_heads, q_len), float("-inf"))
    group = num_q_heads // host.num_kv_heads
    keys, values, valid = host.live()

    def piece(b: int, h0: int, h1: int) -> None:
        qs = q_host[b : b + 1, h0 * group : h1 * group]
        if selection.kind == "all":
            o_part, lse_part = dense_lse_chunked(
                qs, keys[b : b + 1, h0:h1], values[b : b + 1, h0:h1], scale, valid[b : b + 1]
            )
        else:
            o_part, lse_part = ops.sparse_attention_lse(
                qs,
                host.keys[b : b + 1, h0:h1],
                host.values[b : b + 1, h0:h1],
                selection.indices[b : b + 1, h0:h1],
                selection.lengths[b : b + 1, h0:h1],
                scale,
                key_mask=host.valid[b : b + 1],
                block_size=selection.block_size,
                **{name: t[b : b + 1, h0:h1] for name, t in host.scales().items()},
            )
        out[b : b + 1, h0 * group : h1 * group] = o_part
        lse[b : b + 1, h0 * group : h1 * group] = lse_part

    pool.run(batch, host.num_kv_heads, piece)
    return out, lse


def live_blocks(host) -> int:
    """Blocks holding the host tier's live rows (the last one may be partly padding)."""
    return min(-(-host.rows // host.block_size), host.capacity // host.block_size)


def all_blocks(host, num_kv_heads: int, width: int | None = None) -> Selection:
    """Every live block of the host tier as a block selection: ids 0 .. width - 1 per (request, KV head), the
    live block count as each length (padding rows are masked by the valid flags). `width` defaults to the live
    block count; a caller that keeps the selection across steps passes the capacity and refills `lengths`."""
    count = live_blocks(host)
    width = count if width is None else width
    ids = torch.arange(width, dtype=torch.long).expand(host.batch, num_kv_heads, width).contiguous()
    lengths = torch.full((host.batch, num_kv_heads), count, dtype=torch.long)
    return Selection("blocks", ids, lengths, host.block_size)


def _record_selection(layer, selection: Selection, device_rows: torch.Tensor | None = None) -> None:
    """Count this step's attended host rows: the CPU's `selection`, plus `device_rows` [B, Hkv] read by the
    compute device itself (a device share, counted apart in `rows_attended_device` too)."""
    host = layer.host
    attended = selection.attended_rows(host.rows, host.batch, host.num_kv_heads)  # [B, Hkv]
    if device_rows is not None:
        attended = attended + device_rows
        layer.rows_attended_device += int(device_rows.sum())
    available = host.valid_rows()[:, None].expand_as(attended)
    layer.rows_attended += int(torch.minimum(attended, available).sum())
    layer.rows_available += int(available.sum())
    layer.decode_steps += 1


def _record_counts(layer, attended: int, device: int, available: int) -> None:
    """`_record_selection` from totals a compiled call counted itself (`cpu.RankedAttention`)."""
    layer.rows_attended += attended
    layer.rows_attended_device += device
    layer.rows_available += available
    layer.decode_steps += 1


def dense_lse_chunked(q, k, v, scale, key_mask, key_chunk: int = KEY_CHUNK):
    """Dense attention with LSE over many keys, `key_chunk` at a time (online merge).

    key_mask: [B, T] or [B, Lq, T] bool, or a callable (k0, k1) -> mask of keys [k0, k1).
    """
    total = k.shape[2]
    out = lse = None
    for k0 in range(0, total, key_chunk):
        k1 = min(total, k0 + key_chunk)
        if callable(key_mask):
            mask = key_mask(k0, k1)
        else:
            mask = key_mask[..., k0:k1] if key_mask is not None else None
        o_part, lse_part = ops.attention_lse(q, k[:, :, k0:k1], v[:, :, k0:k1], scale, mask)
        out, lse = (o_part, lse_part) if out is None else ops.merge_lse(out, lse, o_part, lse_part)
    if out is None:
        shape = q.shape
        return torch.zeros(shape, device=q.device), torch.full(shape[:-1], float("-inf"), device=q.device)
    return out, lse
