"""`tandem bench` end to end on CPU with a tiny random model: every row present, Tandem `full` decodes the same
greedy tokens as HF's DynamicCache from the same synthetic cache, bad arguments give clear errors."""

import json

import pytest

from tandem.cli import main
from tandem.tools.bench.tandem_side import bound_ms, serial_bound_ms


def _run(tmp_path, *extra):
    args = [
        "bench", "--model", "tiny-llama", "--device", "cpu", "--contexts", "300", "--batches", "1,2",
        "--steps", "2", "--warmup", "3", "--set", "window_tokens=64", "--set", "sink_tokens=16",
        "--cpu-threads", "2", "--out", str(tmp_path), *extra,
    ]  # fmt: skip
    return main(args)


def test_bench_writes_every_row_and_full_matches_hf(tmp_path, capsys):
    assert _run(tmp_path, "--policies", "full,quest") == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["versions"]["torch"] and manifest["machine"]["cores"] >= 1
    rows = {(r["system"].split("[")[0], r["batch"]): r for r in result["rows"]}  # labels carry --set
    assert len(rows) == 8  # 2 batches x (2 HF caches + 2 policies)
    assert all(r["status"] == "ok" for r in rows.values()), [r["error"] for r in rows.values()]
    for batch in (1, 2):
        full, hf = rows[("tandem-full", batch)], rows[("hf-dynamic", batch)]
        assert full["tokens"] == hf["tokens"]  # same synthetic KV, same first token: exact attention agrees
        assert full["attended_fraction"] == 1.0
        quest = rows[("tandem-quest", batch)]
        assert 0 < quest["attended_fraction"] < 0.2 and quest["cpu_bytes_per_step"] > 0
        assert quest["bound_ms"] > 0 and quest["tpot_over_bound"] > 0
        assert quest["serial_bound_ms"] >= quest["bound_ms"] and quest["tpot_over_serial"] > 0
        assert len(quest["tpot_ms"]) == 2
    assert "host_read_gbps" in result["bandwidth"]
    table = (tmp_path / "bench.md").read_text()
    assert "tandem-quest" in table and "hf-offloaded" in table
    assert "tandem-quest" in capsys.readouterr().out


def test_bench_device_share_rows_split_the_bytes(tmp_path):
    """quest with gpu_share: the same rows attended and the same tokens, part of the bytes read by the device
    (on CPU the torch reference stands in for the zero-copy GPU kernel; no PCIe bandwidth, so no bound)."""
    assert _run(tmp_path, "--policies", "quest", "--hf", "none", "--set", "quest.gpu_share=0,0.5") == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    for batch in (1, 2):
        alone, split = (r for r in rows if r["batch"] == batch)
        assert "gpu_share=0.5" in split["system"] and split["status"] == "ok", split["error"]
        assert split["tokens"] == alone["tokens"]
        assert split["attended_fraction"] == alone["attended_fraction"]
        assert not alone["pcie_bytes_per_step"] and split["pcie_bytes_per_step"] > 0
        total = split["cpu_bytes_per_step"] + split["pcie_bytes_per_step"]
        assert total == pytest.approx(alone["cpu_bytes_per_step"])
        assert split["bound_ms"] is None and alone["bound_ms"] > 0


def test_bench_compares_handoffs_side_by_side(tmp_path):
    """--handoff with two values gives one row per value, labelled; on CPU both decode eagerly (no graphs, so
    nothing to hand off), and the rows record that."""
    assert (
        _run(tmp_path, "--policies", "full", "--hf", "none", "--batches", "1", "--handoff", "memops,launches")
        == 0
    )
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["system"].rsplit("@", 1)[-1] for r in rows] == ["memops", "launches"]
    assert all(r["status"] == "ok" and r["handoff"] is None for r in rows)
    assert rows[0]["tokens"] == rows[1]["tokens"]


def test_bound_counts_each_reader_at_its_bandwidth():
    row = {"status": "ok", "cpu_bytes_per_step": 1e9, "pcie_bytes_per_step": 1e9}
    # weights 3 GB at 3000 GB/s = 1 ms; CPU 1 GB at 100 GB/s = 10 ms; PCIe 1 GB at 50 GB/s = 20 ms
    assert bound_ms(row, 3e9, 3000.0, 100.0, 50.0) == pytest.approx(20.0)
    assert bound_ms({**row, "pcie_bytes_per_step": 0.0}, 3e9, 3000.0, 100.0) == pytest.approx(10.0)
    assert bound_ms(row, 3e9, 3000.0, 100.0, None) is None


def test_serial_bound_adds_the_weights_to_the_slowest_host_read():
    row = {"status": "ok", "cpu_bytes_per_step": 1e9, "pcie_bytes_per_step": 1e9}
    # weights 1 ms; CPU 10 ms, PCIe 20 ms, both from host memory 2 GB at 100 GB/s = 20 ms
    assert serial_bound_ms(row, 3e9, 3000.0, 100.0, 50.0) == pytest.approx(21.0)
    # PCIe fast: the shared host memory is the limit (2 GB / 100 GB/s)
    assert serial_bound_ms(row, 3e9, 3000.0, 100.0, 500.0) == pytest.approx(21.0)
    assert serial_bound_ms(row, 3e9, 3000.0, 400.0, 500.0) == pytest.approx(6.0)  # 1 + max(2.5, 2, 5)
    assert serial_bound_ms({**row, "pcie_bytes_per_step": 0.0}, 3e9, 3000.0, 100.0) == pytest.approx(11.0)
    assert serial_bound_ms(row, 3e9, 3000.0, 100.0, None) is None
    assert serial_bound_ms({**row, "status": "oom"}, 3e9, 3000.0, 100.0, 50.0) is None


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--hf", "hf-nothing"], "--hf"),
        (["--policies", "fastest"], "--policies"),
        (["--warmup", "2"], "--warmup"),
        (["--contexts", "12x"], "--contexts"),
        (["--batches", "0"], "--batches: '0' is not a batch size"),
        (["--chunk-tokens", "0"], "--chunk-tokens=0 is out of range: allowed >= 1"),
        (["--cpu-threads", "0"], "--cpu-threads=0 is out of range: allowed >= 1"),
        (["--model", "/no/such/model"], "neither a named shape"),
        (["--handoff", "flags"], "--handoff: unknown 'flags'; allowed: auto, memops, launches"),
    ],
)
def test_bench_refuses_bad_arguments(tmp_path, capsys, extra, message):
    assert _run(tmp_path, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error:") and message in err
