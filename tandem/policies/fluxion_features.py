"""The 41 head features of Fluxion's predictor (Fluxion Appendix A), computed the same way for calibration
(from a model's captured keys and values) and online (from the cache's tiers).

A layer's KV is split into three segments: sinks and the local window (held on the compute device: the hot
segment) and the host (CPU) segment. Everything about the host segment is computed once per prompt, with the
prompt's last query q' as the anchor (`anchor_stats`, Appendix A.2), so a decode step never reads host KV for
its features; `step_features` adds what the current query q says about the device-resident segments.

Each segment is `(keys [B, Hkv, T, D], values [B, Hkv, T, D], mask [B, T] bool)`; queries are [B, Hq, D].
Lengths enter as log2(1 + rows), LSEs and norms as they are; the predictor standardises every feature with
its training statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import reference
from .fluxion_search import SELECTION_BLOCKS, min_budgets

NUM_FEATURES = 41
FEATURE_NAMES = (
    # structural (4)
    "layer", "head", "log_cpu_rows", "log_gpu_rows",
    # KV distribution (12)
    "k_sink_norm", "v_sink_norm", "k_cpu_mean_norm", "v_cpu_mean_norm",
    "k_cpu_norm_mean", "k_cpu_norm_var", "k_cpu_norm_skew", "k_cpu_norm_kurt",
    "v_cpu_norm_mean", "v_cpu_norm_var", "v_cpu_norm_skew", "v_cpu_norm_kurt",
    # QK interaction (5)
    "z_q_mean_key", "z_anchor_mean", "z_anchor_var", "z_anchor_skew", "z_anchor_kurt",
    # attention contribution (11)
    "lse_sink_q", "lse_cpu_q_approx", "lse_local_q", "lse_sink_anchor", "lse_cpu_anchor", "lse_local_anchor",
    "out_sink_q", "out_local_q", "out_sink_anchor", "out_cpu_anchor", "out_local_anchor",
    # query dynamics (3)
    "q_norm", "anchor_norm", "q_anchor_cos",
    # budget estimation (4): Eq. 2 budgets of the anchor query at each selectable block size
    "anchor_budget_16", "anchor_budget_32", "anchor_budget_64", "anchor_budget_128",
    # cross-head (2)
    "max_gpu_out_q", "max_gpu_out_anchor",
)  # fmt: skip
EMPTY_LSE = -60.0  # an empty segment's LSE, finite so the features stay usable


def _moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean, variance, skewness and excess kurtosis of x [..., T] over the True entries of mask (broadcast
    to x): [..., 4]. Zero where fewer than two entries count."""
    m = mask.expand_as(x).float()
    n = m.sum(-1).clamp_min(1.0)
    mean = (x * m).sum(-1) / n
    centred = (x - mean[..., None]) * m
    var = (centred**2).sum(-1) / n
    std = var.sqrt().clamp_min(1e-12)
    skew = (centred**3).sum(-1) / n / std**3
    kurt = (centred**4).sum(-1) / n / std**4 - 3.0
    out = torch.stack([mean, var, skew, kurt], dim=-1)
    return out.where((m.sum(-1) >= 2)[..., None], torch.zeros_like(out))


def _mean_row_norm(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over real rows of each row's L2 norm: x [B, H, T, D], mask [B, T] -> [B, H]."""
    m = mask[:, None, :].float()
    return (x.float().norm(dim=-1) * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, H, D] mean over real rows."""
    m = mask[:, None, :, None].float()
    return (x.float() * m).sum(2) / m.sum(2).clamp_min(1.0)


def segment_attention(q: torch.Tensor, segment, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, Hq, D] over one segment: (out [B, Hq, D], lse [B, Hq]); an empty segment gives
    (0, -inf)."""
    keys, values, mask = segment
    out, lse = reference.attention_lse(q[:, :, None], keys, values, scale, mask)
    return out[:, :, 0], lse[:, :, 0]


def hot_attention(q: torch.Tensor, sink, local, scale: float):
    """Attention over sinks and local window together (the device's part, O_gpu), merged from the two segments'
    own results: ((out_sink, lse_sink), (out_local, lse_local), out_gpu)."""
    (o_sink, lse_sink), (o_local, lse_local) = (segment_attention(q, seg, scale) for seg in (sink, local))
    gpu_out, _ = reference.merge_lse(o_sink, lse_sink, o_local, lse_local)
    return (o_sink, lse_sink), (o_local, lse_local), gpu_out


def join_segments(a, b):
    """Two segments as one: keys and values along their rows, masks along theirs."""
    return (torch.cat([a[0], b[0]], dim=2), torch.cat([a[1], b[1]], dim=2), torch.cat([a[2], b[2]], dim=1))


def _finite_lse(lse: torch.Tensor) -> torch.Tensor:
    return lse.nan_to_num(neginf=EMPTY_LSE).clamp_min(EMPTY_LSE)


def _per_query_head(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, Hkv, ...] -> [B, Hq, ...]: each query head takes its KV head's value."""
    return x.repeat_interleave(num_q_heads // x.shape[1], dim=1)


@dataclass
class AnchorStats:
    """What Appendix A.2 caches at the end of a prompt, for one layer; shapes per request B and head."""

    kv_stats: torch.Tensor  # [B, Hq, 12] the KV distribution features
    k_cpu_mean: torch.Tensor  # [B, Hq, D] mean host key (for <q, MEAN(K_cpu)> at each step)
    z_moments: torch.Tensor  # [B, Hq, 4] moments of z(q') over host keys
    lse: torch.Tensor  # [B, Hq, 3] LSE of q' over sink, cpu, local
    out_norm: torch.Tensor  # [B, Hq, 3] ||O_seg(q')|| over sink, cpu, local
    query: torch.Tensor  # [B, Hq, D] q'
    budgets: torch.Tensor  # [B, Hq, len(SELECTION_BLOCKS), len(taus)] Eq. 2 budgets of q'
    max_gpu_out: torch.Tensor  # [B] max over heads of ||O_gpu(q')||, sinks + local


def anchor_stats(q: torch.Tensor, sink, cpu, local, scale: float, taus: tuple[float, ...]) -> AnchorStats:
    """Appendix A.2's cached prefill statistics of one layer, from the anchor query q' [B, Hq, D]."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    k_cpu, v_cpu, m_cpu = cpu
    k_norms = k_cpu.float().norm(dim=-1)  # [B, Hkv, T]
    v_norms = v_cpu.float().norm(dim=-1)
    k_mean = _masked_mean(k_cpu, m_cpu)
    kv = torch.cat(
        [
            _mean_row_norm(sink[0], sink[2])[..., None],
            _mean_row_norm(sink[1], sink[2])[..., None],
            k_mean.norm(dim=-1)[..., None],
            _masked_mean(v_cpu, m_cpu).norm(dim=-1)[..., None],
            _moments(k_norms, m_cpu[:, None, :]),
            _moments(v_norms, m_cpu[:, None, :]),
        ],
        dim=-1,
    )  # [B, Hkv, 12]
    batch, num_kv_heads = k_cpu.shape[:2]
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    q_norm = q.float().norm(dim=-1).clamp_min(1e-12)  # [B, Hq]
    z = torch.einsum("bhgd,bhtd->bhgt", qg, k_cpu.float()).reshape(batch, num_q_heads, -1) * scale
    z = z / q_norm[..., None]
    (o_sink, lse_sink), (o_local, lse_local), gpu_out = hot_attention(q, sink, local, scale)
    o_cpu, lse_cpu = segment_attention(q, cpu, scale)
    outs, lses = (o_sink, o_cpu, o_local), (lse_sink, lse_cpu, lse_local)
    budgets, _ = min_budgets(q, join_segments(sink, local), cpu, scale, SELECTION_BLOCKS, taus)
    return AnchorStats(
        kv_stats=_per_query_head(kv, num_q_heads),
        k_cpu_mean=_per_query_head(k_mean, num_q_heads),
        z_moments=_moments(z, m_cpu[:, None, :]),
        lse=_finite_lse(torch.stack(lses, dim=-1)),
        out_norm=torch.stack([o.norm(dim=-1) for o in outs], dim=-1),
        query=q.float(),
        budgets=budgets,
        max_gpu_out=gpu_out.norm(dim=-1).amax(dim=-1),
    )


def step_features(
    layer_idx: int,
    q: torch.Tensor,
    anchor: AnchorStats,
    sink,
    local,
    cpu_rows: torch.Tensor,
    scale: float,
    tau_index: int,
) -> torch.Tensor:
    """The 41 features of every head of one layer at one decode step: [B, Hq, 41] float32.

    q: [B, Hq, D] the current query; sink, local: the device-resident segments now (local includes the tokens
    generated so far); cpu_rows: [B] real rows in the host segment now; tau_index: which of the anchor's
    thresholds the budget features use.
    """
    batch, num_q_heads, head_dim = q.shape
    qf = q.float()
    q_norm = qf.norm(dim=-1).clamp_min(1e-12)
    (o_sink, lse_sink), (o_local, lse_local), gpu_out = hot_attention(q, sink, local, scale)
    gpu_rows = sink[2].sum(-1) + local[2].sum(-1)  # [B]
    mu = (qf * anchor.k_cpu_mean).sum(-1) * scale / q_norm  # <q, MEAN(K_cpu)> / (||q|| sqrt(D))
    sigma2 = anchor.z_moments[..., 1]
    log_rows = torch.log(cpu_rows.float().clamp_min(1.0))[:, None]
    lse_cpu = torch.where(cpu_rows[:, None] > 0, log_rows + q_norm * mu + 0.5 * q_norm**2 * sigma2,
                          torch.full_like(mu, EMPTY_LSE))  # fmt: skip
    cos = (qf * anchor.query).sum(-1) / (q_norm * anchor.query.norm(dim=-1).clamp_min(1e-12))
    per_head = lambda x: x[:, None].expand(batch, num_q_heads)  # noqa: E731
    heads = torch.arange(num_q_heads, dtype=torch.float32, device=q.device)
    columns = [
        torch.full((batch, num_q_heads), float(layer_idx), device=q.device),
        heads[None].expand(batch, -1),
        per_head(torch.log2(1.0 + cpu_rows.float())),
        per_head(torch.log2(1.0 + gpu_rows.float())),
        *anchor.kv_stats.unbind(-1),
        mu,
        *anchor.z_moments.unbind(-1),
        _finite_lse(lse_sink),
        lse_cpu.clamp_min(EMPTY_LSE),
        _finite_lse(lse_local),
        *anchor.lse.unbind(-1),
        o_sink.norm(dim=-1),
        o_local.norm(dim=-1),
        *anchor.out_norm.unbind(-1),
        q_norm,
        anchor.query.norm(dim=-1),
        cos,
        *anchor.budgets[..., tau_index].unbind(-1),
        per_head(gpu_out.norm(dim=-1).amax(dim=-1)),
        per_head(anchor.max_gpu_out),
    ]
    features = torch.stack(columns, dim=-1)
    assert features.shape[-1] == NUM_FEATURES
    return features
