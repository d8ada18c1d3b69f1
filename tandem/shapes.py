"""Named model shapes, their weight sizes, and models with random weights built directly on the device.

The shapes are the Hugging Face config fields of public checkpoints (their config.json), written in the
transformers 5 form (`rope_parameters` instead of `rope_theta` + `rope_scaling`). Random weights carry no
information, but a decode step over them costs what it costs over real ones: the same matrices are read.

>>> from tandem.shapes import build_random_model, param_count, shape_config
>>> param_count(shape_config("llama-3.1-8b")) / 1e9  # 8.03
>>> model = build_random_model("tiny-llama", "cpu", torch.float32)
"""

from __future__ import annotations

import copy

import torch

from .models import attention_shape

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": _LLAMA3_ROPE,
        "tie_word_embeddings": False,
    },
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": _LLAMA3_ROPE,
        "tie_word_embeddings": False,
    },
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    # meta-llama/Llama-3.2-3B
    "llama-3.2-3b": {
        "model_type": "llama",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen2.5-7B (q/k/v projections carry a bias: Qwen2's attention hard-codes it)
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
    # mistralai/Mistral-7B-v0.3 (no sliding window, unlike v0.1; MistralConfig's default is 4096)
    "mistral-7b": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32768,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # HuggingFaceTB/SmolLM2-135M (the shape of the default GGUF model)
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "tie_word_embeddings": True,
    },
    # for tests: every code path of a Llama in a few kilobytes
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    },
}

_COUNTED_TYPES = ("llama", "mistral", "qwen2")


def shape_config(name: str, num_layers: int | None = None):
    """The transformers config of a named shape, optionally with only the first `num_layers` layers.

    The attention implementation is left to the caller (`build_random_model(..., attn_implementation=)` or
    `model.set_attn_implementation`).
    """
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}: known shapes are {', '.join(SHAPES)}")
    from transformers import AutoConfig  # heavy import, only when a model is built

    fields = copy.deepcopy(SHAPES[name])
    model_type = fields.pop("model_type")
    if num_layers is not None:
        fields["num_hidden_layers"] = _check_layers(num_layers)
    return AutoConfig.for_model(model_type, **fields)


def _check_layers(num_layers) -> int:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers: expected a positive integer, got {num_layers!r}")
    return num_layers


def _dims(config) -> tuple[int, int, int, int, int, int, int]:
    text = config.get_text_config(decoder=True)
    if text.model_type not in _COUNTED_TYPES:
        raise ValueError(
            f"parameter count from the config supports model types {', '.join(_COUNTED_TYPES)}, not "
            f"{text.model_type!r}: count a built model's parameters instead"
        )
    _, num_q_heads, num_kv_heads, head_dim = attention_shape(text)
    return (
        text.hidden_size,
        text.intermediate_size,
        text.num_hidden_layers,
        num_q_heads,
        num_kv_heads,
        head_dim,
        text.vocab_size,
    )


def param_count(config) -> int:
    """Number of distinct parameters of a Llama / Mistral / Qwen2 config (tied embeddings counted once)."""
    hidden, inter, layers, num_q_heads, num_kv_heads, head_dim, vocab = _dims(config)
    text = config.get_text_config(decoder=True)
    q_out, kv_out = num_q_heads * head_dim, num_kv_heads * head_dim
    attention = hidden * (q_out + 2 * kv_out) + q_out * hidden
    if text.model_type == "qwen2":  # bias on q, k and v, none on o
        attention += q_out + 2 * kv_out
    elif getattr(text, "attention_bias", False):
        attention += q_out + 2 * kv_out + hidden
    mlp = 3 * hidden * inter + (2 * inter + hidden if getattr(text, "mlp_bias", False) else 0)
    per_layer = attention + mlp + 2 * hidden  # + input and post-attention RMSNorm
    embeddings = vocab * hidden * (1 if text.tie_word_embeddings else 2)
    return layers * per_layer + hidden + embeddings  # + final norm


def prefill_flops(config, start: int, end: int, batch: int = 1) -> dict:
    """FLOPs of prefilling prompt tokens [start, end) (the tokens before `start` already cached) with the last
    position's logits only, for a Llama / Mistral / Qwen2 config: {"linear", "attention", "total"}. linear: two
    per weight and token in the layers' projections, plus the LM head once per request; attention: causal, two
    matmuls of 2 FLOPs per (query, key, head dim, query head), each new query over the keys before it and itself
    (within `sliding_window` where the config has one). The work a prefill cannot avoid, whatever it pays on top."""
    hidden, inter, layers, num_q_heads, num_kv_heads, head_dim, vocab = _dims(config)
    text = config.get_text_config(decoder=True)
    q_out, kv_out = num_q_heads * head_dim, num_kv_heads * head_dim
    per_token = layers * (hidden * (q_out + 2 * kv_out) + q_out * hidden + 3 * hidden * inter)
    linear = 2 * batch * ((end - start) * per_token + hidden * vocab)
    attention = 4 * batch * layers * q_out * _causal_keys(start, end, getattr(text, "sliding_window", None))
    return {"linear": linear, "attention": attention, "total": linear + attention}


def _causal_keys(start: int, end: int, window: int | None) -> int:
    """The keys the queries at positions [start, end) attend causally, summed: min(t + 1, window) for each t."""

    def full(a: int, b: int) -> int:  # sum of (t + 1) for t in [a, b)
        return (b * (b + 1) - a * (a + 1)) // 2 if b > a else 0

    if not window:
        return full(start, end)
    return full(start, min(end, window)) + window * max(0, end - max(start, window))


def param_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of all weights in `dtype`, from the config alone (no model is built)."""
    return param_count(config) * _itemsize(dtype)


def weight_bytes_per_step(config, dtype: torch.dtype) -> int:
    """Weight bytes one decode step must read: all of them, except the input embedding table when it is not
    tied to the LM head (a lookup reads one row per request). The numerator of the HBM bound."""
    hidden, *_, vocab = _dims(config)
    untied_table = 0 if config.get_text_config(decoder=True).tie_word_embeddings else vocab * hidden
    return (param_count(config) - untied_table) * _itemsize(dtype)


def model_weight_bytes_per_step(model) -> int:
    """`weight_bytes_per_step` of a built model, from its parameters: what a tensor-parallel shard's GPU reads
    per step (its slices, plus the embeddings and norms every rank holds), without the input embedding table
    unless the LM head shares it."""
    seen, total = set(), 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    table = model.get_input_embeddings().weight
    if table.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        total -= table.numel() * table.element_size()
    return total


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def build_random_model(
    name_or_config,
    device,
    dtype: torch.dtype,
    num_layers: int | None = None,
    seed: int = 0,
    attn_implementation: str | None = None,
    std: float = 0.02,
):
    """A causal LM of a named shape (or a transformers config) with random weights, in eval mode.

    Built without touching host memory: the modules are made on the meta device, given uninitialized
    storage on `device`, and filled there (linear and embedding weights ~ N(0, std), biases 0, norms 1).
    The rotary embeddings' non-persistent buffers (`inv_freq`) are recomputed by rebuilding those modules
    from the config, so positions come out as in a model built the ordinary way. Any other buffer is refused.
    Same `seed`, device and dtype give the same weights.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(name_or_config, str):
        config = shape_config(name_or_config, num_layers)
    else:
        config = copy.deepcopy(name_or_config)
        if num_layers is not None:
            config.num_hidden_layers = _check_layers(num_layers)
            if getattr(config, "layer_types", None) is not None:
                config.layer_types = config.layer_types[:num_layers]
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.to(dtype=dtype)  # on meta: only the recorded dtype changes
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own storage, which unties shared weights
    _fill_random(model, device, seed, std)
    rebuild_rotary(model, device)
    return model.eval()


@torch.no_grad()
def _fill_random(model, device: torch.device, seed: int, std: float) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    seen = set()  # tied weights are one parameter held by two modules
    for module in model.modules():
        is_norm = "Norm" in type(module).__name__
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if is_norm:
                param.fill_(1.0 if name == "weight" else 0.0)
            elif name == "bias":
                param.zero_()
            else:
                param.normal_(0.0, std, generator=gen)


def rebuild_rotary(model, device: torch.device) -> None:
    """Recompute the rotary embeddings' `inv_freq` buffers of a model given uninitialized storage (`to_empty`)
    by rebuilding those modules from the config; refuse any other buffer."""
    rebuilt = set()
    for name, module in list(model.named_modules()):
        if "inv_freq" not in dict(module.named_buffers(recurse=False)):
            continue
        config = getattr(module, "config", None) or model.config.get_text_config(decoder=True)
        with torch.device("cpu"):  # a handful of floats; computed as the ordinary constructor does
            fresh = type(module)(config)
        fresh.to(device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fresh)
        rebuilt.add(name)
    for name, _ in model.named_buffers():
        if name.rpartition(".")[0] not in rebuilt:
            raise ValueError(
                f"build_random_model: buffer {name!r} of {type(model).__name__} has no known initializer "
                "(only rotary-embedding buffers are recomputed)"
            )
