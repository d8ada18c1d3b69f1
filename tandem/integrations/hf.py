"""Hugging Face transformers drop-in: a `Cache` subclass and a registered attention function.

Only public extension points are used: `Cache` / `CacheLayerMixin` subclasses, `AttentionInterface.register`
and `AttentionMaskInterface.register`. The layer's `update` hands its tiered cache to the attention function
by tagging the key tensor it returns, because a model passes what `update` returned straight to the attention
function (transformers 5.17 passes no other per-call state to `update`). Both sides check the hand-off.
"""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from ..attention import TaskPool, attend
from ..attention.hybrid import causal_mask
from ..cache import LayerKV
from ..cache.recall import RecallBudget
from ..cache.sliding import KIND as SLIDING
from ..cache.sliding import SlidingKV
from ..config import TandemConfig
from ..models import attention_shape
from ..policies.certified import certifies_rows
from ..policies.fluxion import resolve_profile

ATTENTION_NAME = "tandem"
FULL = "full_attention"  # transformers' layer type of a global layer (SLIDING: a sliding-window one)
_HANDOFF = "_tandem_layer"


class TandemLayer(CacheLayerMixin):
    """One decoder layer's slot in `TandemCache`; the KV itself lives in `self.kv` (a `LayerKV`)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, kv: LayerKV, owner: TandemCache, max_positions: int | None) -> None:
        super().__init__()
        self.kv = kv
        # weak: the cache holds its layers, and a cycle would keep a dropped cache's tensors (a server request's
        # whole KV) alive until the garbage collector happens to run
        self._owner = weakref.ref(owner)
        self.max_positions = max_positions
        self.pending = False

    @property
    def owner(self) -> TandemCache:
        return self._owner()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.pending:
            raise RuntimeError(
                f"TandemCache layer {self.kv.layer_idx} was updated twice without the '{ATTENTION_NAME}' attention "
                "function running in between: create the cache with TandemCache.for_model(model, config), which "
                f"sets model attention to '{ATTENTION_NAME}', and do not change it afterwards"
            )
        total = self.kv.seq_len + key_states.shape[2]
        if self.owner.step_context is None and self.max_positions is not None and total > self.max_positions:
            # (a fixed-address step has placed its token already, and its runner checks the length itself)
            raise ValueError(
                f"context of {total} tokens exceeds the model's maximum of {self.max_positions} positions "
                "(config.max_position_embeddings); shorten the prompt or max_new_tokens"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = True
        setattr(key_states, _HANDOFF, self)
        return key_states, value_states

    def attention(self, query, key, value, attention_mask, scale: float) -> torch.Tensor:
        """Attention of the new tokens over this layer's cache and themselves, which it then caches:
        query [B, Hq, Lq, D], key / value [B, Hkv, Lq, D] as `update` returned them. Returns [B, Hq, Lq, D]."""
        self.pending = False
        batch, _, q_len, _ = query.shape
        valid = padding_valid(attention_mask, batch, q_len, query.device)
        owner, kv = self.owner, self.kv
        kv.check_usable()
        if kv.initialized:
            kv.check_continues(
                key
            )  # a wrong batch is refused before anything changes: the cache stays usable
        try:
            out = self._attend(query, key, value, valid, scale, owner)
        except BaseException as err:
            owner.mark_failed(err)  # the layers before this one hold the step's token, the rest do not
            raise
        if q_len > 1 and owner.on_prefill_layer is not None:
            owner.on_prefill_layer(kv.layer_idx)
        return out

    def _attend(self, query, key, value, valid, scale: float, owner: TandemCache) -> torch.Tensor:
        """The layer's own attention of the new tokens (the tiers' hybrid attention)."""
        return attend(self.kv, query, key, value, valid, scale, owner.pool, owner.step_context)

    def get_seq_length(self) -> int:
        return self.kv.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Empty the layer for a new request, its buffers kept where they are (`LayerKV.clear`)."""
        self.kv.clear()
        self.pending = False

    def offload(self) -> None:  # the host tier already is the offload; nothing to move
        return None

    def prefetch(self) -> None:
        return None

    def _unsupported(self, what: str):
        raise NotImplementedError(f"TandemCache does not support {what} (use greedy or sampling decoding)")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("crop (assisted / speculative decoding)")

    def reorder_cache(self, beam_idx) -> None:
        self._unsupported("beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("num_return_sequences > 1; repeat the prompt in the batch instead")

    def batch_select_indices(self, indices) -> None:
        self._unsupported("batch selection")


class TandemSlidingLayer(TandemLayer):
    """A sliding-window decoder layer's slot in `TandemCache`: its window on the device (`kv`, a
    `cache.SlidingKV`), attended exactly; no host tier, no selection."""

    is_sliding = True

    def _attend(self, query, key, value, valid, scale: float, owner: TandemCache) -> torch.Tensor:
        """Exact attention over the window before each new token (`SlidingKV.attend`)."""
        return self.kv.attend(query, key, value, valid, scale)

    def reset(self) -> None:
        kv = self.kv
        self.kv = SlidingKV(kv.layer_idx, kv.window, kv.num_kv_heads, kv.head_dim, kv.query_chunk)
        self.pending = False


class TandemCache(Cache):
    """KV cache split between the compute device (sinks + recent window) and host memory (everything older),
    with hybrid GPU/CPU attention.

    A cache holds one batch of sequences. Passed to `generate` again it continues them, as transformers' own caches
    do (input_ids = the tokens it holds, then the new ones); another batch size is refused.

    Example:
        >>> from tandem import TandemCache, TandemConfig, load_model
        >>> model, tok = load_model()
        >>> cache = TandemCache.for_model(model, TandemConfig(policy="hgca"))
        >>> ids = tok("The capital of France is", return_tensors="pt").input_ids
        >>> out = model.generate(ids, max_new_tokens=8, do_sample=False, **generate_cache_kwargs(model, cache))
    """

    def __init__(
        self,
        config: TandemConfig,
        num_layers: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_positions: int | None = None,
        pool: TaskPool | None = None,
        rank=None,
        windows: list[int | None] | None = None,
    ) -> None:
        window = config.window_tokens
        if max_positions is not None and isinstance(window, int) and window > max_positions:
            raise ValueError(
                f"TandemConfig.window_tokens={window} exceeds the model's maximum context of {max_positions} positions "
                f"(config.max_position_embeddings): allowed 1 to {max_positions}, or a fraction of the prompt in (0, 1)"
            )
        self.config = config
        # CPU attention threads; caches that take turns (a server's requests) may share one pool
        self.pool = pool if pool is not None else TaskPool(config.host.threads)
        streams: dict = {}
        budget = RecallBudget(num_layers)  # sizes quest's default recall caches to the device's free memory
        # each layer's kind: None for a global layer (the tiers), else its sliding window (`layer_windows`)
        windows = windows if windows is not None else [None] * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"windows must name one kind per layer ({num_layers}), got {len(windows)}")
        layers = []
        for i, sliding in enumerate(windows):
            if sliding is None:
                kv = LayerKV(
                    config, i, num_q_heads, num_kv_heads, head_dim, streams, budget, num_layers, rank
                )
                layers.append(TandemLayer(kv, self, max_positions))
            else:
                kv = SlidingKV(i, sliding, num_kv_heads, head_dim, config.prefill_chunk)
                layers.append(TandemSlidingLayer(kv, self, max_positions))
        super().__init__(layers=layers)
        self.on_prefill_layer = None  # optional callback(layer_idx) after each layer's prefill/append
        # the `attention.StepContext` of the fixed-address decode steps a runner is taking (`tandem.engine`), or None
        self.step_context = None

    @classmethod
    def for_model(
        cls, model: PreTrainedModel, config: TandemConfig | None = None, pool: TaskPool | None = None
    ) -> TandemCache:
        """Build a cache for `model` and switch the model's attention to Tandem's (public API only). `pool`: CPU
        attention threads to share with other caches (default: the cache's own, `config.host.threads` wide)."""
        config = config if config is not None else TandemConfig()
        if not isinstance(model, PreTrainedModel):
            raise ValueError(
                f"model must be a loaded transformers causal LM (a PreTrainedModel, e.g. from tandem.load_model), "
                f"got {type(model).__name__}"
            )
        if not isinstance(config, TandemConfig):
            raise ValueError(f"config must be a TandemConfig or None, got {type(config).__name__}")
        text_config = model.config.get_text_config(decoder=True)
        windows = layer_windows(text_config)
        _check_device(model, config)
        register()
        if model.config._attn_implementation != ATTENTION_NAME:
            model._tandem_previous_attention = model.config._attn_implementation  # for restore_attention
            model.set_attn_implementation(ATTENTION_NAME)
        shape = attention_shape(text_config)
        if config.policy == "fluxion":  # a missing or mismatched profile is refused here, before any work
            resolve_profile(config, *shape)
        # a tensor-parallel shard (`distributed.tensor_parallel`) names its rank: host_split="requests" needs it
        rank = getattr(model, "tandem_rank", None)
        return cls(config, *shape, getattr(text_config, "max_position_embeddings", None), pool, rank, windows)

    def mark_failed(self, err: BaseException) -> None:
        """A step failed part way (some layers stored its tokens, others not): every layer now refuses further
        use with an error naming `err`, instead of decoding from an inconsistent state."""
        for layer in self.layers:
            layer.kv.mark_failed(err)

    def tandem_layers(self) -> list[LayerKV]:
        """The global layers' tiered caches (a sliding-window layer keeps its window apart: `sliding_layers`)."""
        return [layer.kv for layer in self.layers if not layer.is_sliding]

    def sliding_layers(self) -> list[SlidingKV]:
        return [layer.kv for layer in self.layers if layer.is_sliding]

    def layer_caches(self) -> list[LayerKV | SlidingKV]:
        """Every layer's cache in the model's order: a global layer's tiers, a sliding-window layer's window."""
        return [layer.kv for layer in self.layers]

    def batch_size(self) -> int | None:
        """The batch the cache holds, or None before its first tokens."""
        for layer in self.layers:
            kv = layer.kv
            held = kv.keys if layer.is_sliding else (kv.hot.keys if kv.hot is not None else None)
            if held is not None:
                return held.shape[0]
        return None

    def stats(self) -> dict:
        """Sizes of both tiers and how much of the host tier decode attended."""
        kvs = self.tandem_layers()
        for kv in kvs:
            kv.collect_statistics()
        attended = sum(kv.rows_attended for kv in kvs)
        available = sum(kv.rows_available for kv in kvs)
        sliding = self.sliding_layers()
        stats = {
            "policy": self.config.policy,
            "tokens": self.layers[0].get_seq_length() if self.layers else 0,
            "host_rows": kvs[0].host.rows if kvs and kvs[0].host is not None else 0,
            "hot_bytes": sum(kv.hot_nbytes() for kv in kvs),
            "host_bytes": sum(kv.host_nbytes() for kv in kvs),
            "mean_fraction_attended": attended / available if available else None,
            # global layers hold the tiers; sliding-window layers their window on the device
            "layers": {"global": len(kvs), "sliding": len(sliding)},
            "sliding_bytes": sum(kv.nbytes() for kv in sliding),
        }
        if self.config.policy == "fluxion":
            stats.update(fluxion_statistics([kv.policy.statistics() for kv in kvs]))
        if self.config.certified.epsilon is not None:
            stats["certified"] = certified_statistics(
                [kv.policy.certifier.statistics() for kv in kvs], self.config.certified.epsilon
            )
            stats["certified"]["unit"] = "row" if certifies_rows(self.config) else "block"
        return stats


def fluxion_statistics(per_layer: list[dict]) -> dict:
    """Fluxion's decode statistics over layers: the share of head-steps labelled streaming (they select nothing
    unless skip_streaming is off), the mean per-head budget (skipped heads count 0), and the share of GQA groups
    at each block size among those that selected blocks."""
    heads = sum(s["head_steps"] for s in per_layer)
    by_block: dict[int, float] = {}
    for s in per_layer:
        for block, n in s["groups_by_block"].items():
            by_block[block] = by_block.get(block, 0.0) + n
    working = sum(by_block.values())
    return {
        "streaming_head_share": sum(s["streaming_heads"] for s in per_layer) / heads if heads else None,
        "mean_head_budget": sum(s["budget_sum"] for s in per_layer) / heads if heads else None,
        "granularity_share": {b: n / working for b, n in by_block.items()} if working else None,
    }


def certified_statistics(per_layer: list[dict], epsilon: float) -> dict:
    """The certified selection over layers and decode steps, per (request, query head) of each layer and step:
    the certified skipped probability p and output bound (mean, max), the share that met epsilon when selected,
    the largest excess of p over epsilon where the max_budget cap bound, and the share of live host units (rows or blocks: `certified.unit`) kept."""
    total = {
        k: sum(s[k] for s in per_layer) for k in ("head_steps", "p_sum", "bound_sum", "met", "units_kept")
    }
    heads, live = total["head_steps"], sum(s["units_live"] for s in per_layer)
    return {
        "epsilon": epsilon,
        "head_steps": int(heads),
        "mean_p": total["p_sum"] / heads if heads else None,
        "max_p": max((s["p_max"] for s in per_layer), default=None) if heads else None,
        "mean_output_bound": total["bound_sum"] / heads if heads else None,
        "max_output_bound": max((s["bound_max"] for s in per_layer), default=None) if heads else None,
        "met_share": total["met"] / heads if heads else None,
        "max_excess": max((s["excess_max"] for s in per_layer), default=None) if heads else None,
        "mean_kept": total["units_kept"] / live if live else None,
    }


def layer_windows(text_config) -> list[int | None]:
    """Each decoder layer's kind, from the model's config as transformers 5.x describes it (`layer_types`,
    `sliding_window`): None for a global (full causal) attention layer, which gets the tiered cache, or the window
    of a sliding-window layer, which keeps its window on the device. Raises ValueError naming a kind Tandem does
    not run (chunked, linear or recurrent attention layers), an encoder-decoder model, or a sliding layer without
    a window."""
    if getattr(text_config, "is_encoder_decoder", False):
        raise ValueError(
            "unsupported model: encoder-decoder models are not supported (decoder-only models only)"
        )
    num_layers = text_config.num_hidden_layers
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:  # Mistral: one window for every layer, where the config sets one
        sliding = window and getattr(text_config, "use_sliding_window", True)
        layer_types = ["sliding_attention" if sliding else "full_attention"] * num_layers
    bad = sorted({t for t in layer_types if t not in (FULL, SLIDING)})
    if bad:
        raise ValueError(
            f"unsupported attention layer type {', '.join(repr(t) for t in bad)} in model type "
            f"'{getattr(text_config, 'model_type', '?')}': Tandem runs layers of type '{FULL}' (the tiered cache) "
            f"and '{SLIDING}' (a window on the device)"
        )
    if SLIDING in layer_types and not (isinstance(window, int) and window >= 1):
        raise ValueError(
            f"model type '{getattr(text_config, 'model_type', '?')}' has '{SLIDING}' layers but its config's "
            f"sliding_window is {window!r}: it must be an int >= 1"
        )
    return [window if t == SLIDING else None for t in layer_types]


def _check_device(model, config: TandemConfig) -> None:
    device = next(model.parameters()).device
    if config.device == "auto":
        return
    wanted = torch.device(config.device)
    if wanted.type != device.type or (wanted.index is not None and wanted.index != device.index):
        raise ValueError(
            f"TandemConfig.device={config.device!r} but the model is on {device}; move the model there or use "
            "device='auto' (the hot tier follows the model)"
        )


def generate_cache_kwargs(model, cache: Cache) -> dict:
    """`{"cache": cache}` on transformers versions that renamed the argument, else `{"past_key_values": cache}`."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


# ---- attention + mask functions ------------------------------------------------------------------------------
def tandem_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered as attention implementation 'tandem'. Returns ([B, Lq, Hq, D], None)."""
    layer = key.__dict__.pop(_HANDOFF, None)
    if (
        layer is None
    ):  # a non-Tandem cache (or none): exact SDPA, so the same model still runs with DynamicCache
        return _sdpa_fallback(query, key, value, attention_mask, scaling, kwargs.get("sliding_window"))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # the handed-off layer: a TandemLayer, or any layer with the same `attention` (e.g. integrations.rows)
    return layer.attention(query, key, value, attention_mask, scale).transpose(1, 2).contiguous(), None


def padding_valid(attention_mask, batch: int, q_len: int, device) -> torch.Tensor:
    """[B, Lq] bool of the new tokens from the 2-D padding mask the model passes (None: no padding)."""
    if attention_mask is None:
        return torch.ones(batch, q_len, dtype=torch.bool, device=device)
    if attention_mask.dim() == 2:
        return attention_mask[:, -q_len:].to(device=device, dtype=torch.bool)
    raise ValueError(
        f"TandemCache takes a 2-D padding attention_mask [batch, tokens]; got shape {tuple(attention_mask.shape)}"
    )


def tandem_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    **kwargs,
):
    """Registered mask builder for 'tandem': hands the 2-D padding mask through (None when there is none)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    return attention_mask[:, -kv_length:]


def _sdpa_fallback(query, key, value, attention_mask, scaling, sliding_window=None):
    """Exact causal SDPA with the 2-D padding mask, for models set to 'tandem' but run with another cache; a
    sliding-window layer's queries attend the keys less than `sliding_window` positions back."""
    q_len, kv_len = query.shape[2], key.shape[2]
    banded = sliding_window is not None and kv_len > sliding_window
    if attention_mask is None and q_len == 1 and not banded:
        mask = None  # one new token, no padding: it attends every key (and SDPA may pick a flash kernel)
    elif attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask
    else:
        if attention_mask is None:
            pad = torch.ones(query.shape[0], kv_len, dtype=torch.bool, device=query.device)
        else:
            pad = attention_mask[:, -kv_len:].to(dtype=torch.bool, device=query.device)
        mask = causal_mask(pad, kv_len - q_len, kv_len, 0, kv_len)[:, None]  # the new tokens are the last
        if banded:
            qpos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
            kpos = torch.arange(kv_len, device=query.device)[None, :]
            mask = mask & ((kpos > qpos - sliding_window) | (kpos == qpos))
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def restore_attention(model: PreTrainedModel) -> None:
    """Switch a model that `TandemCache.for_model` set to Tandem's attention back to the implementation it had
    (e.g. 'sdpa'), so other caches run on the model's own kernels rather than on Tandem's exact fallback."""
    previous = getattr(model, "_tandem_previous_attention", None)
    if previous is not None and model.config._attn_implementation == ATTENTION_NAME:
        model.set_attn_implementation(previous)


def register() -> None:
    """Register Tandem's attention and mask functions under the name 'tandem' (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, tandem_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, tandem_mask)
