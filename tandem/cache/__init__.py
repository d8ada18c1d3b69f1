"""Tiered KV cache: hot tier (device ring), host tier (pinned host memory), per-layer eviction."""

from .host import HostMemoryError, HostTier
from .hot import HotTier
from .layer import LayerKV

__all__ = ["HostMemoryError", "HostTier", "HotTier", "LayerKV"]
