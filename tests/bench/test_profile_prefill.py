"""The prefill profile's bookkeeping (`benchmarks/profile_prefill.py`): device activities sorted into kinds by
name, and the device's busy time as the union of overlapping activities."""

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_prefill.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("benchmark_profile_prefill", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize(
    "name, kind",
    [
        ("prefill_attention_kernel", "attention kernel"),
        ("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN", "matmuls"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmuls"),
        ("Memcpy DtoH (Device -> Pinned)", "copies device->host"),
        ("Memcpy HtoD (Pinned -> Device)", "copies host->device"),
        ("rms_norm_kernel", "other Triton"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::silu_kernel>", "other torch"),
    ],
)
def test_device_activities_are_sorted_by_kind(script, name, kind):
    assert script.kind(name) == kind


def test_busy_time_counts_overlaps_once(script):
    assert script.busy_seconds([(0, 10), (5, 20), (30, 40), (32, 35)]) == pytest.approx(30e-6)
    assert script.busy_seconds([]) == 0.0
