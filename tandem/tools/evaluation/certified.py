"""Certificates against measurement: while a model decodes with a certified selection (quest's or fluxion's,
`TandemConfig.certified.epsilon`), record each layer's certificate at every step beside the measured truth, full
attention over every row the layer holds, in float64. Used by the soundness tests and by
`benchmarks/bench_certified.py` (tightness).

    with trace_certificates() as records:
        model.generate(...)                  # a TandemCache with epsilon
    records[i]: {"layer", "p_measured", "p_certified", "p_digest", "p_sketch", "p_box", "deviation", "bound",
                 "bound_digest", "bound_sketch", "bound_box", "met", "kept", "needed"}

"p_certified" is the certificate of the config's `certified.bound`; "p_digest" (box + ball), "p_sketch" (the int8
key sketch) and "p_box" (the box bound alone) are each bound's certificate over the same selection, and
"bound_<name>" its output bound. A selection of single rows (`certified.unit="row"`) has only the sketch's: the
block bounds cannot tell a block's attended rows from its skipped ones. "kept" is the share of the live host
units (rows or blocks) each KV head attended, "needed" the share each query head's certificate asked for before
`max_budget` (above it the head did not meet epsilon).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ...policies import certify
from ...policies.certified import Certifier, certified_mass, certified_row_mass, host_digests
from .metrics import layer_full_attention_lse


def full_attention_gap(layer, q: torch.Tensor, out: torch.Tensor, union: torch.Tensor, rows: bool = False):
    """(p, ||o_full - out||) per (request, query head), float64 on the CPU, for q [B, Hq, D] and the step's output
    out [B, Hq, D]: p is the exact share of full attention over every row `layer` holds that the host blocks
    outside `union` [B, Hkv, >= live blocks] bool hold (with `rows`, the host rows outside `union` [B, Hkv, >=
    live rows]), the attention the step skipped. It is summed in float64
    over the skipped rows themselves, not taken as 1 - (attended mass / full mass) with the kernel's fp32
    log-sum-exp, whose rounding (~1e-6 of the mass) would swamp a small p."""
    full_out, full_lse = layer_full_attention_lse(layer, q, layer.attention_scale)
    batch, num_q_heads, dim = q.shape
    host = layer.host
    keys, _, valid = host.live()
    num_kv_heads, n = keys.shape[1], keys.shape[2]
    qg = q.double().cpu().view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim)
    logits = (qg @ keys.double().cpu().transpose(-1, -2)) * layer.attention_scale  # [B, Hkv, G, n]
    if rows:
        attended = union.cpu()[:, :, :n]
    else:
        attended = union.cpu()[:, :, : n // host.block_size].repeat_interleave(host.block_size, dim=-1)
    skipped = ~attended[:, :, None] & valid.cpu()[:, None, None]  # [B, Hkv, 1, n]
    skipped_lse = logits.masked_fill(~skipped, -math.inf).logsumexp(-1)
    p = torch.exp(skipped_lse.view(batch, num_q_heads) - full_lse)
    return p, (full_out - out.double().cpu()).norm(dim=-1)


def sketch_mass(host, q: torch.Tensor, scale: float, nb: int) -> torch.Tensor:
    """The sketch bound's block mass [B, Hq, nb] (`certified_mass`), from the host tier's own sketch, or, where it
    keeps none (`certified.bound="digest"`), from one made here of its live keys (blocks past them: -inf)."""
    if host.key_codes_dev is not None:
        return certified_mass(host, q, scale, "sketch")[0]
    keys, _, valid = host.live()
    codes, row_scale, error = (t.to(q.device) for t in certify.key_sketch(keys, valid))
    upper, _ = certify.sketch_logit_bounds(q, codes, row_scale, error, valid.to(q.device), scale)
    mass = certify.sketch_mass_bounds(upper, host.block_size)
    return torch.nn.functional.pad(mass, (0, nb - mass.shape[-1]), value=-math.inf)


@contextlib.contextmanager
def trace_certificates(on_select=None):
    """Record every certified decode step of every layer (see the module doc) while the block runs.
    `on_select(layer, q)`, if given, sees each layer's decode query as its selection starts (analysis tools)."""
    records: list[dict] = []
    queries: dict[int, torch.Tensor] = {}
    select, after = Certifier.select, Certifier.after_attention

    def keep_query(self, layer, q, forced=None):
        queries[id(layer)] = q.clone()
        if on_select is not None:
            on_select(layer, queries[id(layer)])
        return select(self, layer, q, forced)

    def record(self, layer, out, lse):
        if self.step is not None:
            step = self.step
            q = queries[id(layer)]
            host, scale = layer.host, layer.attention_scale
            p_cert, bound = certify.certificate_from_tail(step.tail, step.skipped_norm, lse, out)
            if self.rows:  # the rows' own bounds, as the selection saw them
                mass, _, valid = certified_row_mass(host, q, scale)
                rows = valid.float()
                value_norm = host.value_norm_dev[:, :, : rows.shape[1] // host.block_size]
                value_norm = value_norm.repeat_interleave(host.block_size, dim=-1)
                masses = {"sketch": mass}
            else:
                key_min, key_max, _ = host_digests(host, q.device)
                mass, _, rows = certified_mass(host, q, scale, self.config.certified.bound)
                nb = rows.shape[1]
                value_norm = host.value_norm_dev[:, :, :nb]
                box = certify.logit_bounds(
                    q, key_min[:, :, :nb], key_max[:, :, :nb], host.key_centre_dev[:, :, :nb],
                    host.key_radius_dev[:, :, :nb], rows, scale, ball=False,
                )  # fmt: skip
                masses = {
                    "digest": certified_mass(host, q, scale, "digest")[0],
                    "sketch": sketch_mass(host, q, scale, nb),
                    "box": certify.mass_bounds(box, rows),
                }
            union = step.union
            # each bound's certificate of the same selection: (p, output bound)
            alternatives = {
                name: certify.certificate(m, union, value_norm, rows, lse, out) for name, m in masses.items()
            }
            p, deviation = full_attention_gap(layer, q, out, union, self.rows)
            live = step.live.float().clamp(min=1)
            records.append({
                "layer": layer.layer_idx, "p_measured": p.flatten().tolist(),
                "p_certified": p_cert.double().flatten().tolist(),
                **{f"p_{name}": p_alt.double().flatten().tolist() for name, (p_alt, _) in alternatives.items()},
                **{f"bound_{name}": b.double().flatten().tolist() for name, (_, b) in alternatives.items()},
                "deviation": deviation.flatten().tolist(), "bound": bound.double().flatten().tolist(),
                "met": step.met.flatten().tolist(), "kept": (union.sum(-1).float() / live).flatten().tolist(),
                "needed": (step.needed.float() / live).flatten().tolist(),
            })  # fmt: skip
        return after(self, layer, out, lse)

    Certifier.select, Certifier.after_attention = keep_query, record
    try:
        yield records
    finally:
        Certifier.select, Certifier.after_attention = select, after
