"""Host-tier calibration: bench file, validation, Tandem TPOT predictions on the lent H100 host."""

import json
from pathlib import Path

import pytest

from tandem.tools.simulator.calibrate import (
    LENT_H100_HOST,
    HostMeasurements,
    bench_comparison,
    comparison_table,
    engine_setup,
    grid_setups,
    load_bench,
    predict_host,
    prediction_rows,
    read_bench,
)
from tandem.tools.simulator.cli import main as run_cli
from tandem.tools.simulator.host_step import StepSetup


@pytest.fixture
def bench_file(tmp_path):
    path = tmp_path / "bench.json"
    data = {
        "device": "test host",
        "host_read_gbs": 50.0,
        "hbm_gbs": 3000.0,
        "pcie_gbs": 50.0,
        "host_cores": 8,
    }
    path.write_text(json.dumps({**data, "unrelated_key": 1}))
    return path


def test_load_bench(bench_file):
    host = load_bench(bench_file)
    assert host == HostMeasurements(
        host_read_gbs=50, pcie_gbs=50, hbm_gbs=3000, device="test host", host_cores=8
    )


def test_load_bench_errors(tmp_path):
    with pytest.raises(ValueError, match="--from-bench: file not found"):
        load_bench(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_bench(bad)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"host_read_gbs": 10}))
    with pytest.raises(ValueError, match="lacks pcie_gbs, hbm_gbs"):
        load_bench(partial)


def test_host_measurements_validate():
    with pytest.raises(ValueError, match="--host-bandwidth-gbs: must be positive"):
        HostMeasurements(host_read_gbs=0, pcie_gbs=1, hbm_gbs=1)
    with pytest.raises(ValueError, match="--host-cores"):
        HostMeasurements(host_read_gbs=1, pcie_gbs=1, hbm_gbs=1, host_cores=0)


def _tandem_bench(tmp_path, bandwidth, rows):
    """A bench.json as `tandem bench` writes it (the keys the simulator reads)."""
    path = tmp_path / "run" / "bench.json"
    path.parent.mkdir()
    machine = {"gpu": "NVIDIA H100 80GB HBM3", "cores": 16, "memory_gb": 135.1, "gpu_memory_gb": 85.0}
    data = {"machine": machine, "bandwidth": bandwidth, "model": {"name": "llama-3.1-8b"}, "rows": rows}
    path.write_text(json.dumps(data))
    return path


def _row(system, context, ms, status="ok"):
    return {"system": system, "batch": 1, "context": context, "status": status, "tpot_median_ms": ms}


BANDWIDTH = {"host_read_gbps": 107.9, "hbm_gbps": 3031.7, "pcie_h2d_gbps": 55.1}


def test_load_bench_reads_tandem_benchs_own_file(tmp_path):
    host = load_bench(_tandem_bench(tmp_path, BANDWIDTH, []))
    assert (host.host_read_gbs, host.pcie_gbs, host.hbm_gbs) == (107.9, 55.1, 3031.7)
    assert host.host_cores == 16 and host.host_memory_gib == pytest.approx(135.1e9 / 2**30)
    assert "H100" in host.device


def test_a_tandem_bench_file_without_gpu_bandwidths_is_refused_by_name(tmp_path):
    path = _tandem_bench(tmp_path, {"host_read_gbps": 20.0, "hbm_gbps": None, "pcie_h2d_gbps": None}, [])
    with pytest.raises(ValueError, match="without the bandwidths pcie_h2d_gbps, hbm_gbps"):
        load_bench(path)


def _quest_row(system, context, batch, ms, cpu, pcie, cache):
    return {**_row(system, context, ms), "batch": batch, "cpu_bytes_per_step": cpu, "pcie_bytes_per_step": pcie,
            "cache_bytes_per_step": cache}  # fmt: skip


def test_host_ram_limits_batch():
    assert (
        predict_host(LENT_H100_HOST, "llama-3.1-8b", "128k", 16).max_batch == 6
    )  # 108.8 GiB / 17 GiB a request
    assert not predict_host(LENT_H100_HOST, "llama-3.1-8b", "128k", 16).fits
    assert predict_host(LENT_H100_HOST, "llama-3.1-8b", "128k", 12, StepSetup(row_format="int8")).fits


def test_bench_comparison_prices_every_row_and_names_the_ones_it_does_not_model(tmp_path):
    rows = [
        _row("hf-dynamic", 65536, 21.8),
        _row("tandem-streaming", 65536, 7.2),
        _quest_row("tandem-quest[host_dtype=none]", 65536, 1, 13.0, 1.67e8, 1.11e8, 1.5e8),
        _quest_row("tandem-quest[host_dtype=int8]", 65536, 1, 12.7, 0.84e8, 0.56e8, 1.5e8),
        _row("tandem-hgca", 65536, 30.0),
        _row("tandem-quest", 131072, None, status="oom"),
    ]
    out = bench_comparison(_tandem_bench(tmp_path, BANDWIDTH, rows))
    assert [r["system"] for r in out] == [r["system"] for r in rows[:5]]
    assert [r["predicted_ms"] is None for r in out] == [True, False, False, False, True]
    streaming, bf16, int8 = out[1:4]
    assert streaming["terms_ms"]["sync"] == 0 and streaming["terms_ms"]["cpu"] == 0
    assert int8["row_format"] == "int8" and int8["terms_ms"]["pcie"] == pytest.approx(
        bf16["terms_ms"]["pcie"] / 2, rel=0.02
    )
    # the recall cache's measured share, counted in tokens: the 8-bit rows' bytes are half
    assert int8["recall_hit"] == pytest.approx(bf16["recall_hit"], rel=0.02)
    assert bf16["error"] == pytest.approx(bf16["predicted_ms"] / 13.0 - 1)
    table = comparison_table(out)
    assert "| 64K | 1 | 1 | hf-dynamic | 21.84 | - | not modelled |" in table.replace("21.80", "21.84")


def _grid_and_comparison_agree(path):
    data = read_bench(path)
    host = load_bench(path)
    setup = engine_setup(data)
    grid = prediction_rows(host, data["model"]["name"], setup, contexts=("32k", "64k", "128k"), batches=(1, 16),
                           recall_hits=grid_setups(data))  # fmt: skip
    shared = 0
    for row in bench_comparison(path, host=host):
        label = row["system"]
        if row["predicted_ms"] is None or row["policy"] != "quest" or row["row_format"] != "bfloat16":
            continue
        if "gpu_share=" in label or "host_split=" in label:
            continue
        match = [g for g in grid if (g["context"], g["batch"]) == (row["context"], row["batch"])]
        assert len(match) == 1 and match[0]["predicted_ms"] == pytest.approx(row["predicted_ms"]), label
        shared += 1
    return shared


def test_the_reports_tables_agree_on_every_row_they_share(tmp_path):
    rows = [
        _quest_row("tandem-quest[host_dtype=none]", 65536, 1, 13.0, 1.67e8, 1.11e8, 1.5e8),
        _quest_row("tandem-quest", 32768, 16, 32.6, 1.41e9, 0.94e9, 1.07e9),
    ]
    assert _grid_and_comparison_agree(_tandem_bench(tmp_path, BANDWIDTH, rows)) == 2


def test_the_reports_tables_agree_on_the_committed_bench_files():
    for name in COMMITTED:
        assert _grid_and_comparison_agree(RESULTS / name) >= 1, name


def test_json_is_json_and_holds_both_tables(capsys):
    assert run_cli(["--from-bench", str(RESULTS / COMMITTED[0]), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"host", "setup", "predictions", "comparison", "cpu_rates"} <= set(report)
    assert len(report["comparison"]) == 10
    assert run_cli(["--host", "--context", "64k", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_s"] > 0


def test_the_command_lines_host_flags_reach_the_comparison(tmp_path):
    rows = [_quest_row("tandem-quest", 65536, 1, 13.0, 1.67e8, 1.11e8, 1.5e8)]
    path = _tandem_bench(tmp_path, BANDWIDTH, rows)
    slow = HostMeasurements(**{**load_bench(path).__dict__, "pcie_gbs": 5.0})
    assert (
        bench_comparison(path, host=slow)[0]["predicted_ms"] > bench_comparison(path)[0]["predicted_ms"] + 10
    )


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# the committed H100 runs the model is checked on (docs/simulator.md): 1-GPU 8B, 2-GPU 70B
COMMITTED = [
    "2026-11-27_h100_host_dtype/bench/bench.json",
    "2026-11-27_h100_host_dtype/bench_b16/bench.json",
    "2026-11-27_h100x2_tp70b/bench.json",
    "2026-11-26_h100_bench_8b_serial_bound/b1/bench.json",
]


@pytest.mark.parametrize("name", COMMITTED)
def test_every_quest_and_streaming_row_of_the_committed_h100_runs_within_15_percent(name):
    rows = [r for r in bench_comparison(RESULTS / name) if r["predicted_ms"] is not None]
    assert rows and all(r["policy"] in ("quest", "streaming") for r in rows)
    for r in rows:
        assert abs(r["error"]) <= 0.15, (r["system"], r["context"], r["batch"], r["error"])
