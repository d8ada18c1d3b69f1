"""Energy and cost accounting."""

import pytest

from tandem.tools.simulator.config import SystemConfig
from tandem.tools.simulator.hardware import CXL_MEM, GPUS, PNM
from tandem.tools.simulator.model import format_result, simulate


def test_energy_is_idle_plus_active_power_times_busy_time():
    r = simulate(SystemConfig.build("llama-3.1-8b", "128k", 2, 4, "pnm"))
    s, g = r.step, GPUS["a100"]
    gpus = 2 * (g.idle_w * s.step_s + (g.tdp_w - g.idle_w) * s.gpu_busy_s)
    pnms = 4 * (PNM.idle_w * s.step_s + (PNM.active_w - PNM.idle_w) * s.mem_busy_s)
    assert r.energy_per_step_j == pytest.approx(gpus + pnms)
    assert r.energy_per_token_j == pytest.approx((gpus + pnms) / s.batch)


def test_pnm_kv_gpus_idle_during_attention_pnkv_gpus_active():
    pnm = simulate(SystemConfig.build("llama-3.1-8b", "128k", 1, 1, "pnm")).step
    png = simulate(SystemConfig.build("llama-3.1-8b", "128k", 1, 1, "pnkv")).step
    assert pnm.gpu_busy_s == pytest.approx(pnm.phases["fc"] + 0.0)
    assert png.gpu_busy_s > png.phases["fc"] + 0.9 * png.phases["attention"]


def test_cost_uses_table3_rates():
    r = simulate(SystemConfig.build("llama-3.1-8b", "128k", 1, 8, "pnkv"))
    assert r.cost_per_h == pytest.approx(0.761 + 0.072 + 8 * (0.266 + 0.027))
    assert r.tokens_per_dollar == pytest.approx(r.tokens_per_s * 3600 / r.cost_per_h)
    base = simulate(SystemConfig.build("llama-3.1-8b", "128k", 1, 0, "baseline"))
    mems = base.step.num_mem_devices
    assert mems >= 1
    assert base.cost_per_h == pytest.approx(0.833 + mems * (CXL_MEM.hw_cost_per_h + CXL_MEM.op_cost_per_h))


def test_format_and_dict():
    r = simulate(SystemConfig.build("llama-3.1-70b", "512k", 2, 8, "pnkv"))
    text = format_result(r)
    for word in ("tokens/s", "J/token", "tokens/$", "fc", "attention", "recall", "communication"):
        assert word in text
    d = r.to_dict()
    assert d["batch"] == 24 and d["scheme"] == "pnkv" and d["feasible"]
    bad = simulate(SystemConfig.build("llama-3.1-405b", "1m", 2, 8, "pnm"))
    assert "does not fit" in format_result(bad)
