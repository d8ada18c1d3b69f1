"""Tandem: long-context decoding with the KV cache split between GPU and host memory, attention split between
GPU and CPU, and the two partial results merged exactly by log-sum-exp."""

from .config import TandemConfig
from .models import load_model

__version__ = "0.1.0"


def __getattr__(name):  # keep `import tandem` light: transformers loads only when the cache is used
    if name in ("TandemCache", "generate_cache_kwargs"):
        from .integrations import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")


__all__ = ["TandemCache", "TandemConfig", "generate_cache_kwargs", "load_model", "__version__"]
