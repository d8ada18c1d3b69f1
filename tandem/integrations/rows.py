"""One model forward over the rows of several `TandemCache`s: each request keeps its own cache (batch 1, its own
length), and a decode step still runs the model's matmuls once for all of them.

`RowsCache([c0, c1, ...])` is a transformers `Cache` whose batch row b is request b's cache. A layer's `update`
checks every row's length limit, and its attention runs each row against that row's cache (so rows of any
lengths, policies and budgets share a step) and stacks the outputs. Requests join or leave between steps by
building the next step's `RowsCache` from the caches still running; nothing is copied.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .hf import _HANDOFF, TandemCache


class RowsLayer(CacheLayerMixin):
    """Layer `i` of a `RowsCache`: the `TandemLayer`s of layer `i` of each row's cache."""

    is_compileable = False
    is_sliding = False

    def __init__(self, rows: list) -> None:
        super().__init__()
        self.rows = rows

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != len(self.rows):
            raise ValueError(
                f"RowsCache holds {len(self.rows)} requests; the new tokens come as a batch of {key_states.shape[0]}"
            )
        for b, row in enumerate(self.rows):  # each row's own checks (length limit, attention hand-off)
            row.update(key_states[b : b + 1], value_states[b : b + 1])
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        setattr(key_states, _HANDOFF, self)
        return key_states, value_states

    def attention(self, query, key, value, attention_mask, scale: float) -> torch.Tensor:
        """Each row attends its own cache; returns [B, Hq, Lq, D]. A 2-D padding mask is split by row."""
        outs = []
        for b, row in enumerate(self.rows):
            mask = None if attention_mask is None else attention_mask[b : b + 1]
            outs.append(row.attention(query[b : b + 1], key[b : b + 1], value[b : b + 1], mask, scale))
        return torch.cat(outs, dim=0)

    def get_seq_length(self) -> int:
        return max(row.get_seq_length() for row in self.rows)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _unsupported(self, what: str):
        raise NotImplementedError(f"RowsCache does not support {what}: it only runs decode steps")

    def reset(self) -> None:
        self._unsupported("reset (reset each request's own TandemCache)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("num_return_sequences > 1")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("batch selection (build a RowsCache of the rows wanted instead)")

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None


class RowsCache(Cache):
    """The caches of several requests as the rows of one batch (see the module's docstring).

    Example:
        >>> rows = RowsCache([cache_a, cache_b])            # each filled by its own prefill
        >>> out = model(input_ids=next_ids, position_ids=positions, **generate_cache_kwargs(model, rows))  # [2, 1]
    """

    def __init__(self, caches: list[TandemCache]) -> None:
        if not caches:
            raise ValueError("RowsCache needs at least one TandemCache")
        for i, cache in enumerate(caches):
            if not isinstance(cache, TandemCache):
                raise ValueError(f"RowsCache row {i} is a {type(cache).__name__}, not a TandemCache")
        depths = {len(cache.layers) for cache in caches}
        if len(depths) != 1:
            raise ValueError(f"RowsCache rows come from models of different depths: {sorted(depths)} layers")
        self.caches = list(caches)
        layers = [RowsLayer([cache.layers[i] for cache in caches]) for i in range(depths.pop())]
        super().__init__(layers=layers)
