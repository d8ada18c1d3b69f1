"""The Tandem side of `tandem bench`: fill a `TandemCache`, decode with the engine, and account for the bytes.

Rows have the schema of `baselines.empty_row`, so HF baselines and Tandem policies share one table.
"""

from __future__ import annotations

import time

import torch

from ...attention.hybrid import _observe
from ...config import TandemConfig
from ...engine import TandemRunner
from ...integrations.hf import TandemCache
from .baselines import KV_STD, empty_row, fill_agreed, kv_shape, record_failure, record_times, release_memory
from .cli import FILLS
from .concentrated import Profile, load_profile, plant_keys, query_norms


def fill_tandem_synthetic(
    cache: TandemCache,
    model,
    batch: int,
    context: int,
    seed: int = 0,
    lengths: list[int] | None = None,
    profile: Profile | None = None,
) -> None:
    """Put `context` tokens of random K/V (as `baselines.fill_synthetic` does for HF caches) into every layer.
    With `lengths` ([batch] ints <= context) request b holds only its first lengths[b] tokens and rows past them
    are not valid (a batch of mixed lengths). The first min(lengths) rows go in first, all valid: the hot tier's
    sinks are sized by the first append's padding, and left padding would keep up to max - min tokens of every
    layer on the GPU as sinks.

    Each layer's KV goes through the cache's own append path: sinks and window stay on the GPU, the rest
    lands in the host tier with its digests. HGCA then observes random queries over it, as it would observe
    the prompt's last tokens after a prefill, so its selection is built by its real rule.

    With a `profile` (`concentrated.load_profile`), each layer's keys are rescaled row by row so that its
    attention is as concentrated as the profile's measured heads (`concentrated.plant_keys`).
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    text = model.config.get_text_config(decoder=True)
    _, num_kv_heads, head_dim = kv_shape(model.config)
    num_q_heads = text.num_attention_heads
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, num_kv_heads, context, head_dim)
    valid = torch.ones(batch, context, dtype=torch.bool, device=device)
    chunks = [(0, context)]
    if lengths is not None:
        if len(lengths) != batch or not all(0 < n <= context for n in lengths):
            raise ValueError(f"lengths must be {batch} ints in [1, {context}], got {lengths}")
        for b, n in enumerate(lengths):
            valid[b, n:] = False
        shortest = min(lengths)
        chunks = [(0, shortest), (shortest, context)] if shortest < context else chunks
    if profile is not None:
        q_norms = query_norms(model)
        plant_gen = torch.Generator().manual_seed(seed)
    layers = cache.tandem_layers()
    for index, layer in enumerate(layers):
        keys = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        if profile is None:
            keys.mul_(KV_STD)
        else:
            config = layer.config
            plant_keys(
                keys, index, len(layers), profile, q_norms[index], head_dim**-0.5, config.sink_tokens,
                config.window_tokens, plant_gen,
            )  # fmt: skip
        values = torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(KV_STD)
        for start, stop in chunks:
            layer.append(keys[:, :, start:stop], values[:, :, start:stop], valid[:, start:stop])
        if layer.policy.needs_maw:
            obs = (batch, num_q_heads, layer.config.hgca.observation_tokens, head_dim)
            _observe(layer, torch.randn(obs, generator=gen, device=device, dtype=dtype), head_dim**-0.5)
        layer.host.wait()  # bounds the GPU memory held by pending copies to one layer's KV
        del keys, values


def cpu_bytes_per_step(cache: TandemCache) -> float:
    """Bytes the CPU tier read per decode step, summed over layers: the K/V rows the CPU attended plus, for quest
    without a digest mirror on a GPU (a CPU hot tier), every block digest it scores on the CPU."""
    total = 0.0
    for layer in cache.tandem_layers():
        if layer.decode_steps == 0 or layer.host is None:
            continue
        host = layer.host
        layer.collect_statistics()
        cpu_rows = layer.rows_attended - layer.rows_attended_device - layer.rows_attended_cached
        total += cpu_rows / layer.decode_steps * _row_bytes(layer)
        if layer.policy.needs_digest and (host.key_min_dev is None or not host.key_min_dev.is_cuda):
            blocks = host.rows // host.block_size
            digest_bytes = 2 * layer.head_dim * host.dtype.itemsize  # key_min + key_max, never quantized
            total += host.batch * host.num_kv_heads * blocks * digest_bytes
    return total


def device_bytes_per_step(cache: TandemCache) -> float:
    """Bytes of host-tier K/V rows the GPU read in place over PCIe per decode step (a quest `gpu_share`; with a
    recall cache, the blocks it copied in)."""
    return _bytes_per_step(cache, "rows_attended_device", _row_bytes)


def cache_bytes_per_step(cache: TandemCache) -> float:
    """Bytes of host-tier K/V rows attended from quest's recall cache in GPU memory per decode step (gpu_cache)."""
    return _bytes_per_step(cache, "rows_attended_cached", _decoded_row_bytes)


def _bytes_per_step(cache: TandemCache, counter: str, row_bytes) -> float:
    """K/V bytes per decode step of one of the layers' row counters (`row_bytes(layer)` each), summed over
    layers."""
    layers = [layer for layer in cache.tandem_layers() if layer.decode_steps and layer.host is not None]
    for layer in layers:
        layer.collect_statistics()
    return sum(getattr(layer, counter) / layer.decode_steps * row_bytes(layer) for layer in layers)


def _decoded_row_bytes(layer) -> int:
    """Bytes of one K row + one V row in the model's dtype (the recall cache holds decoded rows)."""
    return 2 * layer.head_dim * layer.host.dtype.itemsize


def _row_bytes(layer) -> float:
    """Host-tier bytes of one K row + one V row as stored: the codes plus their share of the block scales with
    `host.dtype`, else the model's dtype."""
    host = layer.host
    scales = 2 * 4 / host.block_size if host.quant else 0.0
    return 2 * layer.head_dim * host.keys.element_size() + scales


def run_tandem(
    model,
    config: TandemConfig,
    label: str,
    batch: int,
    context: int,
    steps: int,
    warmup: int,
    fill: str = "synthetic",
    chunk_tokens: int = 8192,
    use_graphs="auto",
    seed: int = 0,
    handoff: str = "auto",
    forward: str = "auto",
    agree=None,
) -> dict:
    """Fill (synthetic K/V, concentrated or not, or a real chunked prefill of random tokens), decode
    `warmup + steps` greedy steps, and return one row timed over the last `steps`. Out-of-memory (GPU or host) gives status "oom", any other
    failure "error"; neither raises. agree: for tensor-parallel shards, as in `baselines.run_hf_baseline`."""
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {', '.join(FILLS)}, got {fill!r}")
    row = empty_row(f"tandem-{label}", batch, context, steps, warmup)
    device = next(model.parameters()).device
    release_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cache = runner = None
    try:
        cache = TandemCache.for_model(model, config)
        runner = TandemRunner(model, cache, use_graphs=use_graphs, handoff=handoff, forward=forward)
        row["forward"] = runner.forward
        vocab = model.config.get_text_config(decoder=True).vocab_size
        gen = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        if fill in ("synthetic", "concentrated"):
            for layer in cache.tandem_layers():
                layer.capacity_hint = context + warmup + steps + 1
            profile = load_profile() if fill == "concentrated" else None
            fill_agreed(
                agree, lambda: fill_tandem_synthetic(cache, model, batch, context, seed, profile=profile)
            )
            row["filled"] = True
            runner.set_positions(torch.full((batch,), context))
            first = torch.randint(0, vocab, (batch,), generator=gen)
        else:
            ids = torch.randint(0, vocab, (batch, context), generator=gen)
            row["filled"] = (
                True  # a prefill runs the collectives: a rank failing in it leaves the others there
            )
            logits = runner.prefill(ids, chunk_tokens=chunk_tokens, max_new_tokens=warmup + steps + 1)
            first = logits.argmax(-1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row["fill_s"] = time.perf_counter() - start
        row["fill"] = fill
        for layer in cache.tandem_layers():  # count decode steps only (the fill attends nothing)
            layer.reset_statistics()
        tokens, seconds = runner.decode(first, warmup + steps)
        stats = cache.stats()
        record_times(
            row,
            seconds[warmup:],
            device,
            gpu_kv_bytes=stats["hot_bytes"],
            host_kv_bytes=stats["host_bytes"],
            cpu_bytes_per_step=cpu_bytes_per_step(cache),
            pcie_bytes_per_step=device_bytes_per_step(cache),
            cache_bytes_per_step=cache_bytes_per_step(cache),
            attended_fraction=stats["mean_fraction_attended"],
            graphs=runner.use_graphs,
            handoff=runner.handoff if runner.use_graphs else None,
            tokens=tokens.tolist(),
        )
    except Exception as err:  # a row per configuration, whatever happens to it
        record_failure(row, err)
    finally:
        cache = runner = None
        release_memory(device)
    return row


def bound_ms(
    row: dict,
    weight_bytes: int,
    hbm_gbps: float | None,
    host_read_gbps: float,
    pcie_gbps: float | None = None,
) -> float | None:
    """The issue's bound, max(weight bytes / HBM bandwidth, CPU-tier bytes per step / host read bandwidth), with
    a third term where the GPU reads part of the host tier itself: those bytes / PCIe bandwidth."""
    terms = _bound_terms(row, weight_bytes, hbm_gbps, host_read_gbps, pcie_gbps)
    return None if terms is None else max(terms)


def serial_bound_ms(
    row: dict,
    weight_bytes: int,
    hbm_gbps: float | None,
    host_read_gbps: float,
    pcie_gbps: float | None = None,
) -> float | None:
    """The bound with the layers in sequence, as one batch decodes: a layer's host reads need its query, which
    needs its weights, so the weights' time and the host reads' time add up. The host reads are the slowest of
    the CPU's reads, the GPU's reads over PCIe, and both together from host memory (they share its bandwidth):
    weight bytes / HBM + max(CPU bytes / host read, PCIe bytes / PCIe, (CPU + PCIe bytes) / host read)."""
    terms = _bound_terms(row, weight_bytes, hbm_gbps, host_read_gbps, pcie_gbps)
    if terms is None:
        return None
    gpu_ms, cpu_ms, pcie_ms = terms
    both_ms = (row["cpu_bytes_per_step"] + (row.get("pcie_bytes_per_step") or 0.0)) / (host_read_gbps * 1e6)
    return gpu_ms + max(cpu_ms, pcie_ms, both_ms)


def _bound_terms(row, weight_bytes, hbm_gbps, host_read_gbps, pcie_gbps) -> tuple[float, float, float] | None:
    """(weights, CPU reads, PCIe reads) in ms, or None where the row did not run or a bandwidth is missing."""
    if row["status"] != "ok" or row["cpu_bytes_per_step"] is None:
        return None
    gpu_ms = weight_bytes / (hbm_gbps * 1e9) * 1e3 if hbm_gbps else 0.0
    cpu_ms = row["cpu_bytes_per_step"] / (host_read_gbps * 1e9) * 1e3
    pcie_bytes = row.get("pcie_bytes_per_step") or 0.0
    if pcie_bytes and not pcie_gbps:
        return None  # no PCIe measurement (no GPU): no bound for a row that read over PCIe
    pcie_ms = pcie_bytes / (pcie_gbps * 1e9) * 1e3 if pcie_bytes else 0.0
    return gpu_ms, cpu_ms, pcie_ms
