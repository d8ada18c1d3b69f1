"""Small random-weight decoder models for the tests (2 layers, hidden 64, 4 query / 2 KV heads by default)."""

import torch
import transformers


def tiny_model(arch, **overrides):
    """A `{arch}ForCausalLM` (Llama, Qwen2, Mistral, ...) in eval mode, weights seeded with 0."""
    cfg_cls = getattr(transformers, f"{arch}Config")
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    shape = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    cfg = cfg_cls(**{**shape, **overrides})
    torch.manual_seed(0)
    return model_cls(cfg).eval()
