"""Triton GPU kernels: hot-tier decode attention (with HGCA's moving average), zero-copy attention over
selected blocks of a pinned host store, Quest's block bounds over the digests and its top-k, the certified
selection's sketch bounds and histogram, quest's recall cache, an in-place LSE merge, the GPU's side of a step's
task queue, and the model's fused small layers.

Each concern is a pair: `<concern>_kernels.py` holds only its `@triton.jit` functions, `<concern>.py` their
launchers, which validate inputs and launch (`attention`, `selection`, `recall`, `layers`). `_common.py` holds
what the launchers share (the optional triton import, the interpreter's set-up, the input checks) and
`_common_kernels.py` the jit helpers the kernels share. Importing this package never fails: without triton,
`triton_available` is False and the callers use `tandem.kernels.reference` instead.
"""

from ._common import interpreted, triton_available
from .attention import host_block_attention, hot_decode_attention, merge_lse_, prefill_attention
from .certify import certify_histogram, sketch_bounds
from .queue import claim_probe, queue_attention
from .recall import recall_blocks, recall_blocks_table, recall_plan, store_table
from .selection import block_scores, top_blocks

__all__ = [
    "block_scores",
    "certify_histogram",
    "hot_decode_attention",
    "host_block_attention",
    "interpreted",
    "merge_lse_",
    "prefill_attention",
    "claim_probe",
    "queue_attention",
    "recall_blocks",
    "recall_blocks_table",
    "store_table",
    "recall_plan",
    "sketch_bounds",
    "top_blocks",
    "triton_available",
]
