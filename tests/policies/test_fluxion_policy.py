"""`policy="fluxion"` end to end on a tiny random Llama (CPU): invariants against `full`, streaming heads skipped,
the statistics it reports, and how a bad profile or config is refused. One `model` test checks the shipped profile
on the real default model."""

import math

import pytest
import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.config import FluxionConfig, HostConfig
from tandem.policies.fluxion_features import NUM_FEATURES
from tandem.policies.fluxion_predictor import predictor_state, train_predictor
from tandem.policies.fluxion_profile import Profile, default_profile_path, load_profile
from tandem.policies.fluxion_search import CALIBRATION_BLOCKS
from tests.tiny import tiny_model
from tests.tolerances import TOLERANCES

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16  # tiny_model("Llama")
SINKS, WINDOW = 16, 32
PROMPT, PAD, NEW_TOKENS = 260, 37, 6


def make_profile(path, *, bgt0=0.2, k=0.05, streaming=False, taus=(0.1,), predictor=True, **shape):
    """A profile for the tiny model: static (bgt0, k, streaming) the same for every head, and (optionally) a
    predictor trained two epochs on random features."""
    meta = dict(model="tiny-llama", layers=LAYERS, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    meta.update(
        shape, sink_tokens=SINKS, window_tokens=WINDOW, taus=list(taus), blocks=list(CALIBRATION_BLOCKS)
    )
    heads = (meta["layers"], meta["q_heads"])
    static = {
        f"{t:g}": {
            "bgt0": torch.full(heads, float(bgt0)),
            "k": torch.full(heads, float(k)),
            "streaming": torch.full(heads, bool(streaming)),
        }
        for t in taus
    }
    predictors = {}
    if predictor:
        g = torch.Generator().manual_seed(0)
        features = torch.randn(256, NUM_FEATURES, generator=g)
        budgets = torch.rand(256, len(CALIBRATION_BLOCKS), generator=g).sort(dim=-1).values
        labels = torch.rand(256, generator=g) < 0.3
        model = train_predictor(features, budgets, labels, epochs=2, batch_size=128)
        predictors = {f"{t:g}": predictor_state(model) for t in taus}
    Profile(meta, static, predictors, {}).save(path)
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matrices are a few KB: intra-op threads only add synchronisation (seconds per generate on
    a busy 2-core machine against milliseconds with one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return tiny_model("Llama")


@pytest.fixture(scope="module")
def prompt():
    """Two requests, the second left-padded: most of the prompt ends up in the host tier (11 blocks of 16)."""
    ids = torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    return ids, mask


def _run(model, prompt, **fields):
    ids, mask = prompt
    config = TandemConfig(sink_tokens=SINKS, window_tokens=WINDOW, host=HostConfig(threads=1), **fields)
    cache = TandemCache.for_model(model, config)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        **generate_cache_kwargs(model, cache),
    )
    return out, cache.stats()


@pytest.fixture(scope="module")
def full(model, prompt):
    return _run(model, prompt, policy="full")


def _assert_same_as_full(ours, full):
    (out, stats), (base, base_stats) = ours, full
    assert torch.equal(out.sequences, base.sequences)
    for mine, theirs in zip(out.scores, base.scores):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, theirs, **TOLERANCES[torch.float32])
    assert stats["host_rows"] == base_stats["host_rows"] >= 10 * 16  # many blocks on the host tier
    assert stats["mean_fraction_attended"] == 1.0


SHAPES = {
    "gqa2": {},
    "mha": {"num_key_value_heads": 4},
    "gqa3": {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2},
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tau_zero_reproduces_full_attention_without_reading_a_profile(shape, prompt, tmp_path):
    model = tiny_model("Llama", **SHAPES[shape])
    full = _run(model, prompt, policy="full")
    ours = _run(
        model,
        prompt,
        policy="fluxion",
        fluxion=FluxionConfig(tau=0.0, profile=str(tmp_path / "never-read.pt")),
    )
    _assert_same_as_full(ours, full)
    stats = ours[1]
    assert stats["streaming_head_share"] == 0.0 and stats["mean_head_budget"] == 1.0
    assert sum(stats["granularity_share"].values()) == pytest.approx(1.0)


def test_static_budget_one_for_every_head_equals_full_attention(model, prompt, full, tmp_path):
    path = make_profile(tmp_path / "budget-one.pt", bgt0=1.0, k=0.0, predictor=False)
    ours = _run(model, prompt, policy="fluxion", fluxion=FluxionConfig(tau=0.1, profile=path, mode="static"))
    _assert_same_as_full(ours, full)
    assert ours[1]["mean_head_budget"] == 1.0


def test_streaming_heads_do_no_cpu_work(model, prompt, tmp_path):
    path = make_profile(tmp_path / "streaming.pt", bgt0=0.2, k=0.05, streaming=True, predictor=False)
    _, stats = _run(
        model, prompt, policy="fluxion", fluxion=FluxionConfig(tau=0.1, profile=path, mode="static")
    )
    assert stats["host_rows"] > 0
    assert stats["mean_fraction_attended"] == 0.0
    assert stats["streaming_head_share"] == 1.0
    assert stats["mean_head_budget"] == 0.0
    assert stats["granularity_share"] is None  # no group selected any block
    # the ablation: every head gets its Eq. 1 budget. Eq. 3 per group of two heads over L host rows:
    # V(16) = L (2/16 + 2 * 2 * 0.4) = 1.725 L < V(32) = L (2/32 + 2 * 2 * 0.45) = 1.8625 L, so blk 16, budget 0.4
    _, stats = _run(
        model,
        prompt,
        policy="fluxion",
        fluxion=FluxionConfig(tau=0.1, profile=path, mode="static", skip_streaming=False),
    )
    assert stats["streaming_head_share"] == 1.0  # still labelled streaming, only not skipped
    assert stats["mean_head_budget"] == pytest.approx(0.4, abs=1e-6)
    assert stats["granularity_share"] == {16: 1.0, 32: 0.0, 64: 0.0, 128: 0.0}
    assert (
        0.35 < stats["mean_fraction_attended"] < 0.9
    )  # each head 40% (whole blocks), unioned over the group


def test_fixed_granularity_is_reported(model, prompt, tmp_path):
    path = make_profile(tmp_path / "granularity.pt", predictor=False)
    _, stats = _run(
        model,
        prompt,
        policy="fluxion",
        fluxion=FluxionConfig(tau=0.1, profile=path, mode="static", granularity=32),
    )
    assert {b: s for b, s in stats["granularity_share"].items() if s} == {32: 1.0}
    assert stats["mean_head_budget"] == pytest.approx(0.2 + 0.05 * 5, abs=1e-6)  # Eq. 1 at blk 32
    assert 0.0 < stats["mean_fraction_attended"] < 1.0


def test_each_head_reads_its_budget_in_whole_blocks(prompt, tmp_path):
    # MHA: no union over a group, so each KV head reads ceil(0.4 L / 16) blocks of its L >= 160 host rows
    model = tiny_model("Llama", **SHAPES["mha"])
    path = make_profile(tmp_path / "mha.pt", bgt0=0.4, k=0.0, predictor=False, kv_heads=4)
    _, stats = _run(
        model,
        prompt,
        policy="fluxion",
        fluxion=FluxionConfig(tau=0.1, profile=path, mode="static", granularity=16),
    )
    assert stats["mean_head_budget"] == pytest.approx(0.4)
    assert 0.4 <= stats["mean_fraction_attended"] <= 0.4 + 16 / 160


def test_predictor_mode_runs_and_reports_statistics(model, prompt, tmp_path):
    path = make_profile(tmp_path / "predictor.pt")
    out, stats = _run(model, prompt, policy="fluxion", fluxion=FluxionConfig(tau=0.1, profile=path))
    assert all(torch.isfinite(s).all() for s in out.scores)
    assert out.sequences.shape == (2, PROMPT + NEW_TOKENS)
    for name in ("mean_fraction_attended", "streaming_head_share", "mean_head_budget"):
        assert stats[name] is not None and math.isfinite(stats[name]) and 0.0 <= stats[name] <= 1.0, name
    share = stats["granularity_share"]
    if share is not None:  # None only if every group of every step was streaming
        assert set(share) == {16, 32, 64, 128}
        assert all(0.0 <= s <= 1.0 for s in share.values()) and sum(share.values()) == pytest.approx(1.0)


def test_predictor_mode_with_a_prompt_that_fits_on_the_device(model, tmp_path):
    """A prompt shorter than sinks + window leaves the host tier empty at the anchor; decoding then evicts blocks
    there, and the predictor's features (empty host statistics) stay finite."""
    path = make_profile(tmp_path / "predictor.pt")
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(7))
    config = TandemConfig(
        policy="fluxion",
        fluxion=FluxionConfig(tau=0.1, profile=path),
        sink_tokens=SINKS,
        window_tokens=WINDOW,
    )
    cache = TandemCache.for_model(model, config)
    out = model.generate(
        ids, max_new_tokens=60, do_sample=False, pad_token_id=0, output_scores=True,
        return_dict_in_generate=True, **generate_cache_kwargs(model, cache),
    )  # fmt: skip
    assert all(torch.isfinite(s).all() for s in out.scores)
    stats = cache.stats()
    assert stats["host_rows"] > 0 and stats["streaming_head_share"] is not None


def test_oracle_mode_needs_no_profile_and_reads_less_at_a_larger_tau(model, prompt):
    """fluxion_mode='oracle' measures each step's Eq. 2 budgets itself: no profile file is read, and a looser
    tau never needs more of the host tier."""
    missing = "/nonexistent/profile.pt"
    _, tight = _run(
        model, prompt, policy="fluxion", fluxion=FluxionConfig(tau=0.05, mode="oracle", profile=missing)
    )
    _, loose = _run(
        model, prompt, policy="fluxion", fluxion=FluxionConfig(tau=0.5, mode="oracle", profile=missing)
    )
    assert 0.0 < loose["mean_fraction_attended"] <= tight["mean_fraction_attended"] <= 1.0
    assert loose["mean_head_budget"] <= tight["mean_head_budget"]


# ---- refusals ---------------------------------------------------------------------------------------------
def test_profile_of_another_model_is_refused_naming_both_shapes(tmp_path):
    path = make_profile(tmp_path / "other.pt", predictor=False, layers=3, q_heads=8, kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="calibrated on tiny-llama") as err:
        TandemCache.for_model(
            tiny_model("Llama"), TandemConfig(policy="fluxion", fluxion=FluxionConfig(profile=path))
        )
    text = str(err.value)
    assert "3 layers, 8 query / 4 KV heads, head_dim 8" in text
    assert f"{LAYERS} layers, {Q_HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}" in text


def test_uncalibrated_tau_predictor_without_weights_and_missing_file_are_refused(tmp_path):
    model = tiny_model("Llama")
    path = make_profile(tmp_path / "static-only.pt", taus=(0.05, 0.1), predictor=False)
    hot = dict(sink_tokens=SINKS, window_tokens=WINDOW)
    with pytest.raises(ValueError, match=r"TandemConfig\.fluxion\.tau=0\.2 .*allowed 0\.05, 0\.1"):
        TandemCache.for_model(
            model, TandemConfig(policy="fluxion", fluxion=FluxionConfig(tau=0.2, profile=path), **hot)
        )
    with pytest.raises(ValueError, match="fluxion.mode='predictor'.*has no predictor"):
        TandemCache.for_model(
            model, TandemConfig(policy="fluxion", fluxion=FluxionConfig(tau=0.1, profile=path), **hot)
        )
    with pytest.raises(ValueError, match=r"sink_tokens=8, window_tokens=32.*16 sinks and a 32-token window"):
        TandemCache.for_model(
            model,
            TandemConfig(
                policy="fluxion",
                fluxion=FluxionConfig(tau=0.1, profile=path, mode="static"),
                sink_tokens=8,
                window_tokens=WINDOW,
            ),
        )
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        TandemCache.for_model(
            model, TandemConfig(policy="fluxion", fluxion=FluxionConfig(profile=str(tmp_path / "missing.pt")))
        )
    # the accepted configuration builds
    TandemCache.for_model(
        model,
        TandemConfig(policy="fluxion", fluxion=FluxionConfig(tau=0.05, profile=path, mode="static"), **hot),
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("fluxion.tau", 1.5),
        ("fluxion.tau", -0.1),
        ("fluxion.tau", 1.0),
        ("fluxion.mode", "dynamic"),
        ("fluxion.granularity", 48),
        ("fluxion.granularity", True),
        ("fluxion.skip_streaming", "yes"),
        ("block_size", 32),
    ],
)
def test_config_refuses_bad_fluxion_fields(field, value):
    with pytest.raises(ValueError, match=rf"TandemConfig\.{field}="):
        TandemConfig(policy="fluxion").with_settings({field: value})


def test_tau_zero_after_cache_reset_still_needs_no_profile(model, prompt, tmp_path):
    ids, mask = prompt
    config = TandemConfig(policy="fluxion", fluxion=FluxionConfig(tau=0.0, profile=str(tmp_path / "never-read.pt")), sink_tokens=SINKS, window_tokens=WINDOW, host=HostConfig(threads=1))  # fmt: skip
    cache = TandemCache.for_model(model, config)
    kwargs = dict(attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    model.generate(ids, **kwargs, **generate_cache_kwargs(model, cache))
    cache.reset()
    model.generate(ids, **kwargs, **generate_cache_kwargs(model, cache))
    assert cache.stats()["mean_fraction_attended"] == 1.0


# ---- the shipped profile on the real model --------------------------------------------------------------------
@pytest.mark.model
def test_shipped_profile_matches_the_default_model_and_generates(request, prose):
    if not default_profile_path().is_file():
        pytest.skip(f"{default_profile_path()} not shipped yet")
    model, tok = request.getfixturevalue("smollm")  # loaded only once the profile is known to exist
    text_config = model.config.get_text_config(decoder=True)
    profile = load_profile(None)
    profile.check_model(
        text_config.num_hidden_layers,
        text_config.num_attention_heads,
        text_config.num_key_value_heads,
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads,
    )
    assert TandemConfig().fluxion.tau in profile.taus
    ids = tok(prose, return_tensors="pt").input_ids[:, :600]
    cache = TandemCache.for_model(model, TandemConfig(policy="fluxion"))
    out = model.generate(
        ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **generate_cache_kwargs(model, cache)
    )
    assert out.shape == (1, 604)
    stats = cache.stats()
    assert stats["host_rows"] > 0
    for name in ("mean_fraction_attended", "streaming_head_share", "mean_head_budget"):
        assert 0.0 <= stats[name] <= 1.0, name
