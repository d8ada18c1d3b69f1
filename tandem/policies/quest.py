"""Quest: per KV head, the top `budget` fraction of host blocks by the upper bound of q.k (Fluxion §2.1).

With the hot tier on a GPU the host tier mirrors its block digests there, and the bound and the top-k run
on the GPU inside the decode step (Triton kernels over the digests at HBM speed); only the selected block
ids travel to the CPU with q. Otherwise the compiled CPU kernels score the host digests.

With `gpu_share` > 0 a share of each step's selected blocks is attended by the compute device itself,
straight from pinned host memory (`attention.decode.device_part`), and the CPU attends the rest: both read the
host tier at once, one over PCIe and one from DRAM (Fluxion's CPU+GPU split of the sparse attention).

With `epsilon` the fixed budget gives way to a certified selection (`certify`): each query head keeps the
fewest blocks whose skipped mass provably stays under epsilon, and every step's certificate is counted
(`statistics`).
"""

from __future__ import annotations

import math

import torch

from ..kernels import ops
from .base import ALL, NONE, Policy, Selection
from .certified import Certifier
from .granularity import ids_selection, mask_to_ids


class QuestPolicy(Policy):
    name = "quest"
    needs_digest = True

    def __init__(self, config) -> None:
        super().__init__(config)
        # blocks_this_step on the digests' device (read by device_select's kernels) and its value on the host
        self._k: torch.Tensor | None = None
        self._k_value: int | None = None
        self.certified = config.certified.epsilon is not None
        self.needs_bounds = self.certified
        self.certifier = Certifier(config) if self.certified else None
        self.keeps_ranked_range = not self.certified
        # device_select is `rank_blocks` over the host tier's digest mirror, which a pooled step may run for
        # several requests at once (`attention.rows.PooledRows.rank`)
        self.ranks_by_mirror = not self.certified

    def device_select(self, layer, q: torch.Tensor) -> torch.Tensor | None:
        """Block ids [B, Hkv, k_max], k_max = ceil(budget * capacity blocks) so the shape stays fixed while the
        host tier fills, whose first k = ceil(budget * blocks) entries are this step's top-k (`select` keeps
        those); invalid picks carry an id past every block.

        With Triton the top-k is a set (`ops.top_blocks`: ids ascending, the rest invalid picks) for the k held
        in a device tensor that `prepare_step` updates before each step, so a recorded graph follows the host
        tier's growth. Without it, torch.topk ranks k_max blocks best first (any k's top-k is a prefix)."""
        if self.certified:
            return self._certified_select(layer, q)
        host = layer.host
        if host is None or host.key_min_dev is None:
            return None
        num_blocks = host.key_min_dev.shape[2]
        mirror = (host.key_min_dev, host.key_max_dev, host.block_valid_dev)
        return rank_blocks(q, *mirror, self.step_blocks(layer, q.device), self.ranking_width(num_blocks))

    def ranking_width(self, num_blocks: int) -> int:
        """k_max: the width of device_select's ids over a mirror of `num_blocks` blocks."""
        return min(num_blocks, math.ceil(self.config.quest.budget * num_blocks))

    def step_blocks(self, layer, device) -> torch.Tensor:
        """[1] int64 on `device`: blocks_this_step, refreshed here unless a graph is being recorded (the
        engine's `DecodeStep.prepare` refreshes it through `prepare_step` before every step)."""
        self._make_k(device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self.prepare_step(layer)
        return self._k

    def prepare_step(self, layer) -> None:
        super().prepare_step(layer)
        if layer.host is not None and layer.hot is not None:
            # eagerly: made inside a recording, the block count would be zeroed again at every replay
            self._make_k(layer.hot.keys.device)
        if self._k is not None:
            value = self.blocks_this_step(layer)
            if value != self._k_value:
                self._k.fill_(value)
                self._k_value = value

    def _make_k(self, device) -> None:
        if self._k is None or self._k.device != device:
            self._k, self._k_value = torch.zeros(1, dtype=torch.long, device=device), None

    def blocks_this_step(self, layer) -> int:
        """Blocks each KV head attends this step: ceil(budget * host blocks)."""
        host = layer.host
        return math.ceil(self.config.quest.budget * (host.rows // host.block_size))

    def device_share(self, layer) -> int:
        """How many of this step's selected blocks (the first entries of device_select's ids) the compute device
        attends itself: the layer's gpu_share of them."""
        host = layer.host
        if layer.gpu_share == 0 or host is None or host.key_min_dev is None:
            return 0
        k = self.blocks_this_step(layer)
        return min(k, math.floor(layer.gpu_share * k + 0.5))

    def ranked_range(self, layer, from_device, skip: int) -> tuple[int, int] | None:
        """select() with device-ranked ids keeps ranks [skip, ceil(budget * blocks)) (the invalid picks dropped,
        the rest sorted): that is `reference.ranked_blocks`, done by the compiled call in one go."""
        if self.certified:
            return None  # lengths differ per KV head
        k = self.blocks_this_step(layer)
        if from_device is None or from_device.shape[-1] < k:
            return None
        return min(skip, k), k

    def select(self, layer, q, from_device=None, skip: int = 0) -> Selection:
        if self.certified:
            return self._certified_selection(layer, q, from_device)
        host = layer.host
        k = self.blocks_this_step(layer)
        if k - skip <= 0:
            return NONE
        if from_device is not None and from_device.shape[-1] >= k:
            # selected on the device; invalid picks carry an id past every block, so they sort last. The first
            # `skip` entries are the device's share (decode.device_part), the CPU attends entries [skip, k)
            blocks = from_device[..., skip:k].sort(dim=-1).values
            lengths = (blocks < host.capacity // host.block_size).sum(dim=-1)
            blocks = blocks.masked_fill(torch.arange(k - skip) >= lengths[..., None], 0)
            return Selection("blocks", blocks, lengths, host.block_size)
        if skip:
            raise ValueError("quest: a device share needs the device-ranked block ids (from_device)")
        key_min, key_max = host.digest()
        scores = ops.block_scores(q, key_min, key_max, num_threads=self.config.host.threads)
        blocks, lengths = ops.topk_blocks(scores, k, num_threads=self.config.host.threads)
        return Selection("blocks", blocks, lengths, host.block_size)

    # ---- certified selection (`epsilon`) ------------------------------------------------------------------
    def attends_all(self, layer, q: torch.Tensor) -> bool:
        """Whether this step attends every host row instead of selecting: with policy "certified" (the default)
        on a cache whose hot tier is on the CPU. There one CPU both selects and attends, and the certified
        selection measured slower than attending every row at each context measured (docs/certified.md § The
        default on a CPU); attending all of them is exact, so the certificate holds with p = 0. `quest` with an
        epsilon always selects."""
        host = layer.host
        return self._all_on(q.device) and host is not None and host.rows > 0

    def every_row_step(self, layer, q: torch.Tensor) -> bool:
        """`attends_all` (the default on a CPU), with the certificate's step recorded as `device_select` records
        it."""
        if not self.attends_all(layer, q):
            return False
        self.certifier.attend_all(layer, q)
        return True

    def _all_on(self, device: torch.device) -> bool:
        return self.config.policy == "certified" and device.type == "cpu"

    def needs_bounds_on(self, device: torch.device) -> bool:
        """The default on a CPU never selects (`attends_all`): its host tier keeps no bounds or key sketch."""
        return self.needs_bounds and not self._all_on(device)

    def _certified_select(self, layer, q: torch.Tensor) -> torch.Tensor | None:
        """[B, Hkv, n] int64: each KV head's certified units (rows or blocks) ascending, then n (none); see
        `certified`. None where the step attends every host row (`attends_all`) or there is none."""
        if self.attends_all(layer, q):
            self.certifier.attend_all(layer, q)
            return None
        union = self.certifier.select(layer, q)
        return None if union is None else mask_to_ids(union)

    def _certified_selection(self, layer, q, from_device) -> Selection:
        if from_device is None and self.attends_all(layer, q):
            return ALL
        if from_device is None:
            from_device = self._certified_select(layer, q[:, :, 0])
            if from_device is None:
                return NONE
        return ids_selection(from_device, self.certifier.unit(layer.host))


def rank_blocks(q, key_min, key_max, block_valid, k, width: int) -> torch.Tensor:
    """Quest's device-side ranking: block ids [B, Hkv, width] whose first k[b] entries are request b's top-k by
    the bound of q [B, Hq, D] over digest mirrors key_min / key_max [B, Hkv, NB, D] (block_valid [B, NB]); k a
    [1] or [B] int64 tensor on q's device (read there, so a recorded graph follows it). Invalid picks carry the
    id NB. With Triton (or on CPU tensors) the top-k is a set, ids ascending (`ops.top_blocks`); else torch.topk
    ranks `width` blocks best first (any k's top-k is a prefix)."""
    scores = ops.block_scores_matmul(q, key_min, key_max, block_valid)
    if ops.top_blocks_available(scores):
        return ops.top_blocks(scores, k, width)
    best, ids = torch.topk(scores, width, dim=-1, sorted=True)
    return ids.masked_fill(best == float("-inf"), scores.shape[-1])  # invalid picks: an id past every block
