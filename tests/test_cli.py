"""`tandem generate` end to end on the default model, and its error paths (no tracebacks)."""

import json
import subprocess
import sys

import pytest

import tandem.models
from tandem.cli import main

pytestmark = pytest.mark.model


def _run(args, monkeypatch, smollm, capsys):
    monkeypatch.setattr(tandem.models, "load_model", lambda *a, **k: smollm)
    code = main(args)
    return code, capsys.readouterr()


def test_generate_json_on_the_default_model(smollm, monkeypatch, capsys, prose):
    code, out = _run(
        [
            "generate",
            "--prompt",
            prose[:6000],
            "--max-new-tokens",
            "5",
            "--policy",
            "quest",
            "--budget",
            "0.1",
            "--window-tokens",
            "128",
            "--json",
        ],
        monkeypatch,
        smollm,
        capsys,
    )
    assert code == 0, out.err
    result = json.loads(out.out)
    stats = result["stats"]
    assert isinstance(result["text"], str) and stats["generated_tokens"] == 5
    assert stats["prompt_tokens"] > 1024 and stats["host_rows"] > 0 and stats["host_bytes"] > 0
    assert 0.05 < stats["mean_fraction_attended"] < 0.2


def test_generate_streams_text_and_prints_stats(smollm, monkeypatch, capsys):
    code, out = _run(
        ["generate", "--chat", "--prompt", "What is 2 + 2?", "--max-new-tokens", "6"],
        monkeypatch,
        smollm,
        capsys,
    )
    assert code == 0
    assert out.out.strip() and "[tandem] prompt" in out.err and "decode" in out.err


def test_engine_path_matches_generate_and_stops_at_eos(smollm, monkeypatch, capsys):
    """--engine on (the runner, eager on CPU) and --engine off (model.generate) give the same greedy text with
    every entry kept, both stopping at the end-of-sequence token the model emits before the limit."""
    results = {}
    for engine in ("on", "off"):
        code, out = _run(
            ["generate", "--chat", "--prompt", "What is the capital of France? Answer in one sentence.",
             "--max-new-tokens", "24", "--policy", "full", "--engine", engine, "--json"],
            monkeypatch,
            smollm,
            capsys,
        )  # fmt: skip
        assert code == 0, out.err
        results[engine] = json.loads(out.out)
    on, off = results["on"], results["off"]
    assert on["stats"]["engine"] and not off["stats"]["engine"]
    assert on["text"] == off["text"] and "Paris" in on["text"]
    assert on["stats"]["generated_tokens"] == off["stats"]["generated_tokens"] < 24


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "   "], "prompt is empty"),
        (["--prompt", "hi", "--budget", "2"], "TandemConfig.budget=2.0 is out of range: allowed (0, 1]"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens=0 is out of range"),
        (
            ["--prompt-file", "/nonexistent/prompt.txt"],
            "--prompt-file '/nonexistent/prompt.txt' cannot be read",
        ),
        (["--prompt", "hi", "--max-new-tokens", "9000"], "exceeds the model's maximum context of 8192"),
        (
            ["--prompt", "hi", "--engine", "on", "--do-sample"],
            "--engine on decodes greedily: drop --do-sample",
        ),
    ],
)
def test_bad_input_gives_one_clear_error(args, message, smollm, monkeypatch, capsys):
    code, out = _run(["generate", *args], monkeypatch, smollm, capsys)
    assert code == 2
    assert message in out.err and "Traceback" not in out.err


def test_missing_model_path_is_a_clear_error(capsys):
    code = main(["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and "/nonexistent/model.gguf" in err


def test_non_gguf_file_and_non_model_directory_are_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        tandem.models.load_model(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="has no config.json"):
        tandem.models.load_model(tmp_path)


def test_console_script_help_runs():
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "--policy" in done.stdout and "--window-tokens" in done.stdout
