"""Many caches and engines built and dropped in one process, in a seeded random order, give the tokens each gives
alone, and give their memory back.

Each build (`reuse_builds.Build`: policy, batch 1-8 left-padded, float32 / bfloat16, host tier in the model's dtype
or int8, Tandem's own decode forward or transformers', CUDA graphs on or off, certified or not) is compared token
for token with its reference:
- builds that keep every host entry in float32 with no 8-bit codes: DynamicCache's greedy tokens;
- every other build: the same build run first thing in a fresh process.
After each build is dropped, device memory (graph pools included) and pinned host memory go back to the level
the first builds settled at.

CI (CPU) runs a short plan; the `cuda`-marked test runs TANDEM_REUSE_BUILDS builds (default 200) with graphs.
TANDEM_REUSE_SEED picks the order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os

import pytest
import torch

from tests.engine import reuse_builds

MiB = 2**20


def _stress(count: int, seed: int, device: str, workers: int) -> dict:
    builds = reuse_builds.plan(count, seed, device)
    got, levels = [], []
    for build in builds:
        got.append(reuse_builds.tokens(build))
        levels.append(reuse_builds.memory_levels(device))
    unique = {b for b in builds if not b.exact}
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1) as pool:
        lists = pool.map(reuse_builds.fresh_tokens, [dataclasses.asdict(b) for b in unique])
        fresh = {b: torch.tensor(t) for b, t in zip(unique, lists, strict=True)}
    exact = {b: reuse_builds.dynamic_cache_tokens(b) for b in {b for b in builds if b.exact}}
    mismatches = []
    for i, (build, tokens) in enumerate(zip(builds, got, strict=True)):
        reference = exact[build] if build.exact else fresh[build]
        if not torch.equal(tokens, reference):
            which = "DynamicCache" if build.exact else "a fresh process"
            mismatches.append(f"build {i} {build}: {tokens.tolist()} != {which}'s {reference.tolist()}")
    return {
        "builds": builds,
        "mismatches": mismatches,
        "levels": levels,
        "fresh": len(unique),
        "exact": len(exact),
    }


def _settled_growth(levels: list[dict], key: str) -> int:
    """How far `key` rose after the first quarter of the builds (their one-time allocations: cuBLAS workspaces,
    compiled kernels' modules) above its highest level then."""
    settle = max(1, len(levels) // 4)
    return max(level[key] for level in levels[settle:]) - max(level[key] for level in levels[:settle])


def test_reused_process_gives_each_build_its_own_tokens_on_cpu():
    result = _stress(count=9, seed=int(os.environ.get("TANDEM_REUSE_SEED", "0")), device="cpu", workers=2)
    assert not result["mismatches"], "\n".join(result["mismatches"])
    assert result["fresh"] > 0 and result["exact"] > 0  # both references were exercised


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_reused_process_gives_each_build_its_own_tokens_and_memory_back_on_cuda():
    count = int(os.environ.get("TANDEM_REUSE_BUILDS", "200"))
    seed = int(os.environ.get("TANDEM_REUSE_SEED", "0"))
    result = _stress(count, seed, "cuda", workers=8)
    print(
        f"reuse stress: {count} builds, seed {seed}, {result['exact']} exact configurations against DynamicCache, "
        f"{result['fresh']} against a fresh process; graphs in {sum(b.graphs for b in result['builds'])} builds"
    )
    assert not result["mismatches"], "\n".join(result["mismatches"])
    for key in ("device_allocated", "device_reserved", "pinned_allocated"):
        assert _settled_growth(result["levels"], key) <= 2 * MiB, (
            key,
            [level[key] for level in result["levels"]],
        )
