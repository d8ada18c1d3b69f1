"""`tandem eval`: argument checks, task generators, metrics and reports; on the real default model, `full`
matches plain HF generation on every sample, `streaming` loses a needle outside its window (so the harness
tells policies apart), and the attention-output error of `full` is zero up to float32 rounding."""

import json
import re
import zipfile
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import tandem.models
from tandem import manifest
from tandem.cli import main
from tandem.config import HostConfig, TandemConfig
from tandem.tools.evaluation import TaskBuilder, evaluate, load_haystack, make_plan
from tandem.tools.evaluation.metrics import head_errors, reference_attention
from tandem.tools.evaluation.names import GENERATION_TASKS
from tandem.tools.evaluation.report import markdown, merge_results, summarize, verdicts, write_results
from tandem.tools.evaluation.runner import (
    cache_statistics,
    check_lengths,
    check_profiles,
    make_variants,
    parse_lengths,
)
from tandem.tools.evaluation.tasks import MAX_NEW_TOKENS, score_answer


# ---- arguments ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tasks": "niah,nope"}, "--tasks: unknown 'nope'; allowed: niah, multikey"),
        (
            {"policies": "full,magic"},
            "--policies: unknown 'magic'; allowed: certified, full, streaming, hgca, quest",
        ),
        ({"lengths": "1k,2x"}, "--lengths: '2x' is not a context length"),
        ({"lengths": "100"}, "--lengths: '100' is not a context length"),
        (
            {"sets": ["quest.bogus=1"]},
            "--set 'quest.bogus=1': unknown key 'quest.bogus'; allowed: sink_tokens",
        ),
        ({"sets": ["quest.budget"]}, "expected key=v1,v2"),
        ({"sets": ["quest.budget=a"]}, "'a' is not a number"),
        ({"sets": ["magic.budget=0.1"]}, "unknown key 'magic.budget'"),
        ({"sets": ["budget=0.1"]}, "'budget' moved to quest.budget: use TandemConfig(quest=QuestConfig"),
        (
            {"sets": ["quest.epsilon=0.1"]},
            "'epsilon' moved to certified.epsilon: use --set certified.epsilon=0.1",
        ),
        (
            {"policies": "full", "sets": ["quest.budget=0.1"]},
            "quest settings apply only to policies quest, none of which is in --policies (full)",
        ),
        ({"policies": "full", "sets": ["quest.window_tokens=64"]}, "policy 'quest' is not in --policies"),
        ({"sets": ["quest.budget=2"]}, "--set quest[budget=2]: TandemConfig.quest.budget=2 is out of range"),
        ({"samples": 0}, "--samples=0 is out of range"),
        ({"ppl_tokens": 600, "lengths": "1k"}, "--ppl-tokens=600 must be less than half"),
        (
            {"policies": "full,fluxion", "sets": ["fluxion.tau=1.5"]},
            "--set fluxion[tau=1.5]: TandemConfig.fluxion.tau=1.5 is out of range",
        ),
        ({"policies": "fluxion", "sets": ["fluxion.tau=x"]}, "--set 'fluxion.tau=x': 'x' is not a number"),
        (
            {"policies": "fluxion", "sets": ["fluxion.granularity=24"]},
            "--set fluxion[granularity=24]: TandemConfig.fluxion.granularity=24 is out of range: allowed None",
        ),
        (
            {"policies": "fluxion", "sets": ["fluxion.granularity=big"]},
            "--set 'fluxion.granularity=big': 'big' is not a number or 'none'",
        ),
        (
            {"policies": "fluxion", "sets": ["fluxion.skip_streaming=yes"]},
            "--set 'fluxion.skip_streaming=yes': 'yes' is not 0 or 1",
        ),
        (
            {"policies": "fluxion", "sets": ["fluxion.mode=dynamic"]},
            "--set fluxion[fluxion_mode=dynamic]: TandemConfig.fluxion.mode='dynamic' is out of range",
        ),
        (
            {"policies": "fluxion", "sets": ["fluxion.profile=a.pt,,b.pt"]},
            "fluxion.profile=a.pt,,b.pt': empty value",
        ),
        ({"policies": "fluxion", "sets": ["fluxion.block_size=32"]}, "16 with policy='fluxion'"),
        (
            {"policies": "full,quest", "sets": ["fluxion.tau=0.1"]},
            "fluxion settings apply only to policies fluxion, none of which is in --policies (full, quest)",
        ),
    ],
)
def test_bad_arguments_name_the_argument_and_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_plan(**kwargs)


def test_cli_prints_bad_arguments_without_a_traceback(capsys):
    assert main(["eval", "--tasks", "niah,bogus", "--out", "unused"]) == 2
    assert "tandem: error: --tasks: unknown 'bogus'" in capsys.readouterr().err


def test_the_host_tier_sweeps_on_every_policy_or_one_under_its_old_labels():
    """host.dtype and host.huge_pages apply to every policy, or to one (quest.host.dtype); the labels keep the flat
    names of before (quest[host_dtype=int8]), so new results compare with the committed ones."""
    variants = make_variants(["full", "quest"], ["host.dtype=none,int8"])
    assert [v.label for v in variants] == [
        "full[host_dtype=none]", "full[host_dtype=int8]", "quest[host_dtype=none]", "quest[host_dtype=int8]",
    ]  # fmt: skip
    assert variants[-1].config.host.dtype == "int8"
    one = make_variants(["full", "quest"], ["quest.host.dtype=int8", "host.huge_pages=0"])
    assert [v.label for v in one] == ["full[huge_pages=0]", "quest[host_dtype=int8,huge_pages=0]"]
    assert [v.config.host.dtype for v in one] == [None, "int8"] and not one[0].config.host.huge_pages
    with pytest.raises(ValueError, match=r"'host_dtype' moved to quest\.host\.dtype"):
        make_variants(["quest"], ["quest.host_dtype=int8"])
    with pytest.raises(ValueError, match="--cpu-threads"):
        make_variants(["quest"], ["host.threads=2"])


def test_lengths_sweeps_and_model_maximum():
    assert parse_lengths("2k,1k,1000,1k") == [1000, 1024, 2048]
    variants = make_variants(["full", "quest"], ["quest.budget=0.02,0.05", "quest.block_size=16,32"])
    assert [v.label for v in variants] == [
        "full",
        "quest[budget=0.02,block_size=16]",
        "quest[budget=0.02,block_size=32]",
        "quest[budget=0.05,block_size=16]",
        "quest[budget=0.05,block_size=32]",
    ]
    assert variants[-1].config.block_size == 32 and variants[-1].config.quest.budget == 0.05
    everywhere = make_variants(["full", "hgca"], ["window_tokens=128"])
    assert all(v.config.window_tokens == 128 for v in everywhere)
    bounds = make_variants(["quest"], ["certified.epsilon=0.05", "certified.bound=digest,sketch"])
    assert [v.config.certified.bound for v in bounds] == ["digest", "sketch"]
    with pytest.raises(ValueError, match=r"certified\.bound='box'"):
        make_variants(["quest"], ["certified.epsilon=0.05", "certified.bound=box"])
    check_lengths([1024, 8192], 8192)
    with pytest.raises(ValueError, match="--lengths: 16384 tokens exceed the model's maximum of 8192"):
        check_lengths([1024, 16384], 8192)


def test_a_certified_key_applies_to_the_certifying_policies_only():
    variants = make_variants(["full", "quest", "fluxion"], ["certified.epsilon=0.01,0.05"])
    labels = [v.label for v in variants]
    assert labels == [
        "full", "quest[epsilon=0.01]", "quest[epsilon=0.05]", "fluxion[epsilon=0.01]", "fluxion[epsilon=0.05]",
    ]  # fmt: skip
    with pytest.raises(
        ValueError, match="certified settings apply only to policies certified, quest, fluxion"
    ):
        make_variants(["full", "hgca"], ["certified.max_budget=0.5"])


def test_fluxion_sweeps_parse_into_labelled_variants():
    assert [v.label for v in make_plan(policies="full,quest,hgca,fluxion", tasks="niah").variants] == [
        "full",
        "quest",
        "hgca",
        "fluxion",
    ]
    variants = make_variants(["full", "fluxion"], ["fluxion.tau=0.02,0.05,0.1,0.2"])
    assert [v.label for v in variants] == [
        "full",
        "fluxion[tau=0.02]",
        "fluxion[tau=0.05]",
        "fluxion[tau=0.1]",
        "fluxion[tau=0.2]",
    ]
    assert [v.config.fluxion.tau for v in variants[1:]] == [0.02, 0.05, 0.1, 0.2]
    assert variants[1].overrides == {"fluxion.tau": 0.02} and variants[0].config == TandemConfig(
        policy="full", host=HostConfig(threads=variants[0].config.host.threads)
    )
    ablation = make_variants(
        ["fluxion"],
        [
            "fluxion.mode=static",
            "fluxion.granularity=none,16",
            "fluxion.skip_streaming=0,1",
            "fluxion.profile=default,cal/p.pt",
        ],
    )
    assert len(ablation) == 8 and ablation[0].label == (
        "fluxion[fluxion_mode=static,granularity=none,skip_streaming=0,profile=default]"
    )
    last = ablation[-1].config
    assert (
        last.fluxion.mode,
        last.fluxion.granularity,
        last.fluxion.skip_streaming,
        last.fluxion.profile,
    ) == (
        "static",
        16,
        True,
        "cal/p.pt",
    )
    first = ablation[0].config
    assert first.fluxion.granularity is None and first.fluxion.skip_streaming is False
    assert first.fluxion.profile is None
    # a sub-config's key changes only the variants of the policies that read it
    everywhere = make_variants(["quest", "fluxion"], ["fluxion.tau=0.05", "window_tokens=512"])
    assert [v.label for v in everywhere] == [
        "quest[window_tokens=512]",
        "fluxion[tau=0.05,window_tokens=512]",
    ]


def test_fluxion_profiles_are_checked_before_any_run():
    shapes = SimpleNamespace(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576
    )
    missing = make_variants(["full", "fluxion"], ["fluxion.profile=/nonexistent/p.pt", "fluxion.tau=0,0.1"])
    check_profiles(missing[:2], shapes)  # tau = 0 attends everything and reads no profile
    with pytest.raises(
        FileNotFoundError, match=re.escape("--set fluxion[profile=/nonexistent/p.pt,tau=0.1]: ")
    ):
        check_profiles(missing, shapes)


def test_cache_statistics_keep_fluxion_statistics():
    class Cache:
        def __init__(self, **stats):
            self.stats = lambda: dict(stats, policy="x", tokens=1, host_rows=1)

    assert cache_statistics(Cache(mean_fraction_attended=0.25)) == {"fraction_attended": 0.25}
    fluxion = cache_statistics(
        Cache(
            mean_fraction_attended=0.05,
            streaming_head_share=0.4,
            mean_head_budget=0.03,
            granularity_share=None,
        )
    )
    assert fluxion == {
        "fraction_attended": 0.05,
        "streaming_head_share": 0.4,
        "mean_head_budget": 0.03,
        "granularity_share": None,
    }


# ---- haystack, scoring, metrics, reports ----------------------------------------------------------------------
def test_haystack_sources(tmp_path):
    pydoc = load_haystack()
    assert "PSF" in pydoc.source and len(pydoc.text.split()) > 20_000 and len(pydoc.words()) > 1000
    text = " ".join(f"Sentence {i} about the weather and a garden." for i in range(400))
    (tmp_path / "essays").mkdir()
    (tmp_path / "essays" / "a.txt").write_text(text)
    assert load_haystack(tmp_path / "essays").text == text
    with zipfile.ZipFile(tmp_path / "essays.whl", "w") as archive:
        archive.writestr("pkg/PaulGrahamEssays/a.txt", text)
    assert load_haystack(tmp_path / "essays.whl").text == text
    with pytest.raises(ValueError, match="--haystack .*not found"):
        load_haystack(tmp_path / "missing")
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ValueError, match="at least 2000"):
        load_haystack(tmp_path / "short.txt")


def test_score_is_the_share_of_answers_found():
    assert score_answer(" 1234567.", ("1234567",)) == 1.0
    assert score_answer(" 1234568.", ("1234567",)) == 0.0
    assert score_answer("abcde, QWERT and xyz", ("ABCDE", "QWERT", "ZZZZZ", "XYZAB")) == 0.5


def test_reference_attention_and_error_metric():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 16), torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 16)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :5] = False
    out = reference_attention(q, k, v, mask, 0.25)
    expected = F.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=mask[:, None, None], scale=0.25, enable_gqa=True
    )[:, :, 0]
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=1e-5)
    assert head_errors(out, out).abs().max() == 0
    bumped = out.clone()
    bumped[0, 3] += 0.1
    err = head_errors(bumped, out)
    peak = out[0].norm(dim=-1).max()
    torch.testing.assert_close(err[0, 3], 0.1 * 16**0.5 / peak, rtol=1e-6, atol=0)
    assert err[0, :3].abs().max() == 0 and err[1].abs().max() == 0


def _runs():
    runs = []
    for policy, scores, fraction in (("full", [1, 1], 1.0), ("quest", [1, 0], 0.04), ("hgca", [1, 1], 0.3)):
        for i, s in enumerate(scores):
            runs.append(
                dict(task="niah", length=1024, policy=policy, sample=i, score=s, fraction_attended=fraction)
            )
        runs.append(
            dict(
                task="ppl",
                length=1024,
                policy=policy,
                sample=0,
                score=0,
                nll_sum=32.0,
                tokens=16,
                fraction_attended=fraction,
            )
        )
    return runs


def test_summary_delta_verdict_markdown_and_merge():
    labels = ["full", "quest", "hgca"]
    cells = summarize(_runs(), ["niah", "ppl"], [1024], labels, "full")
    niah = {c["policy"]: c for c in cells if c["task"] == "niah"}
    assert niah["quest"]["score"] == 50 and niah["quest"]["delta"] == -50 and niah["hgca"]["delta"] == 0
    assert [c["score"] for c in cells if c["task"] == "ppl"] == pytest.approx([torch.e**2] * 3)
    verdict = {v["policy"]: v for v in verdicts(cells, labels, "full")}
    assert not verdict["quest"]["meets"] and verdict["quest"]["sparse_enough"]
    assert not verdict["hgca"]["meets"] and verdict["hgca"]["within_1_point"]
    meta = {"tasks": ["niah", "ppl"], "command": "tandem eval --lengths 1k"}
    part = {"meta": meta, "baseline": "full", "cells": cells, "runs": _runs()}
    other = [dict(r, length=2048) for r in _runs()]
    merged = merge_results(
        [part, dict(part, runs=other, meta=dict(meta, command="tandem eval --lengths 2k"))]
    )
    assert merged["meta"]["lengths"] == [1024, 2048] and len(merged["cells"]) == 12
    text = markdown(merged)
    assert "| niah | 1K | 100 (±0) · 100.0% | 50 (-50) · 4.0% | 100 (±0) · 30.0% |" in text
    assert "**quest** does not meet" in text and "tandem eval --lengths 2k" in text


def test_cells_where_full_scores_below_the_floor_do_not_judge_a_policy():
    # at 1K full scores 100 and quest keeps it; at 2K full scores 0 (the model cannot do the task) and quest 0
    runs = []
    for length, full_score in ((1024, 1.0), (2048, 0.0)):
        for policy, fraction in (("full", 1.0), ("quest", 0.04 if length == 1024 else 0.02)):
            runs.append(
                dict(
                    task="niah",
                    length=length,
                    policy=policy,
                    sample=0,
                    score=full_score,
                    fraction_attended=fraction,
                )
            )
    cells = summarize(runs, ["niah"], [1024, 2048], ["full", "quest"], "full")
    (verdict,) = verdicts(cells, ["full", "quest"], "full")
    assert verdict["meets"] and verdict["cells_scored"] == 1 and verdict["cells_below_floor"] == 1
    assert verdict["fraction_attended_by_length"] == pytest.approx({1024: 0.04, 2048: 0.02})
    # a low-scoring full cell that a policy beats is still not scored; one above the floor is
    runs[2]["score"], runs[3]["score"] = 0.1, 0.0
    cells = summarize(runs, ["niah"], [1024, 2048], ["full", "quest"], "full")
    (verdict,) = verdicts(cells, ["full", "quest"], "full")
    assert verdict["meets"] and verdict["cells_below_floor"] == 1
    runs[2]["score"] = 0.2
    cells = summarize(runs, ["niah"], [1024, 2048], ["full", "quest"], "full")
    (verdict,) = verdicts(cells, ["full", "quest"], "full")
    assert not verdict["meets"] and verdict["cells_scored"] == 2 and verdict["worst_delta"] == -20
    text = markdown({"meta": {}, "baseline": "full", "cells": cells, "verdicts": [verdict], "runs": runs})
    assert "| niah | 2K | 20 (±0) · 100.0% | 0 (-20) · 2.0% |" in text
    runs[2]["score"] = 0.1
    cells = summarize(runs, ["niah"], [1024, 2048], ["full", "quest"], "full")
    text = markdown(
        {
            "meta": {},
            "baseline": "full",
            "cells": cells,
            "verdicts": verdicts(cells, ["full", "quest"], "full"),
            "runs": runs,
        }
    )
    assert "| niah | 2K | 10† (±0) · 100.0% | 0† (-10) · 2.0% |" in text
    assert "1 cells scored, 1 below the floor (†)" in text and "by context length: 1K 4.0%, 2K 2.0%" in text


def test_a_merged_eval_keeps_the_manifests_of_its_parts(tmp_path, capsys):
    labels = ["full", "quest", "hgca"]
    folders = []
    for length in (1024, 2048):
        runs = [dict(r, length=length) for r in _runs()]
        cells = summarize(runs, ["niah", "ppl"], [length], labels, "full")
        meta = {"tasks": ["niah", "ppl"], "command": f"tandem eval --lengths {length}"}
        folder = tmp_path / str(length)
        folder.mkdir()
        (folder / "results.json").write_text(
            json.dumps({"meta": meta, "baseline": "full", "cells": cells, "runs": runs})
        )
        manifest.write(folder, ["tandem", "eval", "--lengths", str(length)])
        folders.append(str(folder))
    out = tmp_path / "merged"
    assert main(["eval", "--merge", *folders, "--out", str(out), "--no-plots"]) == 0, capsys.readouterr().err
    merged = json.loads((out / "manifest.json").read_text())
    assert [part["command"][-1] for part in merged["parts"]] == ["1024", "2048"]
    assert merged["versions"]["torch"]


def test_fluxion_statistics_in_cells_verdicts_markdown_and_merge():
    runs = [r for r in _runs() if r["policy"] == "full"]
    for i, (share, budget, grain) in enumerate(((0.5, 0.02, {16: 0.75, 32: 0.25}), (0.3, 0.04, {32: 1.0}))):
        stats = dict(streaming_head_share=share, mean_head_budget=budget, granularity_share=grain)
        runs.append(
            dict(
                task="niah", length=1024, policy="fluxion", sample=i, score=1, fraction_attended=0.04, **stats
            )
        )
    cells = summarize(runs, ["niah", "ppl"], [1024], ["full", "fluxion"], "full")
    niah = {c["policy"]: c for c in cells if c["task"] == "niah"}
    assert niah["fluxion"]["streaming_head_share"] == pytest.approx(0.4)
    assert niah["fluxion"]["mean_head_budget"] == pytest.approx(0.03)
    assert niah["fluxion"]["granularity_share"] == pytest.approx({16: 0.375, 32: 0.625})
    assert "streaming_head_share" not in niah["full"] and "granularity_share" not in niah["full"]
    (verdict,) = verdicts(cells, ["full", "fluxion"], "full")
    assert verdict["meets"] and verdict["mean_streaming_head_share"] == pytest.approx(0.4)
    results = {"meta": {"tasks": ["niah", "ppl"]}, "baseline": "full", "cells": cells, "runs": runs}
    reloaded = json.loads(json.dumps(results))  # results.json: the block sizes come back as strings
    merged = merge_results([reloaded])
    merged_cell = next(c for c in merged["cells"] if c["policy"] == "fluxion")
    assert merged_cell["granularity_share"] == pytest.approx({16: 0.375, 32: 0.625})
    text = markdown(merged)
    assert (
        "- **fluxion** meets the bar (worst Δ +0 points, mean Δ +0.0, host entries attended 4.0% mean / 4.0% max, "
        "streaming heads 40.0% mean, head budget 3.0% mean)." in text
    )
    assert "| niah | 1K | 100 (±0) · 100.0% | 100 (±0) · 4.0% |" in text


# ---- on the real model ----------------------------------------------------------------------------------------
@pytest.mark.model
def test_task_prompts_fit_their_length_and_hold_their_answers(smollm):
    _, tok = smollm
    builder = TaskBuilder(tok, load_haystack(), seed=3)
    for task in GENERATION_TASKS:
        samples = builder.samples(task, 1024, 2)
        again = builder.samples(task, 1024, 2)
        for s, s2 in zip(samples, again):
            assert torch.equal(s.input_ids, s2.input_ids)  # generated from the seed alone
            budget = 1024 - MAX_NEW_TOKENS[task]
            assert budget - 40 <= s.input_ids.shape[1] <= budget
            text = tok.decode(s.input_ids[0])
            assert all(a in text for a in s.answers)
    niah = builder.samples("niah", 1024, 3)
    assert [s.info["depth"] for s in niah] == [0.0, 0.5, 1.0]
    assert builder.document(1024, 0).shape == (1, 1024)


@pytest.mark.model
@pytest.mark.slow
def test_eval_full_matches_hf_and_streaming_loses_the_needle(smollm, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tandem.models, "load_model", lambda *a, **k: smollm)
    args = ["eval", "--policies", "full,streaming,quest", "--tasks", "niah", "--lengths", "1k"]
    code = main(
        args + ["--samples", "3", "--check-hf", "--no-progress", "--no-plots", "--out", str(tmp_path)]
    )
    assert code == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "results.json").read_text())
    runs = {(r["policy"], r["sample"]): r for r in results["runs"]}
    for i in range(3):  # full == plain HF generation (DynamicCache) on every sample
        assert runs["full", i]["hf_identical"] and runs["full", i]["score"] == runs["full", i]["hf_score"]
        assert runs["full", i]["score"] == 1.0
    assert runs["streaming", 1]["score"] == 0.0  # the needle at 50% depth is outside sinks + window
    assert all(
        0 < runs["quest", i]["fraction_attended"] < 0.15 for i in range(3)
    )  # sparse, scored as it comes
    assert results["hf_check"] == {"policy": "full", "compared": 3, "identical_tokens": 3, "equal_score": 3}
    assert "| niah | 1K |" in (tmp_path / "results.md").read_text()


@pytest.mark.model
def test_eval_through_the_engine_gives_model_generate_s_answers(smollm, monkeypatch, tmp_path, capsys):
    """--engine on (the runner, eager on CPU): full attention still equals DynamicCache's tokens, and quest
    answers as it does through model.generate."""
    monkeypatch.setattr(tandem.models, "load_model", lambda *a, **k: smollm)
    runs = {}
    for engine in ("on", "off"):
        out = tmp_path / engine
        code = main(
            ["eval", "--policies", "full,quest", "--tasks", "niah", "--lengths", "1k", "--samples", "2",
             "--check-hf", "--engine", engine, "--no-progress", "--no-plots", "--out", str(out)]
        )  # fmt: skip
        assert code == 0, capsys.readouterr().err
        runs[engine] = {
            (r["policy"], r["sample"]): r for r in json.loads((out / "results.json").read_text())["runs"]
        }
    for i in range(2):
        assert runs["on"]["full", i]["engine"] and not runs["off"]["full", i]["engine"]
        assert runs["on"]["full", i]["hf_identical"]
        assert runs["on"]["quest", i]["output"] == runs["off"]["quest", i]["output"]
        assert runs["on"]["quest", i]["fraction_attended"] > 0


@pytest.mark.model
def test_an_interrupted_eval_keeps_every_finished_sample(smollm, monkeypatch, tmp_path, capsys):
    """Ctrl-C (or `timeout -s INT`) in the third sample: results.json holds the first two, marked incomplete."""
    from tandem.tools.evaluation.runner import Runner

    monkeypatch.setattr(tandem.models, "load_model", lambda *a, **k: smollm)
    generate = Runner._generate
    calls = []

    def interrupt_third_sample(self, sample, cache):
        calls.append(sample.index)
        if sample.index == 2:
            raise KeyboardInterrupt
        return generate(self, sample, cache)

    monkeypatch.setattr(Runner, "_generate", interrupt_third_sample)
    args = ["eval", "--policies", "full,streaming", "--tasks", "niah", "--lengths", "1k", "--samples", "4"]
    assert main(args + ["--no-progress", "--no-plots", "--out", str(tmp_path)]) == 130
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["policy"], r["sample"]) for r in results["runs"]) == [
        ("full", 0), ("full", 1), ("streaming", 0), ("streaming", 1),
    ]  # fmt: skip
    assert results["meta"]["complete"] is False
    assert "partial results" in capsys.readouterr().err


@pytest.mark.model
@pytest.mark.slow
def test_attention_output_error_is_zero_for_full_only(smollm, prose):
    model, tok = smollm
    plan = make_plan("full,streaming,quest", "ppl,error", "1k", samples=1, ppl_tokens=12, error_steps=3)
    results = evaluate(model, tok, plan, load_haystack())
    cells = {(c["task"], c["policy"]): c for c in results["cells"]}
    full, streaming, quest = (cells["error", p] for p in ("full", "streaming", "quest"))
    assert full["max_error"] < 1e-5 and full["score"] < 1e-6  # same computation up to float32 rounding
    assert streaming["score"] > 100 * full["score"] and streaming["fraction_attended"] == 0.0
    assert 0 < quest["fraction_attended"] < 0.15 and quest["score"] < streaming["score"]
    assert len(full["layer_head_error"]) == model.config.num_hidden_layers
    assert all(run["steps"] == 3 for run in results["runs"] if run["task"] == "error")
    ppl = {p: cells["ppl", p]["score"] for p in ("full", "streaming", "quest")}
    assert all(1 < v < 100 for v in ppl.values())


@pytest.mark.model
def test_fluxion_statistics_are_recorded_per_run_and_cell(smollm):
    """fluxion at tau = 0 (no profile needed) attends everything: its runs and cells carry its statistics."""
    model, tok = smollm
    plan = make_plan(
        "full,fluxion", "niah,ppl", "1k", samples=1, sets=["fluxion.tau=0"], ppl_tokens=8, error_steps=2
    )
    results = evaluate(model, tok, plan, load_haystack())
    runs = [r for r in results["runs"] if r["policy"] == "fluxion[tau=0]"]
    assert {r["task"] for r in runs} == {"niah", "ppl"}
    for record in runs + [c for c in results["cells"] if c["policy"] == "fluxion[tau=0]"]:
        assert record["streaming_head_share"] == 0 and record["mean_head_budget"] == pytest.approx(1.0)
        assert record["fraction_attended"] == pytest.approx(1.0)
    assert all("streaming_head_share" not in r for r in results["runs"] if r["policy"] == "full")


@pytest.mark.model
def test_the_error_task_puts_the_certified_bound_beside_the_measured_error(smollm, tmp_path):
    """quest with epsilon: each error run and cell carries the certified output bound of the same steps, in the
    measured error's units, never below it; the report prints both and plots one against the other."""
    model, tok = smollm
    plan = make_plan(
        "quest", "error", "1k", samples=1, sets=["certified.epsilon=0.05"], ppl_tokens=6, error_steps=2
    )
    results = evaluate(model, tok, plan, load_haystack())
    run = next(r for r in results["runs"] if r["task"] == "error")
    assert run["certified_error"] >= run["score"] and run["max_certified_error"] >= run["max_error"]
    cell = next(c for c in results["cells"] if c["task"] == "error")
    assert cell["certified_error"] == pytest.approx(run["certified_error"])
    written = write_results(results, tmp_path)
    assert "| quest[epsilon=0.05] | 1K |" in (tmp_path / "results.md").read_text()
    assert any(p.name == "error_certified_vs_measured.png" for p in written)
