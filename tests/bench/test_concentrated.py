"""The concentrated fill of `tandem bench`: its fit, where it puts heavy rows, its query norms, and the attention a
model's own queries give over the keys it plants."""

import statistics

import pytest
import torch
from transformers import DynamicCache

from tandem.integrations.hf import generate_cache_kwargs
from tandem.shapes import build_random_model
from tandem.tools.bench.concentrated import (
    TOP,
    HeadProfile,
    _Draws,
    fit_head,
    key_scales,
    load_profile,
    plant_keys,
    query_norms,
)


def test_fit_recovers_the_statistics_of_known_parameters():
    host_rows, sinks, window = 2000, 64, 256
    target_host, target_top = _Draws(host_rows, sinks, window, seed=7).shares(0.2, 3.0, 6.0)
    fraction, heavy_std, sink_std = fit_head(target_host, target_top, host_rows, sinks, window, seed=0)
    got_host, got_top = _Draws(host_rows, sinks, window, seed=0).shares(fraction, heavy_std, sink_std)
    assert got_host == pytest.approx(target_host, abs=0.02)
    assert got_top == pytest.approx(target_top, abs=0.05)


def test_heavy_rows_lie_where_the_profile_says_and_sinks_and_window_keep_their_spread():
    head = HeadProfile(0.2, (0.3, 0.7, 0.9), (0.0, 0.0, 0.0, 0.25, 0.75), 0.1, 4.0, 6.0)
    context, sinks, window = 1000 + 64 + 256, 64, 256
    scales = key_scales(head, context, sinks, window, torch.Generator().manual_seed(0))
    assert (scales[:sinks] == 6.0).all() and (scales[-window:] == 0.1).all()
    heavy = (scales[sinks:-window] == 4.0).nonzero().flatten()
    assert heavy.numel() == 100  # 10% of the 1,000 host rows
    assert (heavy >= 600).all()  # only the last two fifths have weight
    assert (heavy >= 800).sum() > (heavy < 800).sum()


def test_query_norms_match_the_queries_of_random_inputs():
    model = build_random_model("smollm2-135m", "cpu", torch.float32, num_layers=2)
    attn, norm = model.model.layers[1].self_attn, model.model.layers[1].input_layernorm
    hidden = torch.randn(256, model.config.hidden_size)
    with torch.no_grad():
        queries = attn.q_proj(norm(hidden)).reshape(256, -1, model.config.head_dim)
    measured = queries.pow(2).sum(-1).mean(0).sqrt()
    assert query_norms(model)[1] == pytest.approx(measured, rel=0.1)


def test_the_models_own_queries_see_the_profiles_concentration():
    """Planted keys in an HF cache, then one decode step of a random-weight model with its own queries: the
    attention's host share and top shares, averaged over batch rows, heads and layers, come out near the mean of
    the profile's targets for those layers (each query draws its own heavy rows, so single heads vary)."""
    torch.manual_seed(0)
    layers, batch, context, sinks, window = 4, 4, 8192, 64, 256
    model = build_random_model(
        "smollm2-135m", "cpu", torch.float32, num_layers=layers, attn_implementation="eager"
    )
    profile = load_profile()
    head_dim, num_kv = model.config.head_dim, model.config.num_key_value_heads
    norms = query_norms(model)
    gen, cache = torch.Generator().manual_seed(0), DynamicCache()
    for index in range(layers):
        keys = torch.randn(batch, num_kv, context, head_dim)
        plant_keys(keys, index, layers, profile, norms[index], head_dim**-0.5, sinks, window, gen)
        cache.update(keys, torch.randn_like(keys).mul_(0.1), index)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1))
    with torch.no_grad():
        out = model(
            ids,
            position_ids=torch.full((batch, 1), context),
            output_attentions=True,
            **generate_cache_kwargs(model, cache),  # `cache` where transformers renamed `past_key_values`
        )
    got_host, got_top, want_host, want_top = [], [], [], []
    group = model.config.num_attention_heads // num_kv
    for index, weights in enumerate(out.attentions):  # [B, num_q_heads, 1, context + 1]
        weights = weights[:, :, 0].double()
        host = weights[:, :, sinks : context + 1 - window]
        host_mass = host.sum(-1)
        got_host.append(float(host_mass.mean()))
        ranked = host.sort(-1, descending=True).values
        n = host.shape[-1]
        got_top.append([float((ranked[..., : round(t * n)].sum(-1) / host_mass).mean()) for t in TOP])
        heads = [profile.head(index, layers, h // group) for h in range(model.config.num_attention_heads)]
        want_host.append(statistics.fmean(h.host_share for h in heads))
        want_top.append([statistics.fmean(h.top[i] for h in heads) for i in range(len(TOP))])
    assert statistics.fmean(got_host) == pytest.approx(statistics.fmean(want_host), abs=0.1)
    for i in range(len(TOP)):
        got = statistics.fmean(t[i] for t in got_top)
        want = statistics.fmean(t[i] for t in want_top)
        assert got == pytest.approx(want, abs=0.1), (TOP[i], got, want)
