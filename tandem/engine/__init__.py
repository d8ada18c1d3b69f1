"""Engine: chunked prefill and fixed-address decode steps (one CUDA graph per step) over a `TandemCache`."""

from .runner import TandemRunner
from .step import DecodeStep, freeze_heap

__all__ = ["DecodeStep", "TandemRunner", "freeze_heap"]
