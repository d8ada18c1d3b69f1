"""The docs cite only what the repository holds: every results folder they name exists, no file outside the
repository is referenced, and the results folders hold data and READMEs, not experiment patches (git history
keeps those), and the results index lists every folder."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "ROADMAP.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDER = re.compile(r"benchmarks/results/([A-Za-z0-9_.\-]+)")
# a markdown file named by itself (`architecture.md`), and a path that climbs out of the doc's folder (`../x`)
MARKDOWN_NAME = re.compile(r"(?<![\w./\-])([A-Za-z0-9_\-]+\.md)\b")
CLIMBING_PATH = re.compile(r"(?<![\w.])((?:\.\./)+[\w./\-]*)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cited_results_folders_exist(doc):
    text = doc.read_text()
    missing = sorted({m for m in FOLDER.findall(text) if not (ROOT / "benchmarks/results" / m).exists()})
    assert not missing, f"{doc.name} cites results folders that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_file_outside_the_repository_is_cited(doc):
    """Every markdown file a doc names is one of the repository's, and every path climbing out of the doc's folder
    lands on something the repository holds."""
    text = doc.read_text()
    held = {path.name for path in ROOT.rglob("*.md") if ".git" not in path.parts}
    unknown = sorted({name for name in MARKDOWN_NAME.findall(text) if name not in held})
    assert not unknown, f"{doc.name} names markdown files the repository does not hold: {unknown}"
    for path in CLIMBING_PATH.findall(text):
        target = (doc.parent / path).resolve()
        assert target.is_relative_to(ROOT) and target.exists(), (
            f"{doc.name} cites {path}, outside the repository"
        )


def test_results_hold_no_patch_files():
    assert not sorted((ROOT / "benchmarks/results").rglob("*.patch"))


def test_every_results_folder_is_indexed_in_order():
    """`benchmarks/results/README.md` has a row for each results folder and for nothing else, sorted by name."""
    results = ROOT / "benchmarks/results"
    index = [
        line.split("`")[1].rstrip("/")
        for line in (results / "README.md").read_text().splitlines()
        if line.startswith("| `")
    ]
    folders = sorted(path.name for path in results.iterdir() if path.is_dir())
    assert index == folders
