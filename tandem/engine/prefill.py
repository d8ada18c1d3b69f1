"""A prompt's chunks through the model into a `TandemCache`: where each chunk ends, and one chunk's forward.

`TandemRunner.prefill` runs a whole prompt this way; the server runs one chunk per turn between decode steps
(`RowsRunner.prefill_chunk`). Both cut the prompt with `chunk_end` and run each piece with `run_chunk`, so a prompt
leaves the same cache whichever of them prefilled it.
"""

from __future__ import annotations

import torch


def observed_tokens(config) -> int:
    """Prompt tokens whose queries score the prompt once it is cached: `hgca`'s `observation_tokens`, else 0."""
    return config.hgca.observation_tokens if config.policy == "hgca" else 0


def chunk_end(start: int, total: int, chunk_tokens: int, observed: int = 0) -> int:
    """End of the chunk that starts at `start` of a `total`-token prompt: `chunk_tokens` further, except that the
    last chunk holds at least `observed` tokens (hgca scores the prompt with the last chunk's queries, and one
    whole prefill would have observed that many): a chunk that would leave fewer behind stops where the last
    `observed` begin, or runs to the end when it starts inside them."""
    if not 0 <= start < total:
        raise ValueError(f"start must lie in [0, total = {total}), got {start}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    end = min(total, start + chunk_tokens)
    if total - observed < end < total:
        end = total - observed if total - observed > start else total
    return end


def prefix_end(total: int, chunk_tokens: int, observed: int = 0) -> int:
    """The longest prefix of a `total`-token prompt that a prefill in chunks of `chunk_tokens` passes through at a
    chunk boundary and that another prompt could share (`cache.prefix`): the last multiple of chunk_tokens before
    the prompt's end that `chunk_end` stops at, or 0. A prompt keeps its state there, and a prompt that begins with
    the same tokens starts from it when it is at most this long for that prompt: its own cold prefill would have
    stopped there too, so it continues in the same chunks."""
    end = min(total - 1, total - observed) // chunk_tokens * chunk_tokens
    return max(0, end)


# a prompt keeps its prefixes at this many of its last chunk boundaries (`kept_ends`): two hold a document that a
# question shorter than one chunk follows, wherever the document ends (the last boundary may fall in the question)
KEPT_BOUNDARIES = 2


def kept_ends(total: int, chunk_tokens: int, observed: int = 0) -> list[int]:
    """The boundaries at which a `total`-token prompt's prefill keeps its prefix (`cache.prefix`): the last
    KEPT_BOUNDARIES chunk boundaries up to `prefix_end`, ascending."""
    last = prefix_end(total, chunk_tokens, observed)
    return [
        end for end in range(last - (KEPT_BOUNDARIES - 1) * chunk_tokens, last + 1, chunk_tokens) if end > 0
    ]


def start_from_prefix(store, cache, tokens, chunk_tokens: int) -> int:
    """Start a new batch-1 `cache` from the longest prefix of the prompt `tokens` kept in `store` (a
    `cache.prefix.PrefixCache`) under its settings and this chunk length, one its own cold prefill would also stop
    at (`prefix_end`); returns the tokens it holds then (0: none kept), where the prefill goes on."""
    limit = prefix_end(len(tokens), chunk_tokens, observed_tokens(cache.config))
    entry = store.lookup(cache.config, chunk_tokens, tokens, limit)
    return 0 if entry is None else store.restore(cache.layer_caches(), entry)


def keep_prefix(store, cache, tokens, end: int, chunk_tokens: int) -> None:
    """After the chunk of the prompt `tokens` that ends at `end`: keep `cache`'s state in `store` where `end` is one
    of the prompt's kept boundaries (`kept_ends`)."""
    if end in kept_ends(len(tokens), chunk_tokens, observed_tokens(cache.config)):
        store.insert(cache.layer_caches(), cache.config, chunk_tokens, tokens[:end])


# of the device memory free when a chunked prefill starts, the most its layers' copies of the prompt's host rows
# may take (`LayerKV.keep_prompt_rows`)
PROMPT_ROWS_SHARE = 0.5
# the longest chunk whose prompt keeps them: the copies pay where each host row would cross PCIe again for many
# chunks (8B shape on an H200: 2K chunks 0.72-0.85x the time), not with long chunks (16K chunks of a 128K prompt:
# the same time, and 36 GB of peak device memory against 19; docs/engine.md § Chunked prefill)
PROMPT_ROWS_MAX_CHUNK = 4096


def prompt_rows_budget(device: torch.device, num_layers: int) -> int:
    """The bytes each of `num_layers` layers' copies of a prompt's host rows may take on `device`: their share of
    PROMPT_ROWS_SHARE of its free memory; 0 off CUDA (the host tier is where the layers attend it)."""
    if device.type != "cuda":
        return 0
    return int(PROMPT_ROWS_SHARE * torch.cuda.mem_get_info(device)[0] / num_layers)


def run_chunk(model, cache, cache_kwargs: dict, input_ids, positions, attention_mask=None, last: bool = True):
    """One chunk through the model into `cache`: input_ids and positions [B, t], attention_mask [B, tokens so far]
    (None: no padding); `cache_kwargs` passes the cache to the model (`generate_cache_kwargs`). Returns the last
    position's logits [B, V], float32 on the model's device. Only the last chunk's appends are observed (hgca).
    An error leaves the cache refusing further use: some layers may hold the chunk and others not.

    On CUDA, a prompt's first chunk that is not its last, of at most PROMPT_ROWS_MAX_CHUNK tokens, lets each layer
    keep a device copy of the rows it sends to the host tier (`LayerKV.keep_prompt_rows`, within PROMPT_ROWS_SHARE
    of the free device memory over all layers), so that the next chunks attend them without copying them back over
    PCIe; the last chunk frees them."""
    layers = cache.tandem_layers()
    if layers and cache.get_seq_length() == 0 and not last and input_ids.shape[1] <= PROMPT_ROWS_MAX_CHUNK:
        budget = prompt_rows_budget(input_ids.device, len(layers))
        for layer in layers:
            layer.keep_prompt_rows(budget)
    elif last:
        for layer in layers:
            layer.keep_prompt_rows(0)  # a copy made by earlier chunks serves this one, and none is made
    for layer in layers:
        layer.observe_appends = last
    try:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs,
        )
    except BaseException as err:
        cache.mark_failed(err)
        raise
    finally:
        for layer in layers:
            layer.observe_appends = True
            if last or layer.failed is not None:
                layer.drop_prompt_rows()
    return out.logits[:, -1].float()


__all__ = [
    "chunk_end", "keep_prefix", "kept_ends", "observed_tokens", "prefix_end", "prompt_rows_budget", "run_chunk",
    "start_from_prefix",
]  # fmt: skip
