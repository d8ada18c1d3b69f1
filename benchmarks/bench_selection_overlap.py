"""How much of a quest step's selection earlier steps already selected: the locality a recall cache (`gpu_cache`)
lives on. Runs quest on the CPU (no device share, so the selection is the CPU's own), records each layer's
selected blocks per KV head for a few greedy steps, then replays them through two cache models per
(layer, KV head): one holding the blocks most recently selected (LRU), and one that, like Tandem's, takes in only
the device's share of each step's misses and keeps the rest of the misses out. Then it decodes again with
Tandem's own recall cache (gpu_cache 4) and reports where the attended rows came from.

    python benchmarks/bench_selection_overlap.py                          # the default model on pydoc prose, 8000 tokens
    python benchmarks/bench_selection_overlap.py --random llama-3.2-1b    # random weights of a named shape, 4 layers

The default model cannot take more than 8192 positions; a random shape takes any --context.
"""

from __future__ import annotations

import argparse

import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs, load_model
from tandem.config import QuestConfig
from tandem.policies import quest
from tandem.tools.evaluation.haystack import load_haystack


def record_selections(model, ids, budget: float, steps: int) -> list[list[list[set[int]]]]:
    """[layer][step][kv head] -> the step's selected block ids (request 0)."""
    cache = TandemCache.for_model(
        model, TandemConfig(policy="quest", quest=QuestConfig(budget=budget), window_tokens=256)
    )
    log: dict[int, list] = {}
    original = quest.QuestPolicy.select

    def select(self, layer, q, from_device=None, skip=0):
        selection = original(self, layer, q, from_device, skip)
        heads = selection.indices.shape[1]
        log.setdefault(id(self), []).append(
            [set(selection.indices[0, h, : selection.lengths[0, h]].tolist()) for h in range(heads)]
        )
        return selection

    quest.QuestPolicy.select = select
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=steps, do_sample=False, **generate_cache_kwargs(model, cache))
    finally:
        quest.QuestPolicy.select = original
    return list(log.values())


def measured_hits(
    model, ids, budget: float, steps: int, share: float, factor: float
) -> tuple[float, float, float]:
    """(hits, device reads, CPU reads) as shares of the attended host rows with Tandem's own recall cache (its
    clock, its copies), decoding the same prompt; on the CPU the device share and the plan run as the torch
    reference does."""
    config = TandemConfig(
        policy="quest", quest=QuestConfig(budget=budget, gpu_share=share, gpu_cache=factor), window_tokens=256
    )
    cache = TandemCache.for_model(model, config)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=steps, do_sample=False, **generate_cache_kwargs(model, cache))
    cache.stats()  # folds the cache's counters into the layers' row counts
    layers = cache.tandem_layers()
    total = sum(layer.rows_attended for layer in layers)
    cached = sum(layer.rows_attended_cached for layer in layers)
    device = sum(layer.rows_attended_device for layer in layers)
    return cached / total, device / total, 1 - (cached + device) / total


def lru_hits(layers, factor: float) -> float:
    """Share of selected blocks (after the first step) found in an LRU cache of `factor` x the budget."""
    hits = total = 0
    for steps in layers:
        for h in range(len(steps[0])):
            last: dict[int, int] = {}
            for t, chosen in enumerate(steps):
                chosen = chosen[h]
                if t:
                    hits += len(chosen & last.keys())
                    total += len(chosen)
                for block in chosen:
                    last[block] = t
                excess = len(last) - int(factor * max(1, len(chosen)))
                for block, _ in sorted(last.items(), key=lambda kv: kv[1])[: max(0, excess)]:
                    del last[block]
    return hits / total


def share_hits(layers, factor: float, share: float) -> tuple[float, float, float]:
    """(hits, device reads, CPU reads) as shares of the selected blocks when only `share` of each step's misses
    enters an LRU cache of `factor` x the budget (the rest is attended by the CPU and not kept)."""
    hits = device = total = 0
    for steps in layers:
        for h in range(len(steps[0])):
            last: dict[int, int] = {}
            for t, chosen in enumerate(steps):
                chosen = sorted(chosen[h])
                hit = [b for b in chosen if b in last]
                miss = [b for b in chosen if b not in last]
                taken = miss[: int(share * len(miss) + 0.5)]
                if t:
                    hits, device, total = hits + len(hit), device + len(taken), total + len(chosen)
                for block in hit + taken:
                    last[block] = t
                excess = len(last) - int(factor * max(1, len(chosen)))
                for block, _ in sorted(last.items(), key=lambda kv: kv[1])[: max(0, excess)]:
                    del last[block]
    return hits / total, device / total, 1 - (hits + device) / total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--share", type=float, default=0.4, help="the device's share of each step's misses")
    parser.add_argument("--random", default=None, help="a named shape with random weights (4 layers) instead")
    args = parser.parse_args()
    if args.random:
        from tandem.shapes import build_random_model

        model = build_random_model(args.random, "cpu", torch.float32, num_layers=4)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=gen)
        source = f"random {args.random} weights, random tokens"
    else:
        model, tokenizer = load_model()
        ids = tokenizer(load_haystack(None).text, return_tensors="pt").input_ids[:, : args.context]
        source = "the default model, pydoc prose"
    layers = record_selections(model, ids, args.budget, args.steps)
    blocks = len(layers[-1][-1][0])
    print(
        f"{source}: context {ids.shape[1]}, budget {args.budget}, {blocks} blocks per KV head, {args.steps} steps"
    )
    print(f"  selected the step before: {lru_hits(layers, 1):.3f}")
    for factor in (2, 4):
        hit, device, cpu = share_hits(layers, factor, args.share)
        print(
            f"  cache {factor}x the budget: LRU hits {lru_hits(layers, factor):.3f}; filled by the device's share "
            f"{args.share} of the misses: hits {hit:.3f}, device reads {device:.3f}, CPU reads {cpu:.3f}"
        )
    hit, device, cpu = measured_hits(model, ids, args.budget, args.steps, args.share, 4.0)
    print(
        f"  Tandem's recall cache, 4x (clock), all steps: hits {hit:.3f}, device reads {device:.3f}, "
        f"CPU reads {cpu:.3f}"
    )


if __name__ == "__main__":
    main()
