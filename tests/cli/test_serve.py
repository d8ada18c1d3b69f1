"""`tandem serve`'s flags: help, one-line errors for bad values before any model is loaded, and the server
`build_server` puts together from them (a small random-weight model stands in for the real one)."""

import pytest

import tandem.models
from tandem.cli import build_parser, main
from tandem.cli.serve import GIB, build_server
from tandem.serve.scheduler import Limits, Scheduler
from tests.tiny import tiny_model


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the flags were checked")


def test_serve_help(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    for words in (
        "/v1/chat/completions",
        "--max-batch",
        "--max-queue",
        "--prefill-chunk",
        "--step-tokens",
        "--prefill-thread",
        "--policy",
    ):
        assert words in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "0"], "--port=0 is out of range: allowed 1 to 65535"),
        (["--port", "65536"], "--port=65536 is out of range"),
        (["--max-batch", "0"], "--max-batch=0 is out of range: allowed >= 1"),
        (["--max-queue", "-1"], "--max-queue=-1 is out of range: allowed >= 0"),
        (["--prefill-chunk", "0"], "--prefill-chunk=0 is out of range: allowed >= 1"),
        (["--step-tokens", "0"], "--step-tokens=0 is out of range: allowed >= 1"),
        (["--step-tokens", "64", "--prefill-thread"], "--prefill-thread runs the chunks beside the steps"),
        (["--random-weights", "nope"], "--random-weights='nope' is not a known shape: allowed "),
        (["--random-weights", "llama-3.1-8b", "--model", "m.gguf"], "exclude each other"),
        (["--device", "cpu", "--device-memory", "1"], "--device-memory applies to CUDA devices only"),
        (["--policy", "quest", "--budget", "2"], "TandemConfig.quest.budget=2.0 is out of range"),
    ],
)
def test_bad_flags_give_one_line_before_loading_a_model(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(tandem.models, "load_model", _no_model)
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tandem: error: ") and message in err[0], err


@pytest.mark.parametrize("argv", [["--host-memory", "0"], ["--host-memory", "lots"], ["--log-level", "loud"]])
def test_malformed_flag_values_are_usage_errors(argv, monkeypatch, capsys):
    monkeypatch.setattr(tandem.models, "load_model", _no_model)
    with pytest.raises(SystemExit) as caught:
        main(["serve", *argv])
    assert caught.value.code == 2
    assert f"argument {argv[0]}: invalid" in capsys.readouterr().err


def test_build_server_from_flags(monkeypatch):
    model = tiny_model("Llama")
    monkeypatch.setattr(tandem.models, "load_model", lambda *a, **k: (model, None))
    argv = ["serve", "--max-batch", "3", "--max-queue", "0", "--prefill-chunk", "32", "--host-memory", "1.5"]
    argv += ["--policy", "quest", "--budget", "0.2", "--served-model-name", "tiny", "--cpu-threads", "1"]
    warmed = []
    monkeypatch.setattr(Scheduler, "warm_up", lambda self, config: warmed.append(config.policy) or 0.5)
    server = build_server(build_parser().parse_args(argv))
    assert warmed == ["quest"]  # the server warms up before it serves, with the requests' configuration
    build_server(build_parser().parse_args([*argv, "--no-warmup"]))
    assert warmed == ["quest"]
    assert server.model_name == "tiny" and server.model is model
    assert server.scheduler.limits == Limits(3, 0, 32, int(1.5 * GIB), None)
    budgeted = build_server(build_parser().parse_args([*argv, "--step-tokens", "96"]))
    assert budgeted.scheduler.limits.step_tokens == 96
    beside = build_server(build_parser().parse_args([*argv, "--prefill-thread"]))
    assert beside.scheduler.limits.prefill_thread and not server.scheduler.limits.prefill_thread
    assert (server.config.policy, server.config.quest.budget, server.config.host.threads) == ("quest", 0.2, 1)
    assert server.scheduler.pool.num_threads == 1
    defaults = build_server(build_parser().parse_args(["serve", "--model", "/models/Qwen2-0.5B.gguf"]))
    assert defaults.model_name == "Qwen2-0.5B"
    assert defaults.scheduler.limits.prefill_chunk == 256  # on a CPU
    assert defaults.scheduler.limits.host_bytes is None or defaults.scheduler.limits.host_bytes > 0


def test_replicas_without_ray_name_the_extra_to_install(monkeypatch):
    import builtins

    from tandem.serve import replicas

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ValueError, match=r'--replicas needs Ray Serve.*pip install -e "\.\[cluster\]"'):
        replicas.run_replicas(None, None)


@pytest.mark.parametrize(
    ("flags", "named"), [(["--replicas", "0"], "--replicas"), (["--replica-cpus", "0"], "--replica-cpus")]
)
def test_replica_settings_out_of_range_are_refused_by_name(capsys, flags, named):
    from tandem import cli

    assert cli.main(["serve", "--replicas", "1", *flags]) == 2
    assert named in capsys.readouterr().err
