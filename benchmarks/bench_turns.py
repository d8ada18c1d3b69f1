"""A conversation's next turn appended to the cache that holds the turns before it, against the same conversation
prefilled cold into a new cache, in one run: time to first token of each (the engine's prefill of the turn's own
tokens, against its prefill of the whole conversation), and whether both answer with the same greedy tokens.

    python benchmarks/bench_turns.py --model /path/to/model.gguf --document-tokens 4096,16384 \
        --policies certified,quest --out benchmarks/results/<date>_<machine>_turns

The first turn is a document (prose from Python's documentation, cut to each `--document-tokens`) and a question,
through the model's chat template; its answer is `--answer-tokens` greedy tokens; the second turn is a short
follow-up question. Both sides run through `TandemRunner` (`generate(append=True)` for the next turn: what
`tandem generate --interactive` does), each timed `--repeats` times after one untimed warm-up, the median kept.
Prints and saves turns.json / turns.md (+ a manifest naming the commit and the machine). On a CPU the times are the
CPU's; ratios only, taken side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from tandem import TandemCache, TandemConfig, load_model, manifest
from tandem.engine import TandemRunner
from tandem.models import end_of_sequence_ids
from tandem.tools.evaluation.haystack import load_haystack

QUESTION = "Summarise the text above in one sentence."
FOLLOW_UP = "Now name one function it mentions."


def _template(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


def _timed_generate(
    runner, ids: list[int], tokens: int, stop, append: bool, device
) -> tuple[list[int], float]:
    """(new tokens, seconds to the first of them) of one `generate` on `runner`."""
    first = []

    def on_token(token):
        if not first:
            first.append(time.perf_counter())

    start = time.perf_counter()
    out = runner.generate(
        torch.tensor([ids], device=device), tokens, stop_ids=stop, on_token=on_token, append=append
    )
    return out.tolist(), first[0] - start


def one_case(model, tokenizer, text_ids: list[int], length: int, policy: str, args, device) -> dict:
    """One document length and policy: the next turn appended against the conversation cold, `repeats` times."""
    config = TandemConfig(policy=policy)
    stop = end_of_sequence_ids(model)
    document = tokenizer.decode(text_ids[:length])
    messages = [{"role": "user", "content": f"{document}\n\n{QUESTION}"}]
    first_ids = _template(tokenizer, messages)
    appended, cold, same = [], [], []
    for attempt in range(args.repeats + 1):
        runner = TandemRunner(model, TandemCache.for_model(model, config))
        answer, _ = _timed_generate(runner, first_ids, args.answer_tokens, stop, False, device)
        text = tokenizer.decode(answer, skip_special_tokens=True)
        conversation = messages + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": FOLLOW_UP},
        ]
        whole = _template(tokenizer, conversation)
        held = first_ids + answer[:-1]
        if whole[: len(held)] != held:
            return {
                "policy": policy,
                "document_tokens": length,
                "error": "the template re-tokenized the answer",
            }
        reply, seconds = _timed_generate(runner, whole[len(held) :], args.reply_tokens, stop, True, device)
        fresh = TandemRunner(model, TandemCache.for_model(model, config))
        reply_cold, seconds_cold = _timed_generate(fresh, whole, args.reply_tokens, stop, False, device)
        del runner, fresh
        if attempt == 0:
            continue  # the warm-up: kernels, allocator growth
        appended.append(seconds)
        cold.append(seconds_cold)
        same.append(reply == reply_cold)
    ttft, ttft_cold = statistics.median(appended), statistics.median(cold)
    return {
        "policy": policy,
        "document_tokens": length,
        "conversation_tokens": len(whole),
        "turn_tokens": len(whole) - len(held),
        "ttft_appended_s": ttft,
        "ttft_cold_s": ttft_cold,
        "ratio": ttft / ttft_cold,
        "same_tokens": all(same),
        "repeats": args.repeats,
    }


def markdown(machine: dict, args, rows: list[dict]) -> str:
    where = machine["gpu"] or f"{machine['cpu']}, {machine['cores']} cores"
    lines = [
        f"# A conversation's next turn appended against the conversation cold: {args.model or 'the default model'} "
        f"on {where}",
        "",
        f"First turn: a document and a question, {args.answer_tokens} answer tokens; second turn: a follow-up "
        f"question, {args.reply_tokens} reply tokens. Time to first token of the second turn, median of "
        f"{args.repeats} after a warm-up: appended to the cache of the first (`generate(append=True)`) against the "
        "whole conversation prefilled into a new cache. Same tokens: both replies greedy and equal in every repeat.",
        "",
        "| policy | document tokens | conversation tokens | turn tokens | TTFT appended | TTFT cold | ratio | same "
        "tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['policy']} | {r['document_tokens']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['policy']} | {r['document_tokens']} | {r['conversation_tokens']} | {r['turn_tokens']} | "
            f"{r['ttft_appended_s'] * 1e3:.0f} ms | {r['ttft_cold_s'] * 1e3:.0f} ms | {r['ratio']:.3f}x | "
            f"{'yes' if r['same_tokens'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local HF directory or .gguf (default: the default model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: CUDA if available)")
    p.add_argument("--document-tokens", default="4096", help="comma list of first-turn document lengths")
    p.add_argument("--policies", default="certified,quest", help="comma list of TandemConfig policies")
    p.add_argument("--answer-tokens", type=int, default=16, help="the first answer's greedy tokens at most")
    p.add_argument("--reply-tokens", type=int, default=8, help="the second answer's greedy tokens at most")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each case (after one warm-up)")
    p.add_argument("--out", default=None, help="directory for turns.json / .md and the manifest")
    args = p.parse_args()
    if args.repeats < 1 or args.answer_tokens < 1 or args.reply_tokens < 1:
        p.error("--repeats, --answer-tokens and --reply-tokens must be >= 1")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None}  # fmt: skip
    print(json.dumps(machine), flush=True)
    model, tokenizer = load_model(args.model, device=device)
    text_ids = tokenizer(load_haystack().text, add_special_tokens=False).input_ids
    rows = []
    with torch.inference_mode():
        for length in (int(x) for x in args.document_tokens.split(",")):
            for policy in args.policies.split(","):
                rows.append(one_case(model, tokenizer, text_ids, length, policy, args, device))
                print(json.dumps(rows[-1]), flush=True)
    text = markdown(machine, args, rows)
    print(text)
    if args.out:
        manifest.save_results(args.out, "turns", {"machine": machine, "args": vars(args), "rows": rows}, text)


if __name__ == "__main__":
    main()
