"""Tandem's own decode forward for the Llama family (Llama 2 / 3, Qwen2 with its q/k/v bias, Mistral without a
sliding window), run by the engine in place of transformers' layer code.

transformers' decoder layer launches separate q / k / v and gate / up matmuls and many small elementwise
kernels; at batch 1 those fixed costs, not the weights' bytes, set a decode step's floor. This forward runs the
same arithmetic with:

- q / k / v and gate / up concatenated once (`DecodeForward.__init__`): one matmul each. The model's own linear
  layers become views into the concatenated weights, so no weight is held twice and the model's own forward
  (prefill, `model.generate`) computes exactly what it did. (Such views share storage: `save_pretrained` of the
  model afterwards needs `safe_serialization=False` or a fresh load.)
- the residual add and the next RMSNorm as one kernel, RoPE on q and k as one, and silu(gate) * up as one
  (`kernels.gpu.layers`; the torch references elsewhere), each rounding as the model's ops round;
- Tandem's hybrid attention (`attention.rows.decode_attention`, with the step's context) called directly with
  the step's q / k / v: over one cache for the whole batch, or, in a multi-request step, row b over request b's
  own cache (`rows.py`).

Weights come from the loaded Hugging Face model: nothing is downloaded or converted. `unsupported_reason`
says why a model cannot run here; the engine then keeps transformers' code and says so in one line.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention.rows import decode_attention
from ..kernels import reference
from ..kernels.gpu import layers as gpu_layers
from ..models import attention_shape

FAMILY = ("llama", "qwen2", "mistral")


def _is_rms_norm(module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


@torch.no_grad()
def _norm_matches(module) -> bool:
    """Whether `module` computes Llama's RMSNorm (weight * normalized x), checked on a random input."""
    weight = module.weight
    x = torch.randn(2, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(
        weight.device, weight.dtype
    )
    expected = reference.rms_norm(x, weight, module.variance_epsilon)
    return torch.allclose(module(x).float(), expected.float(), rtol=1e-2, atol=1e-3)


def unsupported_reason(model) -> str | None:
    """Why `model` cannot run Tandem's decode forward (None when it can)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in FAMILY:
        return f"model type {kind!r} is outside the decode forward's family ({', '.join(FAMILY)})"
    text = config.get_text_config(decoder=True)
    if getattr(text, "hidden_act", "silu") != "silu":
        return f"hidden_act {text.hidden_act!r} (the decode forward has silu)"
    layer_types = getattr(text, "layer_types", None) or ()
    sliding = any(t != "full_attention" for t in layer_types)
    if kind == "mistral" and getattr(text, "sliding_window", None) is not None:
        sliding = True
    if kind == "qwen2" and getattr(text, "use_sliding_window", False):
        sliding = True
    if sliding:
        return f"{kind} with a sliding attention window"
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or any(not hasattr(inner, p) for p in parts) or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} lacks the Llama layout (model.{{{', '.join(parts)}}}, lm_head)"
    checked: dict[type, bool] = {}
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or mlp is None or any(not hasattr(attn, n) for n in names):
            return f"{type(layer).__name__} lacks self_attn.{{q,k,v,o}}_proj or mlp"
        linears = [getattr(attn, n) for n in names] + [
            getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")
        ]
        for linear in linears:
            weight = getattr(linear, "weight", None)
            if (
                type(linear) is not torch.nn.Linear
                or not isinstance(weight, torch.Tensor)
                or not weight.is_floating_point()
            ):
                return f"{type(linear).__name__} layers (quantized or wrapped weights)"  # fmt: skip
            if weight.device.type == "meta" or getattr(linear, "_hf_hook", None) is not None:
                return "weights offloaded by accelerate (device_map with cpu / disk)"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not _is_rms_norm(norm):
                return f"{type(norm).__name__} is not an RMSNorm with a 1-D weight"
            if type(norm) not in checked:
                checked[type(norm)] = _norm_matches(norm)
            if not checked[type(norm)]:
                return f"{type(norm).__name__} does not compute Llama's RMSNorm"
    if not _is_rms_norm(inner.norm) or not _norm_matches(inner.norm):
        return f"the final {type(inner.norm).__name__} does not compute Llama's RMSNorm"
    return None


def _still_views(cached, linears) -> bool:
    """Whether every linear's weight (and bias) is still the view into `cached` that `_concatenate` made."""
    weight, bias = cached
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        part = weight[start : start + rows]
        if linear.weight.data_ptr() != part.data_ptr() or linear.weight.shape != part.shape:
            return False
        if linear.bias is not None and (bias is None or linear.bias.data_ptr() != bias[start].data_ptr()):
            return False
        start += rows
    return start == weight.shape[0]


@torch.no_grad()
def _concatenate(
    owner, name: str, linears: list[torch.nn.Linear]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for `linears` stacked by output rows; each linear's parameters become views into
    it, so the model keeps computing the same thing and no weight is held twice. Kept on `owner` (the attention
    or MLP module) as `name`: a second runner of the same model reuses it while the linears are still its views."""
    cached = getattr(owner, name, None)
    if cached is not None and _still_views(cached, linears):
        return cached
    weight = torch.cat([linear.weight for linear in linears], dim=0)
    has_bias = [linear.bias is not None for linear in linears]
    if any(has_bias) and not all(has_bias):
        bias_parts = [
            linear.bias if linear.bias is not None else weight.new_zeros(linear.weight.shape[0])
            for linear in linears
        ]
    else:
        bias_parts = [linear.bias for linear in linears] if all(has_bias) else None
    bias = torch.cat(bias_parts) if bias_parts is not None else None
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        grad = linear.weight.requires_grad
        linear.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=grad)
        if bias is not None and linear.bias is not None:
            linear.bias = torch.nn.Parameter(
                bias[start : start + rows], requires_grad=linear.bias.requires_grad
            )
        start += rows
    object.__setattr__(owner, name, (weight, bias))  # a plain attribute, not a registered buffer
    return weight, bias


class _Layer:
    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv_weight, self.qkv_bias = _concatenate(
            attn, "_tandem_qkv", [attn.q_proj, attn.k_proj, attn.v_proj]
        )
        self.gate_up_weight, self.gate_up_bias = _concatenate(
            mlp, "_tandem_gate_up", [mlp.gate_proj, mlp.up_proj]
        )
        self.o_proj = attn.o_proj
        self.down_proj = mlp.down_proj
        self.norm1 = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.norm2 = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        self.scale = float(attn.scaling)


class DecodeForward:
    """One decode step of a Llama-family model over a `TandemCache`: `forward(ids, positions)` -> logits.

    kernels: "triton" runs the fused kernels (`kernels.gpu.layers`: CUDA, or Triton's interpreter on CPU);
    "torch" runs their torch references. Raises ValueError naming the reason for a model outside the family.
    """

    def __init__(self, model, cache=None, kernels: str = "torch") -> None:
        if kernels not in ("triton", "torch"):
            raise ValueError(f"kernels must be 'triton' or 'torch', got {kernels!r}")
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"Tandem's decode forward cannot run this model: {reason}")
        text = model.config.get_text_config(decoder=True)
        _, self.num_q_heads, self.num_kv_heads, self.head_dim = attention_shape(text)
        inner = model.model
        self.cache = cache
        self.embed = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb
        self.final_norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.lm_head = model.lm_head
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.split = (
            self.num_q_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.kernels = kernels
        self._model = model
        self._qkv_ptr = self.layers[0].qkv_weight.data_ptr()
        if kernels == "triton":
            self.norm, self.add_norm = gpu_layers.rms_norm, gpu_layers.add_rms_norm
            self.rotary, self.silu_mul = gpu_layers.rotary, gpu_layers.silu_mul
        else:
            self.norm, self.add_norm = reference.rms_norm, reference.add_rms_norm
            self.rotary, self.silu_mul = reference.rotary, reference.silu_mul
        self._valid: torch.Tensor | None = None

    def check_weights(self) -> None:
        """Refuse to run on weights the model no longer has: `model.to(...)` or a new checkpoint after this
        forward was made replaces the model's parameters, and the concatenated copies would be stale."""
        q_proj = self._model.model.layers[0].self_attn.q_proj.weight
        if q_proj.data_ptr() != self._qkv_ptr:
            raise RuntimeError(
                "the model's weights were moved or replaced after the TandemRunner was made (model.to(...) or a "
                "new load): make a new TandemRunner for the model as it is now"
            )

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, caches=None, pooled=None
    ) -> torch.Tensor:
        """input_ids, position_ids: [B, 1] int64 on the model's device. Returns the logits [B, V] (model dtype).

        caches: the caches the step attends: None for this forward's own cache (all B rows), or B batch-1
        `TandemCache`s, row b attending caches[b] (the requests of a multi-request step); each with its
        `step_context` set, or None to decode eagerly.
        pooled: with B caches, None, or per layer index the `attention.rows.PooledRows` of the batch's first
        rows (`engine.slots`), whose hot tiers are attended as one batch (`attention.rows.pooled_rows`); a row
        whose cache is None then decodes nothing (its logits are garbage)."""
        batch = input_ids.shape[0]
        if self._valid is None or self._valid.shape[0] != batch or self._valid.device != input_ids.device:
            self._valid = torch.ones(batch, 1, dtype=torch.bool, device=input_ids.device)
        caches = [self.cache] if caches is None else caches
        if len(caches) != 1 and len(caches) != batch:
            raise ValueError(f"{len(caches)} caches for a batch of {batch}: one cache, or one per row")
        hidden = self.embed(input_ids)  # [B, 1, H]
        cos, sin = self.rotary_emb(hidden, position_ids)
        heads, kv_heads, dim = self.num_q_heads, self.num_kv_heads, self.head_dim
        residual, out = hidden, None
        for i, layer in enumerate(self.layers):
            if out is None:
                x = self.norm(hidden, *layer.norm1)
            else:
                residual, x = self.add_norm(out, residual, *layer.norm1)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)  # [B, 1, (Hq + 2 Hkv) D]
            q, k, v = qkv.split(self.split, dim=-1)
            q = q.view(batch, 1, heads, dim).transpose(1, 2)
            k = k.view(batch, 1, kv_heads, dim).transpose(1, 2)
            v = v.view(batch, 1, kv_heads, dim).transpose(1, 2)
            q, k = self.rotary(q, k, cos, sin)
            attn = self._attend(caches, pooled[i] if pooled is not None else None, i, q, k, v, layer.scale)
            attn = attn.to(hidden.dtype)
            attn = layer.o_proj(attn.transpose(1, 2).reshape(batch, 1, heads * dim))
            residual, x = self.add_norm(attn, residual, *layer.norm2)
            gate_up = F.linear(x, layer.gate_up_weight, layer.gate_up_bias)
            out = layer.down_proj(self.silu_mul(gate_up))
        _, x = self.add_norm(out, residual, *self.final_norm)
        return self.lm_head(x[:, -1])

    def _attend(self, caches, pooled, i: int, q, k, v, scale: float) -> torch.Tensor:
        """Layer i's decode attention [B, Hq, 1, D]: the whole batch over one cache, or row b over caches[b] (the
        first rows' hot tiers attended as one batch where `pooled`)."""
        kvs, pools, contexts = [], [], []
        for cache in caches:
            kvs.append(cache.layers[i].kv if cache is not None else None)
            pools.append(cache.pool if cache is not None else None)
            contexts.append(cache.step_context if cache is not None else None)
        return decode_attention(kvs, q, k, v, self._valid, scale, pools, contexts, pooled)
