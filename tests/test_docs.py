"""The docs cite only what the repository holds: every results folder they name exists, no file outside the
repository is referenced, and the results folders hold data and READMEs, not experiment patches (git history
keeps those)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "ROADMAP.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDER = re.compile(r"benchmarks/results/([A-Za-z0-9_.\-]+)")
OUTSIDE = ("../shared", "DESIGN.md", "/work/")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_results_folders_exist(doc):
    text = doc.read_text()
    missing = sorted({m for m in FOLDER.findall(text) if not (ROOT / "benchmarks/results" / m).exists()})
    assert not missing, f"{doc.name} cites results folders that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_file_outside_the_repository_is_cited(doc):
    text = doc.read_text()
    assert not [s for s in OUTSIDE if s in text], f"{doc.name} cites a file outside the repository"


def test_results_hold_no_patch_files():
    assert not sorted((ROOT / "benchmarks/results").rglob("*.patch"))
