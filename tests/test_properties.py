"""Property-based checks (hypothesis) of the edges: every TandemConfig field over values of every type, the
sparse-attention launcher over shapes, dtypes, strides and index values up to the int64 extremes, and the
`tandem generate` command line. Each case either raises a ValueError naming the argument or gives a valid
result (for the launcher: the reference's)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem.cli import build_parser
from tandem.cli.generate import build_config
from tandem.config import MAX_WINDOW_TOKENS, POLICIES, TandemConfig
from tandem.kernels import gpu, ops, reference
from tests.tolerances import assert_close

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

INT64_EXTREMES = (0, 1, -1, 2**31, 2**60, 2**62 + 1, 2**63 - 1, -(2**63))
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from(INT64_EXTREMES),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from([np.float32(0.5), np.float64(0.05), np.int64(16), np.int32(4), np.float16(0.25)]),
    st.sampled_from(list(POLICIES) + ["cuda", "cuda:0", "predictor", "static", "oracle", "int8", "fp8"]),
)
FIELDS = [
    "policy", "sink_tokens", "window_tokens", "block_size", "quest.budget", "hgca.beta", "hgca.maw_alpha",
    "hgca.span", "hgca.observation_tokens", "prefill_chunk", "host.threads", "quest.gpu_share", "quest.gpu_cache",
    "device", "host.huge_pages", "fluxion.tau", "fluxion.mode", "fluxion.granularity", "fluxion.skip_streaming",
    "host.dtype", "certified.epsilon", "certified.max_budget",
]  # fmt: skip
# the policy that reads each sub-config (a sub-config of another policy must keep its defaults)
POLICY_OF = {"quest": "quest", "hgca": "hgca", "fluxion": "fluxion", "certified": "quest", "host": "quest"}


def _get(config: TandemConfig, name: str):
    key, dot, sub = name.partition(".")
    return getattr(getattr(config, key), sub) if dot else getattr(config, key)


def _valid(config: TandemConfig) -> None:
    """What any constructed config must satisfy, checked independently of the constructor's own code."""
    assert config.policy in POLICIES
    for name in (
        "sink_tokens",
        "block_size",
        "hgca.span",
        "hgca.observation_tokens",
        "prefill_chunk",
        "host.threads",
    ):
        assert type(_get(config, name)) is int and _get(config, name) >= (0 if name == "sink_tokens" else 1)
    window = config.window_tokens
    assert (type(window) is int and 1 <= window <= MAX_WINDOW_TOKENS) or (
        type(window) is float and 0 < window < 1
    )
    for name in ("quest.budget", "hgca.beta", "hgca.maw_alpha", "fluxion.tau"):
        value = _get(config, name)
        assert type(value) is float and math.isfinite(value)
    assert (
        0 < config.quest.budget <= 1
        and config.hgca.beta > 0
        and 0 < config.hgca.maw_alpha <= 1
        and 0 <= config.fluxion.tau < 1
    )
    assert config.quest.gpu_share is None or (
        type(config.quest.gpu_share) is float and 0 <= config.quest.gpu_share <= 1
    )
    assert config.host.huge_pages in (True, False) and config.fluxion.skip_streaming in (True, False)
    assert config.fluxion.granularity in (None, 16, 32, 64, 128)
    assert config.host.dtype in (None, "int8", "fp8")
    assert type(config.certified.max_budget) is float and 0 < config.certified.max_budget <= 1
    if config.certified.epsilon is not None:
        assert type(config.certified.epsilon) is float and 0 < config.certified.epsilon < 1
        assert config.policy in ("certified", "quest", "fluxion") and config.host.dtype is None
        assert not config.quest.gpu_share


@SETTINGS
@given(field=st.sampled_from(FIELDS), value=ANY_VALUE)
def test_every_config_field_accepts_a_valid_value_or_names_itself(field, value):
    key, dot, _ = field.partition(".")
    policy = POLICY_OF[key] if dot else "certified"
    try:
        config = TandemConfig(policy=policy).with_settings({field: value})
    except ValueError as err:
        assert f"TandemConfig.{field}=" in str(err) or "TandemConfig." in str(err)
        assert "allowed" in str(err)
        return
    _valid(config)


@SETTINGS
@given(field=st.sampled_from(FIELDS), value=ANY_VALUE)
def test_assignment_keeps_a_valid_config(field, value):
    key, dot, sub = field.partition(".")
    config = TandemConfig(policy=POLICY_OF[key] if dot else "quest")
    before = _get(config, field)
    try:
        if dot:  # a sub-config is replaced whole (they are frozen)
            setattr(config, key, {**getattr(config, key).to_dict(), sub: value})
        else:
            setattr(config, field, value)
    except ValueError as err:
        assert "TandemConfig." in str(err) and "allowed" in str(err)
        assert _get(config, field) == before or (isinstance(before, float) and math.isnan(before))
    _valid(config)


def _store(batch, heads, rows, dim, dtype, strided):
    """A KV store; `strided`: a view taking every other row of a larger one (rows stay contiguous in D)."""
    shape = (batch, heads, rows * (2 if strided else 1), dim)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(rows * dim)).to(dtype)
    return t[:, :, ::2] if strided else t


@SETTINGS
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    dim=st.sampled_from([8, 16, 24]),
    rows=st.integers(1, 40),
    block=st.sampled_from([None, 1, 4, 8]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    strided=st.booleans(),
    width=st.integers(0, 6),
    ids=st.lists(st.one_of(st.integers(0, 12), st.sampled_from(INT64_EXTREMES)), min_size=36, max_size=36),
    scale=st.one_of(st.floats(0.01, 2.0), st.sampled_from([math.nan, math.inf, 0.0])),
)
def test_sparse_attention_names_the_bad_argument_or_matches_the_reference(
    batch, kv_heads, group, dim, rows, block, dtype, strided, width, ids, scale
):
    unit = block or 1
    q = torch.randn(batch, kv_heads * group, 1, dim, generator=torch.Generator().manual_seed(7)).to(dtype)
    k, v = (
        _store(batch, kv_heads, rows, dim, dtype, strided),
        _store(batch, kv_heads, rows + 1, dim, dtype, strided),
    )
    v = v[:, :, :rows]
    indices = torch.tensor(ids[: batch * kv_heads * width] or [0], dtype=torch.long)
    indices = indices[: batch * kv_heads * width].view(batch, kv_heads, width)
    lengths = torch.full((batch, kv_heads), width, dtype=torch.long)
    # whole blocks only: a block that runs past the store's rows is refused like one outside it
    in_range = bool(((indices >= 0) & (indices < rows // unit)).all()) if indices.numel() else True
    try:
        out, lse = ops.sparse_attention_lse(q, k, v, indices, lengths, scale, block_size=block)
    except ValueError as err:
        assert re.search(r"\b(indices|scale|lengths|block_size|k_store|v_store|q)\b", str(err)), str(err)
        assert not (in_range and math.isfinite(scale)), f"refused a valid call: {err}"
        event("refused")
        return
    event("compared with the reference")
    assert in_range and math.isfinite(scale)
    rows_selected = indices * unit
    mask = torch.ones(batch, rows, dtype=torch.bool)
    ref_out, ref_lse = reference.sparse_attention_lse(q, k, v, indices, lengths, scale, mask, block)
    assert rows_selected.numel() == 0 or int(rows_selected.min()) >= 0
    assert_close(out.float(), ref_out.float(), dtype)
    assert_close(lse, ref_lse, dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["int8", "fp8"]),
    batch=st.integers(1, 2),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([8, 16, 24, 64]),
    blocks=st.integers(1, 6),
    block=st.sampled_from([1, 4, 16]),
    data=st.data(),
)
def test_an_8bit_store_attends_as_the_reference_over_its_decoded_rows(
    kind, batch, num_kv_heads, group, head_dim, blocks, block, data
):
    """Over shapes, scale groups (any G dividing the rows), selections and padding: the launcher over the codes
    equals the reference over `reference.dequantize`'d rows at float32's tolerance."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    rows = blocks * block
    x = torch.randn(2, batch, num_kv_heads, rows, head_dim, generator=gen) * 3
    valid = torch.rand(batch, rows, generator=gen) > 0.2
    scale_block = data.draw(st.sampled_from([g for g in (1, 2, 4, 8, 16) if rows % g == 0]), label="G")
    (k, ks), (v, vs) = (reference.quantize_blocks(t, valid, scale_block, kind) for t in x)
    q = torch.randn(batch, num_kv_heads * group, 1, head_dim, generator=gen)
    width = data.draw(st.integers(0, rows), label="width")
    indices = torch.stack([torch.randperm(rows, generator=gen)[:width] for _ in range(batch * num_kv_heads)])
    indices = indices.reshape(batch, num_kv_heads, width)
    lengths = torch.randint(0, width + 1, (batch, num_kv_heads), generator=gen)
    out, lse = ops.sparse_attention_lse(
        q, k, v, indices, lengths, 0.3, key_mask=valid, k_scale=ks, v_scale=vs
    )
    ref_out, ref_lse = reference.sparse_attention_lse(
        q, reference.dequantize(k, ks), reference.dequantize(v, vs), indices, lengths, 0.3, valid
    )
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3]),
    slots=st.integers(1, 40),
    dim=st.sampled_from([8, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    valid_bits=st.integers(0, 2**80),
    scale=st.one_of(st.floats(0.05, 1.5), st.sampled_from([math.nan, -math.inf])),
    with_maw=st.booleans(),
)
def test_hot_attention_names_the_bad_argument_or_matches_the_reference(
    batch, kv_heads, group, slots, dim, dtype, valid_bits, scale, with_maw
):
    """The hot tier's decode attention: the launcher's checks (`ops.hot_attention`) and the Triton kernel it runs
    on CUDA (`gpu.hot_decode_attention`, under the interpreter on CPU tensors), against the reference; rows with
    no valid slot included."""
    gen = torch.Generator().manual_seed(slots * 7 + dim)
    q = torch.randn(batch, kv_heads * group, dim, generator=gen).to(dtype)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
    valid = torch.tensor(
        [[(valid_bits >> (b * slots + i)) & 1 == 1 for i in range(slots)] for b in range(batch)]
    )
    maw = torch.rand(batch, kv_heads * group, slots, generator=gen) if with_maw else None
    maw_ref = maw.clone() if with_maw else None
    try:
        out, lse = ops.hot_attention(q, keys, values, valid, scale, maw=maw, alpha=0.25 if with_maw else 0.0)
        if gpu.triton_available(q.device):  # ops sends CPU tensors to the reference: run the kernel itself
            if with_maw:
                maw.copy_(maw_ref)
            out, lse = gpu.hot_decode_attention(
                q, keys, values, valid, scale, maw=maw, alpha=0.25 if with_maw else 0.0
            )
    except ValueError as err:
        assert "scale" in str(err) and not math.isfinite(scale), str(err)
        return
    assert math.isfinite(scale)
    ref_out, ref_lse = reference.hot_decode_attention(
        q, keys, values, valid, scale, maw=maw_ref, alpha=0.25 if with_maw else 0.0
    )
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)
    if with_maw:
        assert_close(maw, maw_ref, dtype)


GENERATE_FLAGS = {
    "--policy": st.sampled_from(list(POLICIES) + ["dense", ""]),
    "--window-tokens": st.one_of(
        st.integers(-5, 10**9).map(str), st.sampled_from(["0.5", "1.5", "nan", "x"])
    ),
    "--sink-tokens": st.integers(-3, 2**21).map(str),
    "--budget": st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(str), st.just("1e-9")),
    "--beta": st.sampled_from(["inf", "-1", "0", "2", "nan"]),
    "--block-size": st.integers(-1, 5000).map(str),
    "--gpu-share": st.sampled_from(["0", "0.5", "1.5", "-0.1", "nan"]),
    "--tau": st.sampled_from(["0", "0.1", "1", "-0.5", "inf"]),
    "--cpu-threads": st.integers(-2, 5000).map(str),
}


@SETTINGS
@given(
    choices=st.dictionaries(st.sampled_from(sorted(GENERATE_FLAGS)), st.none(), max_size=4), data=st.data()
)
def test_generate_arguments_parse_into_a_valid_config_or_a_named_error(choices, data):
    argv = ["generate", "--prompt", "hi"]
    for flag in choices:
        argv += [f"{flag}={data.draw(GENERATE_FLAGS[flag])}"]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse's own refusal (a value of the wrong type): usage on stderr
        assert exit_.code == 2
        return
    try:
        config = build_config(args)
    except ValueError as err:
        assert "TandemConfig." in str(err) and "allowed" in str(err)
        event("refused")
        return
    event("valid config")
    _valid(config)


def test_the_property_tests_run_on_int64_extremes():
    """The strategies above include the int64 extremes the kernels once overflowed on (a guard against the
    strategies being narrowed by accident)."""
    assert 2**63 - 1 in INT64_EXTREMES and -(2**63) in INT64_EXTREMES and 2**60 in INT64_EXTREMES
    with pytest.raises(ValueError, match="indices"):
        ops.sparse_attention_lse(
            torch.randn(1, 1, 1, 8), torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8),
            torch.tensor([[[2**60]]]), torch.ones(1, 1, dtype=torch.long), 0.3, block_size=4,
        )  # fmt: skip
