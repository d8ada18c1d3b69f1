"""Decode a deep random Llama through the engine: does the one-graph step (handoff "memops") launch and run at
that depth? Hidden size 1024, 8 heads of 128, quest at its defaults, greedy steps timed.

    python benchmarks/bench_deep_model_decode.py LAYERS CONTEXT [TIMEOUT_S]

CUDA only. The process prints its stack and exits after TIMEOUT_S (default 90) instead of hanging: before the
launcher thread (`tandem.engine.handoff.Launcher`) 96 and 128 layers hung in the graph's launch
(`benchmarks/results/2026-11-26_h200_launch_deadlock/`).
"""

from __future__ import annotations

import argparse
import faulthandler

import torch
from transformers import LlamaConfig

from tandem import TandemCache, TandemConfig
from tandem.engine.runner import TandemRunner
from tandem.shapes import build_random_model


def main(layers: int, context: int, timeout_s: int) -> None:
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32000,
        max_position_embeddings=1 << 20,
    )
    model = build_random_model(config, "cuda", torch.bfloat16)
    runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="quest")))
    ids = torch.randint(0, config.vocab_size, (1, context))
    logits = runner.prefill(ids, chunk_tokens=8192, max_new_tokens=16)
    _, seconds = runner.decode(logits.argmax(-1), 12)
    steps = [round(s * 1e3, 2) for s in seconds]
    print(f"layers {layers} context {context}: handoff {runner.handoff}, step ms {steps}")
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layers", type=int)
    p.add_argument("context", type=int, help="prompt tokens")
    p.add_argument("timeout_s", type=int, nargs="?", default=90, help="print the stack and exit after this")
    args = p.parse_args()
    main(args.layers, args.context, args.timeout_s)
