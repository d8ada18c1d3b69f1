"""`manifest.json`, which names what a result measured (commit, command, machine, versions, date)."""

import json
import re
import subprocess

from tandem import manifest


def test_describe_names_the_commit_command_machine_and_versions():
    info = manifest.describe(["tandem", "bench", "--steps", "4"])
    assert info["command"] == ["tandem", "bench", "--steps", "4"]
    if info["commit"] is not None:  # run from a git checkout (not from an installed wheel)
        assert re.fullmatch(r"[0-9a-f]{40}", info["commit"]) and isinstance(info["dirty"], bool)
        head = subprocess.run(
            ["git", "-C", str(manifest._REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        assert info["commit"] == head.stdout.strip()
    assert info["machine"]["cores"] >= 1 and info["machine"]["hostname"]
    assert info["versions"]["python"] and info["versions"]["torch"]
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", info["date"])


def test_without_git_the_commit_is_unknown_not_invented(monkeypatch):
    monkeypatch.setattr(manifest, "_git", lambda *args: None)
    assert manifest.code_state() == {"commit": None, "dirty": None}


def test_save_results_writes_the_manifest_beside_the_json_and_markdown(tmp_path):
    out = manifest.save_results(tmp_path / "run", "soak", {"rows": [1, 2]}, "# Soak\n")
    assert json.loads((out / "soak.json").read_text()) == {"rows": [1, 2]}
    assert (out / "soak.md").read_text() == "# Soak\n"
    assert "commit" in json.loads((out / "manifest.json").read_text())
