"""HGCA: per head, host entries whose moving average of attention weights (MAW) exceeds beta / n (HGCA 3.2).

The selection is kept as per-(request, KV head) row lists, extended when blocks are evicted (threshold over the
hot tier's entry count, Algorithm 1 line 23) and rebuilt from the appended prompt's attention after every
prefill or append (re-evaluation, line 20). A KV head attends the union of its query heads' salient rows, so one
pass over its rows serves the whole GQA group.

`span` (TandemConfig) widens each salient entry forward: an entry is kept when any of the `span` entries ending
at it is salient, applied as a forward max over the MAW before the threshold (span 1 = the paper's rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import ops
from .base import NONE, Policy, Selection


class HGCAPolicy(Policy):
    name = "hgca"
    needs_maw = True
    keeps_selection = True  # self.indices / self.lengths, extended in place (reallocated only to grow)
    # the selection and the evictions queued for it, read on the host at each step (`engine.step.read_layout`)
    layout_skips = ("indices", "lengths", "_evicted")

    def __init__(self, config) -> None:
        super().__init__(config)
        self.indices: torch.Tensor | None = None  # [B, Hkv, width] int64, host memory
        self.lengths: torch.Tensor | None = None  # [B, Hkv] int64
        self._evicted: list[tuple[int, int, torch.Tensor]] = []  # blocks not yet thresholded

    def clear(self) -> None:
        super().clear()
        self.indices = self.lengths = None
        self._evicted = []

    def select(self, layer, q, from_device=None, skip: int = 0) -> Selection:
        self._threshold_evicted(layer)
        if self.lengths is None or int(self.lengths.max()) == 0:
            return NONE
        width = int(self.lengths.max())
        return Selection("rows", self.indices[..., :width], self.lengths)

    def on_evict(self, layer, first_row: int, num_rows: int, hot_counts) -> None:
        # thresholded on the CPU at the next select (after host.wait()), so the GPU never waits for it
        self._evicted.append((first_row, num_rows, hot_counts))

    def prefix_state(self):
        # the evictions not yet thresholded (each its first row, rows and the hot counts then: read-only tensors)
        return list(self._evicted)

    def restore_prefix_state(self, state) -> None:
        self._evicted = list(state)

    def _threshold_evicted(self, layer) -> None:
        """Algorithm 1, line 23: evicted rows with MAW > beta / n_gpu join the selection."""
        host = layer.host
        for first, n, hot_counts in self._evicted:
            maw = self._widen(host.maw[:, :, first : first + n])  # [B, Hq, n]
            batch, num_q_heads, _ = maw.shape
            threshold = self.config.hgca.beta / hot_counts.clamp(min=1).to(maw.dtype)
            keep = (maw > threshold[:, None, None]) & host.valid[:, None, first : first + n]
            keep = keep.view(batch, layer.num_kv_heads, num_q_heads // layer.num_kv_heads, n).any(dim=2)
            self._extend(keep, first)
        self._evicted.clear()

    def on_append(self, layer, host_weights) -> None:
        host = layer.host
        self._evicted.clear()  # the rebuild below covers every host row
        if host.rows == 0 or host_weights is None:
            return
        host.maw[:, :, : host.rows].copy_(host_weights)
        threshold = self.config.hgca.beta / host.valid_rows().clamp(min=1).to(torch.float32)  # [B]
        threshold = threshold[:, None].expand(-1, layer.num_q_heads)
        masked = self._widen(host_weights.masked_fill(~host.valid[:, None, : host.rows], 0.0))
        self.indices, self.lengths = ops.threshold_select(
            masked, threshold, layer.num_kv_heads, host.rows, num_threads=self.config.host.threads
        )

    def _widen(self, maw: torch.Tensor) -> torch.Tensor:
        """[B, Hq, N] -> max of each entry's MAW and the MAW of the `span - 1` entries before it."""
        span = self.config.hgca.span
        if span == 1 or maw.shape[-1] == 0:
            return maw
        return F.max_pool1d(F.pad(maw, (span - 1, 0)), span, stride=1)

    def _extend(self, keep: torch.Tensor, first_row: int) -> None:
        batch, num_kv_heads, n = keep.shape
        if self.lengths is None:
            self.lengths = torch.zeros(batch, num_kv_heads, dtype=torch.long)
            self.indices = torch.zeros(batch, num_kv_heads, 1, dtype=torch.long)
        counts = keep.sum(dim=-1)
        need = int((self.lengths + counts).max()) + 1  # the last column is a scratch slot for dropped rows
        if need > self.indices.shape[-1]:
            width = max(need, self.indices.shape[-1] * 3 // 2)
            grown = torch.zeros(batch, num_kv_heads, width, dtype=torch.long)
            grown[..., : self.indices.shape[-1]] = self.indices
            self.indices = grown
        scratch = self.indices.shape[-1] - 1
        # destination of each kept row: after the current list, in row order
        slot = self.lengths[..., None] + torch.cumsum(keep.long(), dim=-1) - 1
        dest = torch.where(keep, slot, torch.full_like(slot, scratch))
        rows = torch.arange(first_row, first_row + n).expand(batch, num_kv_heads, n)
        self.indices.scatter_(-1, dest, rows)
        self.lengths += counts
