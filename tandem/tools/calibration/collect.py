"""Calibration samples from a real model: per document, layer, sampled decode step and query head, the 41
features and the measured Eq. 2 budgets.

Each calibration document is a chat prompt made of haystack prose (never a `tandem eval` task prompt) and an
open request about it; the model answers greedily with full attention while a registered attention function
records the queries: the prompt's last one (the anchor q') and each decode step's. The decode steps' keys and
values are then read from the cache, split into sinks / host / local segments as a Tandem cache would hold them
at that step, and measured (`search.min_budgets`) and described (`features`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache

from ...integrations.hf import _sdpa_fallback, generate_cache_kwargs
from ...models import attention_shape
from ...policies.fluxion_features import AnchorStats, anchor_stats, join_segments, step_features
from ...policies.fluxion_search import CALIBRATION_BLOCKS, min_budgets

CAPTURE_NAME = "tandem_calibrate"
REQUESTS = (
    "Summarize the text above in a few sentences.",
    "What are the main ideas of the text above? Answer briefly.",
    "Write three questions a reader might ask about the text above.",
    "Which people, places or dates does the text above mention?",
    "Continue the text above with one more paragraph in the same style.",
    "Explain the text above to a twelve-year-old.",
)


@dataclass
class Samples:
    """Calibration samples, one row per (document, layer, decode step, query head)."""

    features: torch.Tensor  # [N, len(taus), 41]
    budgets: torch.Tensor  # [N, len(CALIBRATION_BLOCKS), len(taus)]
    streaming_error: torch.Tensor  # [N] Eq. 2 error with the hot segment only
    layer: torch.Tensor  # [N] int64
    head: torch.Tensor  # [N] int64
    document: torch.Tensor  # [N] int64
    info: list = field(default_factory=list)  # per document: tokens, prompt tokens, seconds

    @staticmethod
    def concat(parts: list[Samples]) -> Samples:
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        info = [i for p in parts for i in p.info]
        return Samples(*(cat(n) for n in ("features", "budgets", "streaming_error", "layer", "head", "document")),
                       info=info)  # fmt: skip


class _Recorder:
    """Attention function that records each layer's last query, then attends exactly (SDPA)."""

    def __init__(self) -> None:
        self.queries: dict[int, list[torch.Tensor]] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        self.queries.setdefault(module.layer_idx, []).append(query[0, :, -1].detach().float().cpu())
        return _sdpa_fallback(query, key, value, attention_mask, scaling)


def segments(keys: torch.Tensor, values: torch.Tensor, tokens: int, sink_tokens: int, window_tokens: int,
             block_size: int = 16):  # fmt: skip
    """(sink, cpu, local) segments of the first `tokens` positions as a Tandem cache holds them: `sink_tokens`
    sinks, whole blocks of `block_size` on the host, at least `window_tokens` recent tokens on the device.
    keys / values: [1, Hkv, T, D]."""
    sinks = min(tokens, sink_tokens)
    host = max(0, (tokens - sinks - window_tokens) // block_size * block_size)
    bounds = (0, sinks, sinks + host, tokens)
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        out.append((keys[:, :, a:b], values[:, :, a:b], torch.ones(1, b - a, dtype=torch.bool)))
    return tuple(out)


def document_prompt(tokenizer, text: str, request: str) -> str:
    message = f"{text}\n\n{request}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
    return message + "\n"


def haystack_document(tokenizer, words: list[str], tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of consecutive haystack prose from a random offset."""
    take = int(tokens * 0.72)  # prose runs ~1.3-1.4 tokens per word here
    for _ in range(8):
        start = rng.randrange(0, max(1, len(words) - take))
        text = " ".join(words[start : start + take])
        have = len(tokenizer(text).input_ids)
        if have >= tokens * 0.9 or take >= len(words):
            break
        take = min(len(words), int(take * tokens / max(1, have)) + 16)
    ids = tokenizer(text).input_ids[:tokens]
    return tokenizer.decode(ids)


@torch.no_grad()
def collect_document(
    model,
    tokenizer,
    prompt: str,
    doc_index: int,
    taus: tuple[float, ...],
    sink_tokens: int,
    window_tokens: int,
    new_tokens: int,
    steps: int,
    rng: random.Random,
) -> Samples:
    """Run one document and measure `steps` of its decode steps at every layer."""
    import time

    start = time.perf_counter()
    device = next(model.parameters()).device
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    recorder = _Recorder()
    AttentionInterface.register(CAPTURE_NAME, recorder)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_NAME)
    try:
        cache = DynamicCache(config=model.config)
        # transformers 5.x renames past_key_values to cache (the old name warns now and goes in 5.40)
        cache_kwargs = generate_cache_kwargs(model, cache)
        out = model(ids, use_cache=True, logits_to_keep=1, **cache_kwargs)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            out = model(token, use_cache=True, **cache_kwargs)
            token = out.logits[:, -1:].argmax(-1)
    finally:
        model.set_attn_implementation(previous)
    prompt_len = ids.shape[1]
    chosen = sorted(rng.sample(range(new_tokens), min(steps, new_tokens)))
    text_config = model.config.get_text_config(decoder=True)
    head_dim = attention_shape(text_config)[3]
    scale = getattr(text_config, "query_pre_attn_scalar", None)
    scale = scale**-0.5 if scale else head_dim**-0.5
    parts = {k: [] for k in ("features", "budgets", "err", "layer", "head")}
    for layer_idx, queries in sorted(recorder.queries.items()):
        keys = cache.layers[layer_idx].keys.float().cpu()
        values = cache.layers[layer_idx].values.float().cpu()
        anchor_q = queries[0][None]  # the prompt's last query
        anchor: AnchorStats = anchor_stats(
            anchor_q, *segments(keys, values, prompt_len, sink_tokens, window_tokens), scale, taus
        )
        for step in chosen:
            q = queries[1 + step][None]  # decode step `step` sits at position prompt_len + step
            sink, cpu, local = segments(keys, values, prompt_len + step + 1, sink_tokens, window_tokens)
            if cpu[0].shape[2] == 0:
                continue
            budgets, err = min_budgets(q, join_segments(sink, local), cpu, scale, CALIBRATION_BLOCKS, taus)
            rows = cpu[2].sum(-1)
            feats = torch.stack(
                [step_features(layer_idx, q, anchor, sink, local, rows, scale, t) for t in range(len(taus))],
                dim=2,
            )  # [1, Hq, T, 41]
            num_q_heads = q.shape[1]
            parts["features"].append(feats[0])
            parts["budgets"].append(budgets[0])
            parts["err"].append(err[0])
            parts["layer"].append(torch.full((num_q_heads,), layer_idx))
            parts["head"].append(torch.arange(num_q_heads))
    count = sum(len(x) for x in parts["head"])
    info = {"document": doc_index, "prompt_tokens": prompt_len, "steps": len(chosen), "samples": count,
            "seconds": time.perf_counter() - start}  # fmt: skip
    return Samples(
        torch.cat(parts["features"]),
        torch.cat(parts["budgets"]),
        torch.cat(parts["err"]),
        torch.cat(parts["layer"]),
        torch.cat(parts["head"]),
        torch.full((count,), doc_index),
        [info],
    )
