"""`tandem serve`: an OpenAI-compatible HTTP server with continuous batching over per-request Tandem caches."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generate import add_cache_arguments, add_model_arguments, build_config

DESCRIPTION = (
    "Serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models) plus /health "
    "and /metrics (Prometheus). Requests join the running decode batch at step boundaries; long prompts prefill "
    "in chunks between decode steps. Each request's cache keeps its KV as `tandem generate` does; its settings "
    "default to the flags below and may be changed per request by extra body fields (e.g. "
    '{"policy": "quest", "budget": 0.1}).'
)
GIB = 2**30


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a number of GiB > 0") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a number of GiB > 0")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: the model file or directory's name)",
    )
    p.add_argument(
        "--max-batch", type=int, default=16, help="requests decoding at once, at most (default 16)"
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up at start (one decode step at every batch size up to --max-batch on throwaway "
        "requests, so that each batch shape's one-time costs and memory fall before the first request)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting for admission, at most; more get 429 with Retry-After (default 256)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens prefilled per turn between decode steps: the longest pause a running stream sees "
        "is one chunk (default 256 on CPU, 2048 on CUDA)",
    )
    p.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help="a turn's token budget: one token for each decoding request, and the waiting prompts' chunks "
        "(--prefill-chunk each) in arrival order while they fit, one at least; a filling server's prompts then "
        "prefill in fewer turns, and a running stream waits for as many chunks as the budget holds (default: one "
        "chunk a turn)",
    )
    p.add_argument(
        "--prefill-thread",
        action="store_true",
        help="prefill prompts on a thread (and CUDA stream) of their own beside the decode steps, instead of in "
        "turns between them: a running stream then waits for no prompt chunk; the two share the GPU and the "
        "host's cores (not with --step-tokens)",
    )
    p.add_argument(
        "--host-memory",
        type=_gib,
        default=None,
        help="GiB of host memory admitted requests' caches may take (default: 80%% of the memory available at "
        "start, after the model is loaded)",
    )
    p.add_argument(
        "--device-memory",
        type=_gib,
        default=None,
        help="CUDA only: GiB of GPU memory admitted requests' caches may take (default: 80%% of what is free "
        "after the model is loaded)",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="keep no prompt prefixes: by default each prompt keeps its state at its last chunk boundaries in host "
        "memory, and a later prompt that begins with the same tokens (a shared document, a conversation's earlier "
        "turns) starts from it and prefills only the rest, with the same tokens as a cold prefill; kept prefixes "
        "count against --host-memory and the least recently used go when a request needs the room. A request "
        'opts out with {"prefix_cache": false}',
    )
    p.add_argument(
        "--random-weights",
        metavar="SHAPE",
        default=None,
        help="serve random weights of a named model shape (e.g. llama-3.1-8b; the names `tandem bench --model` "
        "takes) instead of --model, with the default model's tokenizer (benchmarks only: the text is noise, the "
        "cost is real)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="with --random-weights: a local Hugging Face tokenizer directory (default: the default model's)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="the server's log messages on stderr at this level and above (default %(default)s)",
    )
    replicas = p.add_argument_group("replicas (Ray Serve; needs the cluster extra)")
    replicas.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve from this many replicas behind Ray Serve's HTTP proxy, each with its own model and caches "
        "(default: one server in this process, no Ray)",
    )
    replicas.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica (default 1)"
    )
    replicas.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster ('auto', or ray://HOST:PORT); default: start a local one",
    )
    add_cache_arguments(p)


def _check(args) -> None:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port={args.port} is out of range: allowed 1 to 65535")
    for flag, value, low in (
        ("--max-batch", args.max_batch, 1),
        ("--max-queue", args.max_queue, 0),
        ("--prefill-chunk", args.prefill_chunk, 1),
        ("--step-tokens", args.step_tokens, 1),
    ):
        if value is not None and value < low:
            raise ValueError(f"{flag}={value} is out of range: allowed >= {low}")
    if args.prefill_thread and args.step_tokens is not None:
        raise ValueError(
            "--step-tokens budgets the turns of prompt chunks and decode steps, and --prefill-thread runs the chunks "
            "beside the steps instead: pass one of them"
        )
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas={args.replicas} is out of range: allowed >= 1")
    if not args.replica_cpus > 0 or args.replica_cpus == float("inf"):
        raise ValueError(f"--replica-cpus={args.replica_cpus} is out of range: allowed a number > 0")


def model_name(path: str | None) -> str:
    if path is None:
        return "SmolLM2-135M-Instruct"
    name = Path(path).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def _random_model(args):
    import torch

    from ..models import DTYPES, load_model, resolve_device
    from ..shapes import SHAPES, build_random_model

    if args.random_weights not in SHAPES:
        raise ValueError(
            f"--random-weights={args.random_weights!r} is not a known shape: allowed {', '.join(SHAPES)}"
        )
    if args.model is not None:
        raise ValueError("--random-weights and --model exclude each other: pass one")
    device = resolve_device(args.device)
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype={args.dtype!r}: allowed {', '.join(DTYPES)}")
    dtype = DTYPES[args.dtype] or torch.bfloat16  # random weights have no checkpoint dtype: auto is bfloat16
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        if not Path(args.tokenizer).is_dir():
            raise FileNotFoundError(f"--tokenizer {args.tokenizer!r} is not a directory")
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        _, tokenizer = load_model(None, device="cpu", cache=False if args.no_model_cache else None)
    return build_random_model(args.random_weights, device, dtype), tokenizer


def build_server(args):
    """Load the model and build the `Server` for parsed `tandem serve` arguments."""
    import torch

    from ..attention import TaskPool
    from ..cache.memory import available_host_bytes
    from ..cache.prefix import PrefixCache
    from ..engine import RowsRunner, freeze_heap
    from ..models import load_model, resolve_device
    from ..serve.app import Server
    from ..serve.scheduler import Limits, Scheduler

    _check(args)
    config = build_config(args)
    if args.device_memory is not None and resolve_device(args.device).type != "cuda":  # before loading
        raise ValueError(
            "--device-memory applies to CUDA devices only; on a CPU, --host-memory bounds everything"
        )
    if args.tokenizer is not None and args.random_weights is None:
        raise ValueError("--tokenizer goes with --random-weights (a --model brings its own tokenizer)")
    if args.random_weights is not None:
        model, tokenizer = _random_model(args)
    else:
        model, tokenizer = load_model(
            args.model, device=args.device, dtype=args.dtype, cache=False if args.no_model_cache else None
        )
    device = next(model.parameters()).device
    # the decode steps' runner, with its pool of the requests' hot tiers allocated before the memory budgets
    # are taken from what is left
    runner = RowsRunner(model, slots=args.max_batch, config=config)
    available = available_host_bytes()
    host = int(args.host_memory * GIB) if args.host_memory else (int(0.8 * available) if available else None)
    if device.type == "cuda":
        gpu = (
            int(args.device_memory * GIB)
            if args.device_memory
            else int(0.8 * torch.cuda.mem_get_info(device)[0])
        )
    else:
        gpu = None
    chunk = args.prefill_chunk or (2048 if device.type == "cuda" else 256)
    limits = Limits(args.max_batch, args.max_queue, chunk, host, gpu, args.step_tokens, args.prefill_thread)
    prefix = None if args.no_prefix_cache else PrefixCache(max_bytes=host)
    scheduler = Scheduler(
        model, tokenizer, limits, TaskPool(config.host.threads), runner=runner, prefix=prefix
    )
    name = args.served_model_name or (args.random_weights or model_name(args.model))
    server = Server(model, tokenizer, name, config, scheduler)
    if not args.no_warmup:
        seconds = scheduler.warm_up(config)
        print(f"[tandem] warmed up batch sizes 1-{limits.max_batch} in {seconds:.1f} s", file=sys.stderr)
    freeze_heap()  # what lives now lives as long as the server: out of the collector's full passes
    return server


def run(args) -> int:
    import uvicorn

    from ..serve.app import create_app

    if args.replicas is not None:
        from ..cache.memory import available_host_bytes
        from ..serve.replicas import run_replicas

        _check(args)
        build_config(args)  # refused here, not in every replica
        available = available_host_bytes()
        if args.host_memory is None and available and args.ray_address is None:
            args.host_memory = 0.8 * available / args.replicas / GIB  # the replicas share this host
        print(
            f"[tandem] serving from {args.replicas} replicas on http://{args.host}:{args.port}/v1",
            file=sys.stderr,
        )
        return run_replicas(args, build_server)
    server = build_server(args)
    lim = server.scheduler.limits
    budget = "unbounded" if lim.host_bytes is None else f"{lim.host_bytes / GIB:.1f} GiB"
    print(
        f"[tandem] serving '{server.model_name}' on http://{args.host}:{args.port}/v1 | policy {server.config.policy} "
        f"| batch <= {lim.max_batch}, queue <= {lim.max_queue}, prefill chunk {lim.prefill_chunk}"
        f"{'' if lim.step_tokens is None else f', step budget {lim.step_tokens} tokens'}"
        f"{', prefill beside the steps' if lim.prefill_thread else ''} | host budget "
        f"{budget}{'' if server.scheduler.prefix is None else ', prefixes kept'}",
        file=sys.stderr,
    )
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level=args.log_level)
    return 0
