"""Start-up of the default model on this machine: `load_model` from the GGUF file (a cold model cache, which also
converts it), from its converted copy (warm), and the README's `tandem generate` command with one new token, end
to end in a fresh process. Prints and saves startup.json / .md and a manifest.

    python benchmarks/bench_startup.py --out results/startup
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem import manifest

LOAD = "import time, sys; from tandem import load_model; t = time.perf_counter(); load_model(device='cpu'); print(time.perf_counter() - t)"
COMMAND = ["-m", "tandem.cli", "generate", "--chat", "--prompt",
           "Explain what a key-value cache is in one sentence.", "--max-new-tokens", "1"]  # fmt: skip


def _seconds(args: list[str], env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    return float(done.stdout.strip().splitlines()[-1]) if args[0] == "-c" else wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="warm loads and command runs each")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TANDEM_CACHE_DIR": cache}
        rows = [
            {
                "what": "load_model, cold cache (parses the GGUF file, converts it)",
                "seconds": _seconds(["-c", LOAD], env),
            }
        ]
        rows += [
            {"what": "load_model, warm cache", "seconds": _seconds(["-c", LOAD], env)}
            for _ in range(args.repeats)
        ]
        rows += [{"what": "tandem generate --max-new-tokens 1, whole process, warm cache", "seconds": _seconds(COMMAND, env)}
                 for _ in range(args.repeats)]  # fmt: skip
    lines = [
        f"# Start-up of the default model ({os.cpu_count()} cores)",
        "",
        "| what | seconds |",
        "|---|---|",
    ]
    lines += [f"| {r['what']} | {r['seconds']:.2f} |" for r in rows]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        manifest.write(out)
        (out / "startup.json").write_text(json.dumps(rows, indent=1))
        (out / "startup.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
