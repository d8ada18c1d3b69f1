"""One layer's tiered KV cache: hot tier on the compute device, host tier in host memory, eviction between them."""

from __future__ import annotations

import math

import torch

from ..config import DEFAULT_GPU_SHARE
from ..policies import make_policy
from .failure import Failable
from .host import HostTier
from .hot import HotTier
from .recall import RecallBudget, RecallCache
from .split import RequestSplit

# the compute devices whose layers keep a device copy of a prompt's host rows while it prefills in chunks
# (`LayerKV.keep_prompt_rows`): where the host tier lives in other memory, across PCIe
PROMPT_ROWS_DEVICES = frozenset({"cuda"})


class LayerKV(Failable):
    """Tiered KV of one attention layer.

    Token flow: the first `sink_tokens` slots (widened by the longest left padding of the first prompt, so every
    request keeps that many real sink tokens) stay on the device for good; later tokens enter a ring of
    `ceil(window / block_size) + 1` blocks; when the ring is full its oldest block moves to the host tier.
    A long append sends the tokens that would only pass through the ring straight to the host tier.
    """

    def __init__(
        self,
        config,
        layer_idx: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        side_streams: dict | None = None,
        recall_budget: RecallBudget | None = None,
        num_layers: int | None = None,
        rank=None,
    ) -> None:
        self.config = config
        # the tensor-parallel rank of a sharded model (`distributed.tensor_parallel.Rank`), or None
        self.rank = rank
        # with host_split="requests" over several ranks, this rank's share of the batch (`split`)
        self.split = None
        self.layer_idx = layer_idx
        # the model's layer count, where known (fluxion checks its profile by it)
        self.num_layers = num_layers
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.policy = make_policy(config)
        self.hot: HotTier | None = None
        self.host: HostTier | None = None
        # the tiers of the request before `clear`, emptied, and the arguments they were made with: the next
        # prompt's first append takes each where its own would be made alike (`initialize`)
        self._spare: tuple = (None, None, None, None)
        self._hot_made_with = self._host_made_with = None
        self.seq_len = 0  # slots stored (padding included), as the model counts positions
        self.failed = None  # see `Failable`
        self._side_streams = side_streams if side_streams is not None else {}
        # statistics of the CPU side, summed over decode steps and (request, KV head) pairs
        self.rows_attended = 0
        self.rows_attended_device = 0  # of rows_attended: read by the device over PCIe (quest's gpu_share)
        self.rows_attended_cached = 0  # of rows_attended: attended from the recall cache in device memory
        self.gpu_share = (
            0.0  # the device share in effect (config.quest.gpu_share resolved once the device is known)
        )
        self.rows_available = 0
        self.decode_steps = 0
        self.decode_buffers = None  # fixed per-step buffers of the decode path (attention.decode)
        self.queue_buffers = None  # the step's task queue (attention.queue), with queue_split != "share"
        # how the step's task queue splits quest's selected host blocks (`attention.queue`): the config's
        # scheduler ("share": no queue; "queue"), or one of the static baselines (`SCHEDULER_BASELINES`) that
        # benchmarks/bench_scheduler.py sets on every layer of a cache whose scheduler is "queue", the ones
        # "heads" and "volume" giving the device the fraction `queue_share`: the benchmark's hook, not a setting
        self.queue_split = config.quest.scheduler
        self.queue_share = DEFAULT_GPU_SHARE
        self.attention_scale: float | None = (
            None  # the softmax scale of the decode steps (set by the decode path)
        )
        self.recall: RecallCache | None = None  # quest's cache of selected host blocks on the device
        # (cache, row): where a runner's pool plans this layer's device share (`attention.rows.PooledRows`), the
        # pool's recall cache and the row whose counts are this layer's
        self.recall_row: tuple[RecallCache, int] | None = None
        self.recall_budget = recall_budget  # sizes a default-sized recall cache (shared by a cache's layers)
        self.gpu_cache = 0.0  # its size in effect (config.quest.gpu_cache resolved once the device is known)
        self.observe_appends = True  # HGCA observation after appends (off for non-final prefill chunks)
        self.capacity_hint = 0  # tokens the caller expects to store: the host tier is sized once for them
        # during a chunked prefill, a device copy of the rows this layer sent to the host tier, which the next
        # chunks attend instead of streaming them back over PCIe (`keep_prompt_rows`): (keys, values, valid) of
        # the host tier's capacity and the rows written, or None; and the most bytes a new one may take
        self.prompt_rows = None
        self.prompt_rows_count = 0
        self.prompt_rows_bytes = 0
        # False: a runner stages this layer's next evicted ring block, with other requests' (`staging_due`)
        self.stages_own_evictions = True
        # None, or a callable (slots, dtype, device, keep_maw) -> the storage of a batch-1 hot tier of that many
        # slots (`HotTier`'s `storage`), or None where it has none that fits: a runner's pool of hot tiers
        # (`tandem.engine.slots`), asked once, when the first tokens arrive
        self.hot_storage = None
        # the same for the host tier's digest mirror of a batch-1 cache (`HostTier.mirror_storage`)
        self.mirror_storage = None

    @property
    def initialized(self) -> bool:
        return self.hot is not None

    def initialize(self, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """Allocate both tiers from the first append: keys [B, Hkv, m, D], valid [B, m]."""
        batch, num_kv_heads, prompt_len, head_dim = keys.shape
        if num_kv_heads != self.num_kv_heads or head_dim != self.head_dim:
            raise ValueError(
                f"layer {self.layer_idx}: keys have {num_kv_heads} heads of dim {head_dim}, the cache was built "
                f"for {self.num_kv_heads} heads of dim {self.head_dim}"
            )
        max_pad = int((~valid).sum(dim=1).max()) if prompt_len else 0
        self.make_tiers(batch, prompt_len, max_pad, keys.dtype, keys.device)

    def make_tiers(
        self, batch: int, prompt_len: int, max_pad: int, dtype: torch.dtype, device, reserve_host: bool = True
    ) -> None:
        """Allocate both tiers as a first append of `prompt_len` tokens (the longest left padding `max_pad`) in
        `dtype` on `device` makes them (`initialize`; a restored prefix, `cache.snapshot`, makes them alike).
        reserve_host: the host tier's rows for the capacity hint are allocated here (else left to the caller)."""
        cfg = self.config
        device = torch.device(device)
        num_kv_heads, head_dim = self.num_kv_heads, self.head_dim
        keys = torch.empty(0, dtype=dtype, device=device)  # what the tiers are made like: dtype and device
        window = cfg.window_for_prompt(prompt_len - max_pad)
        ring_blocks = math.ceil(window / cfg.block_size) + 1
        needs_maw = self.policy.needs_maw
        self.gpu_share = cfg.gpu_share_on(keys.device.type)
        self.gpu_cache = cfg.gpu_cache_on(keys.device.type)
        if self.gpu_cache and self.gpu_share == 0:
            raise ValueError(
                f"TandemConfig.quest.gpu_cache={cfg.quest.gpu_cache} needs a device share, and gpu_share is 0 with the hot tier "
                f"on {keys.device.type}: pass gpu_share in (0, 1] (the default on CUDA is > 0), or gpu_cache=0"
            )
        spare_hot, hot_made_with, spare_host, host_made_with = self._spare
        self._spare = (None, None, None, None)
        hot_args = dict(
            batch=batch, num_kv_heads=num_kv_heads, num_q_heads=self.num_q_heads, head_dim=head_dim,
            dtype=keys.dtype, device=keys.device, sink_slots=cfg.sink_tokens + max_pad, ring_blocks=ring_blocks,
            block_size=cfg.block_size, keep_maw=needs_maw,
            # the ring is allocated for the tokens expected (the prompt, or the caller's capacity hint) and
            # grows from there; at most the window's blocks
            initial_blocks=-(
                -max(0, max(prompt_len, self.capacity_hint) - cfg.sink_tokens - max_pad) // cfg.block_size
            ) + 1,
        )  # fmt: skip
        if spare_hot is not None and _hot_fits(hot_made_with, hot_args, spare_hot.allocated_blocks):
            self.hot = spare_hot  # emptied by `clear`; a ring that grew keeps its blocks
        else:
            storage = None
            if self.hot_storage is not None and batch == 1:
                slots = cfg.sink_tokens + max_pad + ring_blocks * cfg.block_size
                storage = self.hot_storage(slots, keys.dtype, keys.device, needs_maw)
            if storage is None:
                _check_hot_memory(
                    self, batch, num_kv_heads, head_dim, keys, cfg.sink_tokens + max_pad, ring_blocks
                )
            self.hot = HotTier(**hot_args, storage=storage)
            if spare_hot is not None:
                # new addresses: a step recorded over the spare's must be recorded again
                self.hot.generation = spare_hot.generation + 1
        self._hot_made_with = hot_args
        stream = None
        if keys.is_cuda:
            stream = self._side_streams.setdefault(keys.device, torch.cuda.Stream(keys.device))
        if cfg.distributed.host_split == "requests" and self.rank is not None and self.rank.world > 1:
            self.split = RequestSplit(self.rank, batch)
        host_args = dict(
            batch=batch, num_kv_heads=num_kv_heads, num_q_heads=self.num_q_heads, head_dim=head_dim,
            dtype=keys.dtype, block_size=cfg.block_size, pin=keys.is_cuda, keep_digest=self.policy.needs_digest,
            keep_maw=needs_maw, stream=stream,
            # on the compute device; also on a CPU one when a device share is asked for, so that the split
            # decode path (attention.decode.device_part) runs, and is tested, without CUDA
            # (and with a request split: the device's ranking is what crosses to the ranks, on CPU as on CUDA)
            mirror_device=keys.device
            if keys.is_cuda or self.gpu_share > 0 or self.queue_split != "share" or self.split is not None
            else None,
            huge_pages=cfg.host.huge_pages, quant=cfg.host.dtype,
            bounds_device=keys.device if self.policy.needs_bounds_on(keys.device) else None,
            keep_sketch=cfg.certified.bound == "sketch", split=self.split,
        )  # fmt: skip
        if spare_host is not None and self.split is None and host_made_with == host_args:
            self.host = spare_host  # emptied by `clear`, its capacity kept
        else:
            self.host = HostTier(**host_args)
            if spare_host is not None:
                self.host.generation = spare_host.generation + 1
        self._host_made_with = host_args
        if batch == 1 and self.split is None:
            self.host.mirror_storage = self.mirror_storage
        if self.capacity_hint > prompt_len and reserve_host:
            # one allocation up front: growing a pinned store by copying needs old + new at once
            self.host.reserve(self.host_rows_hint(), headroom=False)

    def host_rows_hint(self) -> int:
        """The host rows the capacity hint asks for: every hinted token past the sinks, whole blocks."""
        cfg = self.config
        host_rows = max(0, self.capacity_hint - cfg.sink_tokens)
        return -(-host_rows // cfg.block_size) * cfg.block_size

    @torch.inference_mode()
    def clear(self) -> None:
        """Empty the layer for a new request, as a new layer of the same cache would be, keeping the buffers its
        decode steps read where they are: the tiers (emptied, taken again by the next prompt's first append where
        they fit it: `initialize`), the decode and queue buffers, the recall cache (emptied) and the policy's
        device tensors (`Policy.clear`). A runner's recorded step over this layer then serves the next request
        (`engine.TandemRunner`). A layer whose step failed keeps nothing."""
        hot, host = self.hot, self.host
        if hot is not None and hot.keys.is_cuda:
            torch.cuda.synchronize(hot.keys.device)  # nothing queued may still read or write what is zeroed
        if (
            self.failed is not None
            or self.hot_storage is not None
            or self.mirror_storage is not None
            or (host is not None and host.shared)
        ):
            # a failed step's tiers may hold half of it; a pool's rows go to other requests (`engine.slots`); a
            # cached prefix reads the host rows (`cache.snapshot`)
            self._spare = (None, None, None, None)
        elif hot is not None:
            host.clear()  # (waits for the copies that read the ring)
            hot.clear()
            self._spare = (hot, self._hot_made_with, host, self._host_made_with)
        if self.failed is not None:
            self.decode_buffers = self.queue_buffers = self.recall = None
            self.policy = make_policy(self.config)
        else:
            if self.recall is not None:
                self.recall.clear()
            self.policy.clear()
        self.hot = self.host = self.split = None
        self.seq_len = 0
        self.failed = None
        self._zero_counts()
        self.gpu_share = self.gpu_cache = 0.0
        self.attention_scale = None
        self.observe_appends = True
        self.capacity_hint = 0
        self.drop_prompt_rows()

    def keep_prompt_rows(self, max_bytes: int) -> None:
        """From the next eviction on, keep a device copy of the rows this layer sends to the host tier, if it can
        hold all of them: a prompt's first eviction (no host row yet) makes one of the host tier's capacity where
        that takes at most `max_bytes` (0: none is made; one already made keeps growing). A chunked prefill's
        later chunks then attend those rows where they are (`host_pieces`) instead of copying every host row to
        the device again for each chunk. Only for a device other than the host tier's, rows in the model's
        dtype (no 8-bit host tier) and no request split. `drop_prompt_rows` frees it."""
        self.prompt_rows_bytes = max_bytes

    def drop_prompt_rows(self) -> None:
        self.prompt_rows, self.prompt_rows_count, self.prompt_rows_bytes = None, 0, 0

    def _copy_prompt_rows(self, first: int, keys, values, valid) -> None:
        """The device copy of host rows [first, first + n) that `keep_prompt_rows` asked for, made or extended;
        dropped where it cannot hold them (the host tier grew, or rows were written past it)."""
        host, n = self.host, keys.shape[2]
        if self.prompt_rows is None:
            if (
                not self.prompt_rows_bytes
                or first != 0
                or keys.device.type not in PROMPT_ROWS_DEVICES
                or host.quant
                or host.split is not None
            ):
                return
            batch, heads, _, dim = keys.shape
            nbytes = host.capacity * batch * (2 * heads * dim * keys.element_size() + 1)
            if nbytes > self.prompt_rows_bytes:
                return
            shape = (batch, heads, host.capacity, dim)
            self.prompt_rows = (
                torch.empty(shape, dtype=keys.dtype, device=keys.device),
                torch.empty(shape, dtype=values.dtype, device=keys.device),
                torch.zeros(batch, host.capacity, dtype=torch.bool, device=keys.device),
            )
        stored_keys, stored_values, stored_valid = self.prompt_rows
        if first != self.prompt_rows_count or first + n > stored_keys.shape[2]:
            self.drop_prompt_rows()
            return
        stored_keys[:, :, first : first + n].copy_(keys)
        stored_values[:, :, first : first + n].copy_(values)
        stored_valid[:, first : first + n].copy_(valid)
        self.prompt_rows_count = first + n

    def host_pieces(self, device, chunk: int):
        """(keys, values, valid) of the live host rows on `device` in the model's dtype, `chunk` rows at a time:
        views of the prompt's device copy where it holds them all (`keep_prompt_rows`), else copied from the host
        tier (`HostTier.pieces`). The same pieces either way, so the attention over them is the same."""
        rows = self.prompt_rows
        if rows is None or self.prompt_rows_count != self.host.rows or rows[0].device != torch.device(device):
            yield from self.host.pieces(device, chunk)
            return
        keys, values, valid = rows
        for k0 in range(0, self.host.rows, chunk):
            k1 = min(self.host.rows, k0 + chunk)
            yield keys[:, :, k0:k1], values[:, :, k0:k1], valid[:, k0:k1]

    def recall_cache(self, ranked: torch.Tensor, width: int) -> RecallCache | None:
        """The recall cache for this step's selection `ranked` [B, Hkv, K] and a device share `width` blocks
        wide, (re)made when either or the host tier's block count changed (never while a graph records: the
        step is recorded again after the host tier grows); None when `gpu_cache` is off."""
        if not self.gpu_cache or width == 0 or self.host is None:
            return None
        batch, heads, k_max = ranked.shape
        if self.config.quest.gpu_cache is None and self.recall_budget is not None:
            element = self.host.dtype.itemsize  # the recall cache holds decoded rows
            self.gpu_cache = self.recall_budget.factor_for(
                self.gpu_cache, batch, heads, k_max, width, self.host.block_size, self.head_dim, element,
                ranked.device,
            )  # fmt: skip
            if not self.gpu_cache:
                return None
        slots = RecallCache.slots_for(self.gpu_cache, k_max, width)
        num_blocks = self.host.capacity // self.host.block_size
        shape = (batch, heads, self.head_dim, self.host.dtype, ranked.device)
        if self.recall is None or not self.recall.matches(*shape, slots, num_blocks, k_max, width):
            if self.recall is not None:
                self.collect_statistics()
                self.recall = None
            try:
                self.recall = RecallCache(*shape, self.host.block_size, slots, num_blocks, k_max, width)
            except torch.OutOfMemoryError as err:
                kv_bytes = 2 * batch * heads * slots * self.host.block_size * self.head_dim
                kv_bytes *= self.host.dtype.itemsize
                raise MemoryError(
                    f"TandemConfig.quest.gpu_cache={self.gpu_cache}: quest's recall cache needs {kv_bytes / 2**30:.2f} GiB "
                    f"per layer on {ranked.device}, which is full; pass a smaller gpu_cache, or gpu_cache=0 to "
                    "turn it off"
                ) from err
        return self.recall

    def collect_statistics(self) -> None:
        """Fold the recall cache's device-side counts into the row counters (one device read)."""
        counts = []
        if self.recall is not None:
            counts.append(self.recall.take_counts())
        if self.recall_row is not None:
            cache, row = self.recall_row
            counts.append(cache.take_row_counts(row))
        for cached, recalled in counts:
            self.rows_attended += cached + recalled
            self.rows_attended_cached += cached
            self.rows_attended_device += recalled

    def reset_statistics(self) -> None:
        self.collect_statistics()
        self._zero_counts()
        reset = getattr(self.policy, "reset_statistics", None)
        if reset is not None:
            reset()
        if self.policy.certifier is not None:
            self.policy.certifier.reset_statistics()

    def _zero_counts(self) -> None:
        self.rows_attended = self.rows_attended_device = self.rows_attended_cached = 0
        self.rows_available = self.decode_steps = 0

    # ---- appends -------------------------------------------------------------------------------------------
    def check_continues(self, keys: torch.Tensor) -> None:
        """New tokens [B, Hkv, m, D] continue the batch this layer holds: same batch size, dtype and device."""
        held = self.hot.keys
        if keys.shape[0] != held.shape[0] or keys.device != held.device or keys.dtype != held.dtype:
            raise ValueError(
                f"this TandemCache holds a batch of {held.shape[0]} ({held.dtype} on {held.device}); the new tokens "
                f"come as a batch of {keys.shape[0]} ({keys.dtype} on {keys.device}). A cache continues the sequences "
                "it holds: for another batch or prompt, build a new cache (TandemCache.for_model)"
            )

    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Store new tokens [B, Hkv, m, D] (valid [B, m]) after everything already cached. An error part way
        leaves the layer refusing further use (`check_usable`) rather than holding half a step."""
        self.check_usable()
        if self.initialized:
            self.check_continues(keys)  # refused before anything changes
        try:
            self._append(keys, values, valid)
        except BaseException as err:
            self.mark_failed(err)
            raise

    def _append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        if not self.initialized:
            self.initialize(keys, valid)
        hot = self.hot
        m = keys.shape[2]
        self.seq_len += m
        pos = 0
        if hot.sink_used < hot.sink_slots:
            pos = min(m, hot.sink_slots - hot.sink_used)
            hot.write(hot.sink_used, keys[:, :, :pos], values[:, :, :pos], valid[:, :pos])
            hot.sink_used += pos
        if pos == m:
            return
        bs = hot.block_size
        ring_tokens = hot.ring_tokens
        incoming = m - pos
        evict_tokens = max(0, math.ceil((ring_tokens + incoming) / bs) - hot.ring_blocks) * bs
        if evict_tokens and evict_tokens >= ring_tokens:
            # the whole ring and the first new tokens leave: one host append, then refill the ring from block 0
            direct = evict_tokens - ring_tokens
            sl = slice(pos, pos + direct)
            evicted = [keys[:, :, sl], values[:, :, sl], valid[:, sl], None]
            if hot.maw is not None:  # new tokens have no attention history yet
                evicted[3] = torch.zeros(keys.shape[0], self.num_q_heads, direct, device=keys.device)
            if ring_tokens:
                ring = hot.ordered_ring()
                evicted = [
                    r if r is None else torch.cat([r, e], dim=-1 if r.dim() == 2 else 2)
                    for r, e in zip(ring, evicted)
                ]
            self._evict(*evicted)
            hot.release(hot.order, self.host.last_event)
            hot.order, hot.tail_fill = [], 0
            pos += direct
        elif evict_tokens:
            self._evict_oldest_blocks(evict_tokens // bs)
        self._fill_ring(keys[:, :, pos:], values[:, :, pos:], valid[:, pos:])

    def reserve_decode_slot(self) -> int:
        """Bookkeeping of one decode token without writing it: returns the hot-tier slot the caller fills.

        The same token flow as `append` with one new token (evicting the oldest ring block when the ring is
        full), for callers that write the slot themselves, e.g. a captured CUDA graph indexing by a device tensor.
        The slot is marked invalid until written; the caller sets `hot.valid` (and zeroes `hot.maw`) there.
        """
        self.check_usable()
        try:
            return self._reserve_decode_slot()
        except BaseException as err:
            self.mark_failed(err)
            raise

    def _reserve_decode_slot(self) -> int:
        hot = self.hot
        self.seq_len += 1
        if hot.sink_used < hot.sink_slots:
            hot.sink_used += 1
            return hot.sink_used - 1
        if hot.order and hot.tail_fill < hot.block_size:
            hot.tail_fill += 1
            self._stage_next_eviction()
            return hot.block_start(hot.order[-1]) + hot.tail_fill - 1
        if len(hot.order) == hot.ring_blocks:
            self._evict_oldest_block()
        hot.order.append(hot.take_free_block())
        hot.tail_fill = 1
        self._stage_next_eviction()
        return hot.block_start(hot.order[-1])

    def _stage_next_eviction(self) -> None:
        """With the ring full, write its oldest block (the next to leave) into the host tier ahead of its eviction
        (`HostTier.stage`), at the step of the block period that this layer's index picks: each step stages about
        num_layers / block_size layers' blocks, and the eviction step only makes them live. Evicting every layer's
        block in one step made that step far longer than the others on the GPU (a copy, digests and mirror updates
        per layer, launched while the GPU idles; measured in docs/engine.md § Where a step's time goes, "Eviction
        steps")."""
        hot, host = self.hot, self.host
        if not self.stages_own_evictions:
            return
        if len(hot.order) < hot.ring_blocks or host is None or host.staged or host.split is not None:
            return
        if hot.tail_fill < 1 + self.layer_idx % hot.block_size:
            return
        keys_b, values_b, valid_b, _ = hot.block_view(hot.order[0])
        host.stage(keys_b, values_b, valid_b)

    def staging_due(self, period_step: int) -> bool:
        """For a layer whose runner stages its evictions (`stages_own_evictions` False): whether its next evicted
        ring block is staged at this step of the runner's block period, shared by all the runner's requests so
        that one call per layer stages all of theirs. The ring full, its oldest block not staged yet, and the
        period's step that this layer's index picks: one step in every block_size, so one between any two
        evictions (a block missed is written at its eviction, as without staging)."""
        hot, host = self.hot, self.host
        if (
            hot is None
            or len(hot.order) < hot.ring_blocks
            or host is None
            or host.staged
            or host.split is not None
        ):
            return False
        return period_step % hot.block_size == self.layer_idx % hot.block_size

    def _evict_oldest_block(self) -> None:
        hot = self.hot
        block = hot.order.pop(0)
        keys_b, values_b, valid_b, maw_b = hot.block_view(block)
        # the decode step updates every hot MAW in place while the side stream may still copy this block
        maw = maw_b.clone() if maw_b is not None else None
        self._evict(keys_b, values_b, valid_b, maw, staged=self.host.staged == keys_b.shape[2])
        hot.release([block], self.host.last_event)

    def _evict_oldest_blocks(self, count: int) -> None:
        """The ring's `count` oldest blocks to the host tier as one append (an append of a few hundred tokens evicts
        many blocks: one at a time, each would cost the host tier's copies and digests again); a staged block goes
        first, alone, as `stage` wrote it."""
        hot = self.hot
        if self.host.staged:
            self._evict_oldest_block()
            count -= 1
        if count == 0:
            return
        blocks, hot.order = hot.order[:count], hot.order[count:]
        views = [hot.block_view(block) for block in blocks]
        keys, values = torch.cat([v[0] for v in views], dim=2), torch.cat([v[1] for v in views], dim=2)
        valid = torch.cat([v[2] for v in views], dim=1)
        maw = torch.cat([v[3] for v in views], dim=2) if views[0][3] is not None else None
        self._evict(keys, values, valid, maw)
        hot.release(blocks, self.host.last_event)

    def _fill_ring(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """The new tokens into the ring after its newest token: the newest block topped up, then as many free
        blocks as the rest needs, written one run of adjacent blocks at a time (a prompt's window in a few
        copies, not one per block)."""
        hot = self.hot
        bs = hot.block_size
        done, total = 0, keys.shape[2]
        if hot.order and hot.tail_fill < bs and total:
            done = min(bs - hot.tail_fill, total)
            slot = hot.block_start(hot.order[-1]) + hot.tail_fill
            hot.write(slot, keys[:, :, :done], values[:, :, :done], valid[:, :done])
            hot.tail_fill += done
        if done == total:
            return
        blocks = hot.take_free_blocks(-(-(total - done) // bs))
        rest = total - done
        for block, run in hot.block_runs(blocks):
            n = min(run * bs, total - done)
            span = slice(done, done + n)
            hot.write(hot.block_start(block), keys[:, :, span], values[:, :, span], valid[:, span])
            done += n
        hot.order.extend(blocks)
        hot.tail_fill = rest - (len(blocks) - 1) * bs

    def _evict(self, keys, values, valid, maw, staged: bool = False) -> None:
        hot_counts = None
        if self.policy.needs_maw:  # HGCA's n_gpu at eviction time: [B] real hot entries
            hot_counts = self.hot.valid_counts()
            if hot_counts.is_cuda:
                # the side-stream copy waits for this one, so `host.wait()` also makes these counts readable
                hot_counts = torch.empty(hot_counts.shape, dtype=hot_counts.dtype, pin_memory=True).copy_(
                    hot_counts, non_blocking=True
                )
        first = self.host.append(keys, values, valid, maw, staged=staged)
        if self.prompt_rows is not None or self.prompt_rows_bytes:
            self._copy_prompt_rows(first, keys, values, valid)
        self.policy.on_evict(self, first, keys.shape[2], hot_counts)

    # ---- sizes ---------------------------------------------------------------------------------------------
    def hot_nbytes(self) -> int:
        """Bytes on the compute device: the hot tier, the recall cache and the host tier's digests kept there."""
        recall = self.recall.nbytes() if self.recall is not None else 0
        digests = self.host.device_nbytes() if self.host is not None else 0
        return (self.hot.nbytes() if self.hot is not None else 0) + recall + digests

    def host_nbytes(self) -> int:
        return self.host.nbytes() if self.host is not None else 0


def reserve_decode_slots(layers: list[LayerKV]) -> tuple[int, bool]:
    """`LayerKV.reserve_decode_slot` of every layer of one cache, whose layers hold the same tokens: (the slot
    they share, whether any layer did more than take the next slot of its newest ring block: filled a sink slot,
    started a block, evicted or staged one). That common step is done here inline: a step over a batch of
    requests reserves a slot in every layer of each. Layers that disagree on the slot leave the cache
    inconsistent: RuntimeError."""
    slots, moved = set(), False
    for kv in layers:
        hot = kv.hot
        if (
            kv.failed is None
            and hot.sink_used >= hot.sink_slots
            and hot.order
            and hot.tail_fill < hot.block_size
        ):
            kv.seq_len += 1
            hot.tail_fill += 1
            slots.add(hot.sink_slots + hot.order[-1] * hot.block_size + hot.tail_fill - 1)
            if kv.stages_own_evictions and kv.host is not None:
                staged = kv.host.staged
                try:
                    kv._stage_next_eviction()
                except BaseException as err:
                    kv.mark_failed(err)
                    raise
                moved = moved or kv.host.staged != staged
        else:
            slots.add(kv.reserve_decode_slot())
            moved = True
    if len(slots) != 1:
        raise RuntimeError(f"layers disagree on the decode slot ({sorted(slots)}); the cache is inconsistent")
    return slots.pop(), moved


def _hot_fits(made_with: dict, wanted: dict, allocated: int) -> bool:
    """Whether a hot tier made with the arguments `made_with`, its ring now `allocated` blocks, serves as one
    made with `wanted`: the same arguments, and at least the ring blocks `wanted` allocates first."""
    same = all(made_with[k] == v for k, v in wanted.items() if k != "initial_blocks")
    return same and allocated >= min(wanted["initial_blocks"], wanted["ring_blocks"])


def _check_hot_memory(layer, batch, num_kv_heads, head_dim, keys, sink_slots, ring_blocks) -> None:
    """Refuse, before allocating, a hot tier whose layers together would not fit in the memory available on the
    device (or host) that holds it: a MemoryError naming window_tokens, instead of the allocator's failure."""
    from .memory import available_host_bytes

    slots = sink_slots + ring_blocks * layer.config.block_size
    per_layer = 2 * batch * num_kv_heads * slots * head_dim * keys.element_size()
    total = per_layer * (layer.num_layers or 1)
    if keys.is_cuda:
        free = torch.cuda.mem_get_info(keys.device)[0]
    else:
        free = available_host_bytes()
    if free is not None and total > free:
        raise MemoryError(
            f"the hot tier needs {total / 1e9:.1f} GB on {keys.device} for TandemConfig.window_tokens="
            f"{layer.config.window_tokens} (batch {batch}, {layer.num_layers or 1} layers) and {free / 1e9:.1f} GB are "
            "free: lower window_tokens (or the batch)"
        )
