"""`tandem.kernels.ops` launchers refuse bad input with a ValueError that names the bad argument.

Launchers that can dispatch to the compiled CPU kernels are checked on both paths: "native" (the compiled
kernels, when they build here) and "reference" (the plain-torch fallback taken without a compiler or on
CUDA), since the launcher must refuse bad input whichever implementation runs (STYLE.md, 'kernels apart
from launchers').
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
    ops.threshold_select(torch.rand(B, HQ, T), 0.5, HKV, T)


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
    # topk_blocks
    "topk_k_negative": ("topk_blocks", lambda: dict(scores=f32(B, HKV, 7), k=-1), r"\bk\b"),
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
