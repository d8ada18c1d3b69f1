"""What a selection policy is: the rule that decides which offloaded entries each head attends."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Selection:
    """The host rows one decode step attends, per (request, KV head).

    kind: "all" (every live row), "none", "rows" (token row ids) or "blocks" (block ids of `block_size`).
    indices: [B, Hkv, S] int64, padded past `lengths` ([B, Hkv] int64); None for "all" / "none".
    """

    kind: str
    indices: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    block_size: int | None = None

    def attended_rows(self, host_rows: int, batch: int, num_kv_heads: int) -> torch.Tensor:
        """[B, Hkv] number of host rows this selection reads (padding rows included)."""
        if self.kind == "all":
            return torch.full((batch, num_kv_heads), host_rows, dtype=torch.long)
        if self.kind == "none":
            return torch.zeros(batch, num_kv_heads, dtype=torch.long)
        scale = self.block_size if self.kind == "blocks" else 1
        return self.lengths.cpu() * scale


ALL = Selection("all")
NONE = Selection("none")


class Policy:
    """One layer's selection policy. Subclasses keep whatever per-layer state their rule needs.

    Hooks, all called by the layer cache (`tandem.cache.layer.LayerKV`) and the decode path:
      device_select(layer, q)          -> None, or a tensor the policy computes on the compute device inside the
                                       decode step (q [B, Hq, D] there; fixed shapes, no host syncs: it may be
                                       captured in a CUDA graph); it reaches select() through a pinned buffer
      select(layer, q, from_device, skip)  -> Selection for this decode step (q on the host, [B, Hq, 1, D];
                                       from_device: device_select's result on the host, or None; skip: how many
                                       of its ranked entries the device attends itself, see device_share)
      device_share(layer)              -> how many of device_select's ranked entries (per KV head) the compute
                                       device attends this step from pinned host memory (0: the CPU does all)
      prepare_step(layer)              before each decode step, on the host: refresh device tensors that
                                       device_select's kernels read (a recorded graph replays without calling it)
      ranked_range(layer, from_device, skip) -> (skip, count) when select() would pick exactly ranks [skip,
                                       count) of from_device (as blocks of host.block_size), so the decode path
                                       can attend them in one compiled call (`ops.ranked_attention_call`);
                                       None otherwise
      on_evict(layer, first, n, hot_counts)  rows [first, first+n) are on their way to the host tier; their
                                       data (and the CPU tensor hot_counts [B]) are readable after host.wait()
      on_append(layer, host_weights)   a prefill/append finished; host_weights [B, Hq, rows] (or None)
      on_anchor(layer, q_last, scale)  (needs_anchor) a prefill/append finished; q_last [B, Hq, D] is its last
                                       query, on the compute device
      after_attention(layer, out, lse) a decode step's attention of this layer is merged: out [B, Hq, D] and lse
                                       [B, Hq] float32 on the compute device, over everything attended (device
                                       work only: it may be recorded in a CUDA graph)
    """

    name = ""
    needs_digest = False  # per-block min/max keys on the host tier
    needs_maw = False  # moving average of attention weights, hot and host
    # select() returns views of the same index / length tensors step after step, updated in place (hgca): the
    # decode path then prepares one compiled call over them instead of launching the general kernel each step
    keeps_selection = False
    # False when select() always returns NONE (streaming): the decode path then serves the CPU part as an empty
    # compiled task, without calling select()
    attends_host = True
    # True when the policy wants on_anchor(layer, q_last [B, Hq, D], scale) after each prefill / append
    needs_anchor = False
    # per-block key centres / radii, value norms and row counts on the compute device (`certify.block_digest`)
    needs_bounds = False
    # the certified selection (`certified.Certifier`) of a policy run with epsilon, else None
    certifier = None
    # True when ranked_range answers every step that has device_select's ranking (quest at a fixed budget): a
    # pooled step then hands such requests' CPU parts to the host together (`attention.rows.RankedRows`)
    keeps_ranked_range = False
    # True when device_select is `quest.rank_blocks` over the host tier's digest mirror with blocks_this_step and
    # ranking_width(mirror blocks) (quest at a fixed budget): a pooled step then ranks such requests at once
    ranks_by_mirror = False

    def __init__(self, config) -> None:
        self.config = config

    def needs_bounds_on(self, device: torch.device) -> bool:
        """Whether a host tier whose compute device is `device` keeps the certified selection's bounds
        (`needs_bounds`): a policy that never selects by them there leaves them out."""
        return self.needs_bounds

    def device_select(self, layer, q: torch.Tensor) -> torch.Tensor | None:
        return None

    def select(
        self, layer, q: torch.Tensor, from_device: torch.Tensor | None = None, skip: int = 0
    ) -> Selection:
        raise NotImplementedError

    def device_share(self, layer) -> int:
        return 0

    def every_row_step(self, layer, q: torch.Tensor) -> bool:
        """Whether this decode step attends every host row of `layer` with nothing to select, for q [B, Hq, D] on
        the CPU: then this has done the step's own bookkeeping that `device_select` and `select` would, and the
        caller attends the rows (`attention.rows.pooled_rows`, several requests' host tiers in one call). False:
        nothing done (the step selects as usual)."""
        return False

    def prepare_step(self, layer) -> None:
        """Before a decode step, eagerly (never while a step records): make what the step adds to on the device.
        A recorded step replays what it recorded, so a tensor first made inside it would be made again, zeroed,
        at every replay (or not at all: a copy from pageable host memory refuses to record). A request whose
        first decode step is part of a recording (`engine.rows.RowsRunner`, a batch that grows) needs this."""
        if self.certifier is not None and layer.hot is not None:
            self.certifier.prepare(layer.hot.keys.device)

    def clear(self) -> None:
        """Forget the request (`LayerKV.clear`): what the next request's steps start from is a new policy's state,
        while the device tensors a recorded step reads stay where they are (zeroed where they count)."""
        if self.certifier is not None:
            self.certifier.clear()

    def ranked_range(self, layer, from_device: torch.Tensor | None, skip: int) -> tuple[int, int] | None:
        return None

    def on_evict(self, layer, first_row: int, num_rows: int, hot_counts) -> None:
        return None

    def prefix_state(self):
        """What a cached prefix keeps of this policy's state at a prefill's chunk boundary (`cache.snapshot`):
        nothing here, since a prefill's chunks before its last leave a policy as it began."""
        return None

    def restore_prefix_state(self, state) -> None:
        """Take the state `prefix_state` gave (into a policy that has seen no tokens)."""
        return None

    def on_append(self, layer, host_weights) -> None:
        return None

    def on_anchor(self, layer, q_last: torch.Tensor, scale: float) -> None:
        return None

    def after_attention(self, layer, out: torch.Tensor, lse: torch.Tensor) -> None:
        if self.certifier is not None:  # the step's certificate, counted on the device
            self.certifier.after_attention(layer, out, lse)

    @property
    def last_certificate(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(p [B, Hq], output bound [B, Hq]) of the last decode step's certificate (epsilon), else None."""
        return None if self.certifier is None else self.certifier.last_certificate
