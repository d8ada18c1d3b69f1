"""Triton GPU kernels: hot-tier decode attention (with HGCA's moving average), zero-copy attention over
selected blocks of a pinned host store, Quest's block bounds over the digests and its top-k, and an in-place LSE merge.

`triton_kernels` holds only the `@triton.jit` functions; `attention` holds their launchers, which validate
inputs and launch. Importing this package never fails: without triton, `triton_available` is False and the
callers use `tandem.kernels.reference` instead.
"""

from .attention import (
    block_scores,
    host_block_attention,
    hot_decode_attention,
    interpreted,
    merge_lse_,
    prefill_attention,
    recall_blocks,
    recall_plan,
    top_blocks,
    triton_available,
)

__all__ = [
    "block_scores",
    "hot_decode_attention",
    "host_block_attention",
    "interpreted",
    "merge_lse_",
    "prefill_attention",
    "recall_blocks",
    "recall_plan",
    "top_blocks",
    "triton_available",
]
