"""quest's certified selection (`TandemConfig.certified.epsilon`) on real decode steps: every layer's every step, the
measured skipped probability and output deviation from full attention over the same cache never exceed the
certificate; heads that met epsilon have a certificate under it; the stats report it. The tiny model always,
the default model with the `model` marker."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.config import CertifiedConfig, FluxionConfig, HostConfig
from tandem.policies.certified import Certifier
from tandem.tools.evaluation.certified import trace_certificates
from tests.tiny import tiny_model


def _checked_decode(model, ids, config, steps: int):
    """Greedy decode with `config`, checking each layer's certificate against full attention over its cache at
    every step; returns (the cache, the number of head-steps checked)."""
    cache = TandemCache.for_model(model, config)
    with trace_certificates() as records:
        model.generate(
            ids, max_new_tokens=steps, do_sample=False, pad_token_id=0, **generate_cache_kwargs(model, cache)
        )
    checked = 0
    for r in records:
        p, p_cert = (torch.tensor(r[k], dtype=torch.float64) for k in ("p_measured", "p_certified"))
        deviation, bound = torch.tensor(r["deviation"]), torch.tensor(r["bound"])
        assert torch.all(p <= p_cert + 1e-6), (
            f"layer {r['layer']}: measured p {p} over the certificate {p_cert}"
        )
        for name in ("box", "digest", "sketch"):  # each bound's certificate of the same selection
            if f"p_{name}" not in r:  # a selection of rows has the sketch's alone
                continue
            other = torch.tensor(r[f"p_{name}"], dtype=torch.float64)
            assert torch.all(p <= other + 1e-6), f"layer {r['layer']}: the {name} bound is unsound"
            other_bound = torch.tensor(r[f"bound_{name}"])
            assert torch.all(deviation <= other_bound * (1 + 1e-3) + 1e-4), (
                f"the {name} output bound is unsound"
            )
        assert torch.all(deviation <= bound * (1 + 1e-3) + 1e-4), (deviation, bound)
        met = torch.tensor(r["met"])
        assert torch.all(p_cert[met] <= config.certified.epsilon * (1 + 1e-4)), (
            "a head that met epsilon is over it"
        )
        checked += p.numel()
    return cache, checked


@pytest.mark.parametrize("bound, unit", [("sketch", "row"), ("sketch", "block"), ("digest", "block")])
@pytest.mark.parametrize("epsilon", [0.001, 0.05, 0.3])
def test_certificates_hold_on_every_decode_step_of_a_tiny_model(epsilon, bound, unit):
    model = tiny_model("Llama", num_attention_heads=8, num_key_value_heads=2)
    config = TandemConfig(policy="quest", sink_tokens=4, window_tokens=16, block_size=4, certified=CertifiedConfig(epsilon=epsilon, bound=bound, unit=unit))  # fmt: skip
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(0))
    cache, checked = _checked_decode(model, ids, config, steps=12)
    assert checked >= 2 * 8 * 2 * 11  # batch x heads x layers x steps with a host tier
    stats = cache.stats()["certified"]
    assert stats["head_steps"] == checked and stats["max_p"] <= 1.0
    if stats["met_share"] == 1.0:
        assert stats["max_p"] <= epsilon * (1 + 1e-4) and stats["max_excess"] == 0.0


def test_a_binding_cap_is_reported_as_not_meeting_epsilon():
    model = tiny_model("Llama", num_attention_heads=8, num_key_value_heads=2)
    config = TandemConfig(
        policy="quest",
        sink_tokens=4,
        window_tokens=16,
        block_size=4,
        certified=CertifiedConfig(epsilon=1e-6, max_budget=0.05),
    )
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    cache, _ = _checked_decode(model, ids, config, steps=4)
    stats = cache.stats()["certified"]
    # each of a KV head's 4 query heads keeps at most ceil(5%) of the blocks: their union at most 4 times that
    assert stats["met_share"] < 1.0 and stats["max_excess"] > 0.0 and stats["mean_kept"] <= 0.25


@pytest.mark.model
@pytest.mark.parametrize("policy, bound", [("quest", "sketch"), ("quest", "digest"), ("fluxion", "sketch")])
def test_certificates_hold_on_decode_steps_of_the_default_model(smollm, policy, bound):
    model, tokenizer = smollm
    # fluxion's shipped profile was calibrated with 64 sinks and a 256-token window, and needs at least those
    hot = (
        dict(sink_tokens=64, window_tokens=256)
        if policy == "fluxion"
        else dict(sink_tokens=16, window_tokens=64)
    )
    config = TandemConfig(policy=policy, certified=CertifiedConfig(epsilon=0.05, bound=bound), **hot)
    text = " ".join(
        f"Item {i} of the inventory is a {['red', 'blue', 'green'][i % 3]} box." for i in range(120)
    )
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :1024]
    cache, checked = _checked_decode(model, ids, config, steps=6)
    assert checked > 0
    assert cache.stats()["certified"]["head_steps"] == checked


def _fluxion_config(tmp_path, name: str, epsilon, max_budget=0.5, **profile):
    from tests.policies.test_fluxion_policy import SINKS, WINDOW, make_profile

    path = make_profile(tmp_path / name, predictor=False, **profile)
    return TandemConfig(policy="fluxion", fluxion=FluxionConfig(tau=0.1, profile=path, mode="static"), sink_tokens=SINKS, window_tokens=WINDOW, host=HostConfig(threads=1), certified=CertifiedConfig(epsilon=epsilon, max_budget=max_budget))  # fmt: skip


def _fluxion_decode(model, config, ids, steps=6):
    cache = TandemCache.for_model(model, config)
    model.generate(
        ids, max_new_tokens=steps, do_sample=False, pad_token_id=0, **generate_cache_kwargs(model, cache)
    )
    return cache.stats()


def test_fluxion_streaming_heads_get_certified_blocks_only_with_epsilon(tmp_path):
    """Every head labelled streaming: fluxion alone reads nothing from the host tier; with epsilon the certificate
    adds the blocks each head needs, and every step's certificate holds against full attention."""
    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (2, 260), generator=torch.Generator().manual_seed(3))
    alone = _fluxion_decode(model, _fluxion_config(tmp_path, "s.pt", None, streaming=True), ids)
    assert alone["mean_fraction_attended"] == 0.0
    config = _fluxion_config(tmp_path, "s.pt", 0.01, max_budget=1.0, streaming=True)
    cache, checked = _checked_decode(model, ids, config, steps=6)
    stats = cache.stats()
    assert checked == stats["certified"]["head_steps"] > 0
    assert stats["mean_fraction_attended"] > 0.0 and stats["streaming_head_share"] == 1.0
    assert stats["certified"]["met_share"] == 1.0 and stats["certified"]["max_p"] <= 0.01 * (1 + 1e-4)


def test_fluxion_selection_that_already_certifies_is_kept_as_it_is(tmp_path):
    """Budget 1 for every head: fluxion keeps every block, so nothing is skipped (p = 0), and the certificate
    neither adds nor drops a block."""
    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (2, 260), generator=torch.Generator().manual_seed(4))
    stats = _fluxion_decode(model, _fluxion_config(tmp_path, "one.pt", 0.05, bgt0=1.0, k=0.0), ids)
    assert stats["mean_fraction_attended"] == 1.0
    cert = stats["certified"]
    assert cert["met_share"] == 1.0 and cert["max_p"] == 0.0 and cert["mean_kept"] == 1.0


@pytest.mark.parametrize("unit", ["row", "block"])
def test_fluxion_with_epsilon_attends_at_least_what_fluxion_alone_does(tmp_path, monkeypatch, unit):
    """At every step, the certified selection holds each of fluxion's own blocks whole (every live row of it, in
    units of rows), and the heads' budgets are fluxion's."""
    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (2, 260), generator=torch.Generator().manual_seed(5))
    alone = _fluxion_decode(model, _fluxion_config(tmp_path, "b.pt", None, bgt0=0.2, k=0.05), ids)
    select, steps = Certifier.select, []

    def checked(self, layer, q, forced=None):
        union = select(self, layer, q, forced)
        host = layer.host
        if self.rows:  # fluxion's blocks, as their live rows
            forced = (
                forced.repeat_interleave(host.block_size, -1) & host.row_valid_dev[:, None, : union.shape[-1]]
            )
        assert forced is not None and forced.any() and bool((union >= forced).all())
        steps.append(bool((union > forced).any()))
        return union

    monkeypatch.setattr(Certifier, "select", checked)
    config = _fluxion_config(tmp_path, "b.pt", 0.01, max_budget=1.0, bgt0=0.2, k=0.05)
    config.certified = dataclasses.replace(config.certified, unit=unit)
    both = _fluxion_decode(model, config, ids)
    assert len(steps) == 2 * 5 and any(steps)  # 2 layers x 5 decode steps checked; the certificate added some
    assert alone["mean_fraction_attended"] > 0.0
    assert both["mean_head_budget"] == pytest.approx(
        alone["mean_head_budget"]
    )  # fluxion's own rule unchanged
