"""Bindings of the compiled CPU attention kernels: lay out raw pointers and call the library.

Each function has the signature and semantics of its namesake in `tandem.kernels.reference` plus a
`num_threads` keyword (default: `default_num_threads()`, i.e. OMP_NUM_THREADS or all cores but one).
When the compiled library is unavailable the reference runs instead, after one warning per process.
Arguments are validated by the launchers of `tandem.kernels.ops`, which call these; the bindings check only the
layout they read in place (`_checks`) and report the ids the kernels refuse. Quest's scoring and top-k and HGCA's
threshold selection are in `selection`.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels import reference
from tandem.kernels.cpu import _library
from tandem.kernels.cpu._checks import LOG2E, _as, _native, _ptr, _rows_contiguous, _scale_fields, _threads
from tandem.kernels.cpu._library import DTYPE_CODES, AttendArgs, RowStore


def sparse_attention_lse(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
    block_size: int | None = None,
    num_threads: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each KV head's query group over selected rows of a host KV store.

    q:        [B, Hq, Lq, D]        float32 / bfloat16 / float16
    k_store:  [B, Hkv, cap, D]      float32 / bfloat16 / float16, or int8 / float8_e4m3fn codes; last dim
                                    contiguous (never copied)
    v_store:  [B, Hkv, cap, D]      same dtype as k_store
    indices:  [B, Hkv, S] int       row ids, or block ids of `block_size` rows; padded past `lengths`
    lengths:  [B, Hkv] int          valid entries of `indices`
    key_mask: [B, cap] bool         False = padding row, never attended
    k_scale:  [B, Hkv, G] float32   8-bit stores only (then required), v_scale the same shape: row r decodes
                                    as codes * scale[b, h, r // (cap // G)]; G divides cap, last dim contiguous
    Returns out [B, Hq, Lq, D] float32, lse [B, Hq, Lq] float32 (natural log; -inf and 0 where nothing
    was attended).

    >>> q = torch.randn(1, 4, 1, 64); k = torch.randn(1, 1, 100, 64, dtype=torch.bfloat16)
    >>> out, lse = sparse_attention_lse(q, k, k, torch.tensor([[[3, 50, 99]]]), torch.tensor([[3]]), 0.125)
    """
    lib = _native()
    if lib is None:
        return reference.sparse_attention_lse(
            q, k_store, v_store, indices.long(), lengths.long(), scale, key_mask, block_size, k_scale, v_scale
        )
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, cap = k_store.shape[1], k_store.shape[2]
    _rows_contiguous(("k_store", k_store), ("v_store", v_store))
    scale_fields = _scale_fields(k_store, k_scale, v_scale)
    threads = _threads(num_threads)
    q, indices, lengths = _as(q, torch.float32), _as(indices, torch.int64), _as(lengths, torch.int64)
    key_mask = None if key_mask is None else key_mask.contiguous()
    out = torch.empty(batch, num_q_heads, q_len, head_dim, dtype=torch.float32)
    lse = torch.empty(batch, num_q_heads, q_len, dtype=torch.float32)
    args = AttendArgs(
        _ptr(q), scale * LOG2E, _ptr(k_store), _ptr(v_store),  # the kernel works in base 2
        *k_store.stride()[:3], *v_store.stride()[:3],
        _ptr(indices), _ptr(lengths), _ptr(key_mask),
        batch, num_kv_heads, (num_q_heads // num_kv_heads) * q_len, head_dim,
        indices.shape[2], cap, block_size or 1, *_library.prefetch_config(), *scale_fields,
    )  # fmt: skip
    code = DTYPE_CODES[k_store.dtype]
    bad = lib.tandem_sparse_attention(
        _library.isa_code(), code, ctypes.byref(args), _ptr(out), _ptr(lse), threads
    )
    if bad < 0:
        raise RuntimeError(f"CPU kernel rejected isa={_library.isa_code()} dtype={k_store.dtype}")
    if bad:
        raise _out_of_range(bad, cap, block_size)
    return out, lse


def _out_of_range(bad: int, cap: int, block_size: int | None) -> ValueError:
    """The error of a call whose index lists name `bad` rows outside the store (the kernel checks every id it
    reads; the reference path's launcher checks them up front, in these words)."""
    units = f"{cap // block_size}) (blocks of k_store" if block_size else f"{cap}) (rows of k_store"
    return ValueError(f"indices must lie in [0, {units}); {bad} selected rows fall outside [0, {cap})")


def _prepare_in_place(in_place, num_threads):
    """Layout shared by the prepared calls: the named tensors contiguous (read or written in place by the kernel,
    whose pointers outlive this call). Returns (threads, library)."""
    for name, t in in_place:
        if t is not None and not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous (read or written in place), got strides {t.stride()}"
            )
    threads = _threads(num_threads)
    lib = _native()
    if lib is None:
        raise RuntimeError(f"the compiled CPU kernels are unavailable ({_library.unavailable_reason()})")
    return threads, lib


class RankedAttention:
    """Attention over ranks [skip, count) of device-ranked block ids, with every argument checked and laid out
    once for fixed buffers: one decode layer's q, ranked ids, out and lse, and its host store. A call passes only
    the ranks and the per-request available rows, so it costs a few microseconds of Python (the decode path
    makes one call per layer and step). The kept ids of each (request, KV head) are sorted in C++.

    q:        [B, Hq, D] or [B, Hq, Lq, D] float32 / bfloat16 / float16, contiguous
    k_store:  [B, Hkv, cap, D], v_store the same, last dim contiguous; key_mask [B, cap] bool or None
    k_scale:  8-bit stores only, v_scale the same: [B, Hkv, G] float32, as `sparse_attention_lse`
    ranked:   [B, Hkv, W] int64 contiguous, best first; ids outside [0, cap // block_size) are skipped
    out:      float32 q's shape, lse float32 q's shape without D; both contiguous, written in place
    Calling returns (attended, device, available): rows of all `count` ranks' valid ids, clamped per
    (request, KV head) to `available[b]`; rows of the first `skip` ranks' valid ids; sum of `available[b]`
    over (request, KV head). Built by `ops.ranked_attention_call`, which validates the arguments; this class checks
    the layout it reads and writes in place, and `available` at each call.
    """

    def __init__(
        self, q, k_store, v_store, ranked, scale, block_size, out, lse, key_mask=None, num_threads=None,
        k_scale=None, v_scale=None,
    ) -> None:  # fmt: skip
        batch, num_q_heads, head_dim = q.shape[0], q.shape[1], q.shape[-1]
        num_kv_heads, cap = k_store.shape[1], k_store.shape[2]
        _rows_contiguous(("k_store", k_store), ("v_store", v_store))
        scale_fields = _scale_fields(k_store, k_scale, v_scale)
        in_place = (("q", q), ("ranked", ranked), ("out", out), ("lse", lse), ("key_mask", key_mask))
        self.threads, self.lib = _prepare_in_place(in_place, num_threads)
        q_len = q.shape[2] if q.dim() == 4 else 1
        # keeps the addresses alive
        self.tensors = (q, k_store, v_store, ranked, out, lse, key_mask, k_scale, v_scale)
        self.batch, self.num_kv_heads, self.width = batch, num_kv_heads, ranked.shape[2]
        self.indices = torch.empty(batch, num_kv_heads, self.width, dtype=torch.int64)
        self.lengths = torch.zeros(batch, num_kv_heads, dtype=torch.int64)
        self.stats = (ctypes.c_int64 * 3)()
        self.args = AttendArgs(
            _ptr(q), scale * LOG2E, _ptr(k_store), _ptr(v_store),  # the kernel works in base 2
            *k_store.stride()[:3], *v_store.stride()[:3],
            None, None, _ptr(key_mask),
            batch, num_kv_heads, (num_q_heads // num_kv_heads) * q_len, head_dim,
            0, cap, block_size, *_library.prefetch_config(), *scale_fields,
        )  # fmt: skip
        self.call_args = (
            _library.isa_code(), DTYPE_CODES[k_store.dtype], ctypes.byref(self.args), DTYPE_CODES[q.dtype],
            _ptr(ranked), self.width,
        )  # fmt: skip
        self.tail = (_ptr(self.indices), _ptr(self.lengths))
        self.outputs = (self.stats, _ptr(out), _ptr(lse), self.threads)
        self._task = None

    def __call__(self, skip: int, count: int, available: torch.Tensor | None = None) -> tuple[int, int, int]:
        """Attend ranks [skip, count) (0 <= skip <= count <= W); `available`: [B] int64 contiguous, or None."""
        _check_available(available, self.batch)
        bad = self.lib.tandem_ranked_attention(
            *self.call_args, skip, count, *self.tail, _ptr(available), *self.outputs
        )
        return self.result(bad, skip, count)

    def task(self, skip: int, count: int, available: torch.Tensor | None = None) -> _library.HandoffTask:
        """`self(skip, count, available)` as a hand-off task for `serve_handoffs`, not run yet; once served,
        `self.result(task.result, skip, count)` is what the call returns. One task per instance, refilled by each
        call here."""
        _check_available(available, self.batch)
        task = self._task
        if task is None:
            task = self._task = _library.HandoffTask(
                kind=_library.RANKED_TASK, args=ctypes.addressof(self.args), isa=self.call_args[0],
                dtype=self.call_args[1], q_dtype=self.call_args[3], num_threads=self.threads,
                ranked=self.call_args[4], ranked_width=self.width, indices=self.tail[0], lengths=self.tail[1],
                stats=ctypes.addressof(self.stats), out=self.outputs[1], lse=self.outputs[2],
            )  # fmt: skip
        task.skip, task.count, task.available = skip, count, _ptr(available)
        task.result, task.nanoseconds = 0, 0
        # what the task points at lives as long as it does; not `self`, which holds the task (a reference cycle
        # would leave this call's pinned buffers to the garbage collector, which may run inside a graph capture)
        task.keep = (self.args, self.stats, self.tensors, self.indices, self.lengths, available)
        return task

    def result(self, bad: int, skip: int, count: int) -> tuple[int, int, int]:
        """(attended, device, available) of a call that returned `bad`, or the error it means."""
        # the kernel checks the ranks of every call (no launcher sees them); in ops.ranked_block_attention's words
        if bad == -2:
            raise ValueError(
                f"skip / count must satisfy 0 <= skip <= count <= {self.width} (ranked's width), got {skip} / {count}"
            )
        if bad < 0:
            raise RuntimeError(f"CPU kernel rejected isa={self.call_args[0]} dtype code {self.call_args[1]}")
        if bad:
            raise ValueError(f"ranked must name blocks of k_store: {bad} selected rows fall outside it")
        return self.stats[0], self.stats[1], self.stats[2]


def _check_available(available: torch.Tensor | None, batch: int) -> None:
    """A ranked call's `available` ([B] int64, contiguous, or None): read in place at each call, which no launcher
    sees, so checked there."""
    if available is not None and (
        available.dtype != torch.int64 or available.shape != (batch,) or not available.is_contiguous()
    ):
        raise ValueError(
            f"available must be [B] = [{batch}] int64, contiguous, got {tuple(available.shape)} {available.dtype}"
        )


def empty_task(out: torch.Tensor, lse: torch.Tensor) -> _library.HandoffTask:
    """A hand-off task with nothing to attend: `serve_handoffs` writes zeros into `out` and -inf into `lse`
    (float32, contiguous; the task keeps them alive). No launcher stands before it (the decode path calls it on its
    own buffers), so it checks what the writes need."""
    for name, t in (("out", out), ("lse", lse)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    task = _library.HandoffTask(
        kind=_library.EMPTY_TASK, out=_ptr(out), lse=_ptr(lse), out_numel=out.numel(), lse_numel=lse.numel()
    )
    task.keep = (out, lse)  # the addresses above stay valid as long as the task
    return task


def serve_handoffs(tasks, ready: int, done: int, stride: int, abort: int | None, timeout: float):
    """Serve hand-offs in order without Python in between: for each task, spin until the int32 at `ready + 4 *
    stride * i` is set, run the task, set the int32 at `done + 4 * stride * i` (addresses of pinned flags).
    Waiting stops after `timeout` seconds per hand-off, or once the int32 at `abort` (0 = none) is set.

    Returns (status, index): `_library.SERVED` (index = len(tasks)), `TASK_FAILED` (that task's `result` says
    why; its done flag and the later ones are not set), `TIMED_OUT` or `ABORTED` (while waiting for that
    hand-off). Needs the compiled library (`is_available()`)."""
    lib = _native()
    if lib is None:
        raise RuntimeError(f"serve_handoffs needs the compiled CPU kernels: {_library.unavailable_reason()}")
    pointers = (ctypes.POINTER(_library.HandoffTask) * len(tasks))(*(ctypes.pointer(t) for t in tasks))
    at = ctypes.c_int64(len(tasks))
    status = lib.tandem_serve_handoffs(
        pointers, len(tasks), ready, done, stride, abort or None, float(timeout), ctypes.byref(at)
    )
    return status, at.value


class PreparedAttention:
    """`sparse_attention_lse` for fixed buffers, checked and laid out once: one decode layer's q, a policy's
    index lists (which it extends in place) and the out / lse buffers, written in place. A call copies q to fp32
    and runs the kernel: a few microseconds of Python, against ~50-70 for the general launcher (its checks, q and
    index copies, output allocations), paid per layer and step by policies that keep their own selection (hgca).

    q:        [B, Hq, D] float32 / bfloat16 / float16, contiguous
    k_store:  [B, Hkv, cap, D], v_store the same, last dim contiguous; key_mask [B, cap] bool or None
    k_scale:  8-bit stores only, v_scale the same: [B, Hkv, G] float32, as `sparse_attention_lse`
    indices:  [B, Hkv, S] int64 row (or block) ids, stride 1 along S: the first S columns of a [B, Hkv, W]
              buffer (W >= S, the row stride), read in place. The lists are the buffer's rows: a policy that
              extends them in place (hgca) raises `lengths` past S, up to W, without preparing again
    lengths:  [B, Hkv] int64 contiguous, valid entries of each list, read at every call and capped at W, so
              no entry past the buffer is read
    out:      [B, Hq, D] float32, lse [B, Hq] float32, both contiguous, written in place
    Built by `ops.prepared_attention_call`, which validates the arguments; this class checks the layout it reads
    and writes in place (the lists' strides and storage included).
    """

    def __init__(
        self, q, k_store, v_store, indices, lengths, scale, out, lse, key_mask=None, block_size=None,
        num_threads=None, k_scale=None, v_scale=None,
    ) -> None:  # fmt: skip
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads, cap = k_store.shape[1], k_store.shape[2]
        _rows_contiguous(("k_store", k_store), ("v_store", v_store))
        scale_fields = _scale_fields(k_store, k_scale, v_scale)
        # the lists are read in place through these strides, up to W = the row stride (lengths are capped there)
        row = indices.stride(1)
        if indices.shape[2] and (indices.stride(2) != 1 or indices.stride(0) != num_kv_heads * row):
            raise ValueError(
                f"indices must have stride 1 along S and be [B, Hkv] rows of a [B, Hkv, W] buffer, got strides "
                f"{indices.stride()}"
            )
        if indices.shape[2] and (indices.storage_offset() + batch * num_kv_heads * row) * 8 > (
            indices.untyped_storage().nbytes()
        ):
            raise ValueError(
                f"indices must lie within its storage, which ends before the [B, Hkv, W={row}] buffer its strides describe"
            )
        in_place = (("q", q), ("lengths", lengths), ("out", out), ("lse", lse), ("key_mask", key_mask))
        self.threads, self.lib = _prepare_in_place(in_place, num_threads)
        self.q = q
        self.q32 = q if q.dtype == torch.float32 else torch.empty(q.shape, dtype=torch.float32)
        # keeps the addresses alive
        self.tensors = (k_store, v_store, indices, lengths, out, lse, key_mask, k_scale, v_scale)
        self.cap, self.block_size, self.lengths = cap, block_size, lengths
        self.args = AttendArgs(
            _ptr(self.q32), scale * LOG2E, _ptr(k_store), _ptr(v_store),  # the kernel works in base 2
            *k_store.stride()[:3], *v_store.stride()[:3],
            _ptr(indices), _ptr(lengths), _ptr(key_mask),
            batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim,
            row if indices.shape[2] else 0, cap, block_size or 1, *_library.prefetch_config(), *scale_fields,
        )  # fmt: skip
        self.call_args = (
            _library.isa_code(), DTYPE_CODES[k_store.dtype], ctypes.byref(self.args), _ptr(out), _ptr(lse),
            self.threads,
        )  # fmt: skip

    def __call__(self) -> None:
        if self.q32 is not self.q:
            self.q32.copy_(self.q)
        bad = self.lib.tandem_sparse_attention(*self.call_args)
        if bad < 0:
            raise RuntimeError(f"CPU kernel rejected isa={self.call_args[0]} dtype code {self.call_args[1]}")
        if bad:
            raise self._refusal(bad)

    def _refusal(self, bad: int) -> ValueError:
        return _out_of_range(bad, self.cap, self.block_size)


def _store_table(stores) -> tuple[ctypes.Array, int]:
    """(table, scale_rows): the `RowStore` of each request's store (k_store, v_store, key_mask, k_scale, v_scale),
    its layout checked for in-place reads, and the rows per scale of the 8-bit stores (1 for float ones)."""
    table = (RowStore * len(stores))()
    scale_rows = 1
    for b, (k_store, v_store, key_mask, k_scale, v_scale) in enumerate(stores):
        _rows_contiguous(("k_store", k_store), ("v_store", v_store))
        if key_mask is not None and not key_mask.is_contiguous():
            raise ValueError(f"stores[{b}]'s key_mask must be contiguous, got strides {key_mask.stride()}")
        fields = _scale_fields(k_store, k_scale, v_scale)
        scale_rows = fields[-1]
        table[b] = RowStore(
            _ptr(k_store), _ptr(v_store), *k_store.stride()[1:3], *v_store.stride()[1:3], _ptr(key_mask),
            k_store.shape[2], fields[0], fields[1], fields[3], fields[5],
        )  # fmt: skip
    return table, scale_rows


def _stores_args(
    q_ptr, q, stores, table, scale_rows, scale, block_size, indices_ptr=None, lengths_ptr=None, width=0
):
    """`AttendArgs` of a call over `stores` through `table` (`_store_table`): the per-store fields come from the
    table, so the shared ones stay empty."""
    batch, num_q_heads, head_dim = q.shape
    k0 = stores[0][0]
    num_kv_heads = k0.shape[1]
    return AttendArgs(
        q_ptr, scale * LOG2E, _ptr(k0), _ptr(stores[0][1]),  # the kernel works in base 2
        0, 0, 0, 0, 0, 0,
        indices_ptr, lengths_ptr, None,
        batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim,
        width, k0.shape[2], block_size or 1, *_library.prefetch_config(),
        None, None, 0, 0, 0, 0, scale_rows, ctypes.addressof(table),
    )  # fmt: skip


class StoresAttention(PreparedAttention):
    """`PreparedAttention` for requests that each keep their own store, in one call: request b's index lists name
    blocks (or rows) of its own store, so the threads split every request's rows together (one call per layer for a
    batch of requests, instead of one each).

    q:        [B, Hq, D] float32 / bfloat16 / float16, contiguous
    stores:   B tuples (k_store, v_store, key_mask, k_scale, v_scale): request b's store [1, Hkv, cap_b, D] (any
              capacity; one dtype, Hkv and D for all; last dim contiguous), its mask [1, cap_b] bool or None, and
              for 8-bit stores its scales [1, Hkv, G_b] float32 with cap_b / G_b rows per scale, the same for all
    indices:  [B, Hkv, W] int64 contiguous, read in place; request b's ids name its own store's blocks
    lengths:  [B, Hkv] int64 contiguous, read at every call (capped at W); a request with length 0 attends nothing
              (out 0, lse -inf)
    out:      [B, Hq, D] float32, lse [B, Hq] float32, both contiguous, written in place
    Built by `ops.stores_attention_call`, which validates the arguments; this class checks the layout it reads
    and writes in place.
    """

    def __init__(
        self, q, stores, indices, lengths, scale, out, lse, block_size=None, num_threads=None
    ) -> None:  # fmt: skip
        in_place = (("q", q), ("indices", indices), ("lengths", lengths), ("out", out), ("lse", lse))
        self.threads, self.lib = _prepare_in_place(in_place, num_threads)
        self.table, scale_rows = _store_table(stores)
        self.q = q
        self.q32 = q if q.dtype == torch.float32 else torch.empty(q.shape, dtype=torch.float32)
        # keeps the addresses alive
        self.tensors = (stores, indices, lengths, out, lse)
        self.lengths = lengths
        self.args = _stores_args(
            _ptr(self.q32), q, stores, self.table, scale_rows, scale, block_size, _ptr(indices), _ptr(lengths),
            indices.shape[2],
        )  # fmt: skip
        self.call_args = (
            _library.isa_code(), DTYPE_CODES[stores[0][0].dtype], ctypes.byref(self.args), _ptr(out), _ptr(lse),
            self.threads,
        )  # fmt: skip

    def _refusal(self, bad: int) -> ValueError:
        return ValueError(
            f"indices must name blocks of each request's own store: {bad} selected rows fall outside it"
        )


class RankedRowsAttention:
    """`RankedAttention` for requests that each keep their own store and ranking, in one call: request b keeps ranks
    [skips[b], counts[b]) of its ranked ids, which name blocks of its own store (sorted in C++), so a batch of
    requests pays one call per layer instead of one each.

    q:        [B, Hq, D] float32 / bfloat16 / float16, contiguous
    stores:   B tuples (k_store, v_store, key_mask, k_scale, v_scale), as `StoresAttention`
    ranked:   [B, Hkv, W] int64 contiguous, read in place, best first; a request's row past its own ranking holds
              invalid ids (< 0), which are skipped, as are ids past its store
    skips / counts: [B] int64 (this object's, filled by the caller before each call)
    out:      [B, Hq, D] float32, lse [B, Hq] float32, both contiguous, written in place
    Calling returns row_stats [B, 3] int64 (this object's): per request, `RankedAttention`'s (attended, device,
    available). Built by `ops.ranked_rows_call`, which validates the arguments.
    """

    def __init__(self, q, stores, ranked, scale, block_size, out, lse, num_threads=None) -> None:
        in_place = (("q", q), ("ranked", ranked), ("out", out), ("lse", lse))
        self.threads, self.lib = _prepare_in_place(in_place, num_threads)
        self.table, scale_rows = _store_table(stores)
        batch, num_kv_heads, self.width = ranked.shape
        self.batch = batch
        self.ranked = ranked
        self.indices = torch.empty(batch, num_kv_heads, max(self.width, 1), dtype=torch.int64)
        self.lengths = torch.zeros(batch, num_kv_heads, dtype=torch.int64)
        self.skips = torch.zeros(batch, dtype=torch.int64)
        self.counts = torch.zeros(batch, dtype=torch.int64)
        self.row_stats = torch.zeros(batch, 3, dtype=torch.int64)
        self.tensors = (q, list(stores), out, lse)  # keeps the addresses alive
        self.scale_rows = scale_rows
        # the call converts q and sets the lists itself
        self.args = _stores_args(_ptr(q), q, stores, self.table, scale_rows, scale, block_size)
        self.call_args = (
            _library.isa_code(), DTYPE_CODES[stores[0][0].dtype], ctypes.byref(self.args), DTYPE_CODES[q.dtype],
            _ptr(ranked), self.width, _ptr(self.skips), _ptr(self.counts), 1, _ptr(self.indices),
            _ptr(self.lengths),
        )  # fmt: skip
        self.outputs = (_ptr(self.row_stats), 1, _ptr(out), _ptr(lse), self.threads)
        self._task = None

    def set_store(self, b: int, store) -> None:
        """Request b reads `store` from the next call on, as if the call had been built with it (checked by
        `ops.ranked_rows_set_store`)."""
        table, _ = _store_table([store])
        self.table[b] = table[0]
        self.tensors[1][b] = store

    def __call__(self, available: torch.Tensor | None = None) -> torch.Tensor:
        """Attend each request's ranks [skips[b], counts[b]); `available`: [B] int64 contiguous, or None."""
        _check_available(available, self.batch)
        return self.result(
            self.lib.tandem_ranked_rows_attention(*self.call_args, _ptr(available), *self.outputs)
        )

    def task(self, available: torch.Tensor | None = None) -> _library.HandoffTask:
        """`self(available)` as a hand-off task for `serve_handoffs`, not run yet (it reads `skips` / `counts` when
        it runs); once served, `self.result(task.result)` is what the call returns. One task per instance."""
        _check_available(available, self.batch)
        task = self._task
        if task is None:
            task = self._task = _library.HandoffTask(
                kind=_library.RANKED_ROWS_TASK, args=ctypes.addressof(self.args), isa=self.call_args[0],
                dtype=self.call_args[1], q_dtype=self.call_args[3], num_threads=self.threads,
                ranked=self.call_args[4], ranked_width=self.width, indices=self.call_args[9],
                lengths=self.call_args[10], stats=self.outputs[0], out=self.outputs[2], lse=self.outputs[3],
                skips=self.call_args[6], counts=self.call_args[7],
            )  # fmt: skip
        task.available = _ptr(available)
        task.result, task.nanoseconds = 0, 0
        # what the task points at lives as long as it does; not `self`, which holds the task (a reference cycle
        # would leave the pinned buffers to the garbage collector, which may run inside a graph capture)
        task.keep = (self.args, self.tensors, self.ranked, self.indices, self.lengths, self.skips, self.counts,
                     self.row_stats, available)  # fmt: skip
        return task

    def result(self, bad: int) -> torch.Tensor:
        """`row_stats` of a call that returned `bad`, or the error it means."""
        if bad == -2:
            raise ValueError(
                f"skips / counts must satisfy 0 <= skip <= count <= {self.width} (ranked's width) for every request, "
                f"got {self.skips.tolist()} / {self.counts.tolist()}"
            )
        if bad < 0:
            raise RuntimeError(f"CPU kernel rejected isa={self.call_args[0]} dtype code {self.call_args[1]}")
        if bad:
            raise ValueError(
                f"ranked must name blocks of each request's own store: {bad} selected rows fall outside it"
            )
        return self.row_stats


def ranked_block_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    ranked: torch.Tensor,
    skip: int,
    count: int,
    scale: float,
    block_size: int,
    key_mask: torch.Tensor | None = None,
    num_threads: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention over ranks [skip, count) of best-first block ids. See `reference.ranked_block_attention`;
    k_scale / v_scale: the scales of an 8-bit store, as `sparse_attention_lse`."""
    if _native() is None:
        return reference.ranked_block_attention(
            q, k_store, v_store, ranked, skip, count, scale, block_size, key_mask, k_scale, v_scale
        )
    out = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32)
    call = RankedAttention(
        q.contiguous(), k_store, v_store, ranked.contiguous(), scale, block_size, out, lse,
        None if key_mask is None else key_mask.contiguous(), num_threads, k_scale, v_scale,
    )  # fmt: skip
    call(skip, count)
    return out, lse, call.lengths


def _mergeable(tensors) -> bool:
    """The layout the compiled merge reads in place: float32, contiguous, on the CPU."""
    return all(t.dtype == torch.float32 and t.is_contiguous() and not t.is_cuda for t in tensors)


def merge_lse_(out_a, lse_a, out_b, lse_b):
    """`reference.merge_lse` in place into (out_a, lse_a), one compiled loop: out_* [..., D] and lse_* [...]
    float32, contiguous, on the CPU (the launcher `ops.merge_lse_` checks the shapes). Without the compiled
    library, or for other layouts, the reference runs. Returns (out_a, lse_a)."""
    lib = _native()
    tensors = (out_a, lse_a, out_b, lse_b)
    if lib is None or not _mergeable(tensors):
        out, lse = reference.merge_lse(out_a, lse_a, out_b, lse_b)
        out_a.copy_(out)
        lse_a.copy_(lse)
        return out_a, lse_a
    lib.tandem_merge_lse(
        out_a.data_ptr(), lse_a.data_ptr(), out_b.data_ptr(), lse_b.data_ptr(), lse_a.numel(), out_a.shape[-1]
    )
    return out_a, lse_a


class PreparedMerge:
    """`merge_lse_` for fixed buffers, checked and laid out once: (out_b, lse_b) merged into (out_a, lse_a) in
    place at every call, a couple of microseconds of Python. out_* [..., D] and lse_* [...] float32, contiguous,
    on the CPU, of one shape; needs the compiled library."""

    def __init__(self, out_a, lse_a, out_b, lse_b) -> None:
        tensors = (out_a, lse_a, out_b, lse_b)
        if not _mergeable(tensors):
            raise ValueError("PreparedMerge needs contiguous float32 CPU tensors")
        if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or lse_a.shape != out_a.shape[:-1]:
            raise ValueError(
                f"PreparedMerge: out {tuple(out_a.shape)} / {tuple(out_b.shape)} and lse {tuple(lse_a.shape)} / "
                f"{tuple(lse_b.shape)} must match, lse being out's shape without head_dim"
            )
        self.lib = _native()
        if self.lib is None:
            raise RuntimeError(
                f"PreparedMerge needs the compiled CPU kernels: {_library.unavailable_reason()}"
            )
        self.tensors = tensors  # keeps the addresses alive
        self.args = (*(t.data_ptr() for t in tensors), lse_a.numel(), out_a.shape[-1])

    def __call__(self) -> None:
        self.lib.tandem_merge_lse(*self.args)


def claim_probe(counter: torch.Tensor, owner: torch.Tensor, n: int, threads: int) -> int:
    """Claim indices [0, n) from `counter` ([1] int32, pinned or not) with `threads` threads and atomic fetch-adds,
    writing (1 << 20) + thread into `owner` ([n] int32) at each index taken; returns how many this call took
    (`benchmarks/bench_queue_claims.py`)."""
    lib = _native()
    if lib is None:
        raise RuntimeError(f"claim_probe needs the compiled CPU kernels: {_library.unavailable_reason()}")
    return lib.tandem_claim_probe(counter.data_ptr(), owner.data_ptr(), n, threads)


def queue_gpu_claim(control: torch.Tensor, capacity: int, nseg: int, cursor: torch.Tensor) -> int:
    """The GPU's side of a step's queue, taken by a thread that stands in for the GPU (tests, CI): the next piece
    from the front of the plan in `control` ([2 + P + nseg + 3P] int32, contiguous), or -1 once that side is done.
    `cursor`: [1] int32, the stand-in's own (zero before the step)."""
    lib = _native()
    if lib is None:
        raise RuntimeError(f"queue_gpu_claim needs the compiled CPU kernels: {_library.unavailable_reason()}")
    return lib.tandem_queue_gpu_claim(_ptr(control), capacity, nseg, _ptr(cursor))


class QueueAttention:
    """The CPU's side of a decode step's task queue (`tandem.attention.queue`), checked and laid out once for
    fixed buffers: one layer's q, block lists, plan and out / lse, and its host store. A call reads the plan that
    the GPU copied into `control` (the pieces, the lengths, the split), takes pieces from the back, settling
    those the GPU also reaches, and writes the LSE merge of the pieces it took into out / lse (0, -inf where it
    took none).

    q:        [B, Hq, D] float32 / bfloat16 / float16, contiguous
    k_store:  [B, Hkv, cap, D], v_store the same, last dim contiguous; key_mask [B, cap] bool or None
    ids:      [B, Hkv, K] int64 contiguous: each segment's blocks, valid ids first
    control:  [2 + P + B * Hkv + 3P] int32 contiguous (pinned where a GPU shares the queue)
    Calling returns (rows, cpu_rows): rows of valid blocks in all pieces, and those the CPU took.
    """

    def __init__(
        self, q, k_store, v_store, ids, scale, block_size, out, lse, key_mask, control, capacity, pieces_max,
        piece_blocks, num_threads=None, k_scale=None, v_scale=None,
    ) -> None:  # fmt: skip
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads, cap = k_store.shape[1], k_store.shape[2]
        _rows_contiguous(("k_store", k_store), ("v_store", v_store))
        scale_fields = _scale_fields(k_store, k_scale, v_scale)
        in_place = (
            ("q", q),
            ("ids", ids),
            ("out", out),
            ("lse", lse),
            ("key_mask", key_mask),
            ("control", control),
        )
        self.threads, self.lib = _prepare_in_place(in_place, num_threads)
        nseg = batch * num_kv_heads
        if control.dtype != torch.int32 or control.numel() != 2 + 4 * capacity + nseg:
            raise ValueError(
                f"control must hold 2 + 4 * {capacity} + {nseg} int32, got {control.numel()} {control.dtype}"
            )
        self.tensors = (q, k_store, v_store, ids, out, lse, key_mask, control, k_scale, v_scale)
        self.lengths = torch.zeros(nseg, dtype=torch.int64)
        self.owner = torch.zeros(capacity, dtype=torch.int8)
        self.stats = (ctypes.c_int64 * 2)()
        self.args = AttendArgs(
            _ptr(q), scale * LOG2E, _ptr(k_store), _ptr(v_store),  # the kernel works in base 2
            *k_store.stride()[:3], *v_store.stride()[:3],
            _ptr(ids), None, _ptr(key_mask),
            batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim,
            ids.shape[2], cap, block_size, *_library.prefetch_config(), *scale_fields,
        )  # fmt: skip
        self.isa, self.dtype, self.q_dtype = (
            _library.isa_code(),
            DTYPE_CODES[k_store.dtype],
            DTYPE_CODES[q.dtype],
        )
        self.control, self.capacity, self.pieces_max, self.piece_blocks = (
            control,
            capacity,
            pieces_max,
            piece_blocks,
        )
        self.out, self.lse = out, lse
        self._task = None

    def __call__(self, timeout: float = 10.0) -> tuple[int, int]:
        bad = self.lib.tandem_queue_attention(
            self.isa, self.dtype, ctypes.byref(self.args), self.q_dtype, _ptr(self.control), self.capacity,
            self.pieces_max, self.piece_blocks, _ptr(self.lengths), _ptr(self.owner), self.stats,
            _ptr(self.out), _ptr(self.lse), self.threads, float(timeout),
        )  # fmt: skip
        return self.result(bad)

    def task(self) -> _library.HandoffTask:
        """This call as a hand-off task for `serve_handoffs`; once served, `self.result(task.result)` is what the
        call returns."""
        task = self._task
        if task is None:
            task = self._task = _library.HandoffTask(
                kind=_library.QUEUE_TASK, args=ctypes.addressof(self.args), isa=self.isa, dtype=self.dtype,
                q_dtype=self.q_dtype, num_threads=self.threads, ranked=_ptr(self.control),
                ranked_width=self.capacity, skip=self.pieces_max, count=self.piece_blocks,
                lengths=_ptr(self.lengths), stats=ctypes.addressof(self.stats), out=_ptr(self.out),
                lse=_ptr(self.lse),
            )  # fmt: skip
        task.result, task.nanoseconds = 0, 0
        task.keep = (self.args, self.stats, self.tensors, self.lengths)
        return task

    def result(self, bad: int) -> tuple[int, int]:
        if bad == -3:
            raise RuntimeError("the GPU's side of the task queue did not answer within the timeout")
        if bad == -2:
            raise ValueError(
                "the task queue's plan is malformed (pieces out of range or a segment's pieces apart)"
            )
        if bad < 0:
            raise RuntimeError(f"CPU kernel rejected isa={self.isa} dtype code {self.dtype}")
        if bad:
            raise ValueError(f"ids must name blocks of k_store: {bad} selected rows fall outside it")
        return self.stats[0], self.stats[1]
