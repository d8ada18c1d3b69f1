"""Quest: per KV head, the top `budget` fraction of host blocks by the upper bound of q.k (fluxion.txt 2.1).

With the hot tier on a GPU the host tier mirrors its block digests there, and the bound and the top-k run
on the GPU inside the decode step (a few microseconds over the digests at HBM speed); only the ranked block
ids travel to the CPU with q. Otherwise the compiled CPU kernels score the host digests.

With `gpu_share` > 0 the best-ranked share of each step's blocks is attended by the compute device itself,
straight from pinned host memory (`attention.decode.device_part`), and the CPU attends the rest: both read the
host tier at once, one over PCIe and one from DRAM (Fluxion's CPU+GPU split of the sparse attention).
"""

from __future__ import annotations

import math

import torch

from ..kernels import ops
from .base import NONE, Policy, Selection


class QuestPolicy(Policy):
    name = "quest"
    needs_digest = True

    def device_select(self, layer, q: torch.Tensor) -> torch.Tensor | None:
        """Block ids [B, Hkv, k_max] by descending bound, k_max = ceil(budget * capacity blocks), so the
        shape stays fixed while the host tier fills; `select` keeps the first ceil(budget * blocks)."""
        host = layer.host
        if host is None or host.key_min_dev is None:
            return None
        scores = ops.block_scores_matmul(q, host.key_min_dev, host.key_max_dev, host.block_valid_dev)
        num_blocks = scores.shape[-1]
        k_max = min(num_blocks, math.ceil(self.config.budget * num_blocks))
        best, ids = torch.topk(scores, k_max, dim=-1, sorted=True)
        return ids.masked_fill(best == float("-inf"), num_blocks)  # invalid picks: an id past every block

    def blocks_this_step(self, layer) -> int:
        """Blocks each KV head attends this step: ceil(budget * host blocks)."""
        host = layer.host
        return math.ceil(self.config.budget * (host.rows // host.block_size))

    def device_share(self, layer) -> int:
        """How many of the ranked blocks (the best ones) the compute device attends itself: the layer's
        gpu_share of them."""
        host = layer.host
        if layer.gpu_share == 0 or host is None or host.key_min_dev is None:
            return 0
        k = self.blocks_this_step(layer)
        return min(k, math.floor(layer.gpu_share * k + 0.5))

    def ranked_range(self, layer, from_device, skip: int) -> tuple[int, int] | None:
        """select() with device-ranked ids keeps ranks [skip, ceil(budget * blocks)) (the invalid picks dropped,
        the rest sorted): that is `reference.ranked_blocks`, done by the compiled call in one go."""
        k = self.blocks_this_step(layer)
        if from_device is None or from_device.shape[-1] < k:
            return None
        return min(skip, k), k

    def select(self, layer, q, from_device=None, skip: int = 0) -> Selection:
        host = layer.host
        k = self.blocks_this_step(layer)
        if k - skip <= 0:
            return NONE
        if from_device is not None and from_device.shape[-1] >= k:
            # ranked on the device; invalid picks carry an id past every block, so they sort last. The first
            # `skip` ranks are the device's share (decode.device_part), the CPU attends ranks [skip, k)
            blocks = from_device[..., skip:k].sort(dim=-1).values
            lengths = (blocks < host.capacity // host.block_size).sum(dim=-1)
            blocks = blocks.masked_fill(torch.arange(k - skip) >= lengths[..., None], 0)
            return Selection("blocks", blocks, lengths, host.block_size)
        if skip:
            raise ValueError("quest: a device share needs the device-ranked block ids (from_device)")
        key_min, key_max = host.digest()
        scores = ops.block_scores(q, key_min, key_max, num_threads=self.config.cpu_threads)
        blocks, lengths = ops.topk_blocks(scores, k, num_threads=self.config.cpu_threads)
        return Selection("blocks", blocks, lengths, host.block_size)
