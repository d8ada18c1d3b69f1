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
from . import certify
from .base import NONE, Policy, Selection
from .fluxion import _digests
from .granularity import ids_selection, mask_to_ids

# device-side counters of the certified selection, summed over steps (`QuestPolicy.statistics`)
CERT_COUNTERS = (
    "head_steps", "p_sum", "p_max", "bound_sum", "bound_max", "met", "excess_max", "blocks_kept", "blocks_live",
)  # fmt: skip


def certified_mass(host, q: torch.Tensor, scale: float, bound: str):
    """(mass, lower [B, Hq, nb], rows [B, nb]): the log of an upper and of a lower bound of each host block's
    mass per query head, and its rows, from the key sketch (`bound` "sketch") or the block digests ("digest");
    see `certify`. nb covers the device mirror's capacity where there is one (so that a recorded step follows
    the host tier's growth; the blocks past the live ones have no rows), else the live blocks."""
    mirrored = host.key_min_dev is not None and host.key_min_dev.device == q.device
    nb = (host.capacity if mirrored else host.rows) // host.block_size
    rows = host.block_rows_dev[:, :nb]
    if bound == "sketch":
        n = nb * host.block_size
        upper, lower = certify.sketch_logit_bounds(
            q, host.key_codes_dev[:, :, :n], host.key_code_scale_dev[:, :, :n], host.key_code_error_dev[:, :, :n],
            host.row_valid_dev[:, :n], scale,
        )  # fmt: skip
        return (*(certify.sketch_mass_bounds(b, host.block_size) for b in (upper, lower)), rows)
    key_min, key_max, _ = _digests(host, q.device)
    centre, radius = host.key_centre_dev[:, :, :nb], host.key_radius_dev[:, :, :nb]
    upper = certify.mass_bounds(certify.logit_bounds(q, key_min, key_max, centre, radius, rows, scale), rows)
    return upper, certify.ball_lower_mass(q, centre, radius, rows, scale), rows


class QuestPolicy(Policy):
    name = "quest"
    needs_digest = True

    def __init__(self, config) -> None:
        super().__init__(config)
        # blocks_this_step on the digests' device (read by device_select's kernels) and its value on the host
        self._k: torch.Tensor | None = None
        self._k_value: int | None = None
        self.certified = config.epsilon is not None
        self.needs_bounds = self.certified
        self._step = None  # the certified selection of the step in flight, for after_attention
        self._counters: torch.Tensor | None = None
        self._maxima: torch.Tensor | None = None  # which counters keep a maximum instead of a sum
        # (p [B, Hq], output bound [B, Hq]) of the last step's certificate, None when it had no host tier
        self.last_certificate: tuple[torch.Tensor, torch.Tensor] | None = None

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
        scores = ops.block_scores_matmul(q, host.key_min_dev, host.key_max_dev, host.block_valid_dev)
        num_blocks = scores.shape[-1]
        k_max = min(num_blocks, math.ceil(self.config.budget * num_blocks))
        if ops.top_blocks_available(scores):
            return ops.top_blocks(scores, self.step_blocks(layer, scores.device), k_max)
        best, ids = torch.topk(scores, k_max, dim=-1, sorted=True)
        return ids.masked_fill(best == float("-inf"), num_blocks)  # invalid picks: an id past every block

    def step_blocks(self, layer, device) -> torch.Tensor:
        """[1] int64 on `device`: blocks_this_step, refreshed here unless a graph is being recorded (the
        engine's `DecodeStep.prepare` refreshes it through `prepare_step` before every step)."""
        if self._k is None or self._k.device != device:
            self._k, self._k_value = torch.zeros(1, dtype=torch.long, device=device), None
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self.prepare_step(layer)
        return self._k

    def prepare_step(self, layer) -> None:
        if self._k is not None:
            value = self.blocks_this_step(layer)
            if value != self._k_value:
                self._k.fill_(value)
                self._k_value = value

    def blocks_this_step(self, layer) -> int:
        """Blocks each KV head attends this step: ceil(budget * host blocks)."""
        host = layer.host
        return math.ceil(self.config.budget * (host.rows // host.block_size))

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
        scores = ops.block_scores(q, key_min, key_max, num_threads=self.config.cpu_threads)
        blocks, lengths = ops.topk_blocks(scores, k, num_threads=self.config.cpu_threads)
        return Selection("blocks", blocks, lengths, host.block_size)

    # ---- certified selection (`epsilon`) ------------------------------------------------------------------
    def _certified_select(self, layer, q: torch.Tensor) -> torch.Tensor | None:
        """[B, Hkv, nb] int64: each KV head's certified blocks ascending, then nb (none); see `certify`."""
        host = layer.host
        if host is None or host.rows == 0:
            self._step = None
            return None
        scale = layer.attention_scale if layer.attention_scale is not None else q.shape[-1] ** -0.5
        with torch.no_grad():
            mass, lower, rows = certified_mass(host, q, scale, self.config.certify_bound)
            value_norm = host.value_norm_dev[:, :, : rows.shape[1]]
            known = certify.hot_mass(q, layer.hot.keys, layer.hot.valid, scale)
            # live blocks [B, 1] as a device tensor, so that a recorded step follows the host tier's growth
            live = (rows > 0).sum(-1, keepdim=True)
            most = torch.ceil(live * self.config.max_budget).long().clamp(min=1)  # [B, 1]
            union, needed, kept = certify.certified_blocks(
                mass, known, self.config.epsilon, most, layer.num_kv_heads, lower
            )
        self._step = (mass, union, value_norm, rows, needed <= kept, union.sum(-1), live, needed)
        return mask_to_ids(union)

    def _certified_selection(self, layer, q, from_device) -> Selection:
        if from_device is None:
            from_device = self._certified_select(layer, q[:, :, 0])
            if from_device is None:
                return NONE
        return ids_selection(from_device, layer.host.block_size)

    def after_attention(self, layer, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Count this step's certificate (`certify.certificate`) on the device, with the exact attended mass."""
        self.last_certificate = None
        if self._step is None:
            return
        mass, union, value_norm, rows, met, kept_blocks, live, _ = self._step
        self._step = None
        with torch.no_grad():
            p, bound = certify.certificate(mass, union, value_norm, rows, lse, out)
            self.last_certificate = (p, bound)
            excess = (p - self.config.epsilon).clamp(min=0)
            step = torch.stack([
                torch.full_like(p[0, 0], p.numel()), p.sum(), p.max(), bound.sum(), bound.max(),
                met.float().sum(), excess.max(), kept_blocks.float().sum(), (live.float() * layer.num_kv_heads).sum(),
            ])  # fmt: skip
            if self._counters is None or self._counters.device != step.device:
                # made in the eager warm-up steps, updated in place: a recorded step adds to the same tensor
                self._counters = torch.zeros_like(step)
                self._maxima = torch.zeros_like(step, dtype=torch.bool)
                self._maxima[2:7:2] = True  # p_max, bound_max, excess_max
            counters = self._counters
            counters.copy_(torch.where(self._maxima, torch.maximum(counters, step), counters + step))

    def statistics(self) -> dict:
        """The certified selection's counters since the last reset (one device read): see CERT_COUNTERS."""
        values = self._counters.tolist() if self._counters is not None else [0.0] * len(CERT_COUNTERS)
        return dict(zip(CERT_COUNTERS, values))

    def reset_statistics(self) -> None:
        if self._counters is not None:
            self._counters.zero_()  # in place: a recorded step keeps adding to this tensor
