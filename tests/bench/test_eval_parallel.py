"""benchmarks/eval_parallel.py's shard plan and runner: one shard per (length, task, variant) with
--split-tasks, longest contexts first; a finished shard is not run again; the deadline ends a running shard."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "eval_parallel.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("eval_parallel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_tasks_plans_every_cell_longest_first_with_its_variants_together(script, tmp_path):
    variants = ["full", "quest --set quest.epsilon=0.05"]
    shards = script.plan_shards(
        variants, ["1k", "8k", "2k"], ["--samples", "2", "--tasks", "niah,vt"], tmp_path, True
    )
    names = [folder.name for folder, _ in shards]
    assert names == [
        "8k_0_full_niah", "8k_1_quest_niah", "8k_0_full_vt", "8k_1_quest_vt",
        "2k_0_full_niah", "2k_1_quest_niah", "2k_0_full_vt", "2k_1_quest_vt",
        "1k_0_full_niah", "1k_1_quest_niah", "1k_0_full_vt", "1k_1_quest_vt",
    ]  # fmt: skip
    command = shards[1][1]
    assert command[command.index("--tasks") + 1] == "niah" and command.count("--tasks") == 1
    assert "--set" in command and "--samples" in command
    with pytest.raises(SystemExit, match="--tasks"):
        script.plan_shards(variants, ["1k"], ["--samples", "2"], tmp_path, True)


def test_a_finished_shard_is_not_run_again_and_the_deadline_ends_a_running_one(script, tmp_path):
    done = tmp_path / "done"
    done.mkdir()
    (done / "results.json").write_text("{}")
    never = [sys.executable, "-c", "raise SystemExit(3)"]
    assert script.run_shard(done, never, None) == 0  # finished by an earlier run: not started
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "results.json").write_text('{"meta": {"complete": false}}')  # written after a sample, then cut
    assert script.run_shard(cut, never, None) == 3  # run again
    (cut / "results.json").write_text('{"meta": {"comp')  # cut while writing
    assert not script.finished(cut)
    assert script.run_shard(tmp_path / "late", never, 0.0) is None  # past the deadline: not started
    assert not (tmp_path / "late").exists()
    assert script.run_shard(tmp_path / "fails", never, None) == 3
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    assert script.run_shard(tmp_path / "slow", slow, 0.5) is None  # cut at the deadline
    assert not (tmp_path / "slow" / "results.json").exists()
