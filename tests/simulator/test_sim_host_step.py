"""The host-step model's terms, each against its arithmetic, and the CPU rates read from a benchmark file."""

import json

import pytest

from tandem.tools.simulator.calibrate import HostMeasurements
from tandem.tools.simulator.hardware import MODELS
from tandem.tools.simulator.host_step import CpuRates, StepSetup, host_step, selected_tokens

MODEL = MODELS["llama-3.1-8b"]
HOST = HostMeasurements(host_read_gbs=100, pcie_gbs=50, hbm_gbs=3000)


def _rates(fixed_s=20e-6, gbps=50.0):
    """Rates whose fit is exact: three calls on one line, bf16 and int8 rows, 15 threads, blocks of 16."""
    rows = []
    for fmt in ("bfloat16", "int8"):
        for mb in (5, 10, 40):
            seconds = fixed_s + mb * 1e6 / (gbps * 1e9)
            rows.append({"row_format": fmt, "threads": 15, "selection": "block16", "prepared_ms": seconds * 1e3,
                         "kv_gbps": mb * 1e6 / seconds / 1e9, "ms": seconds * 1e3, "mbytes": mb})  # fmt: skip
    return CpuRates(rows)


def test_the_rate_fit_recovers_fixed_cost_and_bandwidth():
    call = _rates().rate("bfloat16", 15, "block16")
    assert call.fixed_s == pytest.approx(20e-6) and call.bytes_per_s == pytest.approx(50e9)
    assert call.seconds(0) == 0


def test_the_nearest_thread_count_and_a_missing_format_is_named():
    rates = _rates()
    assert rates.rate("int8", 7, "block64") == rates.fits[("int8", 15, "block16")]
    with pytest.raises(ValueError, match="no fp8 rows"):
        rates.rate("fp8", 15, "block16")


def test_streaming_is_the_floor_weights_plus_per_layer_cost():
    step = host_step(HOST, _rates(), MODEL, 65536, 1, StepSetup(policy="streaming", hot_tokens=320))
    floor = MODEL.streamed_weight_bytes / 3000e9 + 32 * 75e-6 + 320 * MODEL.kv_bytes_per_token / 3000e9
    assert step.step_s == pytest.approx(floor) and step.sync_s == 0 and step.selection_s == 0


def test_quest_terms_follow_the_layout():
    setup = StepSetup(hot_tokens=320, device_share=0.4, recall_hit=0.25)
    step = host_step(HOST, _rates(), MODEL, 65536, 2, setup)
    selected = selected_tokens(65536, setup)
    assert selected == -(-int(0.05 * (65536 - 320)) // 16) * 16
    kv = MODEL.kv_bytes_per_token
    cache, shared = 0.25 * selected, 0.4 * 0.75 * selected
    assert step.cache_bytes == pytest.approx(2 * cache * kv)
    assert step.pcie_bytes == pytest.approx(2 * shared * kv)
    assert step.cpu_bytes == pytest.approx(2 * (selected - cache - shared) * kv)
    assert step.cpu_s == pytest.approx(32 * (20e-6 + step.cpu_bytes / 32 / 50e9))
    assert step.pcie_s == pytest.approx(step.pcie_bytes / 50e9)
    assert step.shared_read_s == pytest.approx((step.cpu_bytes + step.pcie_bytes) / 100e9)
    assert step.sync_s == pytest.approx(32 * 50e-6)
    digests = 2 * 65536 * MODEL.digest_bytes_per_token(16)
    assert step.selection_s == pytest.approx(digests / 3000e9 + 32 * 49e-6)
    assert step.step_s == pytest.approx(
        step.floor_s + step.selection_s + step.sync_s + max(step.cpu_s, step.pcie_s, step.shared_read_s)
        + step.cache_s
    )  # fmt: skip


def test_eight_bit_rows_halve_host_bytes_but_not_the_recall_cache():
    bf16 = host_step(HOST, _rates(), MODEL, 131072, 1, StepSetup(recall_hit=0.3))
    int8 = host_step(HOST, _rates(), MODEL, 131072, 1, StepSetup(recall_hit=0.3, row_format="int8"))
    assert int8.cpu_bytes == pytest.approx(bf16.cpu_bytes / 2) and int8.pcie_bytes == pytest.approx(
        bf16.pcie_bytes / 2
    )
    assert int8.cache_bytes == bf16.cache_bytes
    assert int8.max_batch == 2 * bf16.max_batch or int8.max_batch == 2 * bf16.max_batch + 1


def test_tensor_parallel_ranks_split_heads_or_requests():
    model = MODELS["llama-3.1-70b"]
    heads = host_step(HOST, _rates(), model, 32768, 4, StepSetup(gpus=2))
    one = host_step(HOST, _rates(), model, 32768, 4, StepSetup(gpus=1))
    assert heads.cpu_bytes == pytest.approx(one.cpu_bytes / 2)
    assert heads.floor_s < one.floor_s  # half the weights a rank
    requests = host_step(HOST, _rates(), model, 32768, 3, StepSetup(gpus=2, host_split="requests"))
    assert requests.pcie_bytes == 0  # no device share
    alone = host_step(HOST, _rates(), model, 32768, 2, StepSetup(gpus=1, device_share=0.0))
    assert requests.cpu_bytes == pytest.approx(
        alone.cpu_bytes
    )  # the busiest rank: ceil(3 / 2) whole requests


def test_a_benchmark_file_from_before_per_format_rows_reads_as_its_dtype(tmp_path):
    rows = [{"kernel": "attention", "selection": "block16", "ms": 0.2, "prepared_ms": 0.1, "mbytes": 5.0},
            {"kernel": "score+top5%", "selection": "block16", "ms": 0.2, "mbytes": 5.0}]  # fmt: skip
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"machine": {"threads": 15}, "dtype": "bfloat16", "rows": rows}))
    assert CpuRates.load(path).rate("bfloat16", 15, "block16").bytes_per_s == pytest.approx(50e9)


def test_the_committed_rates_cover_every_row_format_at_15_and_7_threads():
    rates = CpuRates.load()
    for fmt in ("bfloat16", "int8", "fp8"):
        for threads in (15, 7):
            for selection in ("token", "block16"):
                assert (fmt, threads, selection) in rates.fits
    # fewer threads attend slower
    assert rates.rate("bfloat16", 7, "block16").seconds(10e6) > rates.rate("bfloat16", 15, "block16").seconds(
        10e6
    )
