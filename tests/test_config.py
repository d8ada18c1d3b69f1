"""`TandemConfig` validation: defaults, every out-of-range field refused by name, window fractions."""

from __future__ import annotations

import math

import pytest

from tandem.config import DEFAULT_EPSILON, POLICIES, TandemConfig, default_cpu_threads


def test_defaults():
    cfg = TandemConfig()
    assert cfg.policy == "certified" and cfg.epsilon == DEFAULT_EPSILON == 0.05 and cfg.max_budget == 0.5
    assert TandemConfig(policy="quest").epsilon is None and TandemConfig(policy="hgca").epsilon is None
    assert (cfg.sink_tokens, cfg.window_tokens, cfg.block_size) == (64, 256, 16)
    assert (cfg.budget, cfg.beta, cfg.maw_alpha) == (0.05, 1.0, 0.1)
    assert (cfg.observation_tokens, cfg.prefill_chunk) == (32, 2048)
    assert cfg.cpu_threads == default_cpu_threads() >= 1
    assert cfg.device == "auto"
    assert set(cfg.to_dict()) == set(TandemConfig.field_names())


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_and_edge_values_accepted(policy):
    block_size = 16 if policy == "fluxion" else 1  # fluxion's logical blocks are made of 16-token ones
    cfg = TandemConfig(
        policy=policy, sink_tokens=0, window_tokens=1, block_size=block_size, budget=1, beta=1e-9, maw_alpha=1,
        observation_tokens=1, prefill_chunk=1, cpu_threads=1, device="cuda:3",
    )  # fmt: skip
    # float fields given as ints are stored as floats
    assert isinstance(cfg.budget, float) and isinstance(cfg.maw_alpha, float)
    assert cfg.cpu_threads == 1 and cfg.device == "cuda:3"


BAD_VALUES = [
    ("policy", "bogus"),
    ("policy", None),
    ("sink_tokens", -1),
    ("sink_tokens", 2.0),
    ("window_tokens", 0),
    ("window_tokens", -3),
    ("window_tokens", 1.5),
    ("window_tokens", 1.0),
    ("window_tokens", 0.0),
    ("window_tokens", "x"),
    ("block_size", 0),
    ("block_size", 4097),
    ("budget", 0),
    ("budget", 1.5),
    ("budget", math.nan),
    ("budget", "0.1"),
    ("beta", 0),
    ("beta", -1),
    ("beta", math.nan),
    ("maw_alpha", 0),
    ("maw_alpha", 1.01),
    ("observation_tokens", 0),
    ("prefill_chunk", 0),
    ("cpu_threads", 0),
    ("cpu_threads", 1.0),
    ("device", "tpu"),
    ("device", "cuda:"),
    ("device", "cuda:x"),
    ("device", None),
    ("huge_pages", 2),
    ("huge_pages", "yes"),
    ("huge_pages", None),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_out_of_range_field_names_itself_and_what_is_allowed(field, value):
    with pytest.raises(ValueError) as info:
        TandemConfig(**{field: value})
    message = str(info.value)
    assert field in message and "allowed" in message


INT_FIELDS = [
    "sink_tokens",
    "window_tokens",
    "block_size",
    "observation_tokens",
    "prefill_chunk",
    "cpu_threads",
]


@pytest.mark.parametrize("field", INT_FIELDS + ["budget", "beta", "maw_alpha"])
def test_booleans_are_not_numbers(field):
    # True == 1 would otherwise pass every range check
    with pytest.raises(ValueError, match=field):
        TandemConfig(**{field: True})


@pytest.mark.parametrize(("value", "expected"), [(True, True), (False, False), (1, True), (0, False)])
def test_huge_pages_takes_bools_and_their_command_line_digits(value, expected):
    # `--set quest.huge_pages=0,1` arrives as ints
    assert TandemConfig(huge_pages=value).huge_pages is expected


@pytest.mark.parametrize(
    ("window", "prompt", "expected"),
    [
        (10, 1000, 10),  # a token count ignores the prompt
        (0.25, 100, 25),
        (0.3, 61, 19),  # rounded up
        (0.01, 113, 16),  # at least one block
        (0.5, 27, 16),  # ceil(13.5) = 14 < one block
        (0.5, 61, 31),
    ],
)
def test_window_for_prompt(window, prompt, expected):
    assert TandemConfig(window_tokens=window, block_size=16).window_for_prompt(prompt) == expected


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"policy": "quest", "epsilon": 0.0}, "epsilon"),
        ({"policy": "quest", "epsilon": 1.0}, "epsilon"),
        ({"policy": "hgca", "epsilon": 0.05}, "epsilon"),
        ({"policy": "quest", "epsilon": 0.05, "host_dtype": "int8"}, "epsilon"),
        ({"policy": "quest", "epsilon": 0.05, "gpu_share": 0.4}, "gpu_share"),
        ({"policy": "quest", "epsilon": 0.05, "max_budget": 0.0}, "max_budget"),
        ({"policy": "quest", "max_budget": 1.5}, "max_budget"),
        ({"policy": "quest", "epsilon": 0.05, "certify_bound": "box"}, "certify_bound"),
        ({"policy": "quest", "epsilon": 0.05, "certify_bound": None}, "certify_bound"),
    ],
)
def test_certified_selection_settings_are_refused_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=rf"TandemConfig\.{named}=.*allowed"):
        TandemConfig(**fields)


def test_certify_bound_names_its_allowed_values():
    with pytest.raises(ValueError, match=r"certify_bound='ball'.*allowed 'sketch' or 'digest'"):
        TandemConfig(policy="quest", epsilon=0.05, certify_bound="ball")
    assert TandemConfig(policy="quest", epsilon=0.05).certify_bound == "sketch"
    assert TandemConfig(policy="quest", epsilon=0.05, certify_bound="digest").certify_bound == "digest"


def test_certified_selection_takes_no_device_share_by_default():
    config = TandemConfig(policy="quest", epsilon=0.05)
    assert config.gpu_share_on("cuda") == 0.0 and config.gpu_cache_on("cuda") == 0.0
    assert TandemConfig(policy="quest").gpu_share_on("cuda") > 0


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"policy": "hgca"},
            r"host_split='requests' .*\"heads\" with policy='hgca' .*full, streaming, quest",
        ),
        ({"policy": "fluxion"}, r"host_split='requests' .*\"heads\" with policy='fluxion'"),
        ({"policy": "quest", "gpu_share": 0.4}, r"gpu_share=0.4 .*None or 0 with host_split='requests'"),
        ({"policy": "quest", "gpu_cache": 2.0, "gpu_share": 0.0}, r"gpu_cache=2.0"),
        ({"policy": "quest", "host_dtype": "int8"}, r"host_dtype='int8' .*None with host_split='requests'"),
        ({"policy": "quest", "epsilon": 0.05}, r"epsilon=0.05 .*None with host_split='requests'"),
        (
            {"policy": "quest", "scheduler": "queue"},
            r"scheduler='queue' .*\"share\" with host_split='requests'",
        ),
    ],
)
def test_a_request_split_refuses_what_it_does_not_carry(fields, named):
    with pytest.raises(ValueError, match=named):
        TandemConfig(host_split="requests", **fields)


def test_a_request_split_has_no_device_share_and_names_its_values():
    for policy in ("full", "streaming", "quest"):
        config = TandemConfig(policy=policy, host_split="requests", gpu_share=0)
        assert config.gpu_share_on("cuda") == 0.0 and config.gpu_cache_on("cuda") == 0.0
    assert TandemConfig(policy="quest", host_split="requests").gpu_share_on("cuda") == 0.0
    with pytest.raises(ValueError, match=r"host_split='rows' .*\"heads\" or \"requests\""):
        TandemConfig(host_split="rows")
