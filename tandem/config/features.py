"""The per-feature sub-configs of `TandemConfig`: one frozen dataclass per policy or feature, each checking its own
fields, registered in `FEATURES` under the name it has in `TandemConfig` (`config.quest.budget`), in `--set`
(`--set quest.budget=0.1`) and in a server request (`"quest": {"budget": 0.1}`).

They live here, at the bottom layer beside `TandemConfig`, and not in the modules that read them
(`policies.hgca`, `policies.quest`, `policies.fluxion`, `policies.certified`, `cache.layer`): those import torch,
and `import tandem` (which builds a default `TandemConfig`) must not; the config layer must not import the policy
layer either (tests/test_layering.py). Each class names its reader in `READER`; the layering test checks that the
module exists and that the reader reads it.

A sub-config of a policy that is not `TandemConfig.policy` must stay at its defaults (`Feature.POLICIES`): a
setting that would be ignored is refused instead. That one rule replaces the checks of the flat config that tied
each policy's fields to its policy ("gpu_share needs policy='quest'", "epsilon needs a certifying policy").
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields
from typing import ClassVar

from .checks import checked_float, checked_int, checked_switch, fail, fail_type

# quest's device share with the hot tier on CUDA: why this value, with the runs that chose it, is in docs/engine.md
# § Quest ("Why 0.4")
DEFAULT_GPU_SHARE = 0.4
# quest's recall cache with a device share on CUDA, in multiples of the budget: what it saves and costs in GPU
# memory is in docs/engine.md § Quest ("The recall cache")
DEFAULT_GPU_CACHE = 4.0
# how quest's selected host blocks are split between the compute device and the CPU (`QuestConfig.scheduler`)
SCHEDULERS = ("share", "queue")
# the static splits benchmarks/bench_scheduler.py compares the queue with: the benchmark's, not the product's, so
# it sets them on the cache's layers (`LayerKV.queue_split`, `tandem.attention.queue`), never in the config
SCHEDULER_BASELINES = ("cpu", "heads", "volume")
FLUXION_MODES = ("predictor", "static", "oracle")
FLUXION_GRANULARITIES = (16, 32, 64, 128)
# policy="certified" without an epsilon: the bound that kept full attention's answers on held-out retrieval tasks
# (docs/certified.md, with the share of host rows it attends)
DEFAULT_EPSILON = 0.05
CERTIFY_BOUNDS = ("sketch", "digest")
CERTIFY_UNITS = ("row", "block")
CERTIFYING_POLICIES = ("certified", "quest", "fluxion")  # those that take an epsilon
# how tensor-parallel ranks divide the host tier and its CPU attention (`DistributedConfig.host_split`)
HOST_SPLITS = ("heads", "requests")
HOST_SPLIT_POLICIES = ("full", "streaming", "quest")  # those host_split="requests" supports
HOST_DTYPES = ("int8", "fp8")  # the compressed host tier's formats (None: the model's dtype)

FEATURES: dict[str, type[Feature]] = {}


def register(cls: type[Feature]) -> type[Feature]:
    """Make `cls` a sub-config of `TandemConfig` under `cls.KEY` (TandemConfig declares a field of that name)."""
    FEATURES[cls.KEY] = cls
    return cls


class Feature:
    """Base of the sub-configs: frozen (change one with `TandemConfig.with_settings` or by assigning a new one, so
    that the whole config is checked again), validated on construction, refusals named by their full path."""

    KEY: ClassVar[str]  # its field in TandemConfig, and the prefix of its `--set` keys and request fields
    POLICIES: ClassVar[tuple[str, ...] | None] = None  # the policies that read it (None: every policy)
    READER: ClassVar[str]  # the module that reads it
    # its fields a server request may not set (the server's own: a `tandem serve` flag, a path on the server)
    SERVER_ONLY: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        raise NotImplementedError

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)

    def path(self, name: str) -> str:
        return f"{self.KEY}.{name}"

    def changed(self) -> list[str]:
        """Names of the fields that differ from their defaults."""
        return [f.name for f in fields(self) if getattr(self, f.name) != _default(f)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, values) -> Feature:
        """A sub-config from a mapping of its fields; ValueError names a field it does not have."""
        unknown = [name for name in values if name not in cls.field_names()]
        if unknown:
            raise ValueError(
                f"TandemConfig.{cls.KEY} has no field {unknown[0]!r}: allowed {', '.join(cls.field_names())}"
            )
        return cls(**values)


def _default(f):
    return f.default_factory() if f.default is MISSING else f.default


@register
@dataclass(frozen=True)
class HostConfig(Feature):
    """The host tier: how it stores K/V, the threads that attend it, and the memory it lives in; read with every
    policy.

    Attributes:
        dtype: how the host tier stores K/V: None (default) in the model's dtype; "int8" or "fp8" (e4m3) as 8-bit
            codes with one float32 scale per block of `block_size` rows and KV head, half the host memory and half
            the bytes each step reads from it (the CPU kernels and the GPU's reads decode in registers; quest's
            digests are taken before quantizing and stay exact). With it, `full` no longer equals dense attention:
            the rows it reads are the quantized ones. Its quality cost is in docs/evaluation.md § The compressed
            host tier, its speed in docs/engine.md § The compressed host tier.
        threads: threads for CPU attention, in [1, 4096]. None (default): `default_cpu_threads` of
            `TandemConfig.device` (all cores but one with the hot tier on a GPU, all cores with it on the CPU;
            $TANDEM_CPU_THREADS where set), resolved when the `TandemConfig` is checked.
        huge_pages: back the host tier with transparent huge pages where Linux allows it (THP "always" or
            "madvise"): the decode step's scattered block reads then miss the TLB less, and pinned stores allocate
            faster (`tandem.cache.memory`; measured in docs/cpu-kernels.md § Huge pages). False: plain (pinned)
            allocations.

    Example:
        >>> TandemConfig(policy="quest", host=HostConfig(dtype="int8", threads=4)).host.dtype
        'int8'
    """

    KEY: ClassVar[str] = "host"
    READER: ClassVar[str] = "tandem.cache.layer"
    SERVER_ONLY: ClassVar[tuple[str, ...]] = ("threads", "huge_pages")

    dtype: str | None = None
    threads: int | None = None
    huge_pages: bool = True

    def check(self) -> None:
        allowed = "None (the model's dtype), " + " or ".join(map(repr, HOST_DTYPES))
        if self.dtype is not None and not isinstance(self.dtype, str):
            fail_type(self.path("dtype"), self.dtype, allowed)
        if self.dtype is not None and self.dtype not in HOST_DTYPES:
            fail(self.path("dtype"), self.dtype, allowed)
        if self.threads is not None:
            self._set("threads", checked_int(self.path("threads"), self.threads, 1, 4096))
        self._set("huge_pages", checked_switch(self.path("huge_pages"), self.huge_pages))


@register
@dataclass(frozen=True)
class HgcaConfig(Feature):
    """policy="hgca": attend the host entries whose moving-average attention weight (MAW) is above `beta / n`.

    Attributes:
        beta: the salience threshold factor (entries with MAW > beta / n are attended), in (0, inf).
        maw_alpha: weight of the newest step in the moving average of attention weights, in (0, 1].
        span: each salient entry also keeps the `span - 1` entries after it (1 = the paper's rule). Decoding copies
            forward from what it attends (a number, a name), and those successors get little attention before
            they are needed; the runs on the default model are in docs/architecture.md § `hgca`'s span.
        observation_tokens: how many final prompt tokens score the prompt's entries after a prefill or append
            (their mean attention weight starts each entry's MAW).

    Example:
        >>> TandemConfig(policy="hgca", hgca=HgcaConfig(beta=2.0)).hgca.span
        8
    """

    KEY: ClassVar[str] = "hgca"
    POLICIES: ClassVar[tuple[str, ...]] = ("hgca",)
    READER: ClassVar[str] = "tandem.policies.hgca"

    beta: float = 1.0
    maw_alpha: float = 0.1
    span: int = 8
    observation_tokens: int = 32

    def check(self) -> None:
        self._set("beta", checked_float(self.path("beta"), self.beta, 0.0, float("inf"), "(0, inf)", True))
        self._set(
            "maw_alpha", checked_float(self.path("maw_alpha"), self.maw_alpha, 0.0, 1.0, "(0, 1]", True)
        )
        self._set("span", checked_int(self.path("span"), self.span, 1, 4096))
        self._set(
            "observation_tokens",
            checked_int(self.path("observation_tokens"), self.observation_tokens, 1, 1 << 16),
        )


@register
@dataclass(frozen=True)
class QuestConfig(Feature):
    """policy="quest": per KV head, the top `budget` fraction of host blocks by the min/max key bound, and how the
    selected blocks are split between the compute device and the CPU.

    `budget` lives here because only quest's fixed top-k reads it: `certified` (and quest with an epsilon) keeps
    as many rows as its certificate needs, bounded by `CertifiedConfig.max_budget`, and fluxion derives per-head
    budgets from `FluxionConfig.tau`. The device share is quest's too: it splits quest's ranked top-k, so no other
    policy can use it.

    Attributes:
        budget: the fraction of offloaded entries a KV head attends, in (0, 1], rounded up to whole blocks (so at a
            few dozen host blocks it reads more than `budget`; stats report the real fraction).
        gpu_share: the fraction of each step's selected host blocks that the compute device attends itself,
            reading them from pinned host memory over PCIe (zero-copy) while the CPU attends the rest (Fluxion's
            CPU+GPU split), in [0, 1]; 0 = the CPU reads everything. None (default): DEFAULT_GPU_SHARE with the hot
            tier on a CUDA device (and no epsilon), else 0. The best value depends on the host's memory and PCIe
            bandwidths: `tandem bench --set quest.gpu_share=0,0.3,0.5` measures it.
        gpu_cache: with a device share, a cache on the compute device of recently selected host blocks (PNM-KV's
            steady blocks), sized as a multiple of the step's budget: `ceil(gpu_cache * k)` blocks per KV head for
            `k` selected ones (at least `k` plus the device share). A selected block found there is attended from
            device memory; the device's share of the others is copied in as it is read, replacing blocks not
            selected lately (a clock); the CPU attends the rest. The selection and the result are those of quest
            without it; only where each block is read from changes. None (default): DEFAULT_GPU_CACHE with a
            device share on CUDA, else 0 (off); on CUDA shrunk, with a warning, where the layers' caches together
            would take more than half the device's free memory (`cache.recall.RecallBudget`). It costs
            `gpu_cache * budget` of the host tier's bytes in device memory; a size set here is kept, and a
            `MemoryError` names it if it does not fit.
        scheduler: how each step's selected host blocks are split between the compute device and the CPU
            (`tandem.attention.queue`): "share" (default): the device attends `gpu_share` of every (request, KV
            head) segment's blocks, with the recall cache; "queue": Fluxion's priority queue: the segments, cut
            into pieces and listed largest first, are taken by the device from the front and the CPU from the back
            until none is left, so the split follows each side's speed with no tuning (no recall cache). The
            static splits `benchmarks/bench_scheduler.py` compares them with (`SCHEDULER_BASELINES`) are not
            settings: the benchmark sets them on the cache's layers (`LayerKV.queue_split`).

    Example:
        >>> TandemConfig(policy="quest", quest=QuestConfig(budget=0.1, gpu_share=0.5)).quest.budget
        0.1
    """

    KEY: ClassVar[str] = "quest"
    POLICIES: ClassVar[tuple[str, ...]] = ("quest",)
    READER: ClassVar[str] = "tandem.policies.quest"

    budget: float = 0.05
    gpu_share: float | None = None
    gpu_cache: float | None = None
    scheduler: str = "share"

    def check(self) -> None:
        self._set("budget", checked_float(self.path("budget"), self.budget, 0.0, 1.0, "(0, 1]", True))
        if self.gpu_share is not None:
            allowed = "None or a fraction in [0, 1]"
            self._set(
                "gpu_share", checked_float(self.path("gpu_share"), self.gpu_share, 0.0, 1.0, allowed, False)
            )
        if self.gpu_cache is not None:
            allowed = "None or a multiple of the budget in [0, 64] (0 = off)"
            self._set(
                "gpu_cache", checked_float(self.path("gpu_cache"), self.gpu_cache, 0.0, 64.0, allowed, False)
            )
        if self.gpu_cache and self.gpu_share == 0:
            fail(
                self.path("gpu_cache"),
                self.gpu_cache,
                "0 unless there is a device share (gpu_share None or > 0): the cache is filled by it",
            )
        allowed = " or ".join(f'"{name}"' for name in SCHEDULERS)
        if self.scheduler in SCHEDULER_BASELINES:
            fail(
                self.path("scheduler"),
                self.scheduler,
                f"{allowed} ({', '.join(map(repr, SCHEDULER_BASELINES))} are static baselines of "
                "benchmarks/bench_scheduler.py, which sets them on the cache's layers (LayerKV.queue_split), not "
                "in the config)",
            )
        if self.scheduler not in SCHEDULERS:
            fail(self.path("scheduler"), self.scheduler, allowed)
        if self.scheduler != "share" and self.gpu_cache:
            fail(
                self.path("gpu_cache"),
                self.gpu_cache,
                f"None or 0 with scheduler={self.scheduler!r} (the recall cache is filled by the device share)",
            )
        if self.gpu_share is not None and self.scheduler == "queue":
            fail(
                self.path("gpu_share"),
                self.gpu_share,
                f"None with scheduler={self.scheduler!r} (it sets no fraction)",
            )


@register
@dataclass(frozen=True)
class FluxionConfig(Feature):
    """policy="fluxion": per-head budgets that keep each head's output within `tau` of full attention, streaming
    heads skipped, the block size chosen per GQA group; from a calibration profile.

    Attributes:
        tau: the attention-output error each head may keep (Fluxion Eq. 2): its output may differ from full
            attention's by `tau` times the layer's largest head output. 0, or one of the profile's calibrated
            values (0.02, 0.05, 0.1, 0.2 in the shipped one); 0 attends everything.
        profile: the calibration profile file (`tandem calibrate --out`); None: the one shipped for the default
            model. A profile of a model with other shapes is refused.
        mode: where each step's per-head (bgt0, k, streaming) come from: "predictor" (the profile's MLP over 41
            features of the step) or "static" (the profile's calibrated per-head values); "oracle" measures each
            step's exact Eq. 2 budgets over every host entry, with no profile: it reads the whole host tier each
            step, an analysis mode that separates the budget rule from the predictor.
        granularity: a fixed logical block size (16, 32, 64 or 128) instead of each GQA group's Eq. 3 choice
            (None, the default); an ablation.
        skip_streaming: streaming heads select nothing (True, default); False gives every head its Eq. 1 budget
            (an ablation).

    Example:
        >>> TandemConfig(policy="fluxion", fluxion=FluxionConfig(tau=0.05, mode="static")).fluxion.mode
        'static'
    """

    KEY: ClassVar[str] = "fluxion"
    POLICIES: ClassVar[tuple[str, ...]] = ("fluxion",)
    READER: ClassVar[str] = "tandem.policies.fluxion"
    SERVER_ONLY: ClassVar[tuple[str, ...]] = ("profile",)  # a file on the server: never a client's choice

    tau: float = 0.1
    profile: str | None = None
    mode: str = "predictor"
    granularity: int | None = None
    skip_streaming: bool = True

    def check(self) -> None:
        allowed = "0 or a threshold in (0, 1) calibrated in the profile"
        self._set("tau", checked_float(self.path("tau"), self.tau, 0.0, 1.0, allowed, False))
        if self.tau >= 1.0:
            fail(self.path("tau"), self.tau, allowed)
        if self.profile is not None and not isinstance(self.profile, (str, os.PathLike)):
            fail(
                self.path("profile"),
                self.profile,
                "None (the default model's profile) or a path to a profile file",
            )
        if self.profile is not None:
            self._set("profile", os.fspath(self.profile))
        if self.mode not in FLUXION_MODES:
            fail(self.path("mode"), self.mode, " or ".join(map(repr, FLUXION_MODES)))
        if self.granularity is not None and (
            isinstance(self.granularity, bool) or self.granularity not in FLUXION_GRANULARITIES
        ):
            fail(
                self.path("granularity"), self.granularity, "None (Eq. 3 per group) or one of 16, 32, 64, 128"
            )
        if self.granularity is not None:
            self._set("granularity", int(self.granularity))
        self._set("skip_streaming", checked_switch(self.path("skip_streaming"), self.skip_streaming))


@register
@dataclass(frozen=True)
class CertifiedConfig(Feature):
    """Certified selection, for the policies `certified`, `quest` and `fluxion`.

    With quest (and `certified`, which is quest with it) `epsilon` replaces the fixed budget: each step, every
    query head keeps the fewest of its best host rows or blocks (`unit`; ranked by a sound upper bound of their
    attention mass) for which the mass it skips provably stays at most `epsilon` of its attention
    (`policies.certify`). With fluxion its own selection comes first and the certificate adds rows only to the
    heads it leaves above `epsilon`. It needs the host tier in the model's dtype (`host.dtype` None) and no device
    share (quest's gpu_share None or 0). `cache.stats()` reports the certificate of every step.

    Attributes:
        epsilon: in (0, 1); None (default): no certificate, except with policy `certified` (DEFAULT_EPSILON).
        max_budget: the most of a head's host rows (or blocks) one step may keep, in (0, 1] (fluxion's own
            selection is kept even past it): the cost stays bounded, and a step where it binds is reported as not
            meeting `epsilon`, with its certified bound.
        bound: the upper bound of the skipped logits: "sketch" (default) per row, from an int8 sketch of each host
            key and its error radius (q.k <= q.k~ + ||q|| ||k - k~||), kept beside the host tier on the compute
            device; "digest" per block, from Quest's key min / max and a centre + radius digest (many times looser
            on real keys: docs/certified.md). Both are sound.
        unit: what the certified selection keeps: "row" the fewest host rows, ranked by their own bounds, so a
            block with one heavy row costs one row, not `block_size` (needs the "sketch" bound); "block" whole
            blocks of `block_size` rows, ranked by their blocks' bounds. None (default): "row" with the sketch
            bound, "block" with the digest bound.

    Example:
        >>> TandemConfig(policy="quest", certified=CertifiedConfig(epsilon=0.02)).certified.bound
        'sketch'
    """

    KEY: ClassVar[str] = "certified"
    POLICIES: ClassVar[tuple[str, ...]] = CERTIFYING_POLICIES
    READER: ClassVar[str] = "tandem.policies.certified"

    epsilon: float | None = None
    max_budget: float = 0.5
    bound: str = "sketch"
    unit: str | None = None

    def check(self) -> None:
        if self.epsilon is not None:
            allowed = "None or a fraction in (0, 1)"
            self._set("epsilon", checked_float(self.path("epsilon"), self.epsilon, 0.0, 1.0, allowed, True))
            if self.epsilon >= 1.0:
                fail(self.path("epsilon"), self.epsilon, allowed)
        allowed = "a fraction in (0, 1]"
        self._set(
            "max_budget", checked_float(self.path("max_budget"), self.max_budget, 0.0, 1.0, allowed, True)
        )
        if self.bound not in CERTIFY_BOUNDS:
            fail(self.path("bound"), self.bound, " or ".join(map(repr, CERTIFY_BOUNDS)))
        if self.unit is not None and self.unit not in CERTIFY_UNITS:
            fail(self.path("unit"), self.unit, "None, " + " or ".join(map(repr, CERTIFY_UNITS)))
        if self.unit == "row" and self.bound != "sketch":
            fail(
                self.path("unit"),
                self.unit,
                "None or 'block' with bound='digest' (the digest bounds whole blocks; rows need the sketch)",
            )

    def rows(self) -> bool:
        """Whether the selection keeps rows (else whole blocks)."""
        return self.unit == "row" or (self.unit is None and self.bound == "sketch")


@register
@dataclass(frozen=True)
class DistributedConfig(Feature):
    """Tensor parallelism over several GPUs (`tandem.distributed`); on one GPU it changes nothing.

    Attributes:
        host_split: how the ranks divide the host tier and its CPU attention: "heads" (default) as the GPUs divide
            the model, each rank its heads of every request; "requests": PnG-KV's DP mapping, each rank every head
            of its own requests, with an all-to-all of the queries and of the partial outputs per layer
            (`cache.split`). "requests" supports the policies full, streaming and quest, with no device share
            (quest's gpu_share None or 0), no `host.dtype` and no epsilon.

    Example:
        >>> TandemConfig(policy="quest", distributed=DistributedConfig(host_split="requests")).distributed
        DistributedConfig(host_split='requests')
    """

    KEY: ClassVar[str] = "distributed"
    READER: ClassVar[str] = "tandem.cache.layer"

    host_split: str = "heads"

    def check(self) -> None:
        if self.host_split not in HOST_SPLITS:
            fail(self.path("host_split"), self.host_split, " or ".join(f'"{name}"' for name in HOST_SPLITS))


# the flat fields of the old TandemConfig, and where each went: (sub-config, field)
MOVED = {
    **{name: ("hgca", name) for name in ("beta", "maw_alpha", "span", "observation_tokens")},
    **{name: ("quest", name) for name in ("budget", "gpu_share", "gpu_cache", "scheduler")},
    **{name: ("fluxion", name) for name in ("tau", "profile", "granularity", "skip_streaming")},
    "fluxion_mode": ("fluxion", "mode"),
    "epsilon": ("certified", "epsilon"),
    "max_budget": ("certified", "max_budget"),
    "certify_bound": ("certified", "bound"),
    "certify_unit": ("certified", "unit"),
    "host_split": ("distributed", "host_split"),
    "host_dtype": ("host", "dtype"),
    "cpu_threads": ("host", "threads"),
    "huge_pages": ("host", "huge_pages"),
}


def moved_message(name: str, value=None) -> str:
    """The refusal of an old flat spelling, naming the new one in the Python API, in `--set` and in a request."""
    key, field = MOVED[name]
    cls = FEATURES[key].__name__
    shown = "..." if value is None else repr(value)
    # as --set reads it: a switch as 0 or 1
    text = "..." if value is None else str(int(value) if isinstance(value, bool) else value)
    try:
        body = "..." if value is None else json.dumps(value)
    except TypeError:
        body = "..."
    where = f"TandemConfig({key}={cls}({field}={shown}))"
    if field in FEATURES[key].SERVER_ONLY:  # not a request's: only the server sets it
        return (
            f"TandemConfig field {name!r} moved to {key}.{field}: use {where} or --set {key}.{field}={text}"
        )
    return (
        f"TandemConfig field {name!r} moved to {key}.{field}: use {where}, --set {key}.{field}={text}, or the "
        f'request field {key}.{field} (a JSON body {{"{key}": {{"{field}": {body}}}}})'
    )
