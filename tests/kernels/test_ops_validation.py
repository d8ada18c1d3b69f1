"""`tandem.kernels.ops` launchers refuse bad input with a ValueError that names the bad argument.

Launchers that can dispatch to the compiled CPU kernels are checked on both paths: "native" (the compiled
kernels, when they build here) and "reference" (the plain-torch fallback taken without a compiler or on
CUDA), since the launcher, not the kernel, must refuse bad input, whichever implementation runs.
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import ops

B, HQ, HKV, LQ, T, D = 2, 4, 2, 3, 27, 8


def f32(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.fixture
def path(request, monkeypatch):
    if request.param == "native" and not ops.native_cpu_available():
        pytest.skip("compiled CPU kernels unavailable")
    if request.param == "reference":
        monkeypatch.setattr(ops, "native_cpu_available", lambda: False)
    return request.param


def dense_args(**changes):
    args = dict(q=f32(B, HQ, LQ, D), k=f32(B, HKV, T, D), v=f32(B, HKV, T, D), scale=0.3, key_mask=None)
    args.update(changes)
    return args


def sparse_args(**changes):
    args = dict(
        q=f32(B, HQ, 1, D), k_store=f32(B, HKV, T, D), v_store=f32(B, HKV, T, D),
        indices=torch.arange(5).expand(B, HKV, 5).contiguous(), lengths=torch.full((B, HKV), 5), scale=0.3,
    )  # fmt: skip
    args.update(changes)
    return args


def score_args(**changes):
    args = dict(q=f32(B, HQ, 1, D), key_min=f32(B, HKV, 7, D) - 1, key_max=f32(B, HKV, 7, D) + 1)
    args.update(changes)
    return args


@pytest.mark.parametrize("path", ["native", "reference"], indirect=True)
def test_valid_input_passes(path):
    # the bases below are valid, so each case fails only for the change it makes
    ops.attention_lse(**dense_args(key_mask=torch.ones(B, LQ, T, dtype=torch.bool)))
    ops.sparse_attention_lse(**sparse_args(key_mask=torch.ones(B, T, dtype=torch.bool)))
    ops.sparse_attention_lse(**sparse_args(block_size=4, lengths=torch.ones(B, HKV, dtype=torch.long)))
    ops.topk_blocks(ops.block_scores(**score_args()), 3)
    ops.score_topk(**score_args(), k=3, factor=2)
    ops.threshold_select(torch.rand(B, HQ, T), 0.5, HKV, T)
    # half-precision scores and weights: the launcher converts what the compiled kernels read (float32)
    ops.topk_blocks(f32(B, HKV, 7).bfloat16(), 3, num_threads=1)
    for threshold in (torch.tensor(0.5), torch.rand(B, HQ), torch.rand(B, HQ, 1)):
        ops.threshold_select(torch.rand(B, HQ, T).half(), threshold, HKV, T)


# ---- launchers without a native path ----------------------------------------------------------------------

DENSE_CASES = {
    "q_3d": (dict(q=f32(B, HQ, D)), r"\bq must be 4-D"),
    "q_not_tensor": (dict(q=[[1.0]]), r"\bq must be a torch.Tensor"),
    "k_3d": (dict(k=f32(B, T, D)), r"\bk must be 4-D"),
    "v_shape": (dict(v=f32(B, HKV, T + 1, D)), r"\bk and v\b"),
    "head_dim": (dict(k=f32(B, HKV, T, 2 * D), v=f32(B, HKV, T, 2 * D)), r"head_dim of q .* and k\b"),
    "heads_not_multiple": (
        dict(q=f32(B, 6, LQ, D), k=f32(B, 4, T, D), v=f32(B, 4, T, D)),
        r"q heads .* k heads",
    ),
    "batch": (dict(q=f32(B + 1, HQ, LQ, D)), r"batch of q"),
    "q_int": (dict(q=torch.ones(B, HQ, LQ, D, dtype=torch.int32)), r"\bq\.dtype"),
    "k_int": (dict(k=torch.ones(B, HKV, T, D, dtype=torch.int64)), r"\bk\.dtype"),
    "v_dtype": (dict(v=f32(B, HKV, T, D).half()), r"\bk and v\b.*dtype"),
    "key_mask_shape": (dict(key_mask=torch.ones(B, T + 1, dtype=torch.bool)), r"key_mask"),
    "key_mask_3d_shape": (dict(key_mask=torch.ones(B, LQ + 1, T, dtype=torch.bool)), r"key_mask"),
    "key_mask_dtype": (dict(key_mask=torch.ones(B, T)), r"key_mask must be bool"),
    "key_mask_uint8": (dict(key_mask=torch.ones(B, T, dtype=torch.uint8)), r"key_mask must be bool"),
}


@pytest.mark.parametrize("case", DENSE_CASES)
def test_attention_lse_names_the_bad_argument(case):
    changes, pattern = DENSE_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        ops.attention_lse(**dense_args(**changes))


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        (dict(out_b=f32(B, HQ, LQ, D + 1)), r"out_a .* and out_b"),
        (dict(lse_a=f32(B, HQ, LQ + 1)), r"lse_a / lse_b"),
        (dict(lse_b=f32(B, HQ)), r"lse_a / lse_b"),
    ],
)
def test_merge_lse_names_the_bad_argument(changes, pattern):
    args = dict(out_a=f32(B, HQ, LQ, D), lse_a=f32(B, HQ, LQ), out_b=f32(B, HQ, LQ, D), lse_b=f32(B, HQ, LQ))
    args.update(changes)
    with pytest.raises(ValueError, match=pattern):
        ops.merge_lse(**args)


# ---- launchers with a native and a reference path ---------------------------------------------------------


# name: (launcher, argument builder, pattern naming the argument)
PATH_CASES = {
    # sparse_attention_lse
    "sparse_q_3d": ("sparse_attention_lse", lambda: sparse_args(q=f32(B, HQ, D)), r"\bq\b"),
    "sparse_k_store_3d": (
        "sparse_attention_lse",
        lambda: sparse_args(k_store=f32(B, T, D)),
        r"k_store",
    ),
    "sparse_v_store_shape": (
        "sparse_attention_lse",
        lambda: sparse_args(v_store=f32(B, HKV, T - 1, D)),
        r"v_store",
    ),
    "sparse_head_dim": (
        "sparse_attention_lse",
        lambda: sparse_args(k_store=f32(B, HKV, T, D + 1), v_store=f32(B, HKV, T, D + 1)),
        r"head_dim",
    ),
    "sparse_heads_not_multiple": (
        "sparse_attention_lse",
        lambda: sparse_args(q=f32(B, 3, 1, D)),
        r"q heads",
    ),
    "sparse_q_int": (
        "sparse_attention_lse",
        lambda: sparse_args(q=torch.ones(B, HQ, 1, D, dtype=torch.int32)),
        r"\bq\.dtype",
    ),
    "sparse_k_store_int": (
        "sparse_attention_lse",
        lambda: sparse_args(k_store=torch.ones(B, HKV, T, D, dtype=torch.int8)),
        r"k_store\.dtype",
    ),
    "indices_float": ("sparse_attention_lse", lambda: sparse_args(indices=f32(B, HKV, 5)), r"indices"),
    "indices_2d": (
        "sparse_attention_lse",
        lambda: sparse_args(indices=torch.zeros(B, 5, dtype=torch.long)),
        r"indices",
    ),
    "indices_heads": (
        "sparse_attention_lse",
        lambda: sparse_args(indices=torch.zeros(B, HKV + 1, 5, dtype=torch.long)),
        r"indices",
    ),
    "lengths_shape": (
        "sparse_attention_lse",
        lambda: sparse_args(lengths=torch.full((B,), 5)),
        r"lengths",
    ),
    "sparse_key_mask_shape": (
        "sparse_attention_lse",
        lambda: sparse_args(key_mask=torch.ones(B, T - 1, dtype=torch.bool)),
        r"key_mask",
    ),
    "sparse_key_mask_dtype": (
        "sparse_attention_lse",
        lambda: sparse_args(key_mask=torch.ones(B, T, dtype=torch.int32)),
        r"key_mask",
    ),
    "block_size_0": ("sparse_attention_lse", lambda: sparse_args(block_size=0), r"block_size"),
    # checked only by the compiled binding before checks were done once, here (tandem.kernels.ops)
    "block_size_float": (
        "sparse_attention_lse",
        lambda: sparse_args(block_size=2.5),
        r"block_size must be a positive int or None, got 2.5",
    ),
    "sparse_num_threads_0": (
        "sparse_attention_lse",
        lambda: sparse_args(num_threads=0),
        r"num_threads must be a positive int or None",
    ),
    "indices_on_another_device": (
        "sparse_attention_lse",
        lambda: sparse_args(indices=torch.zeros(B, HKV, 5, dtype=torch.long, device="meta")),
        r"indices is on meta but k_store is on cpu",
    ),
    "q_on_another_device": (
        "sparse_attention_lse",
        lambda: sparse_args(q=torch.zeros(B, HQ, 1, D, device="meta")),
        r"q is on meta but k_store is on cpu",
    ),
    "lengths_float": (
        "sparse_attention_lse",
        lambda: sparse_args(lengths=torch.full((B, HKV), 5.0)),
        r"lengths",
    ),
    "indices_out_of_range": (
        "sparse_attention_lse",
        lambda: sparse_args(indices=torch.full((B, HKV, 5), T)),
        r"indices",
    ),
    # block_scores
    "scores_q_3d": (
        "block_scores",
        lambda: score_args(q=f32(B, HQ, D)),
        r"\bq\b",
    ),
    "scores_head_dim": (
        "block_scores",
        lambda: score_args(q=f32(B, HQ, 1, D + 1)),
        r"\bq\b|key_min",
    ),
    "scores_heads_not_multiple": (
        "block_scores",
        lambda: score_args(q=f32(B, 3, 1, D)),
        r"\bq\b",
    ),
    "scores_q_int": (
        "block_scores",
        lambda: score_args(q=torch.ones(B, HQ, 1, D, dtype=torch.int64)),
        r"\bq\b",
    ),
    "key_max_shape": ("block_scores", lambda: score_args(key_max=f32(B, HKV, 6, D)), r"key_max"),
    "key_min_3d": (
        "block_scores",
        lambda: score_args(key_min=f32(B, 7, D), key_max=f32(B, 7, D)),
        r"key_min",
    ),
    "key_min_int8": (
        "block_scores",
        lambda: score_args(key_min=torch.ones(B, HKV, 7, D, dtype=torch.int8)),
        r"key_min\.dtype must be float32, float16 or bfloat16",
    ),
    "key_max_dtype": (
        "block_scores",
        lambda: score_args(key_max=f32(B, HKV, 7, D).half()),
        r"key_min and key_max must have the same dtype",
    ),
    "key_min_no_heads": (
        "block_scores",
        lambda: score_args(key_min=f32(B, 0, 7, D), key_max=f32(B, 0, 7, D)),
        r"q heads .* key_min heads \(0\)",
    ),
    "scores_num_threads": ("block_scores", lambda: score_args(num_threads=-1), r"num_threads"),
    "key_max_on_another_device": (
        "block_scores",
        lambda: score_args(key_max=torch.zeros(B, HKV, 7, D, device="meta")),
        r"key_max is on meta but key_min is on cpu",
    ),
    # score_topk
    "score_topk_k_negative": ("score_topk", lambda: score_args(k=-1), r"k must be an int >= 0, got -1"),
    "score_topk_factor_0": (
        "score_topk",
        lambda: score_args(k=2, factor=0),
        r"factor must be a positive int \(logical / physical block size\), got 0",
    ),
    "score_topk_q_int": (
        "score_topk",
        lambda: score_args(q=torch.ones(B, HQ, 1, D, dtype=torch.int64), k=2),
        r"\bq\.dtype",
    ),
    # topk_blocks
    "topk_k_negative": ("topk_blocks", lambda: dict(scores=f32(B, HKV, 7), k=-1), r"\bk\b"),
    "topk_k_float": ("topk_blocks", lambda: dict(scores=f32(B, HKV, 7), k=2.5), r"k must be an int >= 0"),
    "topk_num_threads": (
        "topk_blocks",
        lambda: dict(scores=f32(B, HKV, 7), k=2, num_threads=0),
        r"num_threads",
    ),
    "topk_scores_2d": (
        "topk_blocks",
        lambda: dict(scores=f32(B, 7), k=2),
        r"scores",
    ),
    "topk_scores_int": (
        "topk_blocks",
        lambda: dict(scores=torch.ones(B, HKV, 7, dtype=torch.int32), k=2),
        r"scores",
    ),
    # threshold_select
    "maw_2d": (
        "threshold_select",
        lambda: dict(maw=f32(B, T), threshold=0.5, num_kv_heads=1, num_rows=T),
        "maw",
    ),
    "maw_heads_not_multiple": (
        "threshold_select",
        lambda: dict(maw=f32(B, HQ, T), threshold=0.5, num_kv_heads=3, num_rows=T),
        r"maw|num_kv_heads",
    ),
    "num_kv_heads_0": (
        "threshold_select",
        lambda: dict(maw=f32(B, HQ, T), threshold=0.5, num_kv_heads=0, num_rows=T),
        r"num_kv_heads",
    ),
    "num_rows_too_large": (
        "threshold_select",
        lambda: dict(maw=f32(B, HQ, T), threshold=0.5, num_kv_heads=HKV, num_rows=T + 1),
        r"num_rows",
    ),
    "threshold_shape": (
        "threshold_select",
        lambda: dict(maw=f32(B, HQ, T), threshold=f32(B, HQ + 1), num_kv_heads=HKV, num_rows=T),
        r"threshold",
    ),
    "threshold_last_dim": (
        "threshold_select",
        lambda: dict(maw=f32(B, HQ, T), threshold=f32(B, HQ, 2), num_kv_heads=HKV, num_rows=T),
        r"threshold must be a number or a tensor of shape \[\], \[B, Hq\] or \[B, Hq, 1\]",
    ),
    "threshold_not_a_number": (
        "threshold_select",
        lambda: dict(maw=f32(B, HQ, T), threshold="0.5", num_kv_heads=HKV, num_rows=T),
        r"threshold must be a number",
    ),
    "threshold_on_another_device": (
        "threshold_select",
        lambda: dict(
            maw=f32(B, HQ, T), threshold=torch.zeros(B, HQ, device="meta"), num_kv_heads=HKV, num_rows=T
        ),
        r"threshold is on meta but maw is on cpu",
    ),
    "num_kv_heads_float": (
        "threshold_select",
        lambda: dict(maw=f32(B, HQ, T), threshold=0.5, num_kv_heads=2.0, num_rows=T),
        r"num_kv_heads must be a positive int",
    ),
    "num_rows_float": (
        "threshold_select",
        lambda: dict(maw=f32(B, HQ, T), threshold=0.5, num_kv_heads=HKV, num_rows=3.0),
        r"num_rows must be an int",
    ),
    "maw_int": (
        "threshold_select",
        lambda: dict(
            maw=torch.ones(B, HQ, T, dtype=torch.int32), threshold=0.5, num_kv_heads=HKV, num_rows=T
        ),
        r"maw",
    ),
}


def _path_params():
    params = []
    for name in PATH_CASES:
        for path in ("native", "reference"):
            params.append(pytest.param(name, path, id=f"{name}-{path}"))
    return params


@pytest.mark.parametrize(("case", "path"), _path_params(), indirect=["path"])
def test_dispatching_launcher_names_the_bad_argument(case, path):
    launcher, build, pattern = PATH_CASES[case]
    with pytest.raises(ValueError, match=pattern):
        getattr(ops, launcher)(**build())


@pytest.mark.parametrize("path", ["native", "reference"], indirect=True)
@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"ranked": torch.zeros(B, HKV + 1, 4, dtype=torch.long)}, "ranked must be"),
        ({"ranked": torch.zeros(B, HKV, 4, dtype=torch.int32)}, "ranked must be int64"),
        ({"skip": 3, "count": 2}, "skip / count"),
        ({"count": 5}, r"skip / count must satisfy 0 <= skip <= count <= 4"),
        ({"block_size": 0}, "block_size"),
        ({"v_store": f32(B, HKV, T + 1, D)}, "v_store"),
        # checked only by the compiled binding before checks were done once, here
        ({"key_mask": torch.ones(B, 31, dtype=torch.bool)}, r"key_mask must be \[B, cap\] = \[2, 32\]"),
        ({"key_mask": torch.ones(B, 32)}, "key_mask must be bool"),
        ({"skip": 1.0}, "skip / count must satisfy"),
        ({"block_size": 4.0}, "block_size must be a positive int"),
        ({"num_threads": 0}, "num_threads must be a positive int or None"),
        ({"ranked": torch.zeros(B, HKV, 4, dtype=torch.long, device="meta")}, "ranked is on meta"),
    ],
)
def test_ranked_block_attention_refuses(path, changes, match):
    args = dict(
        q=f32(B, HQ, 1, D), k_store=f32(B, HKV, 32, D), v_store=f32(B, HKV, 32, D),
        ranked=torch.tensor([0, 3, 9, 1]).repeat(B, HKV, 1), skip=1, count=3, scale=0.3, block_size=4,
    )  # fmt: skip
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        ops.ranked_block_attention(**args)


# ---- the prepared calls (compiled kernels only: None without them, after the same checks) ------------------


def prepared_args(of_ranks: bool, **changes):
    q = f32(B, HQ, D)
    args = dict(q=q, k_store=f32(B, HKV, 32, D), v_store=f32(B, HKV, 32, D), scale=0.3,
                out=torch.empty(B, HQ, D), lse=torch.empty(B, HQ))  # fmt: skip
    if of_ranks:
        args.update(ranked=torch.tensor([0, 3, 9, 1]).repeat(B, HKV, 1), block_size=4)
    else:
        args.update(indices=torch.arange(5).expand(B, HKV, 5).contiguous(), lengths=torch.full((B, HKV), 5))
    args.update(changes)
    return args


PREPARED_CASES = {
    "q_int": (dict(q=torch.ones(B, HQ, D, dtype=torch.int32)), r"\bq\.dtype"),
    "q_heads": (dict(q=f32(B, 3, D), out=torch.empty(B, 3, D), lse=torch.empty(B, 3)), r"q heads \(3\)"),
    "k_store_head_dim": (
        dict(k_store=f32(B, HKV, 32, D + 1), v_store=f32(B, HKV, 32, D + 1)),
        r"head_dim of q \(8\) and k_store \(9\) differ",
    ),
    "v_store_shape": (dict(v_store=f32(B, HKV, 31, D)), r"k_store and v_store must have the same shape"),
    "out_shape": (dict(out=torch.empty(B, HQ, D + 1)), r"out must be q's shape = \[2, 4, 8\]"),
    "out_dtype": (dict(out=torch.empty(B, HQ, D, dtype=torch.float16)), r"out must be float32"),
    "lse_shape": (dict(lse=torch.empty(B, HQ, 1)), r"lse must be q's shape without head_dim = \[2, 4\]"),
    "key_mask_shape": (dict(key_mask=torch.ones(B, 31, dtype=torch.bool)), r"key_mask must be \[B, cap\]"),
    "scale": (dict(scale=float("nan")), r"scale must be a finite number"),
    "num_threads": (dict(num_threads=0), r"num_threads must be a positive int or None"),
    "out_on_another_device": (
        dict(out=torch.empty(B, HQ, D, device="meta")),
        r"out is on meta but q is on cpu",
    ),
}
RANKED_ONLY = {
    "ranked_shape": (
        dict(ranked=torch.zeros(B, HKV + 1, 4, dtype=torch.long)),
        r"ranked must be \[B, Hkv, W\]",
    ),
    "ranked_dtype": (dict(ranked=torch.zeros(B, HKV, 4, dtype=torch.int32)), r"ranked must be int64"),
    "block_size_none": (dict(block_size=None), r"block_size must be a positive int, got None"),
}
SPARSE_ONLY = {
    "q_4d": (dict(q=f32(B, HQ, 1, D)), r"q must be \[B, Hq, D\]"),
    "indices_dtype": (dict(indices=torch.zeros(B, HKV, 5, dtype=torch.int32)), r"indices must be int64"),
    "lengths_shape": (dict(lengths=torch.full((B,), 5)), r"lengths must be \[B, Hkv\] = \[2, 2\]"),
    "block_size_0": (dict(block_size=0), r"block_size must be a positive int or None"),
}


def _prepared_params():
    cases = [("ranked_attention_call", name) for name in (*PREPARED_CASES, *RANKED_ONLY)]
    cases += [("prepared_attention_call", name) for name in (*PREPARED_CASES, *SPARSE_ONLY)]
    return [pytest.param(launcher, name, path, id=f"{launcher}-{name}-{path}")
            for launcher, name in cases for path in ("native", "reference")]  # fmt: skip


@pytest.mark.parametrize(("launcher", "case", "path"), _prepared_params(), indirect=["path"])
def test_prepared_calls_name_the_bad_argument(launcher, case, path):
    """Checked here, once: `cpu.RankedAttention` / `cpu.PreparedAttention` check only the layout they read in
    place (the tests of tests/kernels/test_cpu_kernels.py)."""
    changes, pattern = {**PREPARED_CASES, **RANKED_ONLY, **SPARSE_ONLY}[case]
    with pytest.raises(ValueError, match=pattern):
        getattr(ops, launcher)(**prepared_args(launcher == "ranked_attention_call", **changes))


@pytest.mark.parametrize("path", ["native", "reference"], indirect=True)
def test_prepared_calls_accept_valid_input(path):
    for launcher in ("ranked_attention_call", "prepared_attention_call"):
        call = getattr(ops, launcher)(**prepared_args(launcher == "ranked_attention_call"))
        assert (call is None) == (path == "reference")
