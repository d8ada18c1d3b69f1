"""A synthetic fill whose attention is as concentrated as a real model's, for `tandem bench --fill concentrated`.

Random keys spread a random-weight model's attention flat: every row holds about the same mass, so a selection
certified at epsilon must keep most of the host tier, and a certified row of the bench says nothing about a real
model. This fill plants, per layer and KV head, the concentration measured on the default model's heads
(`benchmarks/measure_concentration.py`): the share of the attention mass on the host rows, how much of that the top
0.1%, 1% and 5% of host rows hold, and where in the host span the heaviest rows lie.

How. For a query q and a key k with independent N(0, s^2) entries, the score q.k * scale is N(0, (|q| s scale)^2)
whatever q is, so a row's key scale sets the spread of its score under any query the model makes. Rows come in
three kinds, each with a spread of its score:
- light rows (most host rows, the window): spread `LIGHT_SCORE_STD`, nearly flat;
- heavy rows, a fraction `heavy_fraction` of the host rows placed by the measured position histogram: spread
  `heavy_std`, so that under a given query about half of them score high and hold the host tier's mass;
- the attention sinks: spread `sink_std`, which sets the share of the mass left to the host tier.
The three numbers per head are fitted offline (`fit_head`, Monte Carlo over query draws at the measured prompt
length) and stored with the measurement in `profiles/`. A fitted profile keeps its per-row score distribution at
any context, so a longer context holds proportionally more heavy rows and more host mass: for a certified
selection, that errs on the expensive side.

`|q|` comes from the weights: with the layer's input normalised to norm sqrt(hidden) (RMSNorm with weight w),
E|W_q,h x|^2 = mean(w^2) ||W_q,h||_F^2 for an input independent of W_q, as in a random-weight model.

    python -m tandem.tools.bench.concentrated benchmarks/results/2026-11-28_cpu_concentration/concentration.json \\
        --length 8192 --out tandem/tools/bench/profiles/smollm2-135m-8k.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_PROFILE = Path(__file__).with_name("profiles") / "smollm2-135m-8k.json"
# a light row's score spread: nearly flat, as the random keys of `baselines.KV_STD` give a random-weight 8B model
LIGHT_SCORE_STD = 0.1
TOP = (0.001, 0.01, 0.05)
HEAVY_FRACTIONS = (0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0)
_QUERIES = 16  # query draws of a fit
_MAX_STD = 12.0


@dataclass(frozen=True)
class HeadProfile:
    """One KV head's target and fit. host_share: the share of the attention mass on host rows; top: the shares of
    the host mass the top 0.1%, 1% and 5% of host rows hold; bins: where the top 1% lie, as shares of five equal
    spans of the host rows, oldest first; heavy_fraction, heavy_std, sink_std: the fit (module docstring)."""

    host_share: float
    top: tuple[float, float, float]
    bins: tuple[float, ...]
    heavy_fraction: float
    heavy_std: float
    sink_std: float


@dataclass(frozen=True)
class Profile:
    """Per measured layer, per KV head, a `HeadProfile`; measured at `context` tokens with `sink_tokens` sinks
    and a `window_tokens` window (the host rows lie between them)."""

    source: str
    context: int
    sink_tokens: int
    window_tokens: int
    layers: tuple[tuple[HeadProfile, ...], ...]

    def head(self, layer: int, num_layers: int, kv_head: int) -> HeadProfile:
        """The profile of layer `layer` of a model of `num_layers`, mapped by relative depth onto the measured
        layers, and of KV head `kv_head` (modulo the measured KV heads)."""
        measured = len(self.layers)
        index = round(layer * (measured - 1) / max(1, num_layers - 1))
        heads = self.layers[index]
        return heads[kv_head % len(heads)]


def load_profile(path: str | Path = DEFAULT_PROFILE) -> Profile:
    data = json.loads(Path(path).read_text())
    layers = tuple(
        tuple(
            HeadProfile(
                h["host_share"],
                tuple(h["top"]),
                tuple(h["bins"]),
                h["heavy_fraction"],
                h["heavy_std"],
                h["sink_std"],
            )
            for h in heads
        )
        for heads in data["layers"]
    )
    return Profile(data["source"], data["context"], data["sink_tokens"], data["window_tokens"], layers)


# --- the fit -----------------------------------------------------------------------------------------------


def score_shares(
    host_scores: torch.Tensor, other_scores: torch.Tensor
) -> tuple[float, tuple[float, float, float]]:
    """Mean over queries of the host rows' share of the mass and of the top shares of the host mass.
    host_scores: [Q, n] scores of the host rows; other_scores: [Q, m] the sinks' and window's."""
    n = host_scores.shape[1]
    top_all = torch.logsumexp(torch.cat([host_scores, other_scores], 1), 1)
    host_lse = torch.logsumexp(host_scores, 1)
    host_share = float((host_lse - top_all).exp().mean())
    ranked = host_scores.topk(max(1, round(TOP[-1] * n)), 1).values  # sorted, largest first
    tops = tuple(
        float((torch.logsumexp(ranked[:, : max(1, round(t * n))], 1) - host_lse).exp().mean()) for t in TOP
    )
    return host_share, tops


class _Draws:
    """Common random numbers of one fit: the same normals under every trial parameter, so that the fitted
    statistics move smoothly with the parameters and bisection converges."""

    def __init__(self, host_rows: int, sink_rows: int, window_rows: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.host = torch.randn(_QUERIES, host_rows, generator=gen, dtype=torch.float64)
        # row i is heavy iff rank[i] < the fraction tried
        self.rank = torch.rand(host_rows, generator=gen, dtype=torch.float64)
        self.sinks = torch.randn(_QUERIES, sink_rows, generator=gen, dtype=torch.float64)
        self.window = torch.randn(_QUERIES, window_rows, generator=gen, dtype=torch.float64)

    def shares(self, fraction: float, heavy_std: float, sink_std: float):
        heavy = self.rank < fraction
        host = self.host * torch.where(heavy, heavy_std, LIGHT_SCORE_STD)
        other = torch.cat([self.sinks * sink_std, self.window * LIGHT_SCORE_STD], 1)
        return score_shares(host, other)


def _bisect(f, target: float, lo: float, hi: float, increasing: bool, steps: int = 24) -> float:
    for _ in range(steps):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_head(
    host_share: float,
    top: tuple[float, float, float],
    host_rows: int,
    sink_rows: int,
    window_rows: int,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(heavy_fraction, heavy_std, sink_std) whose scores give, at this many host, sink and window rows, the top
    shares `top` of the host mass and the host share `host_share` of the whole mass (least squares over the
    fractions in HEAVY_FRACTIONS, each with the heavy spread that meets the top 1% share exactly)."""
    draws = _Draws(host_rows, sink_rows, window_rows, seed)
    best = None
    for fraction in HEAVY_FRACTIONS:
        std = _bisect(lambda s, fr=fraction: draws.shares(fr, s, 0.0)[1][1], top[1], 0.0, _MAX_STD, True)
        _, got = draws.shares(fraction, std, 0.0)
        error = sum((math.log(a) - math.log(b)) ** 2 for a, b in zip(got, top, strict=True))
        if best is None or error < best[0]:
            best = (error, fraction, std)
    _, fraction, std = best
    sink_std = _bisect(
        lambda s: draws.shares(fraction, std, s)[0], host_share, 0.0, _MAX_STD, increasing=False
    )
    return fraction, std, sink_std


def profile_from_measurement(path: str | Path, length: int, seed: int = 0) -> dict:
    """A profile (as stored in `profiles/`) from `measure_concentration.py`'s concentration.json at one prompt
    length: per layer and KV head, the means over its query heads, and the fit."""
    data = json.loads(Path(path).read_text())
    args = data["args"]
    layers = data["results"][str(length)]
    out = []
    for layer in layers:
        heads = layer["heads"]
        num_kv = len(layer["kv_union"])
        group = len(heads) // num_kv
        kv_heads = []
        for g in range(num_kv):
            members = heads[g * group : (g + 1) * group]
            host_share = statistics.fmean(h["host_share"] for h in members)
            top = tuple(statistics.fmean(h[f"top_{t:g}"] for h in members) for t in TOP)
            bins = [
                statistics.fmean(h["top1_bins"][i] for h in members)
                for i in range(len(members[0]["top1_bins"]))
            ]
            host_rows = round(statistics.fmean(h["host_rows"] for h in members))
            fraction, heavy_std, sink_std = fit_head(
                host_share, top, host_rows, args["sink_tokens"], args["window_tokens"], seed
            )
            kv_heads.append(
                {
                    "host_share": host_share,
                    "top": list(top),
                    "bins": [b / sum(bins) for b in bins],
                    "heavy_fraction": fraction,
                    "heavy_std": heavy_std,
                    "sink_std": sink_std,
                }
            )
        out.append(kv_heads)
    return {
        "source": f"{Path(path).as_posix()} at {length} tokens",
        "context": length,
        "sink_tokens": args["sink_tokens"],
        "window_tokens": args["window_tokens"],
        "layers": out,
    }


# --- the fill ----------------------------------------------------------------------------------------------


def query_norms(model) -> list[torch.Tensor]:
    """Per decoder layer, [num_q_heads] the expected norm of each query head's queries, from the weights (module
    docstring; a tensor-parallel shard's own heads). Needs Llama-style layers: `self_attn.q_proj` and
    `input_layernorm`."""
    from ...models import attention_shape

    head_dim = attention_shape(model.config.get_text_config(decoder=True))[3]
    norms = []
    for index, layer in enumerate(model.get_decoder().layers):
        attn, norm = getattr(layer, "self_attn", None), getattr(layer, "input_layernorm", None)
        if attn is None or not hasattr(attn, "q_proj") or norm is None:
            raise ValueError(
                f"--fill concentrated needs Llama-style decoder layers (self_attn.q_proj, input_layernorm); "
                f"layer {index} is a {type(layer).__name__}"
            )
        weight = attn.q_proj.weight.detach().float()
        weight = weight.reshape(weight.shape[0] // head_dim, head_dim, weight.shape[1])
        gain = norm.weight.detach().float().pow(2).mean().sqrt()
        norms.append((weight.pow(2).sum((1, 2)).sqrt() * gain).cpu())
    return norms


def key_scales(
    head: HeadProfile, context: int, sink_tokens: int, window_tokens: int, gen: torch.Generator
) -> torch.Tensor:
    """[context] the score spread of each row of one KV head (sinks, light and heavy host rows, window), with
    its heavy rows drawn at the profile's positions."""
    scales = torch.full((context,), LIGHT_SCORE_STD, dtype=torch.float32)
    sinks = min(sink_tokens, context)
    scales[:sinks] = head.sink_std
    host_end = max(sinks, context - window_tokens)
    host_rows = host_end - sinks
    heavy = min(host_rows, round(head.heavy_fraction * host_rows))
    if heavy == 0:
        return scales
    # rows drawn without replacement, each weighted by its fifth's share of the top rows over the fifth's length
    # (exponential race: the `heavy` smallest Exp(1) / weight)
    bins = len(head.bins)
    fifth = torch.arange(host_rows) * bins // host_rows
    lengths = torch.bincount(fifth, minlength=bins).double()
    weight = (torch.tensor(head.bins, dtype=torch.float64) / lengths)[fifth].clamp_min(1e-12)
    race = torch.empty(host_rows, dtype=torch.float64).exponential_(generator=gen) / weight
    scales[sinks + race.topk(heavy, largest=False).indices] = head.heavy_std
    return scales


def plant_keys(
    keys: torch.Tensor,
    layer: int,
    num_layers: int,
    profile: Profile,
    q_norms: torch.Tensor,
    scale: float,
    sink_tokens: int,
    window_tokens: int,
    gen: torch.Generator,
) -> None:
    """Rescale keys [B, num_kv_heads, L, head_dim] of N(0, 1) entries in place: row by row to the score spread
    of its kind, divided by scale and the mean |q| of its KV head's query heads (q_norms [num_q_heads]). Every
    batch row gets its own heavy rows."""
    batch, num_kv_heads, context, _ = keys.shape
    q_norms = q_norms.reshape(num_kv_heads, -1).mean(1)
    for g in range(num_kv_heads):
        head = profile.head(layer, num_layers, g)
        per_row = torch.stack(
            [key_scales(head, context, sink_tokens, window_tokens, gen) for _ in range(batch)]
        )  # [B, L]
        per_row /= float(q_norms[g]) * scale
        keys[:, g].mul_(per_row.to(keys.device, keys.dtype).unsqueeze(-1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Fit a concentrated-fill profile to a concentration measurement."
    )
    parser.add_argument("measurement", help="concentration.json of benchmarks/measure_concentration.py")
    parser.add_argument("--length", type=int, required=True, help="the measured prompt length to fit")
    parser.add_argument("--out", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    profile = profile_from_measurement(args.measurement, args.length, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {args.out}: {len(profile['layers'])} layers x {len(profile['layers'][0])} KV heads")


if __name__ == "__main__":
    main()
