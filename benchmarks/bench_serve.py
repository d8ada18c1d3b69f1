"""`tandem serve` under load: many concurrent streaming clients against one server, measured at the client.

Starts `tandem serve` in a subprocess on a free loopback port, waits for /health, sends one small warm-up request,
then runs the load: `--concurrency` clients (one asyncio loop, the `openai` package's AsyncOpenAI), each streaming
/v1/completions requests one after another until `--requests` have been sent. Prompts are token-id lists (exact
lengths, no tokenizer) drawn with a seeded RNG from ids 1000-40000, of lengths drawn from `--prompt-tokens`;
temperature 0, `--max-tokens` each, `stream_options.include_usage`.

Per request: time to first token (TTFT: the first chunk with a choice), the gaps between successive chunks (the
server sends one chunk per token; the longest gap is the longest stall a stream saw, e.g. while another prompt
prefilled), completion tokens from the usage chunk, errors (any non-200, error chunk or broken stream; target 0).
From the server's /metrics: resident memory before the load (`--settle` seconds after the warm-up), right after
it and `--settle` seconds later (target: back to the baseline within 5%; the prompts' prefixes that the server
keeps stay, by design: `-- --no-prefix-cache` leaves them out), the prefill chunks' time, the decode steps (also by
how they ran: eager, recorded, rebound or replayed, and by width), and `tandem_live_caches` at the end (target 0).
With `--shared-documents N`, the prompts are N documents each followed by a question of its own, and the server's
prefix-cache counters give the hit rate.

`--compare-sequential` then sends `--sequential-requests` of the same requests one at a time to the same server:
batched throughput / sequential throughput, the sequential side weighted to the load's mix of prompt lengths, and
the same ratio for the decode steps alone (from the server's step times, prefill left out). Both passes prefill the
same prompts, one chunk per scheduler turn, so the end-to-end ratio stays below (prefill + decode one at a time) /
prefill, however well decode batches: close to 1 where prefill dominates (the CPU; long prompts, few new tokens). Prompts are prefilled in order, so 16 prompts of 32K in
2,048-token chunks fill a batch of 16 only if each generates more than about 15 x 16 tokens.

    python benchmarks/bench_serve.py --concurrency 64 --requests 128 --prompt-tokens 128,512,2048 --max-tokens 32 \\
        --compare-sequential --sequential-requests 8
    python benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 16 --requests 16 \\
        --prompt-tokens 32k --max-tokens 256 --warmup-tokens 4k --compare-sequential --sequential-requests 2
    python benchmarks/bench_serve.py --random-weights llama-3.1-8b --concurrency 16 --requests 16 \\
        --prompt-tokens 32k --shared-documents 4 --max-tokens 64 [-- --no-prefix-cache]

`--static-baseline` then runs `tandem bench`'s static batch at the load's shape in the same machine start, after
the server has stopped: the longest prompt as the context, the server's batch (`--max-batch`, default 16, at most
`--concurrency`), the same policy and weights (the default model's shape with random weights where the server runs
the default model), one cache filled with random K/V; the batched pass's decode steps against its tokens/s, and
its replayed steps of the static batch's width against its step (server flags after `--` are not passed on to it).

Server flags not listed here go after `--` (e.g. `-- --budget 0.1 --host-dtype int8`). Prints and saves serve.json /
.md, the server's log and a manifest into `--out` (default benchmarks/results/<date>_<machine>_serve/).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from tandem import manifest
from tandem.serve.metrics import rows_at_most

REPO = Path(__file__).resolve().parent.parent
TOKEN_IDS = (1000, 40000)  # valid in the default tokenizer's 49,152 ids, whatever the weights
WARMUP_MAX_TOKENS = 4
MEMORY_TOLERANCE = 0.05
PROGRESS_EVERY = 30.0  # seconds between progress lines
OTHER_LOAD = 0.05  # CPU-seconds per second that other processes may use before a pass's times are flagged
DEFAULT_SHAPE = (
    "smollm2-135m"  # the default model's shape, for the static baseline of a server of the default model
)
STATIC_STEPS = 16
SERVER_OPTIONS = ("model", "random_weights", "device", "dtype", "policy", "max_batch", "max_queue",
                  "prefill_chunk", "step_tokens", "host_memory", "device_memory")  # fmt: skip


# ---- the server ----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def start_server(args, extra: list[str], log_path: Path) -> tuple[subprocess.Popen, str, list[str]]:
    port = _free_port()
    command = [sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    for name in SERVER_OPTIONS:
        value = getattr(args, name)
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    command += extra
    with open(log_path, "w") as log:  # the server keeps its own descriptor
        server = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} while starting; see {log_path}")
        try:
            if json.loads(_get(base + "/health", 2.0)).get("status") == "ok":
                return server, base, command
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"the server did not answer /health in {args.start_timeout} s; see {log_path}")
        time.sleep(0.5)


def stop_server(server: subprocess.Popen, grace: float = 30.0) -> dict:
    """SIGINT (uvicorn's graceful shutdown, which stops the scheduler), then SIGKILL after `grace` seconds."""
    if server.poll() is not None:
        return {"exit_code": server.returncode, "killed": False, "already_exited": True}
    server.send_signal(signal.SIGINT)
    try:
        server.wait(grace)
        return {"exit_code": server.returncode, "killed": False}
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        return {"exit_code": server.returncode, "killed": True}


def read_metrics(base: str) -> dict[str, float]:
    """The server's /metrics as {"name{labels}": value} (Prometheus text format, samples only)."""
    samples = {}
    for line in _get(base + "/metrics").decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def histogram(before: dict, after: dict, name: str) -> dict:
    """Count, mean and upper bounds on the median, 99th percentile and max of a histogram's observations between
    two reads (each the first bucket bound that holds that share of them)."""
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    pattern = re.compile(re.escape(name) + r'_bucket\{le="([^"]+)"\}')
    buckets = sorted(
        (float(m.group(1)), after[k] - before.get(k, 0.0)) for k in after if (m := pattern.fullmatch(k))
    )

    def bound(share: float) -> float | None:
        return next((le for le, n in buckets if count and n >= share * count), None)

    return {
        "count": int(count),
        "mean_s": total / count if count else None,
        "p50_at_most_s": bound(0.5),
        "p99_at_most_s": bound(0.99),
        "max_at_most_s": bound(1.0),
    }


STEP_KINDS = ("replayed", "rebound", "recorded", "eager")  # `RowsRunner.last_step`, as /metrics labels them


def kinds_line(kinds: dict) -> str:
    """The report's line on the decode steps by how they ran (`steps_by_kind`)."""
    if not kinds:
        return "Decode steps by how they ran: none."
    parts = []
    for kind in STEP_KINDS:
        k = kinds.get(kind)
        if k is not None:
            widths = ", ".join(
                f"{r['count']} of <= {rows} at {_ms(r['mean_s'])}" for rows, r in k["by_rows"].items()
            )
            parts.append(f"{kind} {k['count']} ({k['seconds']:.1f} s, mean {_ms(k['mean_s'])}: {widths})")
    return "Decode steps by how they ran (requests rounded up to a power of two): " + "; ".join(parts) + "."


def steps_by_kind(before: dict, after: dict) -> dict:
    """The decode steps between two reads by how they ran and by width (`tandem_decode_steps_total{kind,
    rows_at_most}` and their time): {kind: {"count", "seconds", "mean_s", "by_rows": {"rows": {"count", "mean_s"}}}}
    for the kinds that ran, the widths in increasing order."""
    pattern = re.compile(
        r'tandem_decode_(steps|step_time_seconds)_total\{kind="([^"]+)",rows_at_most="(\d+)"\}'
    )
    cells: dict = {}
    for key, value in after.items():
        if m := pattern.fullmatch(key):
            cell = cells.setdefault((m.group(2), int(m.group(3))), [0.0, 0.0])
            cell[m.group(1) != "steps"] = value - before.get(key, 0.0)
    out = {}
    for (kind, rows), (count, seconds) in sorted(cells.items()):
        if count <= 0:
            continue
        entry = out.setdefault(kind, {"count": 0, "seconds": 0.0, "by_rows": {}})
        entry["count"] += int(count)
        entry["seconds"] += seconds
        entry["by_rows"][str(rows)] = {"count": int(count), "mean_s": seconds / count}
    for entry in out.values():
        entry["mean_s"] = entry["seconds"] / entry["count"]
    return out


# ---- the clients ---------------------------------------------------------------------------------------------
async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; times are seconds from sending it."""
    start = time.perf_counter()
    chunks, usage, error = [], None, None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason is None:
                chunks.append(time.perf_counter() - start)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        if usage is None:
            error = "the stream ended without a usage chunk"
    except Exception as err:  # any failure counts as this request's error (openai.APIError and the rest)
        error = f"{type(err).__name__}: {err}"
    seconds = time.perf_counter() - start
    if usage is not None:
        # a text piece held back to the end (a partial character) comes as one more chunk with the last token's
        chunks = chunks[:usage]
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": usage or 0,
        "ttft_s": chunks[0] if chunks else None,
        "gaps_s": [b - a for a, b in zip(chunks, chunks[1:])],
        "seconds": seconds,
        "error": error,
    }


async def sample_server(base: str, samples: list, every: float) -> None:
    while True:
        try:
            m = await asyncio.to_thread(read_metrics, base)
            samples.append({"t": time.perf_counter(), "rss": m.get("process_resident_memory_bytes"),
                            "decoding": m.get("tandem_requests_decoding"),
                            "waiting": m.get("tandem_requests_waiting")})  # fmt: skip
        except OSError:
            pass
        await asyncio.sleep(every)


async def run_load(base: str, model: str, prompts: list[list[int]], args, concurrency: int) -> dict:
    """`concurrency` clients share the list of prompts, each sending its next one when the last has ended."""
    client = openai.AsyncOpenAI(
        base_url=base + "/v1", api_key="none", max_retries=0, timeout=args.request_timeout
    )
    queue = iter(enumerate(prompts))
    results: list[dict | None] = [None] * len(prompts)

    finished, shown = [0], [time.perf_counter()]

    async def worker() -> None:
        for i, prompt in queue:
            results[i] = await one_request(client, model, prompt, args.max_tokens)
            finished[0] += 1
            if time.perf_counter() - shown[0] > PROGRESS_EVERY:
                shown[0] = time.perf_counter()
                print(f"  {finished[0]}/{len(prompts)} requests done", flush=True)

    samples: list[dict] = []
    sampler = asyncio.create_task(sample_server(base, samples, args.sample_every))
    before = await asyncio.to_thread(read_metrics, base)
    busy, cpu, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
    workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(prompts)))]
    done, pending = await asyncio.wait(workers, timeout=args.time_limit)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    busy = machine_busy_seconds() - busy if busy is not None else None
    after = await asyncio.to_thread(read_metrics, base)
    server_cpu = after["process_cpu_seconds_total"] - before["process_cpu_seconds_total"]
    sampler.cancel()
    await asyncio.gather(sampler, return_exceptions=True)
    await client.close()
    for i, r in enumerate(results):
        if r is None:
            results[i] = {"prompt_tokens": len(prompts[i]), "completion_tokens": 0, "ttft_s": None, "gaps_s": [],
                          "seconds": None, "error": f"not finished within --time-limit {args.time_limit} s"}  # fmt: skip
    summary = summarize(results, wall, cpu, concurrency, samples)
    summary["server_cpu_s"] = server_cpu
    summary["server"] = server_side(before, after, summary)
    summary["other_cpu_s"] = busy - server_cpu - cpu if busy is not None else None
    if summary["other_cpu_s"] is not None and summary["other_cpu_s"] > OTHER_LOAD * wall:
        print(f"warning: other processes used {summary['other_cpu_s']:.0f} CPU-seconds during this pass of "
              f"{wall:.0f} s: its times are not this server's alone", flush=True)  # fmt: skip
    return summary


def server_side(before: dict, after: dict, summary: dict) -> dict:
    """What the server's /metrics saw during a pass: prefill chunks, decode steps, its own latencies."""
    steps = histogram(before, after, "tandem_decode_step_seconds")
    # every generated token but each request's first (its prefill's) came from a decode step
    decoded = summary["generated_tokens"] - (summary["requests"] - summary["errors"])
    step_seconds = steps["count"] * steps["mean_s"] if steps["count"] else 0.0
    return {
        "prefill_chunks": histogram(before, after, "tandem_prefill_chunk_seconds"),
        "decode_steps": steps,
        "decode_steps_by_kind": steps_by_kind(before, after),
        "mean_decode_batch": decoded / steps["count"] if steps["count"] else None,
        "decode_tokens_per_step_second": decoded / step_seconds if step_seconds else None,
        "ttft": histogram(before, after, "tandem_time_to_first_token_seconds"),
        "inter_token": histogram(before, after, "tandem_inter_token_seconds"),
        "requests_by_outcome": {
            k: after[k] - before.get(k, 0.0) for k in after if k.startswith("tandem_requests_total")
        },
        # the server's prefix cache (absent with --no-prefix-cache): requests that started from a kept prefix
        "prefix": {
            key: after[f"tandem_prefix_{key}_total"] - before.get(f"tandem_prefix_{key}_total", 0.0)
            for key in ("lookups", "hits", "hit_tokens", "evictions")
        }
        if "tandem_prefix_lookups_total" in after
        else None,
        # the server's host pool (on CUDA): host-tier stores made from ended requests' memory, and mapped anew,
        # and how many of them were made ahead of their request (a server without that counter: absent)
        "host_pool": {
            key: after[f"tandem_host_pool_{key}_total"] - before.get(f"tandem_host_pool_{key}_total", 0.0)
            for key in ("reused", "made", "ahead")
            if f"tandem_host_pool_{key}_total" in after
        }
        if "tandem_host_pool_made_total" in after
        else None,
    }


def serve_defaults() -> argparse.Namespace:
    """`tandem serve`'s defaults, from its own parser: what an unset server flag is."""
    from tandem.cli.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


def static_command(args, context: int, out: Path) -> list[str]:
    """`tandem bench`'s static batch at the load's shape: `context` tokens, the server's batch, policy and weights."""
    defaults = serve_defaults()
    batch = min(args.max_batch or defaults.max_batch, args.concurrency)
    command = [
        sys.executable,
        "-m",
        "tandem.cli",
        "bench",
        "--model",
        args.random_weights or args.model or DEFAULT_SHAPE,
    ]
    command += [
        "--contexts",
        str(context),
        "--batches",
        str(batch),
        "--policies",
        args.policy or defaults.policy,
    ]
    command += ["--hf", "none", "--steps", str(STATIC_STEPS), "--out", str(out)]
    for name in ("device", "dtype"):
        if getattr(args, name) is not None:
            command += [f"--{name}", getattr(args, name)]
    return command


def static_result(bench: dict, batched: dict) -> dict:
    """The static batch's row of `tandem bench`'s result, and the batched pass's decode steps against it."""
    rows = [r for r in bench["rows"] if r.get("status") == "ok" and r.get("tokens_per_s")]
    if not rows:
        states = ", ".join(f"{r.get('system')}: {r.get('status')}" for r in bench["rows"]) or "no row"
        raise RuntimeError(f"the static batch did not run ({states})")
    row = rows[0]
    decode = batched["server"]["decode_tokens_per_step_second"]
    return {
        "system": row["system"],
        "context": row["context"],
        "batch": row["batch"],
        "tokens_per_s": row["tokens_per_s"],
        "tpot_median_ms": row["tpot_median_ms"],
        "decode_steps_over_static": decode / row["tokens_per_s"] if decode else None,
    }


def run_static(args, report: dict, out: Path) -> dict:
    """Run the static baseline (`static_command`) and return `static_result`, with its command."""
    context = max(report["prompt_mix"])
    with tempfile.TemporaryDirectory() as tmp:
        command = static_command(args, context, Path(tmp))
        print(f"static batch: {' '.join(command[3:])} ...", flush=True)
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise RuntimeError(f"`tandem bench` exited with {done.returncode}:\n{tail}")
        bench = json.loads((Path(tmp) / "bench.json").read_text())
        out.mkdir(parents=True, exist_ok=True)
        for name in ("bench.json", "bench.md"):
            (out / f"static_{name}").write_text((Path(tmp) / name).read_text())
    return {**static_result(bench, report["batched"]), "command": command[3:]}


def machine_busy_seconds() -> float | None:
    """CPU-seconds every process on the machine has used since boot (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(results: list[dict], wall: float, cpu: float, concurrency: int, samples: list[dict]) -> dict:
    ok = [r for r in results if r["error"] is None]
    tokens = sum(r["completion_tokens"] for r in results)
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    gaps = [g for r in ok for g in r["gaps_s"]]
    rss = [s["rss"] for s in samples if s["rss"] is not None]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_messages": sorted({r["error"] for r in results if r["error"]})[:10],
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "itl_p50_s": _pct(gaps, 0.5),
        "itl_p99_s": _pct(gaps, 0.99),
        "itl_max_s": max(gaps) if gaps else None,
        "client_cpu_s": cpu,
        "peak_rss_bytes": max(rss) if rss else None,
        "peak_decoding": max((s["decoding"] or 0 for s in samples), default=None),
        "results": results,
    }


def sequential_subset(prompts: list[list[int]], count: int) -> list[list[int]]:
    """`count` of the prompts, taken in turn from each prompt length (so every length is timed)."""
    by_length: dict[int, list] = {}
    for p in prompts:
        by_length.setdefault(len(p), []).append(p)
    chosen, rounds = [], 0
    while len(chosen) < min(count, len(prompts)):
        for group in by_length.values():
            if rounds < len(group) and len(chosen) < count:
                chosen.append(group[rounds])
        rounds += 1
    return chosen


def weighted_sequential(batched: dict, sequential: dict) -> float | None:
    """Sequential tokens/s for the batched load's mix of prompt lengths: each length's mean time and tokens per
    request, one at a time, weighted by how often the load sent it. None where a length was not timed."""
    per_length: dict[int, list[dict]] = {}
    for r in sequential["results"]:
        if r["error"] is None:
            per_length.setdefault(r["prompt_tokens"], []).append(r)
    tokens = seconds = 0.0
    for r in batched["results"]:
        timed = per_length.get(r["prompt_tokens"])
        if not timed:
            return None
        tokens += statistics.mean(t["completion_tokens"] for t in timed)
        seconds += statistics.mean(t["seconds"] for t in timed)
    return tokens / seconds if seconds else None


# ---- report --------------------------------------------------------------------------------------------------
def _ms(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f} s" if s >= 10 else f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:.0f} MiB"


def _cpu(r: dict) -> str:
    other = "-" if r["other_cpu_s"] is None else f"{r['other_cpu_s']:.0f} s"
    return f"{r['server_cpu_s']:.0f} s / {r['client_cpu_s']:.0f} s / {other}"


def _by_length(report: dict) -> list[str]:
    lengths = sorted({r["prompt_tokens"] for r in report["batched"]["results"]})
    mix = {int(n): count for n, count in report["prompt_mix"].items()}  # str keys once read back from JSON
    seq = report.get("sequential")
    lines = [
        "| prompt tokens | requests | TTFT p50, batched | request p50, batched | request mean, sequential |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        ok = [r for r in report["batched"]["results"] if r["prompt_tokens"] == n and r["error"] is None]
        alone = [
            r["seconds"]
            for r in (seq or {"results": []})["results"]
            if r["prompt_tokens"] == n and r["error"] is None
        ]
        lines.append(
            f"| {n} | {mix[n]} | {_ms(_pct([r['ttft_s'] for r in ok], 0.5))} | "
            f"{_ms(_pct([r['seconds'] for r in ok], 0.5))} | {_ms(statistics.mean(alone)) if alone else '-'} |"
        )
    return lines


def markdown(report: dict) -> str:
    b, seq, mem = report["batched"], report.get("sequential"), report["memory"]
    mix = ", ".join(f"{n} tokens x {count}" for n, count in report["prompt_mix"].items())
    pre, steps = b["server"]["prefill_chunks"], b["server"]["decode_steps"]
    lines = [
        "# `tandem serve` under load",
        "",
        f"Machine: {report['machine_line']}. Weights: {report['weights']}. Server: `{' '.join(report['server_args'])}`.",
        f"Load: {b['requests']} requests from {b['concurrency']} concurrent streaming clients (/v1/completions, "
        f"token-id prompts of {report['prompt_tokens']} tokens, seeded mix {mix}), max_tokens "
        f"{report['max_tokens']}, temperature 0.",
        "",
        "| pass | clients | requests | errors | tokens | wall | tokens/s | requests/s | TTFT p50 | TTFT p99 | "
        "ITL p50 | ITL p99 | ITL max | CPU: server / client / other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in (("batched", b), ("sequential", seq)):
        if r is not None:
            lines.append(
                f"| {name} | {r['concurrency']} | {r['requests']} | {r['errors']} | {r['generated_tokens']} | "
                f"{r['wall_s']:.1f} s | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | {_ms(r['ttft_p50_s'])} | "
                f"{_ms(r['ttft_p99_s'])} | {_ms(r['itl_p50_s'])} | {_ms(r['itl_p99_s'])} | {_ms(r['itl_max_s'])} | "
                f"{_cpu(r)} |"
            )
    lines.append("")
    for name, r in (("batched", b), ("sequential", seq)):
        if r is not None and r["errors"]:
            lines.append(f"Errors ({name}): " + "; ".join(r["error_messages"]))
    if seq is not None:
        ratio = report["batched_over_sequential"]
        lines.append(
            f"Batched / sequential throughput: **{ratio:.2f}x** ({b['tokens_per_s']:.1f} tokens/s against "
            f"{report['sequential_tokens_per_s_weighted']:.1f}: the sequential pass's mean time and tokens per "
            "request of each prompt length, weighted to the batched load's mix)."
            if ratio is not None
            else "Batched / sequential: not computed (a prompt length was not timed one at a time)."
        )
        if report["decode_steps_batched_over_sequential"] is not None:
            lines.append(
                f"Decode steps alone (the server's step time, prefill left out): "
                f"{b['server']['decode_tokens_per_step_second']:.1f} tokens/s batched against "
                f"{seq['server']['decode_tokens_per_step_second']:.1f} one at a time, "
                f"{report['decode_steps_batched_over_sequential']:.2f}x."
            )
    static = report.get("static")
    if static is not None:
        ratio = static["decode_steps_over_static"]
        lines.append(
            f"Against the static batch (`tandem bench`, {static['system']}, {static['batch']} x {static['context']} "
            f"tokens, one cache, run after the server in the same machine start): decode steps "
            f"{b['server']['decode_tokens_per_step_second'] or 0:.1f} tokens/s at a mean batch of "
            f"{b['server']['mean_decode_batch'] or 0:.1f} against {static['tokens_per_s']:.1f} "
            f"({static['tpot_median_ms']:.1f} ms a step), "
            + (f"**{ratio:.2f}x**." if ratio is not None else "not computed (no decode step).")
        )
        width = rows_at_most(static["batch"])
        kinds = b["server"].get("decode_steps_by_kind", {})
        replayed = kinds.get("replayed", {}).get("by_rows", {}).get(str(width))
        if replayed is not None:
            lines.append(
                f"The replayed steps of {width // 2 + 1}-{width} requests (no recording, no re-pointing): "
                f"{replayed['count']}, mean {_ms(replayed['mean_s'])} against the static batch's "
                f"{static['tpot_median_ms']:.1f} ms at {static['batch']}."
            )
    settled = mem["settled_vs_before"]
    prefix = b["server"].get("prefix")
    if report.get("shared_documents"):
        lines.append(
            f"Prompts: {report['shared_documents']} shared documents, each request one of them and a question of "
            f"{report['question_tokens']} tokens of its own."
        )
    if prefix is None:
        lines.append("Prefix cache: off.")
    else:
        rate = prefix["hits"] / prefix["lookups"] if prefix["lookups"] else 0.0
        lines.append(
            f"Prefix cache (batched pass): {prefix['hits']:.0f} of {prefix['lookups']:.0f} requests started from a "
            f"kept prefix (hit rate {rate:.0%}), {prefix['hit_tokens']:.0f} prompt tokens not prefilled, "
            f"{prefix['evictions']:.0f} prefixes dropped for room."
        )
    pool = b["server"].get("host_pool")
    if pool is not None:
        lines.append(
            f"Host pool (batched pass): {pool['reused']:.0f} host-tier stores made from ended requests' memory, "
            f"{pool['made']:.0f} mapped and page-locked anew"
            + (f", {pool['ahead']:.0f} of them made ahead of their request." if "ahead" in pool else ".")
        )
    lines += [
        "",
        *_by_length(report),
        "",
        f"Server resident memory: {_mb(mem['before'])} before the load (after one warm-up request), "
        f"{_mb(b['peak_rss_bytes'])} at its peak (sampled every {report['sample_every_s']:g} s), {_mb(mem['after'])} "
        f"right after it, {_mb(mem['settled'])} {report['settle_s']:g} s later: {settled:+.1%} against before "
        f"(target within {MEMORY_TOLERANCE:.0%}: {'met' if abs(settled) <= MEMORY_TOLERANCE else 'missed'}); "
        f"{_mb(mem['end'])} at the end (as long after the sequential pass).",
        f"Prefill chunks during the load: {pre['count']}, mean {_ms(pre['mean_s'])}, max at most "
        f"{pre['max_at_most_s']} s (the histogram's bucket bound). Decode steps: {steps['count']}, mean "
        f"{_ms(steps['mean_s'])} (at most {steps['p50_at_most_s']} s at the median, {steps['p99_at_most_s']} s at p99, "
        f"{steps['max_at_most_s']} s at the max), mean batch {b['server']['mean_decode_batch'] or 0:.1f}, largest batch seen "
        f"{b['peak_decoding']:.0f}.",
        kinds_line(b["server"].get("decode_steps_by_kind", {})),
        f"Live caches at the end: {report['live_caches_end']:.0f} (target 0). Server stopped with exit code "
        f"{report['server_stop']['exit_code']}{', killed after the grace period' if report['server_stop']['killed'] else ''}.",
        "",
        "TTFT counts from sending the request (queueing included) to its first chunk; ITL are the gaps between "
        "successive chunks of one stream, all streams pooled. CPU: CPU-seconds of the server, of this client "
        "process and of every other process on the machine during the pass (from /proc/stat; other work there "
        "makes the times not the server's alone).",
    ]
    return "\n".join(lines) + "\n"


def rewrite(folder: Path) -> None:
    """Write serve.md again from a serve.json (e.g. after a change to the report's wording)."""
    (folder / "serve.md").write_text(markdown(json.loads((folder / "serve.json").read_text())))


def machine_tag(machine: dict, device: str | None) -> str:
    if device == "cpu" or not machine["gpus"]:
        return "cpu"
    name = machine["gpus"][0].lower()
    return next(
        (t for t in ("h200", "h100", "a100", "l40s", "l4") if t in name), re.sub(r"\W+", "", name.split()[-1])
    )


# ---- main ----------------------------------------------------------------------------------------------------
def _tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Server flags not listed go after `--`.",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, default=64, help="concurrent streaming clients (default 64)")
    p.add_argument("--requests", type=int, default=128, help="requests in all (default 128)")
    p.add_argument("--prompt-tokens", default="128,512,2048", help="prompt lengths to draw from, e.g. 512,2k")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shared-documents",
        type=int,
        default=0,
        help="prompts over this many shared documents: each prompt one of them (its length drawn from "
        "--prompt-tokens) and a question of its own, so that the server's prefix cache may serve the document "
        "(default 0: every prompt its own)",
    )
    p.add_argument(
        "--question-tokens", type=int, default=256, help="with --shared-documents: each question's tokens"
    )
    p.add_argument(
        "--warmup-tokens",
        default="16",
        help="prompt tokens of the one warm-up request before the load (default 16; one longer than the sinks "
        "and window also runs the host tier's decode path once, e.g. 4k, so that its first-use costs fall before the "
        "load)",
    )
    p.add_argument("--compare-sequential", action="store_true", help="also send requests one at a time")
    p.add_argument(
        "--static-baseline",
        action="store_true",
        help="then run `tandem bench`'s static batch at the load's shape and set the decode steps against it",
    )
    p.add_argument(
        "--sequential-requests", type=int, default=None, help="requests of that pass (default all)"
    )
    p.add_argument(
        "--settle", type=float, default=2.0, help="seconds after the load before memory is read again"
    )
    p.add_argument(
        "--sample-every", type=float, default=1.0, help="seconds between /metrics reads in the load"
    )
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds a stream may go silent")
    p.add_argument("--time-limit", type=float, default=1800.0, help="seconds a pass may take in all")
    p.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds to wait for the server's /health"
    )
    server = p.add_argument_group("server (passed to `tandem serve`; unset ones keep its defaults)")
    server.add_argument("--model")
    server.add_argument("--random-weights", metavar="SHAPE", help="e.g. llama-3.1-8b")
    server.add_argument("--device")
    server.add_argument("--dtype")
    server.add_argument("--policy")
    server.add_argument("--max-batch", type=int)
    server.add_argument("--max-queue", type=int)
    server.add_argument("--prefill-chunk", type=int)
    server.add_argument("--step-tokens", type=int)
    server.add_argument("--host-memory", type=float, metavar="GIB")
    server.add_argument("--device-memory", type=float, metavar="GIB")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--rewrite", type=Path, metavar="FOLDER", help="only write FOLDER/serve.md again from its serve.json"
    )
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--concurrency, --requests and --max-tokens must be >= 1")
    return args, extra


async def main_async(args, base: str, model: str) -> dict:
    rng = random.Random(args.seed)
    lengths = [_tokens(t) for t in args.prompt_tokens.split(",")]
    if args.shared_documents:
        # each prompt one of the documents (their lengths drawn from --prompt-tokens), then its own question
        documents = [
            [rng.randrange(*TOKEN_IDS) for _ in range(rng.choice(lengths))]
            for _ in range(args.shared_documents)
        ]
        prompts = [rng.choice(documents) + [rng.randrange(*TOKEN_IDS) for _ in range(args.question_tokens)]
                   for _ in range(args.requests)]  # fmt: skip
    else:
        drawn = [rng.choice(lengths) for _ in range(args.requests)]
        prompts = [[rng.randrange(*TOKEN_IDS) for _ in range(n)] for n in drawn]
    warm = [rng.randrange(*TOKEN_IDS) for _ in range(_tokens(args.warmup_tokens))]
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
        warmup = await one_request(client, model, warm, WARMUP_MAX_TOKENS)
    if warmup["error"]:
        raise RuntimeError(f"the warm-up request failed: {warmup['error']}")
    # read as the settled memory is: the server returns free memory once it goes idle
    await asyncio.sleep(args.settle)
    before = read_metrics(base)
    print(f"load: {args.requests} requests, {args.concurrency} clients ...", flush=True)
    batched = await run_load(base, model, prompts, args, args.concurrency)
    after = read_metrics(base)
    await asyncio.sleep(args.settle)
    settled = read_metrics(base)
    rss = "process_resident_memory_bytes"
    report = {
        "prompt_tokens": args.prompt_tokens,
        "prompt_mix": {n: sum(len(p) == n for p in prompts) for n in sorted({len(p) for p in prompts})},
        "shared_documents": args.shared_documents,
        "question_tokens": args.question_tokens if args.shared_documents else None,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "settle_s": args.settle,
        "sample_every_s": args.sample_every,
        "warmup": warmup,
        "batched": batched,
        "memory": {
            "before": before[rss],
            "after": after[rss],
            "settled": settled[rss],
            "settled_vs_before": settled[rss] / before[rss] - 1.0,
        },  # fmt: skip
    }
    print(f"batched: {batched['tokens_per_s']:.1f} tokens/s, {batched['errors']} errors", flush=True)
    if args.compare_sequential:
        subset = sequential_subset(prompts, args.sequential_requests or len(prompts))
        print(f"sequential: {len(subset)} requests one at a time ...", flush=True)
        sequential = await run_load(base, model, subset, args, 1)
        weighted = weighted_sequential(batched, sequential)
        report["sequential"] = sequential
        report["sequential_tokens_per_s_weighted"] = weighted
        report["batched_over_sequential"] = batched["tokens_per_s"] / weighted if weighted else None
        steps = (
            batched["server"]["decode_tokens_per_step_second"],
            sequential["server"]["decode_tokens_per_step_second"],
        )
        report["decode_steps_batched_over_sequential"] = steps[0] / steps[1] if all(steps) else None
    await asyncio.sleep(args.settle)
    end = read_metrics(base)
    report["live_caches_end"] = end["tandem_live_caches"]
    report["reserved_host_bytes_end"] = end["tandem_reserved_host_bytes"]
    report["memory"]["end"] = end[rss]
    return report


def main() -> None:
    args, extra = parse_args(sys.argv[1:])
    if args.rewrite is not None:
        return rewrite(args.rewrite)
    cpu = manifest.machine()
    print(f"machine: {cpu['cpu']}, {cpu['cores']} cores, {cpu['memory_gb']} GB", flush=True)
    weights = (
        f"random ({args.random_weights} shape)"
        if args.random_weights
        else (args.model or "SmolLM2-135M-Instruct (default model)")
    )
    print(f"weights: {weights}", flush=True)
    log = Path(tempfile.gettempdir()) / f"bench_serve_{os.getpid()}.log"  # copied into --out at the end
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server
    server, base, command = start_server(args, extra, log)
    try:
        model = json.loads(_get(base + "/v1/models"))["data"][0]["id"]
        print(f"server up at {base} serving '{model}' (log: {log})", flush=True)
        report = asyncio.run(main_async(args, base, model))
    except BaseException:
        if server.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            print(
                f"the server exited with {server.returncode}; the end of its log ({log}):\n{tail}",
                file=sys.stderr,
            )
        raise
    finally:
        stop = stop_server(server)
    try:  # named after the server has gone, so that this process takes no GPU memory from it
        import torch  # noqa: F401 (manifest names the GPUs only where torch is imported)
    except ImportError:
        pass
    machine = manifest.machine()
    gpus = f", {', '.join(machine['gpus'])}" if machine["gpus"] and args.device != "cpu" else ""
    report.update({
        "machine": machine,
        "machine_line": f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gb']} GB{gpus}",
        "weights": weights,
        "server_args": command[3:],
        "server_stop": stop,
    })  # fmt: skip
    out = args.out or REPO / "benchmarks" / "results" / (
        f"{datetime.date.today().isoformat()}_{machine_tag(machine, args.device)}_serve"
    )
    if args.static_baseline:
        report["static"] = run_static(args, report, out)
    text = markdown(report)
    print(text)
    manifest.write(out)
    (out / "serve.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "serve.md").write_text(text)
    (out / "server.log").write_text(log.read_text())
    log.unlink()
    print(f"saved {out}/serve.json, serve.md, server.log, manifest.json")


if __name__ == "__main__":
    main()
