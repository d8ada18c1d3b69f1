"""A calibrated profile replayed on another model shape, for speed runs on random weights.

Random weights make a predictor's inputs meaningless, so `tandem bench` times `fluxion` with the static per-head
budgets and streaming labels that calibration measured on a real model, mapped onto the benchmarked shape: a
target layer takes the source layer at the same relative depth, and a target head the source head at the same
place in its GQA group (group index and in-group index, each modulo the source's counts). The budgets are shares
of the host tier, so they carry over to any context length as shares.
"""

from __future__ import annotations

import torch

from ...policies.fluxion_profile import Profile


def replay_profile(
    source: Profile, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> Profile:
    """`source`'s static profiles (every tau) mapped onto a model of the given shape; no predictor."""
    meta = source.meta
    src_layers, src_heads, src_kv = meta["layers"], meta["q_heads"], meta["kv_heads"]
    src_group, group = src_heads // src_kv, num_q_heads // num_kv_heads
    layer_map = torch.tensor([layer * src_layers // num_layers for layer in range(num_layers)])
    heads = torch.arange(num_q_heads)
    head_map = (heads // group % src_kv) * src_group + heads % group % src_group
    static = {}
    for key, table in source.static.items():
        static[key] = {
            name: table[name][layer_map][:, head_map].clone()
            for name in ("bgt0", "k", "streaming", "streaming_share_measured")
        }
    replayed_meta = dict(
        meta,
        model=f"replay of {meta.get('model', '?')}",
        replayed_from=meta.get("model", "?"),
        layers=num_layers,
        q_heads=num_q_heads,
        kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    return Profile(replayed_meta, static, {}, {"replayed_from_metrics": source.metrics})


def replay_summary(profile: Profile, tau_key: str) -> dict:
    """What a replayed static profile asks of a step: the share of streaming heads and the mean budget at 16."""
    table = profile.static[tau_key]
    streaming = table["streaming"].float()
    budget16 = (table["bgt0"] + table["k"] * 4.0).clamp(0, 1) * (1 - streaming)
    return {"streaming_share": float(streaming.mean()), "mean_budget16": float(budget16.mean())}
