"""Fluxion: output-aware per-head budgets, streaming-head skipping and per-group granularity (its §3-5).

Every decode step, on the compute device:
1. each query head gets its properties (bgt0, k, streaming): from the head-property predictor over the step's
   41 features (`policies.fluxion_features`, anchored at the prompt's last query), or from the profile's static
   per-head values (`fluxion.mode="static"`), or, at tau = 0, (1, 0, no) for every head: nothing may be skipped.
   `fluxion.mode="oracle"` instead measures the step's exact Eq. 2 budgets over every host entry (analysis only);
2. streaming heads select nothing (`skip_streaming`); each GQA group with a retrieval head picks the block size
   minimising Eq. 3 (or the fixed `granularity`), and each retrieval head its Eq. 1 budget at that size;
3. each head ranks logical blocks by its own Quest bound and keeps its budget; the group's union goes to the CPU
   as 16-token block ids. A group of streaming heads only has no CPU work at all.

The KV head's pass over its union serves every query head of the group (the CPU kernels' GQA rule): a streaming
head in a mixed group attends its group's selection, never less than sinks + window.

With `epsilon` (`certified`), fluxion's selection becomes a floor that the certificate checks: its blocks rank
first, and where they do not certify p <= epsilon for a head (a streaming head that still looks far back, a
budget the predictor set too low), the head's best blocks by their mass bound are added until they do, while
its blocks stay within `max_budget` of the live ones (fluxion's own are kept in any case).
"""

from __future__ import annotations

import torch

from .base import NONE, Policy, Selection
from .certified import Certifier, host_digests
from .fluxion_features import anchor_stats, join_segments, step_features
from .fluxion_predictor import predictor_from_state, streaming_logit_threshold
from .fluxion_profile import Profile, load_profile
from .fluxion_search import SELECTION_BLOCKS, min_budgets
from .granularity import choose_granularity, head_budgets, ids_selection, mask_to_ids, select_blocks

BASE_BLOCK = 16  # the host tier's digest block: every logical block size is a multiple of it


def resolve_profile(
    config, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> Profile | None:
    """The profile `config` asks for, checked against the model's shapes and the config (None at tau = 0, which
    needs none). Raises ValueError / FileNotFoundError naming what to change."""
    if config.fluxion.tau == 0 or config.fluxion.mode == "oracle":  # neither reads a profile
        return None
    profile = load_profile(config.fluxion.profile)
    profile.check_model(num_layers, num_q_heads, num_kv_heads, head_dim)
    profile.tau_key(config.fluxion.tau)
    if config.fluxion.mode == "predictor" and not profile.predictor:
        raise ValueError(
            f"TandemConfig.fluxion.mode='predictor': the profile {profile.path} has no predictor (calibrated with "
            "--no-train); allowed: fluxion.mode='static', or a profile from `tandem calibrate --train`"
        )
    if isinstance(config.window_tokens, int):
        profile.check_hot_set(config.sink_tokens, config.window_tokens)
    return profile


class FluxionPolicy(Policy):
    name = "fluxion"
    needs_digest = True
    needs_anchor = (
        True  # the decode path calls on_anchor with the prompt's last query after a prefill / append
    )

    def __init__(self, config) -> None:
        super().__init__(config)
        self.profile: Profile | None = None
        self._checked = False
        self.anchor = None  # policies.fluxion_features.AnchorStats of the last prompt, on the compute device
        self.scale: float | None = None
        # device-side counters, summed over steps: head-steps, head-steps labelled streaming (skipped or not),
        # budget sum, groups per block size (len(SELECTION_BLOCKS)), groups with no CPU work
        self._counters: torch.Tensor | None = None
        self._constants: dict = {}  # per device: what a step reads, made before any graph records it
        self.needs_bounds = config.certified.epsilon is not None
        self.certifier = Certifier(config) if self.needs_bounds else None

    # ---- set-up -----------------------------------------------------------------------------------------------
    def _ensure_profile(self, layer) -> None:
        if not self._checked:
            num_layers = layer.num_layers
            reads_profile = self.config.fluxion.tau != 0 and self.config.fluxion.mode != "oracle"
            if num_layers is None and reads_profile:
                # a LayerKV built on its own: only its index can be checked against the profile
                num_layers = max(
                    layer.layer_idx + 1, load_profile(self.config.fluxion.profile).meta["layers"]
                )
            self.profile = resolve_profile(
                self.config, num_layers, layer.num_q_heads, layer.num_kv_heads, layer.head_dim
            )
            if (
                self.profile is not None
                and isinstance(self.config.window_tokens, float)
                and layer.hot is not None
            ):
                # a window given as a share of the prompt is known once the hot tier exists
                window = (layer.hot.ring_blocks - 1) * layer.hot.block_size
                self.profile.check_hot_set(self.config.sink_tokens, window)
            self._checked = True

    def _predictor(self, device):
        key = (self.profile.tau_key(self.config.fluxion.tau), str(device))
        models = self.profile.__dict__.setdefault("_models", {})
        if key not in models:
            models[key] = predictor_from_state(self.profile.predictor[key[0]]).to(device)
        return models[key]

    def _on(self, device, layer) -> dict:
        """Tensors each step reads, on `device` (copied there once, outside any graph capture)."""
        key = str(device)
        if key not in self._constants:
            blocks = (
                SELECTION_BLOCKS
                if self.config.fluxion.granularity is None
                else (self.config.fluxion.granularity,)
            )
            const = {
                "blocks": blocks,
                "block_sizes": torch.tensor(blocks, device=device),
                "selection_blocks": torch.tensor(SELECTION_BLOCKS, device=device),
            }
            if self.profile is not None and self.config.fluxion.mode == "static":
                static = self.profile.static[self.profile.tau_key(self.config.fluxion.tau)]
                for name in ("bgt0", "k", "streaming"):
                    const[name] = static[name][layer.layer_idx].to(device)
            self._constants[key] = const
        return self._constants[key]

    @property
    def uses_predictor(self) -> bool:
        return self.config.fluxion.tau != 0 and self.config.fluxion.mode == "predictor"

    def on_anchor(self, layer, q_last: torch.Tensor, scale: float) -> None:
        """After a prefill or append: cache Appendix A.2's statistics of the host tier with the prompt's last
        query q' [B, Hq, D] (one pass over the host rows; nothing per step reads them again)."""
        self.scale = scale
        self._ensure_profile(layer)
        if not self.uses_predictor:
            return
        sink, local = hot_segments(layer.hot)
        cpu = host_segment(layer, q_last.device)
        self.anchor = anchor_stats(q_last, sink, cpu, local, scale, self.profile.taus)

    # ---- per step ---------------------------------------------------------------------------------------------
    def head_properties(self, layer, q: torch.Tensor, host_rows: torch.Tensor):
        """(bgt0, k, streaming) [B, Hq] for this step."""
        batch, num_q_heads, _ = q.shape
        if self.config.fluxion.tau == 0:
            ones = torch.ones(batch, num_q_heads, device=q.device)
            return ones, torch.zeros_like(ones), torch.zeros_like(ones, dtype=torch.bool)
        if self.config.fluxion.mode == "static":
            const = self._on(q.device, layer)
            return tuple(const[n][None].expand(batch, -1) for n in ("bgt0", "k", "streaming"))
        if self.anchor is None:
            raise RuntimeError("fluxion: a decode step before any prefill (no anchor query)")
        sink, local = hot_segments(layer.hot)
        tau_index = self.profile.tau_index(self.config.fluxion.tau)
        features = step_features(
            layer.layer_idx, q, self.anchor, sink, local, host_rows, self.scale, tau_index
        )
        bgt0, k, logit = self._predictor(q.device)(features.view(-1, features.shape[-1]))
        shape = (batch, num_q_heads)
        threshold = streaming_logit_threshold(self.profile.meta.get("quantile", 0.5))
        return bgt0.view(shape), k.view(shape), (logit >= threshold).view(shape)

    def measured_budgets(self, layer, q: torch.Tensor, blocks: tuple[int, ...]):
        """`fluxion.mode="oracle"`: this step's exact Eq. 2 budgets at each block size [B, Hq, len(blocks)] and
        streaming labels [B, Hq], measured over every host entry (`policies.fluxion_search.min_budgets`). It reads the
        whole host tier each step: an analysis mode that separates the budget rule from the predictor."""
        cpu = host_segment(layer, q.device)
        hot = join_segments(*hot_segments(layer.hot))
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        budgets, error = min_budgets(q, hot, cpu, scale, blocks, (self.config.fluxion.tau,))
        return budgets[..., 0], error <= self.config.fluxion.tau

    def device_select(self, layer, q: torch.Tensor) -> torch.Tensor | None:
        """[B, Hkv, nblk] int64: each KV head's selected 16-token host blocks ascending, then nblk (none)."""
        host = layer.host
        if host is None or host.rows == 0:
            return None
        self._ensure_profile(layer)
        key_min, key_max, block_valid = host_digests(host, q.device)
        host_rows = block_valid.sum(-1) * host.block_size  # [B]: whole blocks (a padded block counts whole)
        with torch.no_grad():
            const = self._on(q.device, layer)
            blocks = const["blocks"]
            if self.config.fluxion.mode == "oracle" and self.config.fluxion.tau != 0:
                measured, streaming = self.measured_budgets(layer, q, blocks)
                active = ~streaming if self.config.fluxion.skip_streaming else torch.ones_like(streaming)
                budgets = measured * active[..., None]
            else:
                bgt0, k, streaming = self.head_properties(layer, q, host_rows)
                active = ~streaming if self.config.fluxion.skip_streaming else torch.ones_like(streaming)
                budgets = head_budgets(bgt0.float(), k.float(), active, blocks)
            choice = choose_granularity(budgets, host_rows, const["block_sizes"], layer.num_kv_heads)
            mask = select_blocks(q, key_min, key_max, budgets, choice, host_rows, blocks, BASE_BLOCK)
            self._count(layer, budgets, choice, streaming, active, const)
        if self.certifier is not None:
            mask = self.certifier.select(layer, q, forced=mask)
        return mask_to_ids(mask)

    def select(self, layer, q, from_device=None, skip: int = 0) -> Selection:
        if from_device is None:
            from_device = self.device_select(layer, q[:, :, 0])
            if from_device is None:
                return NONE
        unit = layer.host.block_size if self.certifier is None else self.certifier.unit(layer.host)
        return ids_selection(from_device, unit)

    # ---- statistics -------------------------------------------------------------------------------------------
    def _count(self, layer, budgets, choice, streaming, active, const) -> None:
        group = layer.num_q_heads // layer.num_kv_heads
        batch = budgets.shape[0]
        per_head = choice[..., None].expand(-1, -1, group).reshape(batch, -1)  # [B, Hq]: its group's choice
        chosen = torch.gather(budgets, 2, per_head[..., None])[..., 0]
        size = const["block_sizes"][choice]  # [B, Hkv]
        per_size = (size[..., None] == const["selection_blocks"]).float()
        working = active.view(batch, layer.num_kv_heads, group).any(-1)  # [B, Hkv]
        step = torch.cat([
            torch.full((1,), float(active.numel()), device=choice.device),
            streaming.float().sum()[None],
            chosen.sum()[None],
            (per_size * working[..., None]).sum((0, 1)),
            (~working).float().sum()[None],
        ])  # fmt: skip
        self._make_counters(step.device)  # (made already where a step may record: `prepare_step`)
        self._counters += step

    def prepare_step(self, layer) -> None:
        super().prepare_step(layer)
        if layer.hot is not None:
            self._make_counters(layer.hot.keys.device)

    def _make_counters(self, device: torch.device) -> None:
        """The device counters a step adds to (`_count`), on `device`: made once, eagerly, updated in place."""
        if self._counters is None or self._counters.device != device:
            self._counters = torch.zeros(4 + len(SELECTION_BLOCKS), dtype=torch.float32, device=device)

    def statistics(self) -> dict:
        """Head-steps, streaming head-steps, the sum of per-head budgets, groups per block size and groups that
        did no CPU work, summed since the last reset (one device read)."""
        c = self._counters.tolist() if self._counters is not None else [0.0] * (4 + len(SELECTION_BLOCKS))
        n = len(SELECTION_BLOCKS)
        return {
            "head_steps": c[0],
            "streaming_heads": c[1],
            "budget_sum": c[2],
            "groups_by_block": dict(zip(SELECTION_BLOCKS, c[3 : 3 + n])),
            "idle_groups": c[3 + n],
        }

    def clear(self) -> None:
        """A new request's state (`Policy.clear`): no anchor statistics, nothing counted; the profile and the
        device constants, which depend on the config and the layer only, stay."""
        super().clear()
        self.anchor = self.scale = None
        self.reset_statistics()

    def reset_statistics(self) -> None:
        if self._counters is not None:
            with torch.inference_mode():  # (the decode loop may have made them an inference tensor)
                self._counters.zero_()  # in place: a recorded step keeps adding to this tensor


def hot_segments(hot):
    """(sink, local) segments of the hot tier: its sink slots and its ring (the window and new tokens)."""
    s = hot.sink_slots
    return (
        (hot.keys[:, :, :s], hot.values[:, :, :s], hot.valid[:, :s]),
        (hot.keys[:, :, s:], hot.values[:, :, s:], hot.valid[:, s:]),
    )


def host_segment(layer, device):
    """The host tier's live rows as a segment on `device` (once its pending copies have landed); a prompt that
    fits on the device leaves it empty (no storage yet)."""
    host, hot = layer.host, layer.hot
    if host.rows == 0:
        return hot.keys[:, :, :0], hot.values[:, :, :0], hot.valid[:, :0]
    host.wait()
    keys, values, valid = host.live()
    return keys.to(device), values.to(device), valid.to(device)
