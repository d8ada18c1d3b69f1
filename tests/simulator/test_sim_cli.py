"""`tandem simulate` entry points: add_arguments/run/main, errors, sweep output."""

import argparse
import importlib.util
import json

import pytest

from tandem.tools.simulator import cli


def run_cli(argv):
    return cli.main(argv)


def test_single_configuration(capsys):
    argv = ["--model", "llama-3.1-70b", "--context", "512k", "--gpus", "2", "--pnm", "8", "--scheme", "pnkv"]
    assert run_cli(argv) == 0
    out = capsys.readouterr().out
    assert "PnG-KV" in out and "tokens/s" in out and "J/token" in out and "tokens/$" in out


def test_json_and_compare(capsys):
    assert run_cli(["--context", "128k", "--pnm", "4", "--compare", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["scheme"] for r in rows] == ["baseline", "pnm", "pnkv"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--scheme", "pnm-kv"], "--scheme"),
        (["--model", "llama-9"], "--model"),
        (["--context", "12x"], "--context"),
        (["--gpus", "-1"], "--gpus"),
        (["--pnm", "-3"], "--pnm"),
        (["--gpu", "tpu"], "--gpu"),
        (["--from-bench", "/nonexistent/bench.json"], "--from-bench"),
        (["--sweep", "--no-plots", "--out", "/proc/tandem-sweep"], "--out"),
    ],
)
def test_bad_input_exit_2_without_traceback(capsys, argv, needle):
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_add_arguments_on_foreign_parser(capsys):
    parser = argparse.ArgumentParser(prog="tandem")
    sub = parser.add_subparsers(dest="command")
    cli.add_arguments(sub.add_parser("simulate"))
    args = parser.parse_args(["simulate", "--scheme", "baseline", "--pnm", "0", "--context", "1m"])
    assert cli.run(args) == 0
    assert "GPU-CXL-Mem" in capsys.readouterr().out


def test_host_mode(capsys, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"host_read_gbs": 65, "pcie_gbs": 55, "hbm_gbs": 2900, "device": "fixture"}))
    assert run_cli(["--from-bench", str(bench), "--context", "32k", "--batch", "16"]) == 0
    assert "predicted TPOT" in capsys.readouterr().out
    assert run_cli(["--host", "--host-bandwidth-gbs", "40", "--cpu-threads", "7"]) == 0
    out = capsys.readouterr().out
    assert "| 128K | 16 |" in out and "no (max batch" in out


def test_sweep_without_plots(tmp_path, capsys):
    assert run_cli(["--sweep", "--out", str(tmp_path), "--no-plots"]) == 0
    md = (tmp_path / "sweep.md").read_text()
    assert "Headline claims" in md and "Figure 14" in md
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert {r["scheme"] for r in data["rows"]} == {"baseline", "pnm", "pnkv"}
    assert not list(tmp_path.glob("*.png"))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["command"] and manifest["date"].startswith("20")  # the process's command line


def test_sweep_warns_once_without_matplotlib(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    assert run_cli(["--sweep", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: matplotlib is not installed") == 1
    assert (tmp_path / "sweep.md").exists() and not list(tmp_path.glob("*.png"))


def test_sweep_plots(tmp_path):
    pytest.importorskip("matplotlib")
    assert run_cli(["--sweep", "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == [
        "fig10_throughput.png",
        "fig11_energy.png",
        "fig12_rack.png",
        "fig13_breakdown.png",
        "fig14_cost.png",
    ]
