"""Compiled CPU kernels: sparse attention with LSE (over selected rows, or over ranks of device-ranked
blocks), block scoring + top-k, HGCA threshold selection, the certified row selection.

Plain C++ with OpenMP, built with the system compiler on first use and cached (see `_library`), with
run-time SIMD dispatch (AVX-512-BF16 -> AVX-512F -> AVX2/FMA -> portable). Every function matches its
namesake in `tandem.kernels.reference` and falls back to it, with one warning, if no compiler is found.
These are thin bindings: the launchers of `tandem.kernels.ops` validate the arguments and call them.

>>> from tandem.kernels import cpu
>>> cpu.is_available(), cpu.isa()  # e.g. (True, 'avx512bf16')
"""

from __future__ import annotations

from tandem.kernels.cpu import _library
from tandem.kernels.cpu._library import (
    ABORTED,
    SERVED,
    TASK_FAILED,
    TIMED_OUT,
    default_num_threads,
    prefetch_config,
)
from tandem.kernels.cpu.certify import certified_rows
from tandem.kernels.cpu.ops import (
    PreparedAttention,
    PreparedMerge,
    QueueAttention,
    RankedAttention,
    RankedRowsAttention,
    StoresAttention,
    claim_probe,
    empty_task,
    merge_lse_,
    queue_gpu_claim,
    ranked_block_attention,
    serve_handoffs,
    sparse_attention_lse,
)
from tandem.kernels.cpu.selection import block_scores, read_sum, score_topk, threshold_select, topk_blocks


def has_certified_rows() -> bool:
    """True when the library carries the certified row selection (`certified_rows`)."""
    lib = _library.library()
    return lib is not None and hasattr(lib, "tandem_certified_rows")


def is_available() -> bool:
    """True when the compiled kernels load (building them on first call if needed)."""
    return _library.library() is not None


def isa() -> str | None:
    """The SIMD path in use ("scalar", "avx2", "avx512", "avx512bf16"), or None without the library."""
    if not is_available():
        return None
    return _library.ISA_NAMES[_library.isa_code()]


def supported_isas() -> tuple[str, ...]:
    """Every SIMD path this CPU can run (each can be forced with TANDEM_CPU_ISA)."""
    return _library.supported_isas() if is_available() else ()


__all__ = [
    "ABORTED",
    "SERVED",
    "TASK_FAILED",
    "TIMED_OUT",
    "PreparedAttention",
    "PreparedMerge",
    "QueueAttention",
    "RankedAttention",
    "RankedRowsAttention",
    "StoresAttention",
    "claim_probe",
    "merge_lse_",
    "queue_gpu_claim",
    "block_scores",
    "certified_rows",
    "default_num_threads",
    "prefetch_config",
    "empty_task",
    "has_certified_rows",
    "is_available",
    "isa",
    "ranked_block_attention",
    "read_sum",
    "score_topk",
    "serve_handoffs",
    "sparse_attention_lse",
    "supported_isas",
    "threshold_select",
    "topk_blocks",
]
