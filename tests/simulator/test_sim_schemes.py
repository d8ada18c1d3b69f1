"""Step-time arithmetic of the three schemes on hand-computable cases, and monotonic trends."""

import math
from dataclasses import replace

import pytest

from tandem.tools.simulator.config import SystemConfig
from tandem.tools.simulator.hardware import GIB, PLATFORM, PNM
from tandem.tools.simulator.model import simulate
from tandem.tools.simulator.schemes import fc_time, gpu_free_bytes, roofline

PNM_BW = PNM.bandwidth_gbs * 1e9 * PLATFORM.pnm_bw_eff
PNM_FLOPS = PNM.tflops * 1e12 * PLATFORM.pnm_flops_eff


def cfg(model="llama-3.1-8b", context="128k", gpus=1, pnm=8, scheme="pnm", **kw):
    return SystemConfig.build(model, context, gpus, pnm, scheme, **kw)


def test_roofline_picks_slower_side():
    assert roofline(1e9, 1e9, 1e9, 1e12) == pytest.approx(1.0)
    assert roofline(1e6, 1e12, 1e9, 1e12) == pytest.approx(1.0)
    assert roofline(0, 0, 1e9, 1e12) == 0.0


def test_pnm_batch_is_capacity_over_request_bytes():
    for pnm in (1, 3, 8):
        c = cfg(pnm=pnm)
        request = 131072 * (131072 + 8192)  # tokens * (KV + digest bytes per token)
        assert simulate(c).step.batch == pnm * math.floor(512 * GIB / request)


def test_paper_batch_of_96_for_70b():
    # Section 4.2: 70B at 128K, 2 GPUs: batch 1 on the baseline, 96 with 8 PNMs.
    assert simulate(cfg("llama-3.1-70b", gpus=2, pnm=0, scheme="baseline")).step.batch == 1
    assert simulate(cfg("llama-3.1-70b", gpus=2, pnm=8, scheme="pnkv")).step.batch == 96


def test_baseline_batch_is_free_hbm_over_gpu_bytes():
    c = cfg(pnm=0, scheme="baseline", budget_fraction=0.25)
    free = 80 * GIB * PLATFORM.hbm_usable - 8_030_261_248 * 2
    per_request = 32768 * 131072 + 131072 * 8192  # T_Budget KV + digests of the whole context
    assert gpu_free_bytes(c) == pytest.approx(free)
    assert simulate(c).step.batch == math.floor(free / per_request)


def test_bandwidth_bound_pnm_attention_is_bytes_over_bandwidth():
    # 8B has GQA group 4 < 8 TFLOPS / 1.1 TB/s, so PNM attention is bandwidth-bound.
    c = cfg(pnm=2, budget_fraction=0.25)
    step = simulate(c).step
    per_device = step.batch // 2
    num_bytes = per_device * (131072 * 8192 + 32768 * 131072)
    assert step.phases["attention"] == pytest.approx(num_bytes / PNM_BW)
    assert step.traffic["pnm"] == pytest.approx(num_bytes)


def test_compute_bound_pnm_attention_for_405b():
    # 405B has GQA group 16: 16 FLOP per KV byte exceed the PNM's 8e12/1.1e12 ratio.
    c = cfg("llama-3.1-405b", "128k", gpus=16, pnm=4, budget_fraction=0.25)
    step = simulate(c).step
    m = c.model
    per_device = step.batch / 4
    attend_flops = per_device * 32768 * m.attention_flops_per_token
    select_bytes = per_device * 131072 * m.digest_bytes_per_token(16)
    select = max(select_bytes / PNM_BW, per_device * 131072 * m.score_flops_per_token(16) / PNM_FLOPS)
    assert step.phases["attention"] == pytest.approx(select + attend_flops / PNM_FLOPS)


def test_fc_is_weight_streaming_at_small_batch():
    c = cfg(pnm=0, scheme="baseline")
    bw = c.gpu.hbm_gbs * 1e9 * PLATFORM.gpu_bw_eff
    assert fc_time(c, 1) == pytest.approx(c.model.streamed_weight_bytes / bw)
    assert fc_time(replace(c, num_gpus=2), 1) == pytest.approx(fc_time(c, 1) / 2)


def test_baseline_recall_traffic_and_time():
    c = cfg(pnm=0, scheme="baseline", recall_rate=0.01, budget_fraction=0.25)
    step = simulate(c).step
    assert step.traffic["recall"] == pytest.approx(step.batch * 0.01 * 131072 * 131072)
    link = min(c.gpu.pcie_gbs, PLATFORM.host_link_gbs) * 1e9 * PLATFORM.link_eff
    overhead = 32 * PLATFORM.layer_overhead_us * 1e-6
    assert step.phases["recall"] == pytest.approx(step.traffic["recall"] / link + overhead)


def test_phases_sum_to_step_and_throughput_is_batch_over_step():
    for scheme in ("baseline", "pnm", "pnkv"):
        r = simulate(cfg(scheme=scheme))
        assert set(r.step.phases) == {"fc", "attention", "recall", "communication"}
        assert r.tpot_s == pytest.approx(sum(r.step.phases.values()))
        assert r.tokens_per_s == pytest.approx(r.step.batch / r.tpot_s)


def test_more_pnm_more_throughput_until_fc_bound():
    results = [simulate(cfg(pnm=n)) for n in (1, 2, 4, 8, 16, 32, 64, 128)]
    tputs = [r.tokens_per_s for r in results]
    assert all(b >= a for a, b in zip(tputs, tputs[1:], strict=False))
    assert tputs[1] / tputs[0] > 1.9  # attention-bound: near-linear
    assert tputs[-1] / tputs[-2] < 1.6  # FC (compute) and exchange catch up: sublinear
    fc_share = [r.step.phases["fc"] / r.tpot_s for r in results]
    assert fc_share[-1] > 3 * fc_share[0]


def test_pnkv_not_slower_than_pnm_and_steady_caps():
    for model, ctx, gpus in (
        ("llama-3.1-8b", "128k", 1),
        ("llama-3.1-8b", "1m", 8),
        ("llama-3.1-70b", "128k", 2),
    ):
        for pnm in (1, 8) if gpus == 1 else (gpus, 8):
            png = simulate(cfg(model, ctx, gpus, pnm, "pnkv"))
            only = simulate(cfg(model, ctx, gpus, pnm, "pnm"))
            assert png.tokens_per_s >= only.tokens_per_s * 0.99
            info = png.step.info
            assert info["steady_tokens"] <= info["steady_ratio"] * info["budget_tokens"] + 16
            kv = png.config.model.kv_bytes_per_token
            assert info["steady_tokens"] * png.step.batch * kv <= gpu_free_bytes(png.config)


def test_pnkv_without_steady_tokens_equals_pnm():
    a = simulate(cfg(scheme="pnkv", steady_ratio=0.0))
    b = simulate(cfg(scheme="pnm"))
    assert a.step.info["steady_tokens"] == 0
    assert a.tpot_s == pytest.approx(b.tpot_s)


def test_dp_exchange_is_context_independent_tp_is_not():
    def step(ctx, mapping):
        return simulate(cfg(context=ctx, pnm=8, mapping=mapping, max_batch=8)).step

    assert step("128k", "dp").phases["communication"] == pytest.approx(
        step("1m", "dp").phases["communication"]
    )
    # Figure 7(a): TP adds (N-1) reductions of fp32 page scores per layer, growing with the context.
    for ctx, pages in (("128k", 8192), ("1m", 65536)):
        extra = step(ctx, "tp").traffic["exchange"] - step(ctx, "dp").traffic["exchange"]
        assert extra == pytest.approx(7 * 8 * 32 * pages * 4)
    assert step("1m", "tp").phases["communication"] > 3 * step("1m", "dp").phases["communication"]


def test_infeasible_configurations_report_reason():
    r = simulate(cfg("llama-3.1-70b", gpus=1, pnm=8, scheme="pnm"))
    assert not r.feasible and "weights" in r.step.reason and r.tokens_per_s == 0
    r = simulate(cfg("llama-3.1-405b", "1m", gpus=16, pnm=1, scheme="pnm"))
    assert not r.feasible and "PNM devices" in r.step.reason
    r = simulate(cfg("llama-3.1-8b", "1m", gpus=1, pnm=0, scheme="baseline", budget_fraction=1.0))
    assert not r.feasible and r.energy_per_token_j == float("inf")


def test_405b_at_1m_splits_requests_over_two_devices():
    r = simulate(cfg("llama-3.1-405b", "1m", gpus=16, pnm=16, scheme="pnm"))
    assert r.step.info["shards"] == 2
    assert r.step.batch == 8  # 8 pairs of 512 GiB devices, one ~560 GB request each


def test_max_batch_caps():
    r = simulate(cfg(pnm=8, max_batch=5))
    assert r.step.batch == 5 and r.step.batch_limit == "--batch"
