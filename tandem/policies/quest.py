"""Quest: per KV head, the top `budget` fraction of host blocks by the upper bound of q.k (fluxion.txt 2.1)."""

from __future__ import annotations

import math

from ..kernels import ops
from .base import NONE, Policy, Selection


class QuestPolicy(Policy):
    name = "quest"
    needs_digest = True

    def select(self, layer, q) -> Selection:
        host = layer.host
        num_blocks = host.rows // host.block_size
        k = math.ceil(self.config.budget * num_blocks)
        if k == 0:
            return NONE
        key_min, key_max = host.digest()
        scores = ops.block_scores(q, key_min, key_max, num_threads=self.config.cpu_threads)
        blocks, lengths = ops.topk_blocks(scores, k, num_threads=self.config.cpu_threads)
        return Selection("blocks", blocks, lengths, host.block_size)
