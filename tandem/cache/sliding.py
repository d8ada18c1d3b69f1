"""A sliding-window layer's KV: the last tokens of its window on the model's device, never offloaded or selected.

A sliding-window layer (Gemma 3's local layers, Mistral's window) lets a query at position p attend the keys at
positions p - window + 1 .. p, itself included. Its cache therefore never needs more than the `window - 1` tokens
before the next one, and those stay on the device: no host tier, no selection, exact attention. Memory then grows
with the global layers alone. Positions are slots as the model counts them (left padding included), as the model's
own sliding mask counts them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .failure import Failable

KIND = "sliding_attention"


class SlidingKV(Failable):
    """The last `window - 1` tokens of one sliding-window layer, on the device of the first tokens stored.

    keys, values: [B, Hkv, n, D] (n <= window - 1), or None before the first tokens
    valid:        [B, n] bool, False for padding slots
    seq_len:      slots stored since the start (padding included): the next token's position
    """

    kind = KIND

    def __init__(
        self, layer_idx: int, window: int, num_kv_heads: int, head_dim: int, query_chunk: int
    ) -> None:
        if window < 1:
            raise ValueError(f"layer {layer_idx}: sliding_window must be >= 1, got {window}")
        self.layer_idx, self.window, self.num_kv_heads, self.head_dim = (
            layer_idx,
            window,
            num_kv_heads,
            head_dim,
        )
        self.query_chunk = query_chunk  # queries per attention piece of a long prompt
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.seq_len = 0
        self.failed = None  # see `Failable`

    @property
    def initialized(self) -> bool:
        return self.keys is not None

    def check_continues(self, k_new: torch.Tensor) -> None:
        """New tokens [B, Hkv, m, D] fit this layer and continue the batch it holds (refused before anything
        changes: the cache stays usable)."""
        if k_new.shape[1] != self.num_kv_heads or k_new.shape[3] != self.head_dim:
            raise ValueError(
                f"layer {self.layer_idx}: keys have {k_new.shape[1]} heads of dim {k_new.shape[3]}, the cache was "
                f"built for {self.num_kv_heads} heads of dim {self.head_dim}"
            )
        if self.initialized and (k_new.shape[0] != self.keys.shape[0] or k_new.device != self.keys.device):
            raise ValueError(
                f"this TandemCache holds a batch of {self.keys.shape[0]} on {self.keys.device}; the new tokens come as "
                f"a batch of {k_new.shape[0]} on {k_new.device}. A cache continues the sequences it holds: for another "
                "batch or prompt, build a new cache (TandemCache.for_model)"
            )

    def attend(self, q, k_new, v_new, valid_new, scale: float) -> torch.Tensor:
        """Attention of the new tokens' queries q [B, Hq, Lq, D] over the window before each of them (the cached
        tokens and the new ones, k_new / v_new [B, Hkv, Lq, D], valid_new [B, Lq]), which it then keeps.
        Returns [B, Hq, Lq, D] in q's dtype. A refused input changes nothing; an error part way leaves the layer
        refusing further use."""
        self.check_usable()
        self.check_continues(k_new)
        try:
            return self._attend(q, k_new, v_new, valid_new, scale)
        except BaseException as err:
            self.mark_failed(err)
            raise

    def _attend(self, q, k_new, v_new, valid_new, scale: float) -> torch.Tensor:
        held = 0 if self.keys is None else self.keys.shape[2]
        keys = k_new if self.keys is None else torch.cat([self.keys, k_new.to(self.keys.dtype)], dim=2)
        values = (
            v_new if self.values is None else torch.cat([self.values, v_new.to(self.values.dtype)], dim=2)
        )
        valid = valid_new if self.valid is None else torch.cat([self.valid, valid_new], dim=1)
        q_len = q.shape[2]
        first = self.seq_len - held  # position of keys[:, :, 0]
        outs = []
        for s in range(0, q_len, self.query_chunk):
            e = min(q_len, s + self.query_chunk)
            # the keys any of these queries sees: from (position of query s) - window + 1 to query e - 1
            k0 = max(0, held + s - self.window + 1)
            k1 = held + e
            qpos = torch.arange(self.seq_len + s, self.seq_len + e, device=q.device)[:, None]
            kpos = torch.arange(first + k0, first + k1, device=q.device)[None, :]
            band = (kpos <= qpos) & (kpos > qpos - self.window)
            mask = band[None] & valid[:, None, k0:k1]
            mask = mask | (kpos == qpos)[None]  # a padding query attends itself: no empty row
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, s:e],
                    keys[:, :, k0:k1],
                    values[:, :, k0:k1],
                    attn_mask=mask[:, None],
                    scale=scale,
                    enable_gqa=q.shape[1] != keys.shape[1],
                )  # fmt: skip
            )
        start = max(0, keys.shape[2] - (self.window - 1))  # the next query's window holds window - 1 of these
        self.keys, self.values = keys[:, :, start:].contiguous(), values[:, :, start:].contiguous()
        self.valid = valid[:, start:].contiguous()
        self.seq_len += q_len
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.valid))
