"""Hybrid attention for one layer: dense over the hot tier on its device, sparse over the host tier on the CPU,
merged exactly by log-sum-exp. Decode (one query per request) and prefill/append (many) share the cache.

Decode step:      append new KV -> hot attention (device) -> select host rows (policy) -> host attention (CPU)
                  -> merge. Only q, the CPU output and its LSE cross between devices.
First prefill:    dense causal attention over the prompt on the device in query chunks (no LSE needed: nothing
                  is cached yet), then the prompt's KV goes to the cache, overflow straight to the host tier.
Append (a new prompt turn on a non-empty cache): exact attention over everything cached (hot + all host rows)
                  plus causal attention within the new tokens; then the policy re-evaluates (hgca).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import ops
from ..policies import ALL, Selection
from .tasks import TaskPool

KEY_CHUNK = 4096  # keys per step of the chunked dense paths: bounds the logits buffer


def attend(layer, q, k_new, v_new, valid_new, scale: float, pool: TaskPool) -> torch.Tensor:
    """Attention of `q` over everything cached in `layer` plus the new tokens, which it then caches.

    q:         [B, Hq, Lq, D]   on the hot tier's device
    k_new:     [B, Hkv, Lq, D]  keys/values of the same Lq new tokens (RoPE applied)
    valid_new: [B, Lq] bool     False for padding tokens
    Returns [B, Hq, Lq, D] in q's dtype.
    """
    if layer.initialized and layer.seq_len > 0 and q.shape[2] == 1:
        out = _decode(layer, q, k_new, v_new, valid_new, scale, pool)
    else:
        out = _append(layer, q, k_new, v_new, valid_new, scale, pool)
    return out.to(q.dtype)


# ---- decode -------------------------------------------------------------------------------------------------
def _decode(layer, q, k_new, v_new, valid_new, scale, pool):
    layer.append(k_new, v_new, valid_new)
    hot, host, policy = layer.hot, layer.host, layer.policy
    if policy.needs_maw:
        out_gpu, lse_gpu, weights = ops.attention_lse(
            q, hot.keys, hot.values, scale, hot.valid, return_weights=True
        )
        alpha = layer.config.maw_alpha
        hot.maw.mul_(1.0 - alpha).add_(weights[:, :, 0], alpha=alpha)  # Algorithm 1, line 8
    else:
        out_gpu, lse_gpu = ops.attention_lse(q, hot.keys, hot.values, scale, hot.valid)
    if host.rows == 0:
        return out_gpu
    q_host = q.to("cpu")
    host.wait()  # blocks evicted on a side stream must have landed before the CPU reads them
    selection = policy.select(layer, q_host)
    out_cpu, lse_cpu = host_attention(layer, q_host, selection, scale, pool)
    _record_selection(layer, selection)
    out, _ = ops.merge_lse(out_gpu, lse_gpu, out_cpu.to(q.device), lse_cpu.to(q.device))
    return out


def host_attention(layer, q_host: torch.Tensor, selection: Selection, scale: float, pool: TaskPool):
    """Attention of q_host [B, Hq, Lq, D] (CPU) over the host rows named by `selection`: (out, lse) fp32."""
    host = layer.host
    batch, num_q_heads, q_len, head_dim = q_host.shape
    out = torch.zeros(batch, num_q_heads, q_len, head_dim)
    lse = torch.full((batch, num_q_heads, q_len), float("-inf"))
    if selection.kind == "none" or host.rows == 0:
        return out, lse
    threads = layer.config.cpu_threads
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
        )
    group = num_q_heads // layer.num_kv_heads
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
            )
        out[b : b + 1, h0 * group : h1 * group] = o_part
        lse[b : b + 1, h0 * group : h1 * group] = lse_part

    pool.run(batch, layer.num_kv_heads, piece)
    return out, lse


def _record_selection(layer, selection: Selection) -> None:
    host = layer.host
    attended = selection.attended_rows(host.rows, host.batch, layer.num_kv_heads)  # [B, Hkv]
    available = host.valid_rows()[:, None].expand_as(attended)
    layer.rows_attended += int(torch.minimum(attended, available).sum())
    layer.rows_available += int(available.sum())
    layer.decode_steps += 1


# ---- dense helpers --------------------------------------------------------------------------------------------
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


def causal_mask(valid: torch.Tensor, q_start: int, q_end: int, k_start: int, k_end: int) -> torch.Tensor:
    """[B, Lq, Lk] bool for new tokens: key <= query and key not padding. A padding query still attends
    itself so no row is empty (its output is never used, but must stay finite)."""
    qpos = torch.arange(q_start, q_end, device=valid.device)[:, None]
    kpos = torch.arange(k_start, k_end, device=valid.device)[None, :]
    mask = (kpos <= qpos)[None] & valid[:, None, k_start:k_end]
    return mask | (kpos == qpos)[None]


# ---- prefill / append -----------------------------------------------------------------------------------------
def _append(layer, q, k_new, v_new, valid_new, scale, pool):
    first = not layer.initialized or layer.seq_len == 0
    if first:
        out = _prefill_dense(q, k_new, v_new, valid_new, scale, layer.config.prefill_chunk)
    else:
        out = _append_exact(layer, q, k_new, v_new, valid_new, scale, pool)
    layer.append(k_new, v_new, valid_new)
    if layer.policy.needs_maw:
        _observe(layer, q, scale)
    return out


def _prefill_dense(q, k, v, valid, scale, chunk):
    """Causal attention of a first prompt on its device, `chunk` queries at a time (fused SDPA kernels)."""
    q_len = q.shape[2]
    if q_len <= chunk and bool(valid.all()):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    outs = []
    for s in range(0, q_len, chunk):
        e = min(q_len, s + chunk)
        mask = causal_mask(valid, s, e, 0, e)[:, None]  # [B, 1, c, e]
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, :e], v[:, :, :e], attn_mask=mask, scale=scale, enable_gqa=True
            )
        )
    return torch.cat(outs, dim=2)


def _append_exact(layer, q, k_new, v_new, valid_new, scale, pool):
    hot = layer.hot
    q_len = q.shape[2]
    chunk = layer.config.prefill_chunk
    q_host = q.to("cpu")
    layer.host.wait()
    outs = []
    for s in range(0, q_len, chunk):
        e = min(q_len, s + chunk)
        qc = q[:, :, s:e]
        out, lse = dense_lse_chunked(
            qc,
            k_new[:, :, :e],
            v_new[:, :, :e],
            scale,
            lambda k0, k1, s=s, e=e: causal_mask(valid_new, s, e, k0, k1),
        )
        o_part, lse_part = ops.attention_lse(qc, hot.keys, hot.values, scale, hot.valid)
        out, lse = ops.merge_lse(out, lse, o_part, lse_part)
        o_part, lse_part = host_attention(layer, q_host[:, :, s:e], ALL, scale, pool)
        out, _ = ops.merge_lse(out, lse, o_part.to(q.device), lse_part.to(q.device))
        outs.append(out)
    return torch.cat(outs, dim=2)


def _observe(layer, q, scale) -> None:
    """HGCA after a prefill/append: the last prompt tokens' mean attention weight over each tier (normalized
    within the tier) restarts every entry's MAW, and the policy re-selects host entries (re-evaluation)."""
    hot, host = layer.hot, layer.host
    q_obs = q[:, :, -layer.config.observation_tokens :]
    hot.maw.copy_(observation_weights(q_obs, hot.keys, hot.valid, scale))
    if host.rows:
        host.wait()
        keys, _, valid = host.live()
        weights = observation_weights(q_obs.to("cpu"), keys, valid, scale)
        layer.policy.on_append(layer, weights)


def observation_weights(q_obs, keys, valid, scale, key_chunk: int = KEY_CHUNK) -> torch.Tensor:
    """Mean over the observation queries of softmax(q.k) restricted to `keys`: [B, Hq, T] float32."""
    batch, num_q_heads, _, _ = q_obs.shape
    total = keys.shape[2]
    chunks, lses = [], []
    for k0 in range(0, total, key_chunk):
        k1 = min(total, k0 + key_chunk)
        ks = keys[:, :, k0:k1]
        _, chunk_lse, w = ops.attention_lse(q_obs, ks, ks, scale, valid[:, k0:k1], return_weights=True)
        chunks.append(w)  # normalized within the chunk
        lses.append(chunk_lse)
    lse_all = torch.logsumexp(torch.stack(lses), dim=0)  # [B, Hq, Lobs]
    lse_all = torch.where(torch.isfinite(lse_all), lse_all, torch.zeros_like(lse_all))
    parts = [w * torch.exp(c - lse_all)[..., None] for w, c in zip(chunks, lses)]
    return torch.cat(parts, dim=-1).mean(dim=2) if parts else torch.zeros(batch, num_q_heads, 0)
