"""The paper's headline claims under the default assumptions (regression guard for docs/simulator.md)."""

import pytest

from tandem.tools.simulator.claims import HEADLINE, RACK_GROUP, SERVER_GROUPS, evaluate_claims


@pytest.fixture(scope="module")
def claims():
    return {c.key: c for c in evaluate_claims()}


def test_every_headline_claim_is_computed(claims):
    assert set(HEADLINE) <= set(claims)
    for c in claims.values():
        assert c.model > 0 and c.model == c.model


@pytest.mark.parametrize(
    "key",
    [
        "max_speedup",
        "tokens_per_dollar",
        "png_vs_pnm",
        "png_energy_vs_pnm",
        "gpu_scaling_cost",
        "rack_png_vs_pnm",
    ],
)
def test_matched_claims_stay_within_20_percent(claims, key):
    assert abs(claims[key].diff_pct) <= 20.5


def test_paper_batches_exact(claims):
    assert claims["batch_70b_base"].model == 1
    assert claims["batch_70b_pnm"].model == 96


def test_documented_direction_of_mismatches(claims):
    # Explained in docs/simulator.md: energy claims exceed what the Table 2/3 powers allow.
    assert claims["energy_70b"].model < claims["energy_70b"].paper
    assert claims["png_energy"].model < claims["png_energy"].paper


def test_figure_grid():
    assert SERVER_GROUPS[0].pnm_counts == (1, 2, 4, 8)
    assert all(max(g.pnm_counts) <= 8 for g in SERVER_GROUPS)
    assert RACK_GROUP.gpus == 16 and RACK_GROUP.pnm_counts == (16, 32, 48, 64)
