"""Host tier: the offloaded KV of one layer in (pinned) host memory, plus its per-entry metadata."""

from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from contextlib import nullcontext

import torch

from tandem.cache.memory import host_zeros
from tandem.kernels.reference import QUANT_DTYPES, dequantize, quantize_blocks
from tandem.policies.certify import block_digest, key_sketch

# the certified selection's per-row tensors on the bounds device (the other `_dev` tensors are per block)
SKETCH_ROWS = ("key_codes_dev", "key_code_scale_dev", "key_code_error_dev", "row_valid_dev")
# every buffer a tier may hold (`reserve`), each [B, H, rows or blocks, ...] or [B, rows or blocks]
BUFFERS = (
    "keys", "values", "valid", "key_scale", "value_scale", "key_min", "key_max", "maw", "key_min_dev",
    "key_max_dev", "block_valid_dev", "key_centre_dev", "key_radius_dev", "value_norm_dev", "block_rows_dev",
    *SKETCH_ROWS,
)  # fmt: skip


class PrefixClaim:
    """Kept prefixes' hold on one host tier's host-memory buffers (`cache.snapshot`): how many prefixes read their
    rows, and which tier writes past those rows, weakly (the tier that made them, or the one that took them over).
    Rows once written never change, so a prefix reads its rows wherever they are; a request starting from one takes
    the buffers over when no tier writes into them any more, and copies them otherwise."""

    def __init__(self, writer: HostTier) -> None:
        self.readers = 0
        self.writer = weakref.ref(writer)

    def written(self, keys: torch.Tensor) -> bool:
        """Whether a live tier still writes into the buffers whose keys are `keys`."""
        tier = self.writer()
        return tier is not None and tier.keys is keys

    def take(self, tier: HostTier) -> None:
        """`tier` now writes into these buffers (it took them over)."""
        self.writer = weakref.ref(tier)
        tier.claim = self


class HostMemoryError(MemoryError):
    """The host tier could not grow: host memory (or pinned memory) is exhausted."""


class HostTier:
    """Offloaded KV of one layer, growable by whole blocks with amortized O(1) appends.

    Storage (capacity `cap` rows, the first `rows` live; rows are always a whole number of blocks):
        keys, values: [B, Hkv, cap, D]   model dtype, pinned when the hot tier is on CUDA, on huge pages
                                         when `huge_pages` (`tandem.cache.memory`); with `quant` ("int8" /
                                         "fp8") 8-bit codes instead (int8 / float8_e4m3fn), and
        key_scale, value_scale: [B, Hkv, cap // block_size] float32: row r decodes as
                                         codes * scale[..., r // block_size] (`reference.quantize_blocks`)
        valid:        [B, cap] bool      False for padding rows (left padding of ragged batches)
        key_min/max:  [B, Hkv, cap // block_size, D]  per-block per-dim key digest (quest)
        maw:          [B, Hq, cap] float32            moving average of attention weights (hgca)
    With `bounds_device` (quest's certified selection), on that device, per block: key_centre_dev [B, Hkv, nb, D],
    key_radius_dev / value_norm_dev [B, Hkv, nb], block_rows_dev [B, nb], all float32
    (`policies.certify.block_digest`; nb = cap // block_size, blocks past the live ones have 0 rows), and per
    row the int8 key sketch: key_codes_dev [B, Hkv, cap, D] int8, key_code_scale_dev / key_code_error_dev
    [B, Hkv, cap] float32 (`policies.certify.key_sketch`), row_valid_dev [B, cap] bool (False past the live rows),
    unless `keep_sketch` is False (the digest bound needs no sketch).

    Appends from a CUDA tensor are copied on a side stream; `wait()` makes them visible to CPU readers,
    and `last_event` lets the hot tier delay reuse of the evicted ring slots on the GPU only. An append may be
    split in two: `stage` writes the blocks past the live rows ahead of time, `append(..., staged=True)` makes
    them live.

    With a `split` (`cache.split.RequestSplit`, tensor parallelism with host_split="requests") the
    arguments describe the rank's shard (its KV heads of the whole batch), as appends and the digests' mirror
    do, while the storage holds every rank's heads of this rank's requests: B = split.size, Hkv and Hq times
    split.world. Appends cross to that layout on the device (an all-to-all) before their copy to the host.
    """

    # staged blocks' markers, copies' sources in flight, the live rows' count: the host's, read by no recording
    layout_skips = ("_staged_markers", "_pending_sources", "_valid_count")

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_size: int,
        pin: bool,
        keep_digest: bool,
        keep_maw: bool,
        stream: torch.cuda.Stream | None = None,
        mirror_device: torch.device | None = None,
        huge_pages: bool = True,
        quant: str | None = None,
        bounds_device: torch.device | None = None,
        keep_sketch: bool = True,
        split=None,
    ) -> None:
        if split is not None and (quant is not None or keep_maw or bounds_device is not None):
            raise ValueError("a host tier split by requests stores no 8-bit codes, MAW or certified bounds")
        self.split = split
        # the digests' mirror on the device keeps the shard's layout: the device ranks its own heads' blocks
        self.mirror_shape = (batch, num_kv_heads)
        if split is not None:
            batch = split.size
            num_kv_heads, num_q_heads = num_kv_heads * split.world, num_q_heads * split.world
        if quant is not None and quant not in QUANT_DTYPES:
            raise ValueError(f"quant: must be None or one of {', '.join(QUANT_DTYPES)}, got {quant!r}")
        self.quant = quant
        self.store_dtype = QUANT_DTYPES[quant] if quant else dtype  # dtype: what the rows decode to
        self.batch, self.num_kv_heads, self.num_q_heads = batch, num_kv_heads, num_q_heads
        self.head_dim, self.dtype, self.block_size = head_dim, dtype, block_size
        self.pin, self.keep_digest, self.keep_maw = pin, keep_digest, keep_maw
        self.huge_pages = huge_pages
        self.stream = stream
        self._no_rows()
        self.capacity = 0
        self.keys = self.values = self.valid = None
        self.key_scale = self.value_scale = None
        self.key_min = self.key_max = self.maw = None
        self.last_event: torch.cuda.Event | None = None
        # digests mirrored on the compute device (quest scores blocks there; only block ids cross PCIe):
        # finite values (0 where a block is all padding) and block_valid [B, cap // block_size]
        self.mirror_device = mirror_device if keep_digest else None
        self.key_min_dev = self.key_max_dev = self.block_valid_dev = None
        # None, or a callable (blocks, dtype, device) -> the mirror's (key_min, key_max, block_valid) for that many
        # blocks, kept elsewhere (a runner's pool of the digests of several requests, `tandem.engine.slots`), or
        # None where it keeps none: asked each time the tier grows
        self.mirror_storage = None
        self.bounds_device = bounds_device
        self.keep_sketch = bounds_device is not None and keep_sketch
        self.key_centre_dev = self.key_radius_dev = self.value_norm_dev = self.block_rows_dev = None
        self.key_codes_dev = self.key_code_scale_dev = self.key_code_error_dev = self.row_valid_dev = None
        self.generation = 0  # bumped when the buffers are reallocated (captured graphs hold their addresses)
        # the kept prefixes' hold on this tier's host-memory buffers, once one reads them (`cache.snapshot`): while
        # any does, `clear` never zeroes them for another request; the buffers go with the last reference
        self.claim: PrefixClaim | None = None

    # ---- storage -------------------------------------------------------------------------------------------
    def _zeros(self, shape, dtype) -> torch.Tensor:
        try:
            return host_zeros(shape, dtype, pin=self.pin, huge=self.huge_pages)
        except (RuntimeError, MemoryError) as err:  # CUDA's pinned allocator raises RuntimeError
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            raise HostMemoryError(
                f"cannot allocate {nbytes / 2**30:.2f} GiB of {'pinned ' if self.pin else ''}host memory for "
                f"the Tandem host tier ({err}); reduce the batch size or context length"
            ) from err

    def reserve(self, rows: int, headroom: bool = True) -> None:
        """Make room for `rows` live rows; grows geometrically so appends stay amortized O(1). Staged rows do not
        move (`stage` reserves before it writes them, and nothing reserves again before they are appended).

        headroom: the first allocation (a prompt's rows) leaves an eighth more for the decode that follows, so its
        first evictions do not copy the whole tier at once (False: exactly `rows`, for a known final size)."""
        if rows <= self.capacity:
            return
        self.wait()  # the old buffers may still be the target of an async copy
        bs = self.block_size
        new_cap = max(rows, int(self.capacity * 1.5), 64 * bs)
        if headroom and self.capacity == 0:
            new_cap = max(new_cap, rows + rows // 8)
        new_cap = -(-new_cap // bs) * bs
        grown = self._allocate(new_cap)
        for name, new in grown.items():
            old = getattr(self, name)
            if old is not None and self.rows:
                row_dim, used = _rows_of(name, new, self.rows, bs)
                new.narrow(row_dim, 0, used).copy_(old.narrow(row_dim, 0, used))
            setattr(self, name, new)
        self.capacity = new_cap
        self.generation += 1
        self.claim = None  # kept prefixes may read the old buffers; these are the tier's own

    @property
    def shared(self) -> bool:
        """Whether a kept prefix reads this tier's buffers (`cache.snapshot`)."""
        return self.claim is not None and self.claim.readers > 0

    def adopt(self, buffers: dict[str, torch.Tensor], rows: int) -> None:
        """Take `buffers` (name -> tensor: the host-memory buffers of another tier of these settings, whose first
        `rows` rows are live and that no tier writes into any more) as this empty tier's own, without a copy; the
        tier's other buffers are allocated alike and their rows are left for the caller to fill. A kept prefix's
        host rows taken by the request that starts from it (`cache.snapshot`)."""
        if self.rows or self.capacity:
            raise RuntimeError("adopt: the tier already holds buffers")
        cap = buffers["keys"].shape[2]
        if not set(buffers) <= set(self.kept_buffers()):
            raise ValueError(f"adopt: the buffers {sorted(buffers)} are not all this tier's")
        allocated = self._allocate(cap, skip=set(buffers))
        for name, tensor in {**buffers, **allocated}.items():
            setattr(self, name, tensor)
        self.capacity, self.rows = cap, rows
        self.generation += 1

    def _allocate(self, new_cap: int, skip=frozenset()) -> dict[str, torch.Tensor]:
        """Every buffer this tier keeps (`kept_buffers`) but those in `skip`, for `new_cap` rows, zeroed (the
        digests' mirror from `mirror_storage` where it gives one)."""
        nb = new_cap // self.block_size
        b, hkv, hq, d = self.batch, self.num_kv_heads, self.num_q_heads, self.head_dim
        host, dev = self._zeros, self.bounds_device
        shapes = {
            "keys": lambda: host((b, hkv, new_cap, d), self.store_dtype),
            "values": lambda: host((b, hkv, new_cap, d), self.store_dtype),
            "valid": lambda: host((b, new_cap), torch.bool),
            "key_scale": lambda: host((b, hkv, nb), torch.float32),
            "value_scale": lambda: host((b, hkv, nb), torch.float32),
            "key_min": lambda: host((b, hkv, nb, d), self.dtype),
            "key_max": lambda: host((b, hkv, nb, d), self.dtype),
            "maw": lambda: host((b, hq, new_cap), torch.float32),
            "key_centre_dev": lambda: torch.zeros(b, hkv, nb, d, device=dev),
            "key_radius_dev": lambda: torch.zeros(b, hkv, nb, device=dev),
            "value_norm_dev": lambda: torch.zeros(b, hkv, nb, device=dev),
            "block_rows_dev": lambda: torch.zeros(b, nb, device=dev),
            "key_codes_dev": lambda: torch.zeros(b, hkv, new_cap, d, dtype=torch.int8, device=dev),
            "key_code_scale_dev": lambda: torch.zeros(b, hkv, new_cap, device=dev),
            "key_code_error_dev": lambda: torch.zeros(b, hkv, new_cap, device=dev),
            "row_valid_dev": lambda: torch.zeros(b, new_cap, dtype=torch.bool, device=dev),
        }
        try:
            grown = {
                name: shapes[name]() for name in self.kept_buffers() if name in shapes and name not in skip
            }
            if self.mirror_device is not None and "key_min_dev" not in skip:
                mirror_dev, (mb, mh) = self.mirror_device, self.mirror_shape
                pooled = None
                if self.mirror_storage is not None:
                    pooled = self.mirror_storage(nb, self.dtype, mirror_dev)
                if pooled is not None:
                    grown["key_min_dev"], grown["key_max_dev"], grown["block_valid_dev"] = pooled
                else:
                    grown["key_min_dev"] = torch.zeros(mb, mh, nb, d, dtype=self.dtype, device=mirror_dev)
                    grown["key_max_dev"] = torch.zeros_like(grown["key_min_dev"])
                    grown["block_valid_dev"] = torch.zeros(mb, nb, dtype=torch.bool, device=mirror_dev)
        except MemoryError as err:
            if isinstance(err, HostMemoryError):
                raise
            raise HostMemoryError(
                f"host memory exhausted growing the Tandem host tier to {new_cap} rows"
            ) from err
        return grown

    def kept_buffers(self) -> list[str]:
        """The names (of `BUFFERS`) of the buffers this tier keeps, by its settings."""
        names = ["keys", "values", "valid"]
        if self.quant:
            names += ["key_scale", "value_scale"]
        if self.keep_digest:
            names += ["key_min", "key_max"]
        if self.keep_maw:
            names += ["maw"]
        if self.mirror_device is not None:
            names += ["key_min_dev", "key_max_dev", "block_valid_dev"]
        if self.bounds_device is not None:
            names += ["key_centre_dev", "key_radius_dev", "value_norm_dev", "block_rows_dev"]
        if self.keep_sketch:
            names += list(SKETCH_ROWS)
        return names

    def clear(self) -> None:
        """Empty, as a new tier would be, keeping every buffer where it is (the addresses a recorded step reads)
        and the capacity: the rows written so far (live and staged) and their metadata zeroed; the rest was never
        written. The caller has let the GPU finish the work that reads them."""
        if self.shared:
            raise RuntimeError("clear: a kept prefix reads this host tier's rows (`claim`)")
        self.wait()
        written = self.rows + self.staged
        with torch.inference_mode():  # (a decode step may have made the device ones inference tensors)
            for name in BUFFERS:
                tensor = getattr(self, name)
                if tensor is not None and written:
                    row_dim, used = _rows_of(name, tensor, written, self.block_size)
                    tensor.narrow(row_dim, 0, used).zero_()
        self._no_rows()

    def _no_rows(self) -> None:
        """No row live or staged, nothing counted, no copy's source kept."""
        self.rows = 0
        self.staged = 0  # rows written past the live ones by `stage`, live at the next `append(staged=True)`
        self._staged_markers: dict[str, torch.Tensor] = {}  # `_write_bounds`'s markers of the staged rows
        self._valid_count = torch.zeros(
            self.batch, dtype=torch.long
        )  # non-padding rows among the first _counted
        self._valid_total = 0  # their sum over the batch
        self._counted = 0
        # blocks holding a non-padding row among the first _blocks_counted rows, summed over the batch
        self._valid_blocks = 0
        self._blocks_counted = 0
        self._pending_sources: list[torch.Tensor] = []

    def move_mirror(self, key_min, key_max, block_valid) -> None:
        """The digests' mirror now lives in these tensors (its `mirror_storage` moved it, contents and all): a
        new buffer generation."""
        self.key_min_dev, self.key_max_dev, self.block_valid_dev = key_min, key_max, block_valid
        self.generation += 1

    # ---- appends -------------------------------------------------------------------------------------------
    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        maw: torch.Tensor | None = None,
        staged: bool = False,
    ) -> int:
        """Append whole blocks of rows; returns the first new row index.

        keys/values: [B, Hkv, n, D] with n a multiple of block_size (any device); valid: [B, n] bool;
        maw: [B, Hq, n] float32 or None. With a split, the shard's layout (`mirror_shape`).
        staged: the rows were written ahead by `stage` from these same tokens, bounds included: only make them
        live (`maw` is their attention history as it is now).
        """
        assert keys.shape[2] % self.block_size == 0, "the host tier takes whole blocks"
        n = keys.shape[2]
        if staged:
            if self.staged != n:
                raise RuntimeError(f"append(staged=True) of {n} rows: {self.staged} are staged")
            first, markers = self.rows, self._staged_markers
        else:
            first = self._write(
                keys, values, valid
            )  # over any staged rows: they held these rows' first tokens
            markers = self._write_bounds(first, keys, values, valid)
        self.staged, self._staged_markers = 0, {}
        self._publish(first, n, markers, maw)
        return first

    def stage(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Write the whole blocks that `append(..., staged=True)` will append next into the rows past the live
        ones, without making them live: their K/V, valid flags, digests, 8-bit codes, certified bounds and key
        sketch are written now (all of an append's work but a few device copies), and nothing reads them before
        that append, since no reader goes past the live rows (the device-side markers hold them absent until
        then). The engine stages each layer's next evicted ring block at another step of the block period, so
        the evictions' cost is spread over the steps instead of stalling every `block_size`-th one. Not with a split (its copies are collectives every rank must join in
        the same step) and not twice."""
        if self.split is not None or self.staged:
            raise RuntimeError("stage: a host tier split by requests, or one already holding staged rows")
        assert keys.shape[2] % self.block_size == 0, "the host tier takes whole blocks"
        first = self._write(keys, values, valid)
        self._staged_markers = self._write_bounds(first, keys, values, valid)
        self.staged = keys.shape[2]

    def takes_written_stage(self) -> bool:
        """Whether `stage_written` takes this tier's next staged rows: one without a split, staged rows, 8-bit codes,
        certified bounds or key sketch (those are written by `stage`)."""
        return (
            self.split is None
            and not self.staged
            and not self.quant
            and self.bounds_device is None
            and not self.keep_sketch
        )

    def stage_written(
        self, keys, values, valid, digests=None, mirror=None, copies: list | None = None
    ) -> None:
        """`stage` of rows that the caller moved into host memory and digested itself, with other requests' (a
        runner staging the evicted blocks of a batch of requests at once, `engine.slots`): keys / values
        [B, Hkv, n, D] and valid [B, n] in host memory go into the rows past the live ones; digests (key_min,
        key_max) [B, Hkv, n / block_size, D] in host memory as `block_minmax` gives them; mirror (key_min,
        key_max, block_valid) on the mirror device, the digests made finite and block_valid [B, n / block_size],
        as `_write` and `_write_bounds` give them. Only where `takes_written_stage`.

        copies: None (the host rows are copied here), or a list that takes their (destination, source) pairs
        instead, for the caller to copy before the staged rows become live (the next eviction): until then no
        reader looks past the live rows. The mirror's rows are copied here either way (on its device)."""
        if not self.takes_written_stage():
            raise RuntimeError("stage_written: a tier that stages its rows itself (`takes_written_stage`)")
        n, bs = keys.shape[2], self.block_size
        first = self.rows
        self.reserve(first + n)
        b0, b1 = first // bs, (first + n) // bs
        pairs = [
            (self.keys[:, :, first : first + n], keys),
            (self.values[:, :, first : first + n], values),
            (self.valid[:, first : first + n], valid),
        ]
        markers = {}
        if self.keep_digest:
            pairs += [(self.key_min[:, :, b0:b1], digests[0]), (self.key_max[:, :, b0:b1], digests[1])]
            if self.mirror_device is not None:
                self.key_min_dev[:, :, b0:b1].copy_(mirror[0])
                self.key_max_dev[:, :, b0:b1].copy_(mirror[1])
                markers["block_valid_dev"] = mirror[2]
        if copies is None:
            for dst, src in pairs:
                dst.copy_(src)
        else:
            copies.extend(pairs)
        self._staged_markers = markers
        self.staged = n

    def _write(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> int:
        """The rows' K/V, valid flags, digests and codes into rows [rows, rows + n) (and the digests' mirror, whose
        block_valid_dev `_publish` sets); returns the first row."""
        n = keys.shape[2]
        bs = self.block_size
        first = self.rows
        self.reserve(first + n)
        digest = None
        if self.keep_digest:
            digest = block_minmax(keys, valid, bs)  # computed where the keys are (GPU when evicting)
            if self.mirror_device is not None:
                b0, b1 = first // bs, (first + n) // bs
                dev = self.mirror_device
                self.key_min_dev[:, :, b0:b1].copy_(digest[0].nan_to_num(posinf=0.0, neginf=0.0).to(dev))
                self.key_max_dev[:, :, b0:b1].copy_(digest[1].nan_to_num(posinf=0.0, neginf=0.0).to(dev))
        if self.split is not None:  # into the storage's layout: every head of this rank's requests
            split = self.split
            keys, values, valid = split.to_requests(keys), split.to_requests(values), split.own(valid)
            if digest is not None:
                digest = tuple(split.to_requests(part) for part in digest)
        key_scale = value_scale = None
        if self.quant:  # after the digest, which stays exact
            keys, key_scale = quantize_blocks(keys, valid, bs, self.quant)
            values, value_scale = quantize_blocks(values, valid, bs, self.quant)
        b0, b1 = first // bs, (first + n) // bs
        with self._side_stream(keys) as nb:
            copy_to_host(self.keys[:, :, first : first + n], keys, nb)
            copy_to_host(self.values[:, :, first : first + n], values, nb)
            copy_to_host(self.valid[:, first : first + n], valid, nb)
            if digest is not None:
                copy_to_host(self.key_min[:, :, b0:b1], digest[0], nb)
                copy_to_host(self.key_max[:, :, b0:b1], digest[1], nb)
            if self.quant:
                copy_to_host(self.key_scale[:, :, b0:b1], key_scale, nb)
                copy_to_host(self.value_scale[:, :, b0:b1], value_scale, nb)
        self._keep_until_copied(keys, values, valid, *(digest or ()), key_scale, value_scale)
        return first

    def _write_bounds(self, first: int, keys, values, valid) -> dict[str, torch.Tensor]:
        """The device-side bounds of rows [first, first + n), written by `_write`: the certified bounds and the key
        sketch go into their slots now, while the markers that readers go by (the mirror's block_valid_dev, the
        bounds' block_rows_dev, the sketch's row_valid_dev; rows and blocks past them count as absent) are
        returned for `_publish` to set, so that staged rows stay invisible until then."""
        n, bs = keys.shape[2], self.block_size
        b0, b1 = first // bs, (first + n) // bs
        markers = {}
        if self.mirror_device is not None:
            block_valid = valid.view(valid.shape[0], n // bs, bs).any(dim=-1)
            markers["block_valid_dev"] = block_valid.to(self.mirror_device)
        if self.bounds_device is not None:
            dev = self.bounds_device
            bounds = block_digest(keys, values, valid, bs)
            for name, digest_part in zip(("key_centre_dev", "key_radius_dev", "value_norm_dev"), bounds):
                getattr(self, name)[:, :, b0:b1].copy_(digest_part.to(dev))
            markers["block_rows_dev"] = bounds[3].to(dev)
        if self.keep_sketch:
            dev = self.bounds_device
            sketch = key_sketch(keys, valid)
            for name, sketch_part in zip(SKETCH_ROWS[:3], sketch):
                getattr(self, name)[:, :, first : first + n].copy_(sketch_part.to(dev))
            markers["row_valid_dev"] = valid.to(dev, copy=True)
        return markers

    def _publish(self, first: int, n: int, markers: dict[str, torch.Tensor], maw) -> None:
        """Rows [first, first + n), written by `_write` and `_write_bounds`, become live: their markers, the
        attention history (hgca), then `rows`. Only device copies are left for this step, so that staged
        evictions of every layer cost the eviction step little."""
        bs = self.block_size
        for name, marker in markers.items():
            lo, hi = (first, first + n) if name in SKETCH_ROWS else (first // bs, (first + n) // bs)
            getattr(self, name)[:, lo:hi].copy_(marker)
        if self.keep_maw:
            src = maw if maw is not None else torch.zeros_like(self.maw[:, :, :n])
            with self._side_stream(src) as nb:
                copy_to_host(self.maw[:, :, first : first + n], src, nb)
            self._keep_until_copied(src)
        self.rows = first + n

    def _side_stream(self, source: torch.Tensor):
        """Where copies of `source` into host memory run: a CUDA source's on the side stream (after the work
        queued on the current stream), yielding non_blocking=True; otherwise in place, yielding False."""
        on_cuda = source.is_cuda and self.stream is not None
        if not on_cuda:
            return nullcontext(False)
        self.stream.wait_stream(torch.cuda.current_stream(source.device))
        return _on_stream(self.stream)

    def _keep_until_copied(self, *sources) -> None:
        """Keep CUDA sources of the side stream's copies alive until they are done, and record `last_event`
        after them (nothing to do for copies that ran in place)."""
        cuda = [src for src in sources if src is not None and src.is_cuda]
        if not cuda or self.stream is None:
            return
        for src in cuda:
            src.record_stream(self.stream)
        self.last_event = torch.cuda.Event()
        self.last_event.record(self.stream)

    def wait(self) -> None:
        """Block the calling CPU thread until every pending copy into host memory has landed."""
        if self.last_event is not None:
            self.last_event.synchronize()
            self.last_event = None

    # ---- views ---------------------------------------------------------------------------------------------
    def live(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, valid) of the live rows in the model's dtype: views, or with `quant` decoded copies (for
        analysis and reference paths; the kernels read the codes and `scales()` in place)."""
        n = self.rows
        if self.quant:
            return (
                self._decoded(self.keys, self.key_scale, 0, n),
                self._decoded(self.values, self.value_scale, 0, n),
                self.valid[:, :n],
            )
        return self.keys[:, :, :n], self.values[:, :, :n], self.valid[:, :n]

    def address(self) -> tuple:
        """The store's tensors' addresses and capacity: what a table or prepared call that reads it in place holds
        of it (equal exactly when they read the same memory the same way, whichever tier object owns it)."""
        tensors = (self.keys, self.values, self.valid, *self.scales().values())
        return (*(t.data_ptr() for t in tensors), self.keys.shape[2])

    def scales(self) -> dict:
        """The kernels' keyword arguments for this store: {"k_scale": ..., "v_scale": ...} with `quant`, else {}."""
        return {"k_scale": self.key_scale, "v_scale": self.value_scale} if self.quant else {}

    def pieces(self, device, chunk: int):
        """(keys, values, valid) of the live rows on `device` in the model's dtype, `chunk` rows at a time. Only
        the stored bytes cross to the device (the codes and their scales with `quant`; decoded there). With a
        split, in the shard's layout (every rank takes part: an all-to-all per piece)."""
        for k0 in range(0, self.rows, chunk):
            k1 = min(self.rows, k0 + chunk)
            if self.split is not None:
                split = self.split
                yield (
                    split.to_heads(rows_to_device(self.keys, k0, k1, device)),
                    split.to_heads(rows_to_device(self.values, k0, k1, device)),
                    split.gather(self.valid[:, k0:k1].to(device, non_blocking=True)),
                )
                continue
            yield (
                self._decoded(self.keys, self.key_scale, k0, k1, device),
                self._decoded(self.values, self.value_scale, k0, k1, device),
                self.valid[:, k0:k1].to(device, non_blocking=True),
            )

    def _decoded(self, store, scale, k0: int, k1: int, device=None) -> torch.Tensor:
        """Rows [k0, k1) of `store` on `device` (default: where the store is), decoded to the model's dtype: the
        whole blocks around them cross to the device with their scales, and `reference.dequantize` decodes them."""
        device = store.device if device is None else device
        if not self.quant:
            return rows_to_device(store, k0, k1, device)
        bs = self.block_size
        b0, b1 = k0 // bs, -(-k1 // bs)  # live rows are whole blocks: b1 * bs <= rows
        codes = rows_to_device(store, b0 * bs, b1 * bs, device)
        decoded = dequantize(codes, scale[:, :, b0:b1].to(codes.device, non_blocking=True))
        return decoded[:, :, k0 - b0 * bs : k1 - b0 * bs].to(self.dtype)

    def digest(self) -> tuple[torch.Tensor, torch.Tensor]:
        nb = self.rows // self.block_size
        return self.key_min[:, :, :nb], self.key_max[:, :, :nb]

    def valid_rows(self) -> torch.Tensor:
        """[B] number of non-padding live rows per request (read after `wait()`).

        Counted incrementally: decode asks every step, and rows never change once written."""
        if self._counted < self.rows:
            self._valid_count = self._valid_count + self.valid[:, self._counted : self.rows].sum(dim=1)
            self._valid_total = int(self._valid_count.sum())
            self._counted = self.rows
        return self._valid_count

    def valid_total(self) -> int:
        """`valid_rows()` summed over the batch, as a Python int (read after `wait()`): what the statistics of a
        step that attends no host row add, without a tensor op."""
        self.valid_rows()
        return self._valid_total

    def valid_blocks_total(self) -> int:
        """Blocks that hold a non-padding live row, summed over the batch, as a Python int (read after `wait()`):
        counted incrementally as `valid_rows` is (rows are live in whole blocks and never change once written)."""
        if self._blocks_counted < self.rows:
            new = self.valid[:, self._blocks_counted : self.rows]
            self._valid_blocks += int(new.view(self.batch, -1, self.block_size).any(-1).sum())
            self._blocks_counted = self.rows
        return self._valid_blocks

    def device_nbytes(self) -> int:
        """Bytes this tier keeps on the compute device: the digests' mirror and the certified selection's
        digests and key sketch (allocated capacity)."""
        names = ("key_min_dev", "key_max_dev", "block_valid_dev", "key_centre_dev", "key_radius_dev",
                 "value_norm_dev", "block_rows_dev", *SKETCH_ROWS)  # fmt: skip
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in names) if t is not None)

    def nbytes(self) -> int:
        """Bytes held in host memory by this tier (allocated capacity, all buffers)."""
        total = 0
        for name in ("keys", "values", "valid", "key_min", "key_max", "key_scale", "value_scale", "maw"):
            t = getattr(self, name)
            if t is not None:
                total += t.numel() * t.element_size()
        return total


def _rows_of(name: str, tensor: torch.Tensor, rows: int, block_size: int) -> tuple[int, int]:
    """(dimension of rows or blocks, how many of them hold something) of the buffer `name` of a tier whose first
    `rows` rows were written: per-block buffers count the blocks those rows begin."""
    per_block = name in ("key_min", "key_max", "key_scale", "value_scale") or (
        name.endswith("_dev") and name not in SKETCH_ROWS
    )
    used = -(-rows // block_size) if per_block else rows
    return (1 if tensor.dim() == 2 else 2), used


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream):
    with torch.cuda.stream(stream):
        yield True


def block_minmax(keys: torch.Tensor, valid: torch.Tensor, block_size: int):
    """Per-block per-dim min/max of keys over non-padding rows: [B, Hkv, n/bs, D] each."""
    b, hkv, n, d = keys.shape
    mask = valid[:, None, :, None]
    kmin = keys.masked_fill(~mask, float("inf")).view(b, hkv, n // block_size, block_size, d).amin(dim=3)
    kmax = keys.masked_fill(~mask, float("-inf")).view(b, hkv, n // block_size, block_size, d).amax(dim=3)
    return kmin, kmax


# `copy_to_host` makes one DMA per contiguous slice where there are at most this many, or where each holds at least
# SLICE_BYTES; else one copy through torch's pageable temporary (a wait, but one launch): a decode step's evicted
# block of a large batch (16 rows x 128 (request, head) slices of a few KB) would cost more in launches than the
# wait, where a prefill chunk's slices are long transfers
MAX_SLICES = 16
SLICE_BYTES = 256 << 10


def copy_to_host(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """`dst.copy_(src, non_blocking)` where dst is a view of rows of a pinned host store (e.g. rows [r0, r1) of a
    [B, H, cap, D] store) and src a CUDA tensor: one contiguous DMA per index of dst's leading dims, down to the
    dims whose slices are contiguous. torch copies into a strided host view through a pageable temporary, which
    makes the copy synchronous: the CPU would wait for the GPU at every write of the host tier. Many small slices
    (`MAX_SLICES`, `SLICE_BYTES`) take torch's copy."""
    if not (non_blocking and src.is_cuda) or dst.is_contiguous() or not dst.is_pinned():
        dst.copy_(src, non_blocking=non_blocking)
        return
    lead = _contiguous_from(dst)
    slices = math.prod(dst.shape[:lead])
    if slices > MAX_SLICES and dst.numel() // slices * dst.element_size() < SLICE_BYTES:
        dst.copy_(src, non_blocking=True)
        return
    src = src.expand(dst.shape)
    for index in itertools.product(*(range(n) for n in dst.shape[:lead])):
        dst[index].copy_(src[index], non_blocking=True)


def _contiguous_from(t: torch.Tensor) -> int:
    """The first dim k such that every t[i0, .., ik-1] is contiguous (dims of size 1 never break it)."""
    expected = 1
    for k in range(t.dim() - 1, -1, -1):
        if t.shape[k] != 1 and t.stride(k) != expected:
            return k + 1
        expected *= t.shape[k]
    return 0


def rows_to_device(store: torch.Tensor, k0: int, k1: int, device) -> torch.Tensor:
    """Rows [k0, k1) of a [B, H, cap, D] host store on `device`, one contiguous DMA per (request, head).

    Slicing rows of the whole store gives a strided view, which torch would first gather into pageable
    memory on the CPU; each (request, head) slice is contiguous and pinned, so it copies asynchronously."""
    if store.device == torch.device(device) or not store.is_pinned():
        return store[:, :, k0:k1].to(device, non_blocking=True)
    batch, heads, _, head_dim = store.shape
    out = torch.empty(batch, heads, k1 - k0, head_dim, dtype=store.dtype, device=device)
    for b in range(batch):
        for h in range(heads):
            out[b, h].copy_(store[b, h, k0:k1], non_blocking=True)
    return out
