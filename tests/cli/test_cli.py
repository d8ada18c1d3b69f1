"""`tandem generate` end to end on the default model, and its error paths (no tracebacks); without the model, its
arguments into `TandemConfig` and its stats line."""

import io
import json
import re
import subprocess
import sys

import pytest
import torch

import tandem.models
from tandem import TandemCache, generate_cache_kwargs
from tandem.cli import build_parser, generate, main
from tandem.config import CertifiedConfig, QuestConfig, TandemConfig


def _run(args, monkeypatch, smollm, capsys):
    monkeypatch.setattr(tandem.models, "load_model", lambda *a, **k: smollm)
    code = main(args)
    return code, capsys.readouterr()


@pytest.mark.model
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


@pytest.mark.model
def test_generate_fluxion_at_tau_zero_attends_everything(smollm, monkeypatch, capsys, prose):
    """At tau = 0 no head may lose anything: no streaming heads, every budget 1, every host entry attended (no
    profile is read)."""
    args = [
        "generate",
        "--prompt",
        prose[:6000],
        "--max-new-tokens",
        "3",
        "--policy",
        "fluxion",
        "--tau",
        "0",
    ]
    code, out = _run(args + ["--json"], monkeypatch, smollm, capsys)
    assert code == 0, out.err
    stats = json.loads(out.out)["stats"]
    assert stats["policy"] == "fluxion" and stats["host_rows"] > 0
    assert stats["streaming_head_share"] == 0 and stats["mean_head_budget"] == pytest.approx(1.0)
    assert stats["mean_fraction_attended"] == pytest.approx(1.0)
    code, out = _run(args, monkeypatch, smollm, capsys)
    assert code == 0 and "(fluxion) | streaming heads 0.0% | mean head budget 100.0%" in out.err


@pytest.mark.model
def test_generate_streams_text_and_prints_stats(smollm, monkeypatch, capsys):
    code, out = _run(
        ["generate", "--chat", "--prompt", "What is 2 + 2?", "--max-new-tokens", "6"],
        monkeypatch,
        smollm,
        capsys,
    )
    assert code == 0
    assert out.out.strip() and "[tandem] prompt" in out.err and "decode" in out.err


@pytest.mark.model
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
    assert on["stats"]["warmup_seconds"] > 0 and off["stats"]["warmup_seconds"] == 0  # the engine's warm-up
    assert on["text"] == off["text"] and "Paris" in on["text"]
    assert on["stats"]["generated_tokens"] == off["stats"]["generated_tokens"] < 24


@pytest.mark.model
@pytest.mark.parametrize(
    "engine, policy", [("on", "certified"), ("off", "certified"), ("on", "fluxion"), ("off", "quest")]
)
def test_a_conversation_prefills_each_turn_once(engine, policy, smollm, monkeypatch, capsys):
    """--interactive: the second turn prefills only its own tokens, the first turn and answer kept in the cache
    (a window of 16 puts most of them in the host tier; fluxion keeps its profile's window), and answers as one
    prompt holding the whole conversation does (the same greedy text); blank lines are no turns."""
    turns = ["What is the capital of France? Answer in one sentence.", "", "And of Italy?"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(turns) + "\n"))
    window = {} if policy == "fluxion" else {"sink_tokens": 4, "window_tokens": 16}
    small = ["--policy", policy, *(f"--{k.replace('_', '-')}={v}" for k, v in window.items())]
    code, out = _run(
        ["generate", "--interactive", "--max-new-tokens", "24", "--engine", engine, "--json", *small],
        monkeypatch, smollm, capsys,
    )  # fmt: skip
    assert code == 0, out.err
    first, second = (json.loads(line) for line in out.out.splitlines())
    assert (first["turn"], second["turn"]) == (1, 2) and "Paris" in first["text"]
    assert first["stats"]["reused_tokens"] == 0 and (second["stats"]["host_rows"] > 0 or not window)
    held = first["stats"]["prompt_tokens"] + first["stats"]["generated_tokens"] - 1
    assert second["stats"]["reused_tokens"] == held
    tokenizer = smollm[1]
    messages = [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": turns[2]},
    ]
    whole = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert second["stats"]["prompt_tokens"] == len(whole) - held
    model, ids = smollm[0], torch.tensor([whole])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            **generate_cache_kwargs(
                model, TandemCache.for_model(model, TandemConfig(policy=policy, **window))
            ),
        )  # fmt: skip
    assert second["text"] == tokenizer.decode(out[0, len(whole) :], skip_special_tokens=True)


@pytest.mark.model
def test_engine_samples_inside_the_step_and_a_seed_repeats_its_text(smollm, monkeypatch, capsys):
    """--do-sample through the engine (eager on CPU): the same seed gives the same text, another seed another."""
    texts = []
    for seed in (5, 5, 6):
        code, out = _run(
            ["generate", "--prompt", "Once upon a time", "--max-new-tokens", "16", "--engine", "on", "--do-sample",
             "--temperature", "1.2", "--seed", str(seed), "--json", "--no-warmup"],
            monkeypatch,
            smollm,
            capsys,
        )  # fmt: skip
        assert code == 0, out.err
        result = json.loads(out.out)
        assert result["stats"]["engine"] and result["stats"]["warmup_seconds"] == 0
        texts.append(result["text"])
    assert texts[0] == texts[1] and texts[0] != texts[2]


@pytest.mark.model
@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "   "], "prompt is empty"),
        (
            ["--prompt", "hi", "--budget", "2"],
            "TandemConfig.quest.budget=2.0 is out of range: allowed (0, 1]",
        ),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens=0 is out of range"),
        (
            ["--prompt-file", "/nonexistent/prompt.txt"],
            "--prompt-file '/nonexistent/prompt.txt' cannot be read",
        ),
        (["--prompt", "hi", "--max-new-tokens", "9000"], "exceeds the model's maximum context of 8192"),
    ],
)
def test_bad_input_gives_one_clear_error(args, message, smollm, monkeypatch, capsys):
    code, out = _run(["generate", *args], monkeypatch, smollm, capsys)
    assert code == 2
    assert message in out.err and "Traceback" not in out.err


@pytest.mark.model
def test_a_conversation_past_the_context_or_on_several_gpus_is_refused(smollm, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n"))
    code, out = _run(["generate", "--interactive", "--max-new-tokens", "9000"], monkeypatch, smollm, capsys)
    assert code == 2 and "turn 1: the conversation has" in out.err and "start a new conversation" in out.err
    code, out = _run(["generate", "--interactive", "--gpus", "2"], monkeypatch, smollm, capsys)
    assert code == 2 and "--interactive runs on one device" in out.err and "Traceback" not in out.err


@pytest.mark.model
def test_missing_model_path_is_a_clear_error(capsys):
    code = main(["generate", "--model", "/nonexistent/model.gguf", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "does not exist" in err and "/nonexistent/model.gguf" in err


@pytest.mark.model
def test_non_gguf_file_and_non_model_directory_are_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        tandem.models.load_model(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="has no config.json"):
        tandem.models.load_model(tmp_path)


@pytest.mark.model
def test_console_script_help_runs():
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "--policy" in done.stdout and "--window-tokens" in done.stdout


# ---- without the model ----------------------------------------------------------------------------------------
def _generate_args(*extra):
    return build_parser().parse_args(["generate", "--prompt", "hi", *extra])


def test_fluxion_flags_build_the_config():
    config = generate.build_config(
        _generate_args("--policy", "fluxion", "--tau", "0.05", "--profile", "cal/p.pt", "--fluxion-mode", "static",
                       "--granularity", "32", "--no-skip-streaming", "--window-tokens", "512")
    )  # fmt: skip
    assert (config.policy, config.fluxion.tau, config.fluxion.profile, config.fluxion.mode) == (
        "fluxion",
        0.05,
        "cal/p.pt",
        "static",
    )
    assert (
        config.fluxion.granularity == 32
        and config.fluxion.skip_streaming is False
        and config.window_tokens == 512
    )
    default = TandemConfig(policy="fluxion")
    config = generate.build_config(_generate_args("--policy", "fluxion"))
    assert config.fluxion == default.fluxion
    assert (config.sink_tokens, config.block_size) == (default.sink_tokens, default.block_size)


def test_flags_and_set_map_onto_the_sub_configs():
    config = generate.build_config(
        _generate_args("--policy", "quest", "--budget", "0.1", "--set", "quest.gpu_share=0.5",
                       "--set", "certified.max_budget=0.3", "--set", "window_tokens=0.25")
    )  # fmt: skip
    assert config.quest == QuestConfig(budget=0.1, gpu_share=0.5)
    assert config.certified.max_budget == 0.3 and config.window_tokens == 0.25
    same = generate.build_config(_generate_args("--policy", "quest", "--set", "quest.budget=0.1"))
    assert same.quest.budget == 0.1  # --budget is --set quest.budget
    later = generate.build_config(
        _generate_args("--policy", "quest", "--budget", "0.1", "--set", "quest.budget=0.2")
    )
    assert later.quest.budget == 0.2  # --set comes last
    split = generate.build_config(
        _generate_args("--policy", "quest", "--set", "distributed.host_split=requests")
    )
    assert split.distributed.host_split == "requests"
    hgca = generate.build_config(_generate_args("--policy", "hgca", "--beta", "2"))
    assert hgca.hgca.beta == 2.0 and hgca.quest == QuestConfig()  # quest's --budget default sets nothing


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--set", "budget=0.1"],
            "'budget' moved to quest.budget: use TandemConfig(quest=QuestConfig(budget=0.1))",
        ),
        (["--set", "fluxion_mode=static"], "--set fluxion.mode=static"),
        (["--set", "quest.bugdet=0.1"], "TandemConfig.quest has no field 'bugdet'"),
        (["--set", "nonsense=1"], "unknown setting 'nonsense'"),
        (["--set", "quest.budget"], "expected KEY=VALUE"),
        (["--set", "quest.budget=x"], "'x' is not a number"),
        (
            ["--policy", "hgca", "--budget", "0.1"],
            "TandemConfig.quest.budget=0.1 is out of range: allowed its default",
        ),
        (["--policy", "hgca", "--epsilon", "0.1"], "certified.epsilon=0.1 .*policy='hgca'"),
    ],
)
def test_old_spellings_and_unread_settings_on_the_command_line_are_refused(
    argv, message, monkeypatch, capsys
):
    monkeypatch.setattr(tandem.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["generate", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message if ".*" in message else re.escape(message), err), err


def test_bad_fluxion_flags_are_refused_before_the_model_loads(monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(tandem.models, "load_model", no_model)
    assert main(["generate", "--prompt", "hi", "--policy", "fluxion", "--tau", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "tandem: error: TandemConfig.fluxion.tau=1.5 is out of range" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        _generate_args("--granularity", "24")
    assert "argument --granularity: invalid choice: 24" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _generate_args("--fluxion-mode", "dynamic")
    assert "argument --fluxion-mode: invalid choice: 'dynamic'" in capsys.readouterr().err


def test_generate_help_lists_fluxion(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("fluxion", "--tau", "--profile", "--fluxion-mode", "--granularity", "--no-skip-streaming"):
        assert flag in text, flag


def test_stats_line_adds_fluxion_statistics():
    stats = dict(prompt_tokens=3000, generated_tokens=8, prefill_seconds=1.5, decode_tokens_per_s=20.0,
                 hot_bytes=2**20, host_bytes=3 * 2**20, mean_fraction_attended=0.042, policy="quest")  # fmt: skip
    line = generate.stats_line(stats)
    assert line.endswith("host entries attended 4.2% (quest)") and "streaming" not in line
    fluxion = dict(stats, policy="fluxion", streaming_head_share=0.375, mean_head_budget=0.031)
    assert generate.stats_line(fluxion).endswith(
        "host entries attended 4.2% (fluxion) | streaming heads 37.5% | mean head budget 3.1%"
    )
    assert "streaming heads n/a" in generate.stats_line(dict(fluxion, streaming_head_share=None))
    assert generate.stats_line(dict(stats, gpus=2)).endswith(
        "(quest) | 2 GPUs, tensor-parallel (hot / host: one rank's)"
    )
    assert "GPUs" not in generate.stats_line(dict(stats, gpus=1))


@pytest.mark.model
def test_a_prompt_that_fits_the_hot_tier_says_so_instead_of_nulls(smollm, monkeypatch, capsys):
    """Nothing reaches the host tier: the JSON says why in one line, and has no null read statistics."""
    args = ["generate", "--prompt", "Hello", "--max-new-tokens", "3", "--engine", "off"]
    code, out = _run(args + ["--json"], monkeypatch, smollm, capsys)
    assert code == 0, out.err
    stats = json.loads(out.out)["stats"]
    assert stats["host_tier"].startswith(f"empty: all {stats['tokens']} tokens fit the hot tier (sinks 64 + ")
    assert "mean_fraction_attended" not in stats and "certified" not in stats
    assert None not in [v for k, v in stats.items() if k in generate.HOST_READ_STATS]
    code, out = _run(args, monkeypatch, smollm, capsys)
    assert code == 0 and "host tier empty: all" in out.err and "n/a" not in out.err


def test_an_unread_host_tier_is_explained_not_null():
    config = TandemConfig(policy="fluxion", certified=CertifiedConfig(epsilon=0.05))
    read = dict(prompt_tokens=3000, tokens=3008, host_rows=2600, mean_fraction_attended=0.1, policy="fluxion")
    assert generate.explain_unread_host_tier(read, config) is read
    unread = dict(read, prompt_tokens=5, tokens=8, host_rows=0, mean_fraction_attended=None,
                  streaming_head_share=None, mean_head_budget=None, granularity_share=None,
                  certified={"epsilon": 0.05, "head_steps": 0, "mean_p": None})  # fmt: skip
    shown = generate.explain_unread_host_tier(unread, config)
    assert shown["host_tier"] == (
        "empty: all 8 tokens fit the hot tier (sinks 64 + window 256), so no decode step read host entries"
    )
    assert not set(shown) & {*generate.HOST_READ_STATS, "certified"}
    late = generate.explain_unread_host_tier(dict(unread, host_rows=16), config)
    assert late["host_tier"].startswith("16 rows, unread by any decode step")
    line = generate.stats_line(dict(shown, prefill_seconds=0.1, generated_tokens=3, decode_tokens_per_s=None,
                                    hot_bytes=2**20, host_bytes=0))  # fmt: skip
    assert (
        "| host tier empty: all 8 tokens fit the hot tier" in line and "n/a" not in line.split("host tier")[1]
    )
