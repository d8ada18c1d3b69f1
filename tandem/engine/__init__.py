"""Engine: chunked prefill and fixed-address decode steps (one CUDA graph per step) over a `TandemCache`."""

from .runner import TandemRunner
from .sampling import Sampler, SamplingParams
from .step import DecodeStep, freeze_heap

__all__ = ["DecodeStep", "Sampler", "SamplingParams", "TandemRunner", "freeze_heap"]
