"""What one request's cache will hold, known before it is admitted: host-tier bytes and compute-device bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import TandemConfig

HOST_MIN_BLOCKS = 64  # `HostTier.reserve` allocates at least this many blocks, even for a short request


@dataclass(frozen=True)
class CacheShape:
    """The attention shape of a model and the dtype its KV is stored in. `sliding`: the windows of its
    sliding-window layers (of the num_layers; the others are global)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding: tuple[int, ...] = ()

    @property
    def element(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def global_layers(self) -> int:
        """The layers with a host tier (those without a sliding window)."""
        return self.num_layers - len(self.sliding)


@dataclass(frozen=True)
class RequestBytes:
    """Bytes a request's `TandemCache` allocates: `host` in host memory (the host tier), `device` on the
    compute device (hot tier, digests mirrored there, quest's recall cache). On a CPU device both are host
    memory; `on_host` sums what host memory must hold."""

    host: int
    device: int
    device_is_host: bool

    @property
    def on_host(self) -> int:
        return self.host + (self.device if self.device_is_host else 0)

    @property
    def on_device(self) -> int:
        return 0 if self.device_is_host else self.device


def request_bytes(
    shape: CacheShape,
    config: TandemConfig,
    prompt_tokens: int,
    max_tokens: int,
    device_type: str,
    pooled_slots: int = 0,
) -> RequestBytes:
    """Upper bound on a batch-1 cache's allocations for a prompt of `prompt_tokens` and `max_tokens` more.

    Follows the global layers' tiers' own sizing (`cache.hot.HotTier`, `cache.host.HostTier`): the host tier is
    reserved once for every token past the sinks (the server passes the same capacity hint), whole blocks, at
    least `HOST_MIN_BLOCKS` of them; a sliding-window layer holds its window on the device. pooled_slots: the
    width of a row of the runner's pool of hot tiers (`engine.slots`, allocated already), or 0: a hot tier that
    fits one (and keeps no moving average) is not counted."""
    bs = config.block_size
    e = shape.element
    kv_row = 2 * shape.num_kv_heads * shape.head_dim  # K and V of one token, elements
    needs_digest = _needs_digest(config)
    needs_maw = config.policy == "hgca"
    on_cuda = device_type == "cuda"
    share = config.gpu_share_on(device_type)

    window = config.window_for_prompt(prompt_tokens)
    slots = config.sink_tokens + (math.ceil(window / bs) + 1) * bs
    hot = slots * (kv_row * e + 1) + (shape.num_q_heads * slots * 4 if needs_maw else 0)
    if slots <= pooled_slots and not needs_maw:
        hot = 0

    rows = _host_rows(config, prompt_tokens + max_tokens)
    blocks = rows // bs
    host = sum(host_stores(shape, config, prompt_tokens, max_tokens))
    digest = blocks * 2 * shape.num_kv_heads * shape.head_dim * e if needs_digest else 0
    device = hot
    if needs_digest and (on_cuda or share > 0):
        device += digest + blocks  # the digests' mirror on the compute device, and which blocks hold rows
    if config.certified.epsilon is not None:
        # the certified selection's digests on the compute device, float32: key centres [Hkv, nb, D], radii and
        # value norms [Hkv, nb], rows per block [nb]
        device += blocks * (shape.num_kv_heads * (shape.head_dim + 2) + 1) * 4
    if config.certified.epsilon is not None and config.certified.bound == "sketch":
        # and the int8 key sketch per row: codes [Hkv, rows, D], scale and error radius [Hkv, rows] float32,
        # which rows are live [rows]
        device += rows * (shape.num_kv_heads * (shape.head_dim + 8) + 1)
    if config.policy == "quest" and share > 0:
        factor = config.gpu_cache_on(device_type) or 0.0
        selected = math.ceil(config.quest.budget * blocks)
        device += int(factor * selected) * bs * kv_row * e
    # a sliding-window layer keeps window - 1 tokens on the device, and no host tier
    sliding = sum((window - 1) * (kv_row * e + 1) for window in shape.sliding)
    return RequestBytes(host * shape.global_layers, device * shape.global_layers + sliding, not on_cuda)


def host_stores(shape: CacheShape, config: TandemConfig, prompt_tokens: int, max_tokens: int) -> list[int]:
    """Bytes of each host-memory store of one global layer's host tier (`cache.host.HostTier`'s buffers: keys,
    values and valid flags, the 8-bit tier's scales, the digests, the moving average), as a batch-1 cache
    reserves them once for a prompt of `prompt_tokens` and `max_tokens` more (the server's capacity hint)."""
    rows = _host_rows(config, prompt_tokens + max_tokens)
    blocks = rows // config.block_size
    kv_heads, dim, e = shape.num_kv_heads, shape.head_dim, shape.element
    stored = 1 if config.host.dtype is not None else e
    stores = [rows * kv_heads * dim * stored] * 2 + [rows]
    if config.host.dtype is not None:
        stores += [blocks * kv_heads * 4] * 2  # K and V scales per block and KV head, float32
    if _needs_digest(config):
        stores += [blocks * kv_heads * dim * e] * 2  # each block's key minima and maxima
    if config.policy == "hgca":
        stores.append(rows * shape.num_q_heads * 4)  # the moving average of attention, float32
    return stores


def _host_rows(config: TandemConfig, tokens: int) -> int:
    """The host tier's rows for `tokens` cached: every token past the sinks, whole blocks, at least
    `HOST_MIN_BLOCKS` of them (`HostTier.reserve`)."""
    bs = config.block_size
    return max(-(-max(0, tokens - config.sink_tokens) // bs), HOST_MIN_BLOCKS) * bs


def _needs_digest(config: TandemConfig) -> bool:
    return config.policy in ("certified", "quest", "fluxion")
