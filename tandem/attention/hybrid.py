"""Hybrid attention for one layer: dense over the hot tier on its device, sparse over the host tier on the CPU,
merged exactly by log-sum-exp. Decode (one query per request) and prefill/append (many) share the cache.

Decode step:      `rows.decode_attention`: new KV into the hot tier, hot attention on the device while the CPU
                  selects (policy) and attends host rows, merge. Only q, the CPU output and its LSE cross.
First prefill:    dense causal attention over the prompt on the device in query chunks (no LSE needed: nothing
                  is cached yet), then the prompt's KV goes to the cache, overflow straight to the host tier.
Append (a new prompt turn, or the next chunk of a chunked prefill): exact attention over everything cached
                  (hot + all host rows) plus causal attention within the new tokens; then the policy
                  re-evaluates (hgca). With the hot tier on a GPU the host rows stream to the GPU in pieces
                  for this (a prefill chunk has thousands of queries: too much arithmetic for the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import gpu, ops
from ..policies import ALL
from .host import KEY_CHUNK, dense_lse_chunked, host_attention
from .rows import decode_attention
from .tasks import TaskPool

FLASH_KEY_CHUNK = 16384  # host rows per piece streamed to the GPU for the flash-style exact append
# A prefill chunk's host rows go through cuDNN's fused attention (`ops.fused_attention_lse`, 2.2x the Triton
# kernel's rate on an H200) in calls of these row counts, the largest that fit first, with the chunk's queries
# padded to a multiple of FUSED_QUERY_STEP: cuDNN plans each new shape or stride layout before it first runs it
# (40-60 ms), so its calls keep to a few shapes. The rows left under the smallest, and chunks of fewer than
# FUSED_MIN_QUERIES queries, run on the Triton kernel. A process's first call loads cuDNN's engine (0.8 s), more
# than a 32K prompt can gain (at most 0.15 s of 2 s): it is made once the host rows reach FUSED_MIN_HOST_ROWS, and
# from then on for any chunk (a server's later prompts).
FUSED_PIECES = (16384, 8192, 4096, 2048)
FUSED_QUERY_STEP = 512
FUSED_MIN_QUERIES = 1024
FUSED_MIN_HOST_ROWS = 32768


def attend(layer, q, k_new, v_new, valid_new, scale: float, pool: TaskPool, context=None) -> torch.Tensor:
    """Attention of `q` over everything cached in `layer` plus the new tokens, which it then caches.

    q:         [B, Hq, Lq, D]   on the hot tier's device
    k_new:     [B, Hkv, Lq, D]  keys/values of the same Lq new tokens (RoPE applied)
    valid_new: [B, Lq] bool     False for padding tokens
    context:   a fixed-address decode step's `StepContext` (one new token each, its slot reserved), or None
    Returns [B, Hq, Lq, D] in q's dtype.
    """
    if q.shape[2] == 1 and (context is not None or (layer.initialized and layer.seq_len > 0)):
        out = decode_attention([layer], q, k_new, v_new, valid_new, scale, [pool], [context])
    else:
        out = _append(layer, q, k_new, v_new, valid_new, scale, pool)
    return out.to(q.dtype)


# ---- dense helpers --------------------------------------------------------------------------------------------
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
    if layer.policy.needs_anchor and layer.observe_appends:
        layer.policy.on_anchor(layer, q[:, :, -1], scale)  # the prompt's last query: fluxion's anchor q'
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


def flash_prefill_available(q: torch.Tensor) -> bool:
    """Whether the exact append path runs `gpu.prefill_attention` (CUDA with Triton) instead of the reference
    kernel with materialised logits (tests switch it on for CPU tensors under Triton's interpreter)."""
    return q.is_cuda and gpu.triton_available(q.device)


def _append_exact(layer, q, k_new, v_new, valid_new, scale, pool):
    hot = layer.hot
    q_len = q.shape[2]
    chunk = layer.config.prefill_chunk
    on_device = q.is_cuda
    layer.host.wait()
    if flash_prefill_available(q):
        return _append_exact_flash(layer, q, k_new, v_new, valid_new, scale)
    outs = []
    unpadded = not on_device and bool(valid_new.all())  # read on the host: no wait for a device
    for s in range(0, q_len, chunk):
        e = min(q_len, s + chunk)
        qc = q[:, :, s:e]
        if s == 0 and unpadded:  # the first queries over their own keys: causal, no mask to build
            out, lse = ops.causal_attention_lse(qc, k_new[:, :, :e], v_new[:, :, :e], scale)
        else:
            out, lse = dense_lse_chunked(
                qc,
                k_new[:, :, :e],
                v_new[:, :, :e],
                scale,
                lambda k0, k1, s=s, e=e: causal_mask(valid_new, s, e, k0, k1),
            )
        o_part, lse_part = ops.attention_lse(qc, hot.keys, hot.values, scale, hot.valid)
        out, lse = ops.merge_lse(out, lse, o_part, lse_part)
        if not on_device and layer.split is None:
            o_part, lse_part = host_attention(layer, qc, ALL, scale, pool)
            out, lse = ops.merge_lse(out, lse, o_part, lse_part)
        outs.append((out, lse))
    if (on_device or layer.split is not None) and layer.host.rows:
        # (with a request split the host rows of this rank's heads come back from the ranks that hold them)
        outs = _host_rows_on_device(layer, q, outs, scale)
    return torch.cat([out for out, _ in outs], dim=2)


def _append_exact_flash(layer, q, k_new, v_new, valid_new, scale):
    """`_append_exact` with the flash-style kernel: all queries at once (no logits are materialised, so no query
    chunks), each part merged into the running (out, lse) in place: the new tokens (causal), the hot tier, then
    the host rows streamed to the GPU in FLASH_KEY_CHUNK-row pieces."""
    hot = layer.hot
    out, lse = gpu.prefill_attention(
        q, k_new, v_new, scale, key_valid=valid_new, causal_offset=0
    )  # query i is new token i
    gpu.prefill_attention(
        q, hot.keys, hot.values, scale, key_valid=hot.valid, out=out, lse=lse, accumulate=True
    )
    if layer.host.rows:
        q_fused = _fused_queries(layer, q)
        for keys, values, valid in _host_pieces(layer, q.device, FLASH_KEY_CHUNK):
            done = 0 if q_fused is None else _fused_rows(q_fused, keys, values, scale, out, lse)
            if done < keys.shape[2]:
                part = slice(done, None)
                gpu.prefill_attention(
                    q, keys[:, :, part], values[:, :, part], scale, key_valid=valid[:, part], out=out, lse=lse,
                    accumulate=True,
                )  # fmt: skip
    return out


def _fused_queries(layer, q):
    """`q` as the fused kernel takes it for the layer's host rows (contiguous, padded with zero queries to a
    multiple of FUSED_QUERY_STEP, so that its shapes are few), or None where the Triton kernel attends them all:
    fewer than FUSED_MIN_QUERIES queries, no fused kernel for q's device and dtype, a request split, fewer than
    FUSED_MIN_HOST_ROWS host rows while the kernel has not run in this process, or a host row that is not a real
    token (padding needs the Triton kernel's key mask; read on the host tier's flags in host memory, so nothing
    waits for the device)."""
    host = layer.host
    q_len = q.shape[2]
    if (
        q_len < FUSED_MIN_QUERIES
        or layer.split is not None
        or not ops.fused_attention_runs(q.device, q.dtype)
    ):
        return None
    if host.rows < FUSED_MIN_HOST_ROWS and not ops.fused_attention_ran(q.device, q.dtype):
        return None
    if host.valid.is_cuda or not bool(host.valid[:, : host.rows].all()):
        return None
    padded = -(-q_len // FUSED_QUERY_STEP) * FUSED_QUERY_STEP
    q_fused = q.new_zeros(q.shape[0], q.shape[1], padded, q.shape[3])
    q_fused[:, :, :q_len] = q
    return q_fused


def _fused_rows(q_fused, keys, values, scale: float, out, lse) -> int:
    """The leading rows of one host piece (keys / values [B, Hkv, n, D]) attended by the fused kernel in calls of
    FUSED_PIECES rows, each copied to a dense layout (a view's strides would be a new layout to plan) and merged
    into (out, lse) in place. Returns the rows done: the rest lie under the smallest piece, or the kernel
    declined."""
    q_len, done, total = out.shape[2], 0, keys.shape[2]
    for size in FUSED_PIECES:
        while total - done >= size:
            rows = slice(done, done + size)
            part = ops.fused_attention_lse(
                q_fused, keys[:, :, rows].contiguous(), values[:, :, rows].contiguous(), scale
            )
            if part is None:
                return done
            ops.merge_lse_(out, lse, part[0][:, :, :q_len].float(), part[1][:, :, :q_len])
            done += size
    return done


def _host_pieces(layer, device, key_chunk: int = KEY_CHUNK):
    """(keys, values, valid) of the live host rows in the model's dtype, `key_chunk` rows at a time, on `device`
    (from the prompt's device copy where the layer keeps one, `LayerKV.keep_prompt_rows`)."""
    return layer.host_pieces(device, key_chunk)


def _host_rows_on_device(layer, q, outs, scale):
    """Merge attention over every host row into each query chunk's (out, lse); each host piece is copied once."""
    chunk = layer.config.prefill_chunk
    outs = list(outs)
    for keys, values, valid in _host_pieces(layer, q.device):
        for i, (out, lse) in enumerate(outs):
            s = i * chunk
            o_part, lse_part = ops.attention_lse(q[:, :, s : s + out.shape[2]], keys, values, scale, valid)
            outs[i] = ops.merge_lse(out, lse, o_part, lse_part)
    return outs


def _observe(layer, q, scale) -> None:
    """HGCA after a prefill/append: the last prompt tokens' mean attention weight over each tier (normalized
    within the tier) restarts every entry's MAW, and the policy re-selects host entries (re-evaluation).

    Skipped while `layer.observe_appends` is False (chunks of a chunked prefill before the last: the last
    chunk's observation overwrites every MAW anyway)."""
    if not layer.observe_appends:
        return
    hot, host = layer.hot, layer.host
    q_obs = q[:, :, -layer.config.hgca.observation_tokens :]
    hot.maw.copy_(observation_weights(q_obs, tier_pieces(hot.keys, hot.valid), scale))
    if host.rows:
        host.wait()
        # the host keys stream to the query's device piece by piece; only the weights come back
        pieces = ((keys, valid) for keys, _, valid in _host_pieces(layer, q.device))
        weights = observation_weights(q_obs, pieces, scale).to("cpu")
        layer.policy.on_append(layer, weights)


def observation_weights(q_obs, pieces, scale) -> torch.Tensor:
    """Mean over the observation queries of softmax(q.k) restricted to the keys of `pieces`, an iterable of
    (keys [B, Hkv, n, D], valid [B, n]) on q_obs's device: [B, Hq, total n] float32."""
    batch, num_q_heads, _, _ = q_obs.shape
    chunks, lses = [], []
    for keys, valid in pieces:
        _, chunk_lse, w = ops.attention_lse(q_obs, keys, keys, scale, valid, return_weights=True)
        chunks.append(w)  # normalized within the chunk
        lses.append(chunk_lse)
    if not chunks:
        return torch.zeros(batch, num_q_heads, 0, device=q_obs.device)
    lse_all = torch.logsumexp(torch.stack(lses), dim=0)  # [B, Hq, Lobs]
    lse_all = torch.where(torch.isfinite(lse_all), lse_all, torch.zeros_like(lse_all))
    parts = [w * torch.exp(c - lse_all)[..., None] for w, c in zip(chunks, lses)]
    return torch.cat(parts, dim=-1).mean(dim=2)


def tier_pieces(keys, valid, key_chunk: int = KEY_CHUNK):
    """(keys, valid) of a tier already on the query's device, `key_chunk` rows at a time (bounds the logits)."""
    for k0 in range(0, keys.shape[2], key_chunk):
        yield keys[:, :, k0 : k0 + key_chunk], valid[:, k0 : k0 + key_chunk]
