"""Kernels of quest's recall cache on the device: one step's plan (hits, copies in, the clock's victims) and
the copy of host blocks into the cache's slots. Only `@triton.jit` functions live here; `recall.py` validates
and launches.
"""

import triton
import triton.language as tl

from ._common_kernels import _load_rows


@triton.jit
def recall_blocks_kernel(
    src_k_ptr,  # [B, Hkv, T, D] (pinned host memory read through UVA, or device memory)
    src_v_ptr,
    src_valid_ptr,  # [B, T] uint8
    dst_k_ptr,  # [B, Hkv * slots * BLOCK_SIZE, D] on the device
    dst_v_ptr,
    dst_valid_ptr,  # [B, Hkv * slots * BLOCK_SIZE] uint8
    src_ids_ptr,  # [B, Hkv, W] int64 host block ids
    dst_ids_ptr,  # [B, Hkv, W] int64 slots
    counts_ptr,  # [B, Hkv] int64: live entries
    src_k_scale_ptr,  # [B, Hkv, T // G] fp32, read only when QUANT
    src_v_scale_ptr,  # [B, Hkv, T // G] fp32
    table_ptr,  # [B, 5] int64, read only when TABLE: request b's own store (see below)
    num_rows,
    slots,
    scale_group,  # G: rows per scale
    stride_skb,
    stride_skh,
    stride_skt,
    stride_svb,
    stride_svh,
    stride_svt,
    stride_smb,
    stride_dkb,
    stride_dkt,
    stride_dvb,
    stride_dvt,
    stride_dmb,
    stride_ib,
    stride_ih,
    stride_jb,
    stride_jh,
    stride_cb,
    stride_ch,
    stride_ksb,
    stride_ksh,
    stride_vsb,
    stride_vsh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    RNE_BF16: tl.constexpr,
    TABLE: tl.constexpr,
):
    """Grid (B, Hkv, W): entry w < counts[b, h] copies host block src_ids[b, h, w] (rows past num_rows: not
    valid) into slot dst_ids[b, h, w] of head h, K, V and validity, BLOCK_R rows at a time. QUANT (see
    `_load_rows`): 0 a source of the cache's dtype; 1 / 2 int8 / float8 codes, decoded to the cache's dtype.
    TABLE: each request b reads its own store (the requests of a pool, each with its own host tier):
    table[b] = (its keys', values' and valid flags' element offsets from src_k / src_v / src_valid, its keys'
    head stride, its rows T), with the row stride stride_skt shared; QUANT 0 only."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    w = tl.program_id(2)
    if TABLE:
        entry = table_ptr + b * 5
        stride_h = tl.load(entry + 3)
        src_k_row = src_k_ptr + tl.load(entry) + head * stride_h
        src_v_row = src_v_ptr + tl.load(entry + 1) + head * stride_h
        src_valid_row = src_valid_ptr + tl.load(entry + 2)
        num_rows = tl.load(entry + 4)
    else:
        src_k_row = src_k_ptr + b * stride_skb + head * stride_skh
        src_v_row = src_v_ptr + b * stride_svb + head * stride_svh
        src_valid_row = src_valid_ptr + b * stride_smb
    count = tl.load(counts_ptr + b * stride_cb + head * stride_ch)
    if w < count:
        block = tl.load(src_ids_ptr + b * stride_ib + head * stride_ih + w).to(tl.int64)
        # checked before it is scaled (id * BLOCK_SIZE wraps near the int64 extremes); -1 reads nothing
        block = tl.where((block >= 0) & (block < (num_rows + BLOCK_SIZE - 1) // BLOCK_SIZE), block, -1)
        slot = tl.load(dst_ids_ptr + b * stride_jb + head * stride_jh + w).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_live = d < HEAD_DIM
        for r0 in range(0, BLOCK_SIZE, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_live = r < BLOCK_SIZE
            src_row = block * BLOCK_SIZE + r
            readable = r_live & (src_row >= 0) & (src_row < num_rows)
            dst_row = (head * slots + slot) * BLOCK_SIZE + r
            put = r_live[:, None] & d_live[None, :]
            k = _load_rows(
                src_k_row, src_row, stride_skt, d, readable, d_live,
                src_k_scale_ptr + b * stride_ksb + head * stride_ksh, scale_group,
                dst_k_ptr.dtype.element_ty, QUANT, RNE_BF16,
            )  # fmt: skip
            tl.store(dst_k_ptr + b * stride_dkb + dst_row[:, None] * stride_dkt + d[None, :], k, mask=put)
            v = _load_rows(
                src_v_row, src_row, stride_svt, d, readable, d_live,
                src_v_scale_ptr + b * stride_vsb + head * stride_vsh, scale_group,
                dst_v_ptr.dtype.element_ty, QUANT, RNE_BF16,
            )  # fmt: skip
            tl.store(dst_v_ptr + b * stride_dvb + dst_row[:, None] * stride_dvt + d[None, :], v, mask=put)
            ok = tl.load(src_valid_row + src_row, mask=readable, other=0)
            tl.store(dst_valid_ptr + b * stride_dmb + dst_row, ok, mask=r_live)


@triton.jit
def _recall_entries(ids_row, block_row, c0, K, k, limit, BLOCK_K: tl.constexpr):
    """Entries [c0, c0 + BLOCK_K) of a step's selection: (positions, inside K, block ids, selected, slot or -1)."""
    e = c0 + tl.arange(0, BLOCK_K)
    in_k = e < K
    ids = tl.load(ids_row + e, mask=in_k, other=limit)
    live = in_k & (e < k) & (ids >= 0) & (ids < limit)
    slot = tl.load(block_row + ids, mask=live, other=-1)
    return e, in_k, ids, live, slot


@triton.jit
def recall_plan_kernel(
    ids_ptr,  # [B, Hkv, K] int64: the step's selection (entries >= k or >= limit are not selected)
    k_ptr,  # [1] or [B] int64: blocks selected this step (k_stride 0: one count for every request)
    block_slot_ptr,  # [B, Hkv, NB] int64: slot of each host block, -1 if not cached
    slot_block_ptr,  # [B, Hkv, S] int64: block of each slot, -1 if empty
    last_ptr,  # [B, Hkv, S] int64: step of each slot's last hit or fill
    ref_ptr,  # [B, Hkv, S] int8: the clock's second-chance bit
    hand_ptr,  # [B, Hkv] int64: the clock's hand
    step_ptr,  # [B, Hkv] int64: steps planned so far
    cpu_ptr,  # [B, Hkv, K] int64 out: the CPU's blocks, `limit` elsewhere
    src_ptr,  # [B, Hkv, W] int64 out: blocks the device copies in
    dst_ptr,  # [B, Hkv, W] int64 out: their slots
    counts_ptr,  # [B, Hkv] int64 out: live entries of src / dst
    gpu_ptr,  # [B, Hkv, K + W] int64 out: flat-store block ids the device attends, `heads * S` where dead
    counters_ptr,  # [2] or [B, 2] int64: rows attended from the cache, rows copied in (accumulated; per request
    # with counters_stride 2)
    share,
    k_stride,
    counters_stride,
    K,
    W,
    S,
    NB,
    limit,
    heads,
    block_size,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Grid (B, Hkv): one (request, KV head)'s recall plan for a step, and its bookkeeping, in one program
    (`reference.recall_plan` is the same algorithm written as loops). Contiguous tensors."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = b * heads + head
    ids_row = ids_ptr + row * K
    cpu_row = cpu_ptr + row * K
    gpu_row = gpu_ptr + row * (K + W)
    block_row = block_slot_ptr + row * NB
    slot_row = slot_block_ptr + row * S
    last_row = last_ptr + row * S
    ref_row = ref_ptr + row * S
    src_row = src_ptr + row * W
    dst_row = dst_ptr + row * W
    step = tl.load(step_ptr + row)
    k = tl.load(k_ptr + b * k_stride)
    dead = heads * S
    base = head * S
    # 1. hits: attended from their slots, marked used this step
    n_hit = tl.zeros((), dtype=tl.int64)
    n_miss = tl.zeros((), dtype=tl.int64)
    for c0 in range(0, K, BLOCK_K):
        e, in_k, ids, live, slot = _recall_entries(ids_row, block_row, c0, K, k, limit, BLOCK_K)
        hit = live & (slot >= 0)
        tl.store(last_row + slot, tl.zeros_like(slot) + step, mask=hit)
        tl.store(ref_row + slot, tl.full(slot.shape, 1, tl.int8), mask=hit)
        tl.store(gpu_row + e, tl.where(hit, base + slot, dead), mask=in_k)
        n_hit += tl.sum(hit.to(tl.int64))
        n_miss += tl.sum((live & ~hit).to(tl.int64))
    count = tl.minimum(tl.floor(n_miss.to(tl.float32) * share + 0.5).to(tl.int64), W)
    # 2. misses in selection order: the first `count` are copied in, the rest go to the CPU
    seen = tl.zeros((), dtype=tl.int64)
    for c0 in range(0, K, BLOCK_K):
        e, in_k, ids, live, slot = _recall_entries(ids_row, block_row, c0, K, k, limit, BLOCK_K)
        miss = live & (slot < 0)
        rank = seen + tl.cumsum(miss.to(tl.int64), 0) - 1
        recall = miss & (rank < count)
        tl.store(src_row + rank, ids, mask=recall)
        tl.store(cpu_row + e, tl.where(miss & ~recall, ids, limit), mask=in_k)
        seen += tl.sum(miss.to(tl.int64))
    tl.debug_barrier()
    # 3. victims: the clock's hand walks the slots, taking those not used this step whose second chance is spent,
    # and spending the chance of those it passes
    hand = tl.load(hand_ptr + row)
    taken = tl.zeros((), dtype=tl.int64)
    offsets = tl.arange(0, BLOCK_S)
    while taken < count:
        slots = (hand + offsets) % S
        ref = tl.load(ref_row + slots)
        last = tl.load(last_row + slots)
        free = last != step
        cand = free & (ref == 0)
        crank = taken + tl.cumsum(cand.to(tl.int64), 0) - 1
        take = cand & (crank < count)
        tl.store(dst_row + crank, slots, mask=take)
        tl.store(last_row + slots, tl.zeros_like(last) + step, mask=take)  # never taken twice
        n_take = tl.sum(take.to(tl.int64))
        stop = tl.max(tl.where(take, offsets, -1)) + 1
        advance = tl.where(taken + n_take >= count, stop, BLOCK_S)
        tl.store(ref_row + slots, tl.zeros_like(ref), mask=(offsets < advance) & free & ~take)
        taken += n_take
        hand = (hand + advance) % S
        tl.debug_barrier()
    tl.store(hand_ptr + row, hand)
    # 4. the copied-in blocks take their slots
    for j0 in range(0, W, BLOCK_W):
        j = j0 + tl.arange(0, BLOCK_W)
        active = j < count
        slot = tl.load(dst_row + j, mask=active, other=0)
        block = tl.load(src_row + j, mask=active, other=0)
        old = tl.load(slot_row + slot, mask=active, other=-1)
        tl.store(block_row + old, tl.full(old.shape, -1, tl.int64), mask=active & (old >= 0))
        tl.store(block_row + block, slot, mask=active)
        tl.store(slot_row + slot, block, mask=active)
        tl.store(ref_row + slot, tl.full(slot.shape, 1, tl.int8), mask=active)
        tl.store(gpu_row + K + j, tl.where(active, base + slot, dead), mask=j < W)
    tl.store(counts_ptr + row, count)
    tl.store(step_ptr + row, step + 1)
    tl.atomic_add(counters_ptr + b * counters_stride, n_hit * block_size)
    tl.atomic_add(counters_ptr + b * counters_stride + 1, count * block_size)
