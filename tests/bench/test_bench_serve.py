"""`benchmarks/bench_serve.py --static-baseline`: `tandem bench`'s static batch at the load's shape, run after the
server, and the batched pass's decode steps set against it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"


@pytest.fixture
def bench_serve(monkeypatch):
    spec = importlib.util.spec_from_file_location("benchmark_bench_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _args(**given):
    args = dict(
        random_weights=None, model=None, max_batch=None, concurrency=64, policy=None, device=None, dtype=None
    )
    return SimpleNamespace(**{**args, **given})


def test_the_static_batch_takes_the_servers_shape_batch_and_policy(bench_serve, tmp_path):
    command = bench_serve.static_command(_args(), 2048, tmp_path)
    flags = dict(zip(command[4::2], command[5::2], strict=True))
    assert command[3] == "bench" and flags["--model"] == "smollm2-135m"  # the default model's shape
    assert (flags["--contexts"], flags["--batches"], flags["--policies"], flags["--hf"]) == (
        "2048", "16", "certified", "none"
    )  # fmt: skip
    eight_b = bench_serve.static_command(
        _args(random_weights="llama-3.1-8b", max_batch=32, concurrency=16, policy="quest", device="cuda"),
        32768,
        tmp_path,
    )
    assert eight_b[eight_b.index("--model") + 1] == "llama-3.1-8b"
    assert eight_b[eight_b.index("--batches") + 1] == "16"  # no more rows than clients
    assert eight_b[eight_b.index("--device") + 1] == "cuda" and "--dtype" not in eight_b


def test_the_decode_steps_are_set_against_the_static_batchs_tokens(bench_serve):
    bench = {"rows": [
        {"system": "tandem-quest", "status": "oom", "tokens_per_s": None},
        {"system": "tandem-quest", "status": "ok", "tokens_per_s": 400.0, "batch": 16, "context": 32768,
         "tpot_median_ms": 40.0},
    ]}  # fmt: skip
    batched = {"server": {"decode_tokens_per_step_second": 300.0}}
    result = bench_serve.static_result(bench, batched)
    assert result["decode_steps_over_static"] == pytest.approx(0.75) and result["batch"] == 16
    with pytest.raises(RuntimeError, match="tandem-quest: oom"):
        bench_serve.static_result({"rows": bench["rows"][:1]}, batched)


def test_a_static_batch_runs_and_is_reported(bench_serve, tmp_path):
    """The real command on a CPU (a tiny random-weight shape), its result saved beside the serve report."""
    report = {"prompt_mix": {200: 3, 256: 1}, "batched": {"server": {"decode_tokens_per_step_second": 50.0}}}
    args = _args(random_weights="tiny-llama", max_batch=2, policy="quest", device="cpu")
    static = bench_serve.run_static(args, report, tmp_path)
    assert static["context"] == 256 and static["batch"] == 2 and static["tokens_per_s"] > 0
    assert static["decode_steps_over_static"] == pytest.approx(50.0 / static["tokens_per_s"])
    assert (tmp_path / "static_bench.json").exists() and (tmp_path / "static_bench.md").exists()


def test_the_report_names_the_ratio_to_the_static_batch(bench_serve):
    saved = SCRIPT.parent / "results" / "2026-11-30_h200_host_stores_ahead" / "start1_ahead" / "serve.json"
    report = json.loads(saved.read_text())
    decode = report["batched"]["server"]["decode_tokens_per_step_second"]
    report["static"] = {"system": "tandem-quest", "context": 32768, "batch": 16, "tokens_per_s": 2 * decode,
                        "tpot_median_ms": 34.6, "decode_steps_over_static": 0.5}  # fmt: skip
    lines = [line for line in bench_serve.markdown(report).splitlines() if "Against the static batch" in line]
    assert len(lines) == 1 and "16 x 32768 tokens" in lines[0] and lines[0].endswith("**0.50x**.")


def test_the_decode_steps_are_split_by_how_they_ran_and_their_width(bench_serve):
    """`/metrics`'s steps and step time by kind and width, between two reads, and the report's lines on them: the
    replayed steps of the static batch's width are set against its step."""

    def sample(kind, rows, steps, seconds):
        labels = f'{{kind="{kind}",rows_at_most="{rows}"}}'
        return {
            f"tandem_decode_steps_total{labels}": steps,
            f"tandem_decode_step_time_seconds_total{labels}": seconds,
        }

    before = {**sample("replayed", 16, 10, 0.3), **sample("eager", 1, 2, 0.1)}
    after = {
        **sample("replayed", 16, 30, 0.9), **sample("replayed", 8, 4, 0.1), **sample("recorded", 16, 1, 0.7),
        **sample("eager", 1, 2, 0.1),
    }  # fmt: skip
    kinds = bench_serve.steps_by_kind(before, after)
    assert set(kinds) == {"replayed", "recorded"}  # no eager step between the reads
    replayed = kinds["replayed"]
    assert (replayed["count"], list(replayed["by_rows"])) == (24, ["8", "16"])
    assert replayed["seconds"] == pytest.approx(0.7) and replayed["mean_s"] == pytest.approx(0.7 / 24)
    assert replayed["by_rows"]["16"]["mean_s"] == pytest.approx(0.03)
    line = bench_serve.kinds_line(kinds)
    assert line.index("replayed 24") < line.index("recorded 1") and "20 of <= 16 at 30.0 ms" in line
    saved = SCRIPT.parent / "results" / "2026-11-30_h200_host_stores_ahead" / "start1_ahead" / "serve.json"
    report = json.loads(saved.read_text())
    report["batched"]["server"]["decode_steps_by_kind"] = kinds
    report["static"] = {"system": "tandem-quest", "context": 32768, "batch": 16, "tokens_per_s": 400.0,
                        "tpot_median_ms": 34.6, "decode_steps_over_static": 0.5}  # fmt: skip
    text = bench_serve.markdown(report)
    assert "The replayed steps of 9-16 requests (no recording, no re-pointing): 20, mean 30.0 ms against the " \
        "static batch's 34.6 ms at 16." in text  # fmt: skip
    assert line in text
    del report["batched"]["server"]["decode_steps_by_kind"]  # a report saved before the split
    assert "Decode steps by how they ran: none." in bench_serve.markdown(report)
