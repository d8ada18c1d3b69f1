"""Hugging Face baselines of `tandem bench`: DynamicCache (all KV on the GPU) and HF's offloaded cache (KV in
host memory, each layer copied to the GPU before it is used), filled with synthetic KV and timed per decode step.

A real prefill is replaced by `fill_synthetic`: with random weights the prompt carries no information, and at
64K-128K tokens a prefill costs minutes of GPU time; a decode step reads the same bytes either way.
`decode` / `time_decode` are cache-agnostic, so the Tandem side can be timed by the same loop.

>>> model = build_random_model("llama-3.1-8b", "cuda", torch.bfloat16)
>>> row = run_hf_baseline(model, "dynamic", batch=1, context=32768, steps=32, warmup=4)
>>> row["status"], row["tpot_median_ms"]  # e.g. ('ok', 21.3)
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from tandem.cache.memory import empty_pinned_cache
from tandem.integrations.hf import generate_cache_kwargs, restore_attention
from tandem.models import attention_shape

KINDS = ("dynamic", "offloaded")
# SDPA backends allowed while timing on CUDA. Left to itself, torch 2.11 on an H200 picks cuDNN attention, which
# pays host time per call for every KV length it has not seen, i.e. on every decode step (docs/engine.md §
# `tandem bench`). A baseline slowed by that would flatter whatever is compared with it.
SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
KV_STD = 0.1  # synthetic K/V ~ N(0, KV_STD): small, as keys and values of real layers are
_ERROR_CHARS = 300


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def kv_shape(model_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers config."""
    num_layers, _, num_kv_heads, head_dim = attention_shape(model_config.get_text_config(decoder=True))
    return num_layers, num_kv_heads, head_dim


def fill_synthetic(
    cache, model_config, batch: int, context: int, device, dtype: torch.dtype, seed: int = 0
) -> None:
    """Append `context` tokens of random K/V to every layer of an HF cache through `cache.update`.

    Per layer: key, value [batch, num_kv_heads, context, head_dim] ~ N(0, KV_STD) in `dtype`, made on `device`
    (where a prefill would have produced them; an offloading cache moves them to host memory itself).
    """
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got batch={batch}, context={context}")
    num_layers, num_kv_heads, head_dim = kv_shape(model_config)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, num_kv_heads, context, head_dim)
    for layer_idx in range(num_layers):
        key = torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(KV_STD)
        value = torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(KV_STD)
        cache.update(key, value, layer_idx)
        del key, value  # the cache holds its own copy; free ours before the next layer's


def _offloading_note(model) -> str | None:
    if _model_device(model).type == "cuda":
        return None
    return (
        f"model on {_model_device(model).type}: HF's offloaded cache needs CUDA and its offload target is host "
        "memory, where this KV already is; ran as DynamicCache"
    )


def make_hf_cache(kind: str, model):
    """An empty HF cache for `model`: kind "dynamic" -> `DynamicCache(config=...)`; "offloaded" ->
    `DynamicCache(config=..., offloading=True)` (each layer's KV lives in pinned host memory and is prefetched
    to the GPU one layer ahead). On a model off CUDA, "offloaded" gives a plain DynamicCache (see the note
    `run_hf_baseline` writes), since HF's offloading needs CUDA streams and would move nothing.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown HF cache kind {kind!r}: expected one of {', '.join(KINDS)}")
    if kind == "dynamic" or _offloading_note(model) is not None:
        return DynamicCache(config=model.config)
    if "offloading" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(config=model.config, offloading=True)
    from transformers.cache_utils import OffloadedCache  # transformers before the `offloading` flag

    return OffloadedCache()


def decode(
    model,
    cache,
    batch: int,
    context: int,
    steps: int,
    warmup: int = 2,
    seed: int = 0,
    sdpa_backends=SDPA_BACKENDS,
) -> tuple[list[float], torch.Tensor]:
    """Greedy decode of `warmup + steps` tokens per request after a cache of `context` tokens.

    Each step feeds one token per request (input_ids [batch, 1]) at position `context + step` (explicit
    `position_ids`, and `cache_position` where the model's forward takes it), asks for the last logits only,
    and feeds the argmax back. A step is timed with perf_counter from a device synchronize to one after the
    argmax. The first token is random (seeded). On CUDA, torch's SDPA may only use `sdpa_backends`
    (None: torch's own choice).

    Returns (seconds of each of the last `steps` steps, tokens [batch, warmup + steps] int64 on CPU).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    device = _model_device(model)
    params = inspect.signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    cache_kwargs = generate_cache_kwargs(model, cache)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, 1), generator=gen).to(device)
    positions = torch.arange(context, context + warmup + steps, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, tokens = [], []
    use_backends = sdpa_backends is not None and device.type == "cuda"
    backends = sdpa_kernel(list(sdpa_backends)) if use_backends else contextlib.nullcontext()
    with torch.no_grad(), backends:
        for step in range(warmup + steps):
            position_ids = positions[step : step + 1].expand(batch, 1)
            if "cache_position" in params:
                extra["cache_position"] = positions[step : step + 1]
            sync()
            start = time.perf_counter()
            out = model(input_ids=ids, position_ids=position_ids, use_cache=True, **cache_kwargs, **extra)
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            sync()
            if step >= warmup:
                times.append(time.perf_counter() - start)
            tokens.append(ids)
            del out
    return times, torch.cat(tokens, dim=1).cpu()


def time_decode(
    model, cache, batch: int, context: int, steps: int, warmup: int = 2, sdpa_backends=SDPA_BACKENDS
) -> list[float]:
    """Seconds per decode step of the last `steps` of `warmup + steps` greedy steps (see `decode`)."""
    return decode(model, cache, batch, context, steps, warmup, sdpa_backends=sdpa_backends)[0]


def percentile(ordered: list[float], share: float) -> float:
    """The `share` quantile (0..1) of ascending values, linear interpolation between ranks."""
    rank = share * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(times_s: list[float]) -> tuple[float | None, ...]:
    """(median, 90th percentile, 99th percentile, max) in milliseconds, linear interpolation; Nones for no
    times. The tail columns show steps that stall (a serving user's inter-token spikes), which the median hides."""
    if not times_s:
        return None, None, None, None
    ordered = sorted(times_s)
    return tuple(1e3 * v for v in (statistics.median(ordered), percentile(ordered, 0.9),
                                   percentile(ordered, 0.99), ordered[-1]))  # fmt: skip


def kv_bytes(cache) -> tuple[int, int]:
    """(bytes of K/V on CUDA devices, bytes of K/V in host memory) held by an HF cache's layers now."""
    gpu = host = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                nbytes = tensor.numel() * tensor.element_size()
                if tensor.device.type == "cuda":
                    gpu += nbytes
                else:
                    host += nbytes
    return gpu, host


def is_oom(err: BaseException) -> bool:
    """True for CUDA out-of-memory, host MemoryError and allocator RuntimeErrors that say out of memory."""
    if isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    message = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return message if len(message) <= _ERROR_CHARS else message[: _ERROR_CHARS - 3] + "..."


def empty_row(system: str, batch: int, context: int, steps: int, warmup: int) -> dict:
    """A result row with every key `tandem.bench.report` reads, measurements unset."""
    return {
        "system": system,
        "batch": batch,
        "context": context,
        "steps": steps,
        "warmup": warmup,
        "status": "ok",
        "error": None,
        "note": None,
        "tpot_ms": [],
        "tpot_median_ms": None,
        "tpot_p90_ms": None,
        "tpot_p99_ms": None,
        "tpot_max_ms": None,
        "tokens_per_s": None,
        "gpu_peak_bytes": None,
        "gpu_kv_bytes": None,
        "host_kv_bytes": None,
        "cpu_bytes_per_step": None,
        "pcie_bytes_per_step": None,
        "cache_bytes_per_step": None,
        "attended_fraction": None,
        "bound_ms": None,
        "tpot_over_bound": None,
        "tokens": None,
    }


def run_hf_baseline(
    model,
    kind: str,
    batch: int,
    context: int,
    steps: int,
    warmup: int = 2,
    seed: int = 0,
    sdpa_backends=SDPA_BACKENDS,
    agree=None,
) -> dict:
    """Fill an HF cache of `kind` with `context` synthetic tokens per request, decode, and return one row.

    A configuration that does not fit comes back with status "oom" (its memory freed), any other failure
    with status "error" and the message; neither raises. gpu_peak_bytes is the CUDA allocator's peak over
    fill + decode, weights included (None off CUDA); gpu_kv_bytes / host_kv_bytes are where the cache's K/V
    sit after the last step; tokens [batch][warmup + steps] are the greedy tokens. The offloaded cache
    reaches its steady speed after about 5 steps (its first steps allocate pinned host blocks): warm up 4+.
    agree: for a tensor-parallel shard, `fill_agreed`'s collective: no rank decodes unless every rank filled.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown HF cache kind {kind!r}: expected one of {', '.join(KINDS)}")
    row = empty_row(f"hf-{kind}", batch, context, steps, warmup)
    device = _model_device(model)
    dtype = next(model.parameters()).dtype
    if kind == "offloaded":
        row["note"] = _offloading_note(model)
    release_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cache = None
    restore_attention(model)  # a Tandem row before this one left the model on Tandem's attention
    try:
        cache = make_hf_cache(kind, model)
        fill_agreed(agree, lambda: fill_synthetic(cache, model.config, batch, context, device, dtype, seed))
        row["filled"] = True
        times, tokens = decode(model, cache, batch, context, steps, warmup, seed, sdpa_backends)
        gpu_kv, host_kv = kv_bytes(cache)
        record_times(row, times, device, gpu_kv_bytes=gpu_kv, host_kv_bytes=host_kv, tokens=tokens.tolist())
    except Exception as err:  # a row per configuration, whatever happens to it
        record_failure(row, err)
    finally:
        cache = None
        release_memory(device)
    return row


def fill_agreed(agree, fill) -> None:
    """Run `fill()`; with `agree` (tensor-parallel ranks: all_ok(flag) -> whether every rank's flag was set),
    raise on every rank if any rank's fill failed, so that none goes on to a decode step whose collectives the
    failed one would never join."""
    try:
        fill()
    except Exception:
        if agree is not None:
            agree(False)
        raise
    if agree is not None and not agree(True):
        raise torch.OutOfMemoryError("another tensor-parallel rank failed to fill its cache (see its row)")


def record_times(row: dict, times_s: list[float], device: torch.device, **fields) -> None:
    """Fill a row's timing columns from per-step seconds (and any other `fields`), plus the GPU peak."""
    median_ms, p90_ms, p99_ms, max_ms = summarize(times_s)
    row.update(
        tpot_ms=[t * 1e3 for t in times_s],
        tpot_median_ms=median_ms,
        tpot_p90_ms=p90_ms,
        tpot_p99_ms=p99_ms,
        tpot_max_ms=max_ms,
        tokens_per_s=row["batch"] / (median_ms / 1e3),
        **fields,
    )
    if device.type == "cuda":
        row["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)


def record_failure(row: dict, err: BaseException) -> None:
    row["status"] = "oom" if is_oom(err) else "error"
    row["error"] = _short(err)


def release_memory(device: torch.device) -> None:
    gc.collect()  # tracebacks and caches can hold device tensors in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
        # pinned host blocks stay cached by torch after their tensors die; a large host tier per row would pile up
        # across rows without this
        empty_pinned_cache()
