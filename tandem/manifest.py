"""`manifest.json`: what a result measured, written beside the outputs of `tandem bench`, `tandem eval` and
`tandem simulate --sweep`: the commit (and whether the work tree had uncommitted changes), the command line,
the machine, the package versions and the date.

Importable without torch (`tandem --help` stays fast): versions come from the installed packages' metadata, and
the GPU is named only when the command has imported torch already.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("tandem-kv", "torch", "transformers", "triton", "numpy")
_REPO = Path(__file__).resolve().parent.parent  # the checkout, when tandem runs from one


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def code_state() -> dict:
    """{"commit": hash or None, "dirty": bool or None}: the checkout tandem runs from (None for both when it is
    installed from a wheel, without git, or outside a work tree)."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[str]:
    torch = sys.modules.get("torch")  # named only where the command imported it
    if torch is None or not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def machine() -> dict:
    return {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "gpus": _gpus(),
    }


def versions() -> dict:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def describe(argv: list[str] | None = None) -> dict:
    """The manifest of a run of this process: `argv` defaults to the process's command line."""
    command = list(sys.argv if argv is None else argv)
    return {
        **code_state(),
        "command": command,
        "machine": machine(),
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write(
    out_dir: str | os.PathLike, argv: list[str] | None = None, name: str = "manifest.json", **extra
) -> Path:
    """Write the manifest as `name` into `out_dir` (created if needed); `extra` keys are added as given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps({**describe(argv), **extra}, indent=1) + "\n", encoding="utf-8")
    return path


def save_results(out_dir: str | os.PathLike, stem: str, data: dict, text: str) -> Path:
    """A benchmark's results in `out_dir`: the manifest, `stem`.json (`data`) and `stem`.md (`text`)."""
    out = Path(out_dir)
    write(out)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text(text, encoding="utf-8")
    return out
