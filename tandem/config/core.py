"""`TandemConfig`: the cache's core settings (policy, sinks, window, block size, prefill chunk, device) flat, and
one sub-config per policy or feature (`features.py`; the host tier's is `host`), validated together."""

from __future__ import annotations

import functools
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace

from .checks import checked_int, fail, fail_type
from .features import (
    DEFAULT_EPSILON,
    DEFAULT_GPU_CACHE,
    DEFAULT_GPU_SHARE,
    FEATURES,
    HOST_SPLIT_POLICIES,
    MOVED,
    CertifiedConfig,
    DistributedConfig,
    Feature,
    FluxionConfig,
    HgcaConfig,
    HostConfig,
    QuestConfig,
    moved_message,
)

POLICIES = ("certified", "full", "streaming", "hgca", "quest", "fluxion")
MAX_WINDOW_TOKENS = 1 << 22  # far past any model context: a window past the model's own is refused per model
CPU_THREADS_ENV = "TANDEM_CPU_THREADS"  # set by a tensor-parallel rank for its share of the cores
ENGINE_CHOICES = ("auto", "on", "off")  # `--engine` of generate and eval: Tandem's engine, or model.generate


def uses_engine(choice: str, device_type: str) -> bool:
    """Whether an `--engine` choice decodes through Tandem's engine on a device of `device_type`: "on", or
    "auto" on CUDA (where its graph steps pay); "off" is model.generate."""
    if choice not in ENGINE_CHOICES:
        raise ValueError(f"engine must be one of {', '.join(ENGINE_CHOICES)}, got {choice!r}")
    return choice == "on" or (choice == "auto" and device_type == "cuda")


def default_cpu_threads(device: str = "auto") -> int:
    """$TANDEM_CPU_THREADS where set (a tensor-parallel rank's share, `distributed.launch`); else, for a cache on
    a GPU (`device` "cuda", or "auto" with CUDA present), all cores but one, which launches GPU work; else all
    cores: with the hot tier on the CPU nothing else runs while the CPU part does."""
    env = os.environ.get(CPU_THREADS_ENV, "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if device == "cpu" or (device == "auto" and not _cuda_present()):
        return cores
    return max(1, cores - 1)


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_number(text: str) -> int | float:
    """A command-line value of a numeric field: "256" -> 256, "0.25" -> 0.25; ValueError otherwise."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None


@dataclass
class TandemConfig:
    """Configuration of a Tandem cache: the core settings, and one sub-config per policy or feature.

    Attributes:
        policy: which offloaded (host) entries each head attends during decode: `certified` (the default: quest's
            selection with `certified.epsilon`, DEFAULT_EPSILON unless set: each query head keeps the fewest host
            rows whose skipped attention is provably at most epsilon of its attention; with the hot tier on the
            CPU it attends every host row, which costs less there than selecting), `full` (all), `streaming`
            (none: sinks + window only), `hgca` (moving-average attention weight above `hgca.beta / n`, per head),
            `quest` (top `quest.budget` fraction of blocks by the min/max key bound, per KV head), `fluxion`
            (per-head budgets that keep each head's output within `fluxion.tau` of full attention, streaming heads
            skipped, the block size chosen per GQA group; from a calibration profile).
        sink_tokens: first tokens of every sequence kept on the compute device for good.
        window_tokens: recent tokens kept on the compute device. An int is a token count; a float in (0, 1)
            is a fraction of the first prompt's length (at least one block).
        block_size: tokens per block: the unit of eviction and of the `quest` key digests.
        prefill_chunk: query tokens per chunk of a prefill/append, so no full attention matrix is built.
        device: where the hot tier lives: "auto" (the model's device), "cpu", "cuda" or "cuda:N".
        host: `HostConfig`: the host tier's storage dtype (`dtype`), its CPU attention threads (`threads`; None
            resolves to `default_cpu_threads(device)` here) and its huge pages (`huge_pages`), read with every
            policy.
        hgca: `HgcaConfig`, read with policy `hgca`.
        quest: `QuestConfig` (budget and device share), read with policy `quest`.
        fluxion: `FluxionConfig`, read with policy `fluxion`.
        certified: `CertifiedConfig` (epsilon), read with policies `certified`, `quest` and `fluxion`.
        distributed: `DistributedConfig` (host_split), read with tensor parallelism.

    A sub-config of a policy other than `policy` must keep its defaults (`Feature.POLICIES`). A sub-config may be
    given as a mapping of its fields (`quest={"budget": 0.1}`), as `to_dict` writes it. The flat fields of
    earlier versions (`budget=`, `epsilon=`, `host_dtype=`, ...) are refused with a ValueError naming the new
    spelling.

    Example:
        >>> cfg = TandemConfig(policy="quest", quest=QuestConfig(budget=0.1), window_tokens=512)
        >>> cfg.quest.budget, cfg.block_size
        (0.1, 16)
        >>> cfg.with_settings({"quest.budget": 0.02}).quest.budget
        0.02
    """

    policy: str = "certified"
    sink_tokens: int = 64
    window_tokens: int | float = 256
    block_size: int = 16
    prefill_chunk: int = 2048
    device: str = "auto"
    host: HostConfig = field(default_factory=HostConfig)
    hgca: HgcaConfig = field(default_factory=HgcaConfig)
    quest: QuestConfig = field(default_factory=QuestConfig)
    fluxion: FluxionConfig = field(default_factory=FluxionConfig)
    certified: CertifiedConfig = field(default_factory=CertifiedConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __setattr__(self, name: str, value) -> None:
        """A field assigned after construction is checked like the constructor's: the whole config is validated
        again, and an invalid value is refused (the old one stays). A sub-config is replaced whole
        (`cfg.quest = QuestConfig(budget=0.1)`): sub-configs are frozen, so no change escapes the checks."""
        state = self.__dict__
        if not state.get("_ready") or state.get("_validating") or name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name in MOVED:
            raise AttributeError(moved_message(name, value))
        if name not in state:
            raise AttributeError(
                f"TandemConfig has no field {name!r}: allowed {', '.join(f.name for f in fields(self))}"
            )
        old = state[name]
        object.__setattr__(self, name, value)
        try:
            self._validate()
        except ValueError:
            object.__setattr__(self, name, old)
            raise

    def __getattr__(self, name: str):
        if name in MOVED:
            key, moved = MOVED[name]
            raise AttributeError(f"TandemConfig.{name} moved to TandemConfig.{key}.{moved}")
        raise AttributeError(f"'TandemConfig' object has no attribute {name!r}")

    def __post_init__(self) -> None:
        self._validate()
        object.__setattr__(self, "_ready", True)

    def _validate(self) -> None:
        object.__setattr__(self, "_validating", True)
        try:
            self._check_fields()
        finally:
            object.__setattr__(self, "_validating", False)

    def _check_fields(self) -> None:
        if self.policy not in POLICIES:
            fail("policy", self.policy, "one of " + ", ".join(POLICIES))
        self.sink_tokens = checked_int("sink_tokens", self.sink_tokens, 0, 1 << 20)
        self._check_window()
        self.block_size = checked_int("block_size", self.block_size, 1, 4096)
        self.prefill_chunk = checked_int("prefill_chunk", self.prefill_chunk, 1, 1 << 24)
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda")
            or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            fail("device", self.device, '"auto", "cpu", "cuda" or "cuda:N"')
        for key, cls in FEATURES.items():
            self._check_feature(key, cls)
        if self.host.threads is None:  # its default depends on the device, a core field
            self.host = replace(self.host, threads=default_cpu_threads(self.device))
        self._check_across()

    def _check_window(self) -> None:
        allowed = "an int >= 1 or a float fraction in (0, 1)"
        if isinstance(self.window_tokens, bool) or not isinstance(self.window_tokens, numbers.Real):
            fail_type("window_tokens", self.window_tokens, allowed)
        if isinstance(self.window_tokens, numbers.Integral):
            self.window_tokens = int(self.window_tokens)
        else:
            self.window_tokens = float(self.window_tokens)
        if isinstance(self.window_tokens, float):
            if not 0.0 < self.window_tokens < 1.0:
                fail("window_tokens", self.window_tokens, allowed)
        elif not 1 <= self.window_tokens <= MAX_WINDOW_TOKENS:
            fail(
                "window_tokens",
                self.window_tokens,
                f"an int in [1, {MAX_WINDOW_TOKENS}] or a float fraction in (0, 1)",
            )

    def _check_feature(self, key: str, cls: type[Feature]) -> None:
        """The sub-config `key` is a `cls` (a mapping of its fields becomes one) and, unless its policies include
        `policy`, keeps its defaults: a setting that would be ignored is refused."""
        value = getattr(self, key)
        if isinstance(value, Mapping):
            value = cls.from_dict(value)
            setattr(self, key, value)
        if not isinstance(value, cls):
            fail_type(key, value, f"a {cls.__name__} (or a mapping of its fields)")
        if key == "certified" and self.policy == "certified" and value.epsilon is None:
            setattr(self, key, replace(value, epsilon=DEFAULT_EPSILON))
            return
        changed = value.changed()
        if cls.POLICIES is not None and self.policy not in cls.POLICIES and changed:
            name = changed[0]
            fail(
                f"{key}.{name}",
                getattr(value, name),
                f"its default ({getattr(cls(), name)!r}) with policy={self.policy!r}: {cls.__name__} is read "
                f"only with policy={' or '.join(map(repr, cls.POLICIES))}",
            )

    def _check_across(self) -> None:
        """The checks between a feature and the core fields or another feature, which no structure removes."""
        epsilon, quest = self.certified.epsilon, self.quest
        if self.policy == "fluxion" and self.block_size != 16:
            fail(
                "block_size",
                self.block_size,
                "16 with policy='fluxion' (its logical blocks are 16-128 tokens)",
            )
        host_dtype = self.host.dtype
        if epsilon is not None and host_dtype is not None:
            if self.policy == "certified":
                fail(
                    "host.dtype",
                    host_dtype,
                    "None with policy='certified' (the default: its certificate bounds the exact keys, and 8-bit "
                    "ones differ); an 8-bit host tier needs another policy, e.g. policy='quest'",
                )
            fail(
                "certified.epsilon",
                epsilon,
                "None with host.dtype set: the certificate bounds the stored keys, and 8-bit ones differ",
            )
        if epsilon is not None and quest.gpu_share:
            fail(
                "quest.gpu_share",
                quest.gpu_share,
                "None or 0 with certified.epsilon (the device share splits one top-k by rank; certified "
                "selections differ per head)",
            )
        if quest.scheduler != "share" and epsilon is not None:
            fail(
                "quest.scheduler",
                quest.scheduler,
                '"share" with certified.epsilon (the queue splits quest\'s top-k)',
            )
        if quest.scheduler != "share" and host_dtype is not None:
            fail(
                "host.dtype",
                host_dtype,
                f"None with quest.scheduler={quest.scheduler!r} (the queue's GPU side reads the model's dtype only)",
            )
        if self.distributed.host_split == "requests":
            self._check_requests_split()

    def _check_requests_split(self) -> None:
        if self.policy not in HOST_SPLIT_POLICIES:
            supported = ", ".join(HOST_SPLIT_POLICIES)
            fail(
                "distributed.host_split",
                "requests",
                f'"heads" with policy={self.policy!r} ("requests" supports {supported})',
            )
        unread = "(a rank's host tier holds other ranks' heads, which its GPU does not read)"
        unsupported = "(the split moves K/V in the model's dtype and no per-row bounds)"
        for name, value, allowed, why in (
            ("quest.gpu_share", self.quest.gpu_share, "None or 0", unread),
            ("quest.gpu_cache", self.quest.gpu_cache, "None or 0", unread),
            ("host.dtype", self.host.dtype, "None", unsupported),
            ("certified.epsilon", self.certified.epsilon, "None", unsupported),
        ):
            if value is not None and value != 0:
                fail(name, value, f"{allowed} with distributed.host_split='requests' {why}")
        if self.quest.scheduler != "share":
            fail(
                "quest.scheduler",
                self.quest.scheduler,
                f"\"share\" with distributed.host_split='requests' {unread}",
            )

    def gpu_share_on(self, device_type: str) -> float:
        """The device share in effect with the hot tier on a device of this type ("cuda", "cpu"): resolves the
        None default of `quest.gpu_share`."""
        if self.quest.scheduler != "share":
            return 0.0  # the queue splits the blocks (`tandem.attention.queue`)
        if self.distributed.host_split == "requests":
            return 0.0  # the device cannot read the other ranks' heads in this rank's host tier
        if self.quest.gpu_share is not None:
            return self.quest.gpu_share
        certified = self.certified.epsilon is not None
        return (
            DEFAULT_GPU_SHARE if self.policy == "quest" and device_type == "cuda" and not certified else 0.0
        )

    def gpu_cache_on(self, device_type: str) -> float:
        """The recall cache's size in effect with the hot tier on a device of this type: resolves the None default
        of `quest.gpu_cache` (on with a device share on CUDA)."""
        if self.quest.gpu_cache is not None:
            return self.quest.gpu_cache
        return DEFAULT_GPU_CACHE if device_type == "cuda" and self.gpu_share_on(device_type) > 0 else 0.0

    def window_for_prompt(self, prompt_tokens: int) -> int:
        """Window size in tokens once the first prompt's length is known."""
        if isinstance(self.window_tokens, float):
            return max(self.block_size, math.ceil(self.window_tokens * prompt_tokens))
        return self.window_tokens

    def to_dict(self) -> dict:
        """The core fields, and each sub-config as a dict of its fields: what `from_dict` reads back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping) -> TandemConfig:
        """The config `to_dict` wrote (sub-configs as mappings); an old flat field raises its moved error."""
        return cls(**values)

    def with_settings(self, settings: Mapping) -> TandemConfig:
        """A copy with `settings` applied and the whole checked: keys are core fields ("window_tokens"), dotted
        sub-config fields ("quest.budget"), or sub-config names with a mapping of fields ({"quest": {...}}), as
        `--set` and a server request give them. ValueError names an unknown or moved key."""
        changes: dict = {}
        nested: dict[str, dict] = {}
        for name, value in settings.items():
            key, dot, sub = str(name).partition(".")
            if not dot and key in MOVED:
                raise ValueError(moved_message(key, value))
            if key in FEATURES and (dot or isinstance(value, Mapping)):
                nested.setdefault(key, {}).update({sub: value} if dot else value)
            elif not dot and key in CORE_FIELDS:
                changes[key] = value
            else:
                raise ValueError(f"unknown setting {name!r}: allowed {', '.join(setting_names())}")
        for key, values in nested.items():
            cls = FEATURES[key]
            current = getattr(self, key).to_dict()
            if key == "certified" and "policy" in changes and self.policy == "certified":
                current["epsilon"] = None  # the default epsilon belongs to policy certified: re-resolved
            changes[key] = cls.from_dict({**current, **values})
        if "policy" in changes and changes["policy"] != "certified" and "certified" not in nested:
            if self.policy == "certified" and self.certified.epsilon == DEFAULT_EPSILON:
                changes["certified"] = replace(self.certified, epsilon=None)
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        """The core fields and the sub-configs' names."""
        return [f.name for f in fields(cls)]


CORE_FIELDS = tuple(f.name for f in fields(TandemConfig) if f.name not in FEATURES)


def setting_names() -> list[str]:
    """Every settable name: the core fields, and each sub-config field dotted ("quest.budget")."""
    return [*CORE_FIELDS, *(f"{key}.{name}" for key, cls in FEATURES.items() for name in cls.field_names())]


_dataclass_init = TandemConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args, **kwargs) -> None:
    for name in kwargs:
        if name in MOVED:
            raise ValueError(moved_message(name, kwargs[name]))
    _dataclass_init(self, *args, **kwargs)


TandemConfig.__init__ = _init  # the flat spellings of earlier versions are refused with their new one
