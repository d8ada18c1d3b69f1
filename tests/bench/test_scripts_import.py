"""Every benchmark script imports: a renamed library function fails here, not on the GPU host where the script is
run next."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 20


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their helpers beside them
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # module level only: each runs its work under `if __name__ == "__main__"`
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
