"""`TandemConfig` validation: defaults, every out-of-range field refused by name, window fractions, the
per-feature sub-configs (their checks, the policy each belongs to, round trips) and the old flat spellings'
errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from tandem.config import (
    DEFAULT_EPSILON,
    FEATURES,
    MOVED,
    POLICIES,
    CertifiedConfig,
    DistributedConfig,
    FluxionConfig,
    HgcaConfig,
    HostConfig,
    QuestConfig,
    TandemConfig,
    default_cpu_threads,
    setting_names,
)

# the policy each sub-config's settings need (certified: one of the three that certify)
POLICY_OF = {
    "hgca": "hgca",
    "quest": "quest",
    "fluxion": "fluxion",
    "certified": "quest",
    "distributed": "quest",
    "host": "quest",  # every policy reads it; quest takes an 8-bit host tier, the default certified not
}


def make(**settings) -> TandemConfig:
    """A config of `settings` (core fields, dotted sub-config fields), with the policy their sub-config needs."""
    features = {name.partition(".")[0] for name in settings if "." in name}
    policy = settings.pop("policy", POLICY_OF[min(features)] if features else "certified")
    return TandemConfig(policy=policy).with_settings(settings)


def test_defaults():
    cfg = TandemConfig()
    assert cfg.policy == "certified" and cfg.certified.epsilon == DEFAULT_EPSILON == 0.05
    assert cfg.certified.max_budget == 0.5
    assert TandemConfig(policy="quest").certified.epsilon is None
    assert TandemConfig(policy="hgca").certified.epsilon is None
    assert (cfg.sink_tokens, cfg.window_tokens, cfg.block_size) == (64, 256, 16)
    assert (cfg.quest.budget, cfg.hgca.beta, cfg.hgca.maw_alpha) == (0.05, 1.0, 0.1)
    assert (cfg.hgca.observation_tokens, cfg.prefill_chunk) == (32, 2048)
    assert cfg.host.threads == default_cpu_threads() >= 1
    assert (cfg.host.dtype, cfg.host.huge_pages) == (None, True)
    assert TandemConfig(device="cpu").host.threads == default_cpu_threads(
        "cpu"
    )  # the default follows the device
    assert cfg.device == "auto"
    assert set(cfg.to_dict()) == set(TandemConfig.field_names())
    assert len(TandemConfig.field_names()) <= 12
    assert set(FEATURES) == {"host", "hgca", "quest", "fluxion", "certified", "distributed"}
    assert all(isinstance(getattr(cfg, key), cls) for key, cls in FEATURES.items())


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_and_edge_values_accepted(policy):
    block_size = 16 if policy == "fluxion" else 1  # fluxion's logical blocks are made of 16-token ones
    own = {
        "quest": {"quest": QuestConfig(budget=1)},
        "hgca": {"hgca": HgcaConfig(beta=1e-9, maw_alpha=1, observation_tokens=1)},
    }.get(policy, {})
    cfg = TandemConfig(
        policy=policy, sink_tokens=0, window_tokens=1, block_size=block_size, prefill_chunk=1,
        host=HostConfig(threads=1), device="cuda:3", **own,
    )  # fmt: skip
    # float fields given as ints are stored as floats
    assert isinstance(cfg.quest.budget, float) and isinstance(cfg.hgca.maw_alpha, float)
    assert cfg.host.threads == 1 and cfg.device == "cuda:3"


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
    ("quest.budget", 0),
    ("quest.budget", 1.5),
    ("quest.budget", math.nan),
    ("quest.budget", "0.1"),
    ("hgca.beta", 0),
    ("hgca.beta", -1),
    ("hgca.beta", math.nan),
    ("hgca.maw_alpha", 0),
    ("hgca.maw_alpha", 1.01),
    ("hgca.observation_tokens", 0),
    ("prefill_chunk", 0),
    ("host.threads", 0),
    ("host.threads", 1.0),
    ("host.dtype", "int4"),
    ("host.dtype", 8),
    ("device", "tpu"),
    ("device", "cuda:"),
    ("device", "cuda:x"),
    ("device", None),
    ("host.huge_pages", 2),
    ("host.huge_pages", "yes"),
    ("host.huge_pages", None),
    ("quest.gpu_share", 1.5),
    ("quest.gpu_cache", 100.0),
    ("quest.scheduler", "lanes"),
    ("quest.scheduler", "heads"),  # a baseline of benchmarks/bench_scheduler.py, not a setting
    ("fluxion.tau", 1.0),
    ("fluxion.mode", "magic"),
    ("fluxion.granularity", 8),
    ("fluxion.skip_streaming", 2),
    ("certified.epsilon", 0.0),
    ("certified.epsilon", 1.0),
    ("certified.max_budget", 1.5),
    ("certified.bound", None),
    ("certified.unit", "rows"),
    ("distributed.host_split", "rows"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_out_of_range_field_names_itself_and_what_is_allowed(field, value):
    with pytest.raises(ValueError) as info:
        make(**{field: value})
    message = str(info.value)
    assert f"TandemConfig.{field}=" in message and "allowed" in message


@pytest.mark.parametrize(("field", "value"), [f for f in BAD_VALUES if "." in f[0]], ids=lambda v: str(v))
def test_a_sub_config_checks_its_own_fields_alone(field, value):
    key, _, name = field.partition(".")
    with pytest.raises(ValueError, match=rf"TandemConfig\.{key}\.{name}=.*allowed"):
        FEATURES[key](**{name: value})


INT_FIELDS = [
    "sink_tokens",
    "window_tokens",
    "block_size",
    "hgca.observation_tokens",
    "prefill_chunk",
    "host.threads",
]


@pytest.mark.parametrize("field", INT_FIELDS + ["quest.budget", "hgca.beta", "hgca.maw_alpha"])
def test_booleans_are_not_numbers(field):
    # True == 1 would otherwise pass every range check
    with pytest.raises(ValueError, match=field):
        make(**{field: True})


@pytest.mark.parametrize(("value", "expected"), [(True, True), (False, False), (1, True), (0, False)])
def test_huge_pages_takes_bools_and_their_command_line_digits(value, expected):
    # `--set host.huge_pages=0,1` arrives as ints
    assert TandemConfig(host=HostConfig(huge_pages=value)).host.huge_pages is expected


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


# ---- the old flat spellings -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MOVED))
def test_every_old_flat_spelling_is_refused_naming_the_new_one(name):
    key, field = MOVED[name]
    new = FEATURES[key].__name__
    with pytest.raises(ValueError) as api:
        TandemConfig(**{name: 0.1})
    message = str(api.value)
    assert f"'{name}' moved to {key}.{field}" in message
    assert f"TandemConfig({key}={new}({field}=0.1))" in message  # the Python API
    assert f"--set {key}.{field}=0.1" in message  # the command line
    # a server request, unless only the server sets it (its threads, its memory)
    server_only = field in FEATURES[key].SERVER_ONLY
    assert (f'{{"{key}": {{"{field}": 0.1}}}}' in message) is not server_only
    with pytest.raises(ValueError, match=f"moved to {key}.{field}"):
        TandemConfig().with_settings({name: 0.1})  # `--set budget=0.1`, a request's "budget"
    with pytest.raises(ValueError, match=f"moved to {key}.{field}"):
        dataclasses.replace(TandemConfig(), **{name: 0.1})
    with pytest.raises(AttributeError, match=rf"TandemConfig\.{name} moved to TandemConfig\.{key}\.{field}"):
        getattr(TandemConfig(), name)
    config = TandemConfig()
    with pytest.raises(AttributeError, match=f"moved to {key}.{field}"):
        setattr(config, name, 0.1)


def test_every_flat_field_of_earlier_versions_is_mapped():
    flat = {
        "budget", "beta", "maw_alpha", "span", "observation_tokens", "gpu_share", "gpu_cache", "scheduler",
        "host_split", "tau", "profile", "fluxion_mode", "granularity", "skip_streaming", "epsilon", "max_budget",
        "certify_bound", "certify_unit", "host_dtype", "cpu_threads", "huge_pages",
    }  # fmt: skip
    assert set(MOVED) == flat
    assert not flat & set(TandemConfig.field_names())
    for key, field in MOVED.values():
        assert field in FEATURES[key].field_names()


# ---- what the structure makes impossible ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "feature"),
    [
        ("hgca", QuestConfig(gpu_share=0.5)),  # was: "gpu_share ... needs policy='quest'"
        ("full", QuestConfig(gpu_cache=2.0)),  # was: "gpu_cache ... needs policy='quest'"
        ("hgca", QuestConfig(scheduler="queue")),  # was: "scheduler needs policy='quest'"
        ("certified", QuestConfig(gpu_share=0.4)),  # was: "gpu_share None or 0 with policy='certified'"
        ("hgca", CertifiedConfig(epsilon=0.05)),  # was: "epsilon needs a certifying policy"
        ("streaming", FluxionConfig(tau=0.05)),
        ("quest", HgcaConfig(beta=2.0)),
    ],
)
def test_a_sub_config_of_another_policy_is_refused_naming_the_field_and_the_policy(policy, feature):
    name = feature.changed()[0]
    with pytest.raises(ValueError, match=rf"TandemConfig\.{feature.KEY}\.{name}=.*policy='{policy}'"):
        TandemConfig(policy=policy, **{feature.KEY: feature})


def test_a_sub_config_of_another_policy_at_its_defaults_is_accepted():
    config = TandemConfig(policy="hgca", quest=QuestConfig(), fluxion=FluxionConfig())
    assert config.quest == QuestConfig()


def test_sub_configs_are_frozen_and_replaced_whole_with_the_whole_checked():
    config = TandemConfig(policy="quest")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.quest.budget = 0.2
    config.quest = QuestConfig(budget=0.2)
    assert config.quest.budget == 0.2
    config.quest = {"budget": 0.3, "gpu_share": 0.5}  # a mapping of its fields
    assert isinstance(config.quest, QuestConfig) and config.quest.gpu_share == 0.5
    with pytest.raises(ValueError, match=r"quest\.budget=0\.3 .*policy='hgca'"):
        config.policy = "hgca"
    assert config.policy == "quest"  # the old value stays
    with pytest.raises(ValueError, match=r"TandemConfig\.quest=.*wrong type"):
        config.quest = 0.1
    with pytest.raises(ValueError, match=r"TandemConfig\.quest has no field 'epsilon'"):
        TandemConfig(policy="quest", quest={"epsilon": 0.1})


# ---- checks between a feature and the rest, which no structure removes ------------------------------------------
@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"policy": "quest", "certified.epsilon": 0.05, "host.dtype": "int8"}, "certified.epsilon"),
        ({"policy": "certified", "host.dtype": "int8"}, "host.dtype"),
        ({"policy": "quest", "certified.epsilon": 0.05, "quest.gpu_share": 0.4}, "quest.gpu_share"),
        ({"policy": "quest", "certified.epsilon": 0.05, "quest.scheduler": "queue"}, "quest.scheduler"),
        ({"policy": "quest", "quest.scheduler": "queue", "host.dtype": "int8"}, "host.dtype"),
        ({"policy": "fluxion", "block_size": 32}, "block_size"),
        ({"policy": "quest", "certified.bound": "digest", "certified.unit": "row"}, "certified.unit"),
        ({"policy": "quest", "quest.gpu_share": 0, "quest.gpu_cache": 2.0}, "quest.gpu_cache"),
        ({"policy": "quest", "quest.scheduler": "queue", "quest.gpu_share": 0.4}, "quest.gpu_share"),
    ],
)
def test_the_remaining_cross_checks_name_the_field(fields, named):
    with pytest.raises(ValueError, match=rf"TandemConfig\.{named}=.*allowed"):
        make(**fields)


def test_certify_bound_names_its_allowed_values():
    with pytest.raises(ValueError, match=r"certified\.bound='ball'.*allowed 'sketch' or 'digest'"):
        CertifiedConfig(epsilon=0.05, bound="ball")
    assert TandemConfig(policy="quest", certified=CertifiedConfig(epsilon=0.05)).certified.bound == "sketch"
    assert CertifiedConfig(bound="digest").rows() is False and CertifiedConfig().rows() is True


def test_certified_selection_takes_no_device_share_by_default():
    config = TandemConfig(policy="quest", certified=CertifiedConfig(epsilon=0.05))
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
        ({"quest.gpu_share": 0.4}, r"gpu_share=0.4 .*None or 0 with distributed.host_split='requests'"),
        ({"quest.gpu_cache": 2.0, "quest.gpu_share": 0.0}, r"gpu_cache=2.0"),
        ({"host.dtype": "int8"}, r"host.dtype='int8' .*None with distributed.host_split='requests'"),
        ({"certified.epsilon": 0.05}, r"epsilon=0.05 .*None with distributed.host_split='requests'"),
        (
            {"quest.scheduler": "queue"},
            r"scheduler='queue' .*\"share\" with distributed.host_split='requests'",
        ),
    ],
)
def test_a_request_split_refuses_what_it_does_not_carry(fields, named):
    with pytest.raises(ValueError, match=named):
        make(**{"policy": "quest", **fields, "distributed.host_split": "requests"})


def test_a_request_split_has_no_device_share_and_names_its_values():
    for policy in ("full", "streaming", "quest"):
        config = TandemConfig(policy=policy, distributed=DistributedConfig(host_split="requests"))
        assert config.gpu_share_on("cuda") == 0.0 and config.gpu_cache_on("cuda") == 0.0
    with pytest.raises(ValueError, match=r"host_split='rows' .*\"heads\" or \"requests\""):
        TandemConfig(distributed=DistributedConfig(host_split="rows"))


# ---- round trips and settings -----------------------------------------------------------------------------------
CONFIGS = [
    TandemConfig(),
    TandemConfig(
        policy="quest", quest=QuestConfig(budget=0.1, gpu_share=0.5, gpu_cache=2.0), window_tokens=0.25
    ),
    TandemConfig(
        policy="fluxion",
        fluxion=FluxionConfig(tau=0.05, mode="static", granularity=32),
        certified=CertifiedConfig(epsilon=0.02, bound="digest"),
    ),  # fmt: skip
    TandemConfig(policy="hgca", hgca=HgcaConfig(beta=2.0, span=1), host=HostConfig(dtype="int8", threads=3)),
    TandemConfig(policy="streaming", distributed=DistributedConfig(host_split="requests")),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.policy)
def test_to_dict_and_back_through_json_is_the_same_config(config):
    written = json.loads(json.dumps(config.to_dict()))
    assert written["quest"]["budget"] == config.quest.budget  # sub-configs nest
    assert TandemConfig.from_dict(written) == config
    assert TandemConfig(**written) == config


def test_from_dict_refuses_an_old_flat_record_naming_the_new_spelling():
    old = {"policy": "quest", "window_tokens": 256, "budget": 0.1}
    with pytest.raises(ValueError, match=r"'budget' moved to quest\.budget"):
        TandemConfig.from_dict(old)


def test_with_settings_takes_dotted_nested_and_core_names():
    base = TandemConfig(policy="quest")
    config = base.with_settings({"quest.budget": 0.1, "certified": {"max_budget": 0.2}, "window_tokens": 512})
    assert (config.quest.budget, config.certified.max_budget, config.window_tokens) == (0.1, 0.2, 512)
    assert base.quest.budget == 0.05  # the base is left alone
    with pytest.raises(ValueError, match=r"unknown setting 'quest\.bugdet'|no field 'bugdet'"):
        base.with_settings({"quest.bugdet": 0.1})
    with pytest.raises(ValueError, match=r"unknown setting 'nonsense'.*quest\.budget"):
        base.with_settings({"nonsense": 1})


def test_leaving_policy_certified_drops_its_default_epsilon():
    """The certified policy's default epsilon is its own: switching a certified config to quest gives quest's
    fixed budget, not a certified quest (an explicit certified.epsilon is kept)."""
    config = TandemConfig().with_settings({"policy": "quest", "quest.budget": 0.2})
    assert config.certified.epsilon is None and config.quest.budget == 0.2
    kept = TandemConfig().with_settings({"policy": "quest", "certified.epsilon": 0.02})
    assert kept.certified.epsilon == 0.02


def test_setting_names_list_every_core_field_and_every_sub_config_field():
    names = setting_names()
    assert "window_tokens" in names and "quest.budget" in names and "certified.epsilon" in names
    assert "fluxion.mode" in names and "distributed.host_split" in names
    assert {"host.dtype", "host.threads", "host.huge_pages"} <= set(names)
    assert not set(names) & set(MOVED) and not set(names) & set(FEATURES)


def test_host_threads_resolve_from_the_device_whenever_left_unset():
    config = TandemConfig(device="cpu", host=HostConfig(dtype=None))
    assert config.host.threads == default_cpu_threads("cpu")
    config.host = {"huge_pages": False}  # a new host sub-config: its threads resolved again
    assert config.host.threads == default_cpu_threads("cpu") and config.host.huge_pages is False
    assert TandemConfig().with_settings({"host.threads": 3}).host.threads == 3
