"""Host-tier calibration: bench file, validation, Tandem TPOT predictions on the lent H100 host."""

import json

import pytest

from tandem.tools.simulator.calibrate import (
    LENT_H100_HOST,
    HostMeasurements,
    bench_comparison,
    comparison_table,
    load_bench,
    predict_host,
    prediction_table,
)


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


def test_batch1_is_bandwidth_arithmetic():
    # Batch 1, 128K: the CPU reads all page digests (1/16 of KV) plus 5% of the offloaded KV per step.
    host = HostMeasurements(host_read_gbs=50, pcie_gbs=50, hbm_gbs=2000, layer_sync_us=0)
    step = predict_host(host, "llama-3.1-8b", "128k", 1).result.step
    kv, ctx = 131072, 131072
    sparse_tokens = -(-int(0.05 * (ctx - 4096)) // 16) * 16
    cpu_bytes = ctx * kv / 16 + sparse_tokens * kv
    assert step.phases["attention"] == pytest.approx(cpu_bytes / 50e9)
    assert step.phases["fc"] == pytest.approx((8_030_261_248 - 128256 * 4096) * 2 / 2000e9)


def test_predictions_grow_with_context_and_shrink_with_bandwidth():
    tpot = [predict_host(LENT_H100_HOST, "llama-3.1-8b", c, 1).result.tpot_s for c in ("32k", "64k", "128k")]
    assert tpot[0] < tpot[1] < tpot[2]
    fast = HostMeasurements(host_read_gbs=130, pcie_gbs=55, hbm_gbs=2900)
    assert predict_host(fast, "llama-3.1-8b", "128k", 1).result.tpot_s < tpot[2]


def test_host_ram_limits_batch():
    pred = predict_host(LENT_H100_HOST, "llama-3.1-8b", "128k", 16)
    assert not pred.fits and pred.max_batch == 6  # 108.8 GiB usable / 17 GiB per request
    assert predict_host(LENT_H100_HOST, "llama-3.1-8b", "32k", 16).fits


def test_prediction_table_rows():
    table = prediction_table()
    assert table.count("\n") == 7
    assert "no (max batch 6)" in table


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


def test_bench_comparison_puts_each_quest_row_beside_the_prediction(tmp_path):
    rows = [
        _row("hf-dynamic", 65536, 21.8),
        _row("tandem-quest", 65536, 13.0),
        _row("tandem-quest[host_dtype=int8]", 65536, 12.7),  # the model prices a full-precision host tier
        _row("tandem-quest", 131072, None, status="oom"),
    ]
    path = _tandem_bench(tmp_path, BANDWIDTH, rows)
    out = bench_comparison(path)
    assert [(r["context"], r["system"]) for r in out] == [(65536, "tandem-quest")]
    host = load_bench(path)
    pred = predict_host(host, "llama-3.1-8b", 65536, 1, hot_tokens=320, device_share=0.4, gpu_selection=True)
    predicted = pred.result.step.step_s * 1e3
    assert out[0]["predicted_ms"] == pytest.approx(predicted)
    assert out[0]["error"] == pytest.approx(predicted / 13.0 - 1)
    assert "| 64K | 1 | tandem-quest | 13.00 |" in comparison_table(out)


def test_a_tensor_parallel_bench_is_predicted_on_its_gpus_and_its_ranks_host_share(tmp_path):
    rows = [_row("tandem-quest", 131072, 50.8), _row("tandem-quest[gpu_share=0.7]", 131072, 49.9)]
    path = _tandem_bench(tmp_path, BANDWIDTH, rows)
    data = json.loads(path.read_text())
    data["model"] = {"name": "llama-3.1-70b", "gpus": 2}
    path.write_text(json.dumps(data))
    host = load_bench(path)
    assert (
        host.host_read_gbs == pytest.approx(2 * 107.9) and host.host_cores == 32
    )  # each rank measured its share
    out = bench_comparison(path)
    for row, share in zip(out, (0.4, 0.7), strict=True):
        pred = predict_host(
            host, "llama-3.1-70b", 131072, 1, hot_tokens=320, device_share=share, gpu_selection=True, gpus=2
        )
        assert row["predicted_ms"] == pytest.approx(pred.result.step.step_s * 1e3)
    one_gpu = predict_host(
        host, "llama-3.1-70b", 131072, 1, hot_tokens=320, device_share=0.4, gpu_selection=True
    )
    assert not one_gpu.result.feasible and out[0]["predicted_ms"] > 0  # 141 GB of weights need both GPUs


def test_a_request_split_is_priced_on_the_busiest_ranks_requests(tmp_path):
    """host_split=requests: one memory device per rank holding whole requests. One request leaves the other rank's
    CPU idle (slower than the heads split); two requests a rank cost what the heads split does."""
    rows = [_row(f"tandem-quest[gpu_share=0,host_split={s}]", 131072, 100.0) for s in ("heads", "requests")]
    path = _tandem_bench(tmp_path, BANDWIDTH, rows)
    data = json.loads(path.read_text())
    data["model"] = {"name": "llama-3.1-70b", "gpus": 2}
    path.write_text(json.dumps(data))
    host = load_bench(path)
    kwargs = dict(hot_tokens=320, device_share=0.0, gpu_selection=True, gpus=2)

    def step(batch, split):
        return predict_host(host, "llama-3.1-70b", 131072, batch, host_split=split, **kwargs).result.step

    one_heads, one_requests = step(1, "heads"), step(1, "requests")
    assert one_requests.step_s > one_heads.step_s
    assert one_requests.phases["attention"] == pytest.approx(2 * one_heads.phases["attention"], rel=0.05)
    assert step(4, "requests").step_s == pytest.approx(step(4, "heads").step_s, rel=0.01)
    out = bench_comparison(path)
    assert [r["predicted_ms"] for r in out] == pytest.approx(
        [one_heads.step_s * 1e3, one_requests.step_s * 1e3]
    )


def test_the_recall_caches_measured_hits_are_attended_from_hbm(tmp_path):
    row = _row("tandem-quest", 131072, 16.4)
    row.update(
        cpu_bytes_per_step=3e8, pcie_bytes_per_step=2e8, cache_bytes_per_step=5e8
    )  # half the reads hit
    path = _tandem_bench(tmp_path, BANDWIDTH, [row])
    host = load_bench(path)
    kwargs = dict(hot_tokens=320, device_share=0.4, gpu_selection=True)
    hits = predict_host(host, "llama-3.1-8b", 131072, 1, recall_hit=0.5, **kwargs).result.step
    none = predict_host(host, "llama-3.1-8b", 131072, 1, **kwargs).result.step
    assert bench_comparison(path)[0]["predicted_ms"] == pytest.approx(hits.step_s * 1e3)
    assert hits.traffic["recall_hits"] > 0 and none.traffic["recall_hits"] == 0
    assert (
        hits.traffic["pnm"] < none.traffic["pnm"]
        and hits.traffic["device_share"] < none.traffic["device_share"]
    )
    assert hits.step_s < none.step_s
    with pytest.raises(ValueError, match="--recall-hit"):
        predict_host(host, "llama-3.1-8b", 131072, 1, recall_hit=1.5, **kwargs)


def test_the_command_lines_host_flags_reach_the_comparison(tmp_path, capsys):
    from tandem.tools.simulator.cli import main

    path = _tandem_bench(tmp_path, BANDWIDTH, [_row("tandem-quest", 65536, 13.0)])
    predicted = []
    for sync in ("0", "200"):
        assert main(["--from-bench", str(path), "--layer-sync-us", sync]) == 0
        row = capsys.readouterr().out.strip().splitlines()[-1]
        predicted.append(float(row.split("|")[5]))
    assert predicted[1] - predicted[0] == pytest.approx(32 * 0.2, rel=0.02)  # 32 layers x 200 us


def test_simulate_from_a_tandem_bench_file_prints_the_comparison(tmp_path, capsys):
    from tandem.tools.simulator.cli import main

    path = _tandem_bench(tmp_path, BANDWIDTH, [_row("tandem-quest", 65536, 13.0)])
    assert main(["--from-bench", str(path)]) == 0
    assert "The bench's quest rows beside the prediction" in capsys.readouterr().out


def test_the_device_share_moves_host_reads_to_the_link_and_gpu_selection_moves_scoring_to_hbm():
    base = predict_host(LENT_H100_HOST, "llama-3.1-8b", "128k", 1, hot_tokens=320).result.step
    shared = predict_host(
        LENT_H100_HOST, "llama-3.1-8b", "128k", 1, hot_tokens=320, device_share=0.4
    ).result.step
    assert shared.traffic["pnm"] < base.traffic["pnm"] and shared.traffic["device_share"] > 0
    assert base.traffic["device_share"] == 0
    on_gpu = predict_host(
        LENT_H100_HOST, "llama-3.1-8b", "128k", 1, hot_tokens=320, gpu_selection=True
    ).result.step
    assert on_gpu.traffic["pnm"] < base.traffic["pnm"] and on_gpu.step_s < base.step_s
    with pytest.raises(ValueError, match="--device-share"):
        predict_host(LENT_H100_HOST, "llama-3.1-8b", "128k", 1, device_share=1.5)


def test_a_measured_streaming_row_replaces_the_models_weight_time(tmp_path):
    rows = [_row("tandem-streaming", 65536, 7.15), _row("tandem-quest", 65536, 13.0)]
    out = bench_comparison(_tandem_bench(tmp_path, BANDWIDTH, rows))
    pred = predict_host(
        load_bench(tmp_path / "run" / "bench.json"), "llama-3.1-8b", 65536, 1, hot_tokens=320, device_share=0.4,
        gpu_selection=True,
    ).result.step  # fmt: skip
    assert out[0]["floor_predicted_ms"] == pytest.approx(pred.step_s * 1e3 - pred.phases["fc"] * 1e3 + 7.15)
    assert out[0]["floor_error"] == pytest.approx(out[0]["floor_predicted_ms"] / 13.0 - 1)


def test_the_reports_tables_price_a_bench_files_row_alike_and_json_is_json(tmp_path, capsys):
    """The prediction table of a bench file uses the file's model, GPU count and settings: on a row the
    comparison also prices (no recall cache), the two agree. --json prints both tables as JSON."""
    from tandem.tools.simulator.cli import main

    path = _tandem_bench(tmp_path, BANDWIDTH, [_row("tandem-quest", 65536, 40.0)])
    data = json.loads(path.read_text())
    data["model"] = {"name": "llama-3.1-70b", "gpus": 2}
    path.write_text(json.dumps(data))
    assert main(["--from-bench", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "llama-3.1-70b" and report["gpus"] == 2 and report["hot_tokens"] == 320
    (table_row,) = [r for r in report["predictions"] if (r["context"], r["batch"]) == (65536, 1)]
    (compared,) = report["comparison"]
    assert table_row["predicted_ms"] == pytest.approx(compared["predicted_ms"])
    assert main(["--from-bench", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"| 64K | 1 | {table_row['predicted_ms']:.2f} |" in text and "llama-3.1-70b" in text
