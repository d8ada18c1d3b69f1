"""The compiled certified row selection (`tandem.kernels.cpu.certified_rows`) against `certified_rows_reference`, on
every SIMD path this CPU supports.

The kernel's fp32 dot products sum in another order than torch's matmul, so a row whose bound sits within rounding
of a bucket edge may land in the neighbouring bucket and move a head's cut. So the cases check, each:
- soundness: with float64 logits from the real keys, the mass of the rows the kernel's union skips never exceeds
  exp(tail_lse), so the skipped probability never exceeds what tail_lse certifies;
- tail_lse and skipped_norm equal the reference's `skipped_rows` for the kernel's own union;
- needed and kept equal the reference's wherever the unions are equal;
and over all cases, the union equals the reference's in the overwhelming majority, and differs in a few rows at most.
Inputs are slices of capacity-wide buffers, as the policy passes them (`certified._select_rows`).
"""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from tandem.kernels import cpu
from tandem.policies import certify

BLOCK = 16
needs_native = pytest.mark.skipif(
    not cpu.has_certified_rows(), reason="CPU kernels unavailable (no compiler?)"
)


@functools.cache
def make_case(seed: int) -> dict:
    """Random inputs of `certified_rows` as the policy builds them: the key sketch of random keys, every row-indexed
    tensor the first n rows of a wider buffer (capacity), ragged validity with whole invalid blocks, GQA groups 1-8,
    forced rows or None, max_units an int or a [B, 1] tensor, binding or not. Also returns the float64 logits of
    the real keys, the reference's output and its upper bounds (cached: every SIMD path checks the same cases)."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch, num_kv_heads, group = rnd.randint(1, 3), rnd.choice([1, 2, 3]), rnd.choice([1, 2, 3, 4, 8])
    dim = rnd.choice([16, 40, 64, 128])  # 40: a tail past the vector width
    n = BLOCK * rnd.choice([1, 2, 5, 16, 64, 256])  # 16 .. 4096 rows
    cap = n + BLOCK * rnd.randint(1, 4)
    keys = torch.randn(batch, num_kv_heads, cap, dim, generator=gen) * rnd.choice([0.5, 1.0, 3.0])
    valid = torch.rand(batch, cap, generator=gen) > rnd.choice([0.0, 0.1, 0.5])
    for b in range(batch):
        valid[b, rnd.randint(1, n) :] = False  # ragged fill; with the holes a request may keep no row
        for block in rnd.sample(range(n // BLOCK), k=rnd.randint(0, n // BLOCK // 4)):
            valid[b, block * BLOCK : (block + 1) * BLOCK] = False  # whole invalid blocks
    codes, row_scale, error = certify.key_sketch(keys, valid)
    q = torch.randn(batch, num_kv_heads * group, dim, generator=gen) * rnd.choice([0.5, 1.0, 2.0, 4.0])
    if rnd.random() < 0.25:
        q = q.to(torch.bfloat16)
    scale = dim**-0.5
    # the hot tier's mass: around the host rows' own, from far below to far above
    logits = exact_logits(q, keys[:, :, :n], scale)
    spread = torch.randn(batch, num_kv_heads * group, generator=gen, dtype=torch.float64) * 3
    known = (logits.masked_fill(~valid[:, None, :n], -math.inf).logsumexp(-1) + spread).float()
    live = int(valid[:, :n].sum(-1).min())
    max_units = rnd.choice([n, n, max(1, live // 50), max(1, live // 10), live // 3 + 1])
    if rnd.random() < 0.5:
        max_units = torch.full((batch, 1), max_units, dtype=torch.long)
    forced = None
    if rnd.random() < 0.4:
        wide = torch.rand(batch, num_kv_heads, cap, generator=gen) < rnd.choice([0.01, 0.05, 0.3])
        forced = (wide & valid[:, None, :])[:, :, :n]
    value_norm = torch.rand(batch, num_kv_heads, cap // BLOCK, generator=gen) * 4
    args = dict(
        q=q, codes=codes[:, :, :n], row_scale=row_scale[:, :, :n], error=error[:, :, :n], row_valid=valid[:, :n],
        scale=scale, known_lse=known, epsilon=rnd.choice([0.001, 0.01, 0.05, 0.1, 0.3]), max_units=max_units,
        num_kv_heads=num_kv_heads, value_norm=value_norm[:, :, : n // BLOCK], block_size=BLOCK, forced=forced,
    )  # fmt: skip
    return complete(args, logits, threads=rnd.choice([1, 2, 3]))


def complete(args: dict, logits: torch.Tensor, threads: int) -> dict:
    """A case: the arguments, the float64 logits of the real keys, the reference's output and upper bounds."""
    names = ("q", "codes", "row_scale", "error", "row_valid", "scale")
    upper, _ = certify.sketch_logit_bounds(*(args[name] for name in names))
    reference = certify.certified_rows_reference(**args)
    return dict(args=args, logits=logits, upper=upper, reference=reference, threads=threads)


def exact_logits(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * q.k in float64 for every row and query head: [B, Hq, n]. keys: [B, Hkv, n, D]."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads = keys.shape[1]
    qg = q.double().view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim)
    return (qg @ keys.double().transpose(-1, -2)).reshape(batch, num_q_heads, -1) * scale


def per_query_head(mask: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, Hkv, n] -> [B, Hq, n], each KV head's row repeated for its group."""
    return mask.repeat_interleave(num_q_heads // mask.shape[1], dim=1)


def check_sound(case: dict, union: torch.Tensor, tail_lse: torch.Tensor) -> None:
    """The true mass of the skipped rows is at most exp(tail_lse), hence the skipped probability against the
    attended mass (the hot tier's and the union's) at most sigmoid(tail_lse - log attended)."""
    a = case["args"]
    num_q_heads = a["q"].shape[1]
    logits = case["logits"]
    valid = a["row_valid"][:, None, :]
    skipped = per_query_head(~union & valid, num_q_heads)
    attended = per_query_head(union & valid, num_q_heads)
    skipped_lse = logits.masked_fill(~skipped, -math.inf).logsumexp(-1)
    attended_lse = torch.logaddexp(
        logits.masked_fill(~attended, -math.inf).logsumexp(-1), a["known_lse"].double()
    )
    bound = tail_lse.double()
    assert bool((skipped_lse <= bound + 1e-6).all()), f"skipped mass {skipped_lse} over its bound {bound}"
    nothing = torch.zeros_like(bound)  # nothing skipped: p = 0, also where nothing is attended either
    p_true = torch.where(skipped_lse > -math.inf, torch.sigmoid(skipped_lse - attended_lse), nothing)
    p_certified = torch.where(bound > -math.inf, torch.sigmoid(bound - attended_lse), nothing)
    assert bool((p_true <= p_certified * (1 + 1e-6) + 1e-12).all())


def check_against_reference(case: dict, out: tuple) -> bool:
    """tail_lse and skipped_norm against the reference's for the kernel's union; needed and kept against the
    reference's where the unions are equal. Returns whether they are."""
    a, ref = case["args"], case["reference"]
    union, needed, kept, tail_lse, skipped_norm = out
    assert union.dtype == torch.bool and union.shape == ref[0].shape
    assert needed.dtype == kept.dtype == torch.int64 and tail_lse.dtype == skipped_norm.dtype == torch.float32
    tail_ref, norm_ref = certify.skipped_rows(case["upper"], union, a["row_valid"], a["value_norm"], BLOCK)
    torch.testing.assert_close(tail_lse, tail_ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(skipped_norm, norm_ref)
    same = torch.equal(union, ref[0])
    if same:
        assert torch.equal(needed, ref[1]) and torch.equal(kept, ref[2])
    return same


@needs_native
def test_certified_rows_matches_reference(isa):
    cases, same, most_different = 60, 0, 0
    for seed in range(cases):
        case = make_case(seed)
        out = cpu.certified_rows(**case["args"], num_threads=case["threads"])
        check_sound(case, out[0], out[3])
        same += check_against_reference(case, out)
        most_different = max(most_different, int((out[0] ^ case["reference"][0]).sum()))
    assert same >= 0.95 * cases, f"unions equal in {same} of {cases} cases"
    assert most_different <= 4, f"{most_different} rows differ in a case"


def extreme(case: dict, change: str) -> dict:
    """The case with its hot tier 900 nats above or below the host rows (every row's mass underflows against the
    best, or the hot tier weighs nothing), a tiny epsilon under a cap of 3 rows, or queries 30x sharper."""
    a, logits = dict(case["args"]), case["logits"]
    if change == "hot tier far above":
        a["known_lse"] = a["known_lse"] + 900
    elif change == "hot tier far below":
        a["known_lse"] = a["known_lse"] - 900
    elif change == "tiny epsilon, cap 3":
        a.update(epsilon=1e-9, max_units=3)
    else:
        a["q"], logits = a["q"].float() * 30, logits * 30
    return complete(a, logits, threads=2)


@needs_native
@pytest.mark.parametrize(
    "change", ["hot tier far above", "hot tier far below", "tiny epsilon, cap 3", "sharp q"]
)
def test_extreme_masses_match_the_reference(change):
    """Tails far below the head's best (summed again from their own maximum), a group whose heads pick each
    other's tails, a cap of 3: still sound and equal to the reference."""
    for seed in (1, 2, 4, 9, 12):
        case = extreme(make_case(seed), change)
        out = cpu.certified_rows(**case["args"], num_threads=case["threads"])
        check_sound(case, out[0], out[3])
        assert check_against_reference(case, out)


@needs_native
def test_every_thread_count_gives_the_same_selection():
    """The work split (chunks, heads) never changes a result: the sums run in a fixed order per head."""
    case = make_case(7)
    results = [cpu.certified_rows(**case["args"], num_threads=t) for t in (1, 2, 5)]
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other))


@needs_native
def test_the_dispatcher_runs_the_kernel_and_falls_back_without_it(monkeypatch):
    case = make_case(3)
    assert cpu.has_certified_rows()
    args = tuple(case["args"].values())
    kernel = cpu.certified_rows(*args)
    assert all(torch.equal(x, y) for x, y in zip(certify.certified_rows(*args), kernel))
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "off")
    assert not cpu.has_certified_rows()
    ref = certify.certified_rows_reference(*args)
    assert all(torch.equal(x, y) for x, y in zip(certify.certified_rows(*args), ref))


@needs_native
def test_nothing_skipped_and_nothing_live():
    """Every row kept (tail -inf, no skipped block: norm 0); no live row at all (nothing kept, nothing skipped)."""
    case = make_case(11)
    a = dict(case["args"], epsilon=1e-12, max_units=10**9)
    union, needed, kept, tail_lse, skipped_norm = cpu.certified_rows(**a)
    assert bool(union[a["row_valid"][:, None, :].expand_as(union)].all())
    assert bool(torch.isinf(tail_lse).all()) and bool((skipped_norm == 0).all())
    a["row_valid"] = torch.zeros_like(a["row_valid"])
    union, needed, kept, tail_lse, skipped_norm = cpu.certified_rows(**dict(a, forced=None))
    assert not bool(union.any()) and bool((needed == 0).all()) and bool((kept == 0).all())
    assert bool(torch.isinf(tail_lse).all()) and bool((skipped_norm == 0).all())


def strided_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes' values with a last dim that is not contiguous (every other byte of a wider buffer)."""
    wide = torch.zeros(*codes.shape[:3], 2 * codes.shape[3], dtype=torch.int8)
    wide[..., ::2] = codes
    return wide[..., ::2]


@needs_native
@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("q", lambda a: a["q"].long()),
        ("q", lambda a: a["q"][0]),
        ("codes", lambda a: a["codes"].float()),
        ("codes", lambda a: strided_codes(a["codes"])),
        ("row_scale", lambda a: a["row_scale"][:, :, :-1]),
        ("error", lambda a: a["error"].double()),
        ("row_valid", lambda a: a["row_valid"].float()),
        ("known_lse", lambda a: a["known_lse"][:, :1]),
        ("max_units", lambda a: 2.5),
        ("max_units", lambda a: torch.ones(7, 7, dtype=torch.long)),
        ("value_norm", lambda a: a["value_norm"][:, :, 1:]),
        ("forced", lambda a: torch.ones_like(a["row_scale"])),
        ("num_kv_heads", lambda a: 0),
        ("block_size", lambda a: 7),
    ],
)
def test_bad_arguments_are_refused_by_name(name, change):
    a = make_case(5)["args"]
    with pytest.raises(ValueError, match=name):
        cpu.certified_rows(**dict(a, **{name: change(a)}))
