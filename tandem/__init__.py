"""Tandem: long-context decoding with the KV cache split between GPU and host memory, attention split between
GPU and CPU, and the two partial results merged exactly by log-sum-exp."""

from .config import (
    CertifiedConfig,
    DistributedConfig,
    FluxionConfig,
    HgcaConfig,
    HostConfig,
    QuestConfig,
    TandemConfig,
)

__version__ = "0.1.0"

_LAZY = {  # keep `import tandem` light: torch and transformers load only when used
    "TandemCache": "integrations.hf",
    "generate_cache_kwargs": "integrations.hf",
    "load_model": "models",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")


__all__ = [
    "CertifiedConfig", "DistributedConfig", "FluxionConfig", "HgcaConfig", "HostConfig", "QuestConfig",
    "TandemCache", "TandemConfig", "generate_cache_kwargs", "load_model", "__version__",
]  # fmt: skip
