"""Engine: chunked prefill and fixed-address decode steps (one CUDA graph per step) over a `TandemCache`, or over
the batch-1 caches of several requests (`RowsRunner`, the server's step)."""

from .rows import RowsRunner
from .runner import TandemRunner
from .sampling import Sampler, SamplingParams
from .step import DecodeStep, freeze_heap

__all__ = ["DecodeStep", "RowsRunner", "Sampler", "SamplingParams", "TandemRunner", "freeze_heap"]
