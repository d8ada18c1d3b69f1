"""Metrics: attention-output error of the sparse path against full attention on the same cache state.

The error follows Fluxion's Eq. 2: per layer, decode step and query head h,

    err_h = ||o_h(sparse) - o_h(full)||_2 / max_h' ||o_h'(full)||_2

where o(sparse) is what Tandem's hybrid attention returned and o(full) is exact attention of the same query over
every cached entry of the same layer (hot and host tiers), computed independently in float64. So the error is
zero for `full` up to float32 rounding, and measures only the selection, never drift from earlier steps.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ...integrations import hf

PROBE_NAME = "tandem_probe"


def reference_attention_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention in float64, and its log-sum-exp.

    query: [B, Hq, D]; keys, values: [B, Hkv, T, D]; key_mask: [B, T] bool. Returns ([B, Hq, D], [B, Hq]) float64.
    """
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    q = query.double().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    logits = torch.einsum("bhgd,bhtd->bhgt", q, keys.double()) * scale
    logits = logits.masked_fill(~key_mask[:, None, None, :], -math.inf)
    out = torch.einsum("bhgt,bhtd->bhgd", torch.softmax(logits, dim=-1), values.double())
    return out.reshape(batch, num_q_heads, head_dim), logits.logsumexp(-1).reshape(batch, num_q_heads)


def reference_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Exact attention in float64: `reference_attention_lse`'s output alone, [B, Hq, D]."""
    return reference_attention_lse(query, keys, values, key_mask, scale)[0]


def head_errors(sparse: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Fluxion Eq. 2. sparse, full: [B, Hq, D]. Returns [B, Hq] float64."""
    diff = (sparse.double() - full.double()).norm(dim=-1)
    peak = full.double().norm(dim=-1).amax(dim=-1, keepdim=True).clamp(min=1e-30)
    return diff / peak


def layer_full_attention_lse(kv, query: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of query [B, Hq, D] over everything a `LayerKV` holds (hot + host), and its log-sum-exp:
    ([B, Hq, D], [B, Hq]) float64 on the CPU."""
    hot, host = kv.hot, kv.host
    keys, values, mask = [hot.keys.cpu()], [hot.values.cpu()], [hot.valid.cpu()]
    if host is not None and host.rows:
        host.wait()
        host_keys, host_values, host_valid = host.live()
        keys.append(host_keys)
        values.append(host_values)
        mask.append(host_valid)
    return reference_attention_lse(
        query.cpu(), torch.cat(keys, dim=2), torch.cat(values, dim=2), torch.cat(mask, dim=1), scale
    )


def layer_full_attention(kv, query: torch.Tensor, scale: float) -> torch.Tensor:
    """`layer_full_attention_lse`'s output alone: [B, Hq, D] float64 on the CPU."""
    return layer_full_attention_lse(kv, query, scale)[0]


class AttentionProbe:
    """Wraps Tandem's attention function to record, on chosen decode steps, each layer's Eq. 2 error and the
    fraction of its host entries the policy attended.

    Use `with probe.attached(model):` around the decode loop (it registers the wrapper under 'tandem_probe' with
    transformers' public registries and restores 'tandem' after), and `probe.armed = True` for the steps to
    measure. `errors` collects one [num_layers, Hq] float64 tensor per measured step (batch averaged). With quest's
    certified selection (`epsilon`), `certified` collects the certified output bound of the same steps, divided by
    the same norm as the Eq. 2 error (so certified >= measured, head by head).

    Example:
        >>> probe = AttentionProbe(cache)
        >>> with probe.attached(model):
        ...     probe.armed = True
        ...     model(next_ids, **generate_cache_kwargs(model, cache))
        >>> probe.errors[-1].shape
        torch.Size([30, 9])
    """

    def __init__(self, cache: hf.TandemCache) -> None:
        self.cache = cache
        self.armed = False
        self.errors: list[torch.Tensor] = []
        self.certified: list[torch.Tensor] = []
        self.fractions: list[float] = []
        self._step: dict[int, torch.Tensor] = {}
        self._certified: dict[int, torch.Tensor] = {}
        self._rows: tuple[int, int] = (0, 0)

    @contextmanager
    def attached(self, model):
        previous = model.config._attn_implementation
        AttentionInterface.register(PROBE_NAME, self._attention)
        AttentionMaskInterface.register(PROBE_NAME, hf.tandem_mask)
        model.set_attn_implementation(PROBE_NAME)
        try:
            yield self
        finally:
            model.set_attn_implementation(previous)

    def begin_step(self) -> None:
        self._step, self._certified = {}, {}
        kvs = self.cache.tandem_layers()
        for kv in kvs:
            kv.collect_statistics()
        self._rows = (sum(kv.rows_attended for kv in kvs), sum(kv.rows_available for kv in kvs))

    def end_step(self) -> None:
        if not self.armed:
            return
        kvs = self.cache.tandem_layers()
        if len(self._step) != len(kvs):
            raise RuntimeError(
                f"probe saw {len(self._step)} of {len(kvs)} layers: is the model using the probe?"
            )
        self.errors.append(torch.stack([self._step[kv.layer_idx] for kv in kvs]))
        if len(self._certified) == len(kvs):
            self.certified.append(torch.stack([self._certified[kv.layer_idx] for kv in kvs]))
        for kv in kvs:
            kv.collect_statistics()
        attended = sum(kv.rows_attended for kv in kvs) - self._rows[0]
        available = sum(kv.rows_available for kv in kvs) - self._rows[1]
        if available:
            self.fractions.append(attended / available)

    def _attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out, weights = hf.tandem_attention(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        layer = self.cache.layers[module.layer_idx]
        if self.armed and query.shape[2] == 1 and not layer.is_sliding:  # a sliding layer attends exactly
            kv = layer.kv
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            full = layer_full_attention(kv, query[:, :, 0], scale)  # [B, Hq, D]
            self._step[module.layer_idx] = head_errors(out[:, 0].cpu(), full).mean(dim=0)
            certificate = getattr(kv.policy, "last_certificate", None)
            if certificate is not None:
                peak = full.norm(dim=-1).amax(dim=-1, keepdim=True).clamp(min=1e-30)
                self._certified[module.layer_idx] = (certificate[1].double().cpu() / peak).mean(dim=0)
        return out, weights


def perplexity(nll_sum: float, tokens: int) -> float:
    return math.exp(nll_sum / tokens) if tokens else math.nan
