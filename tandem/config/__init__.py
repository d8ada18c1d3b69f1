"""Tandem's configuration: `TandemConfig` (core settings) and one sub-config per policy or feature."""

from .core import (
    CORE_FIELDS,
    CPU_THREADS_ENV,
    ENGINE_CHOICES,
    MAX_WINDOW_TOKENS,
    POLICIES,
    TandemConfig,
    default_cpu_threads,
    parse_number,
    setting_names,
    uses_engine,
)
from .features import (
    CERTIFY_BOUNDS,
    CERTIFY_UNITS,
    CERTIFYING_POLICIES,
    DEFAULT_EPSILON,
    DEFAULT_GPU_CACHE,
    DEFAULT_GPU_SHARE,
    FEATURES,
    FLUXION_GRANULARITIES,
    FLUXION_MODES,
    HOST_DTYPES,
    HOST_SPLIT_POLICIES,
    HOST_SPLITS,
    MOVED,
    SCHEDULER_BASELINES,
    SCHEDULERS,
    CertifiedConfig,
    DistributedConfig,
    Feature,
    FluxionConfig,
    HgcaConfig,
    HostConfig,
    QuestConfig,
    moved_message,
)
from .settings import parse_setting

__all__ = [
    "CERTIFYING_POLICIES", "CERTIFY_BOUNDS", "CERTIFY_UNITS", "CORE_FIELDS", "CPU_THREADS_ENV", "DEFAULT_EPSILON",
    "DEFAULT_GPU_CACHE", "DEFAULT_GPU_SHARE", "ENGINE_CHOICES", "FEATURES", "FLUXION_GRANULARITIES",
    "FLUXION_MODES", "HOST_DTYPES", "HOST_SPLITS", "HOST_SPLIT_POLICIES", "MAX_WINDOW_TOKENS", "MOVED", "POLICIES",
    "SCHEDULERS", "SCHEDULER_BASELINES", "CertifiedConfig", "DistributedConfig", "Feature", "FluxionConfig",
    "HgcaConfig", "HostConfig", "QuestConfig", "TandemConfig", "default_cpu_threads", "moved_message",
    "parse_number", "parse_setting", "setting_names", "uses_engine",
]  # fmt: skip
