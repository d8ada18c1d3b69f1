"""Builds for the reuse stress test: one cache and engine each, over the configurations a server meets.

A `Build` is one request's worth of work: a `TandemCache` and a `TandemRunner` over a shared tiny model (one per
dtype per process, as a server keeps its model), a left-padded prompt batch drawn from the build's own seed,
prefill, greedy decode, and the runner and cache dropped. `plan` draws builds in a seeded random order; `tokens`
runs one; `fresh_tokens` runs one in a process that has run nothing else (the reference for sparse builds).
"""

from __future__ import annotations

import dataclasses
import gc
import random
import zlib

import torch

from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner
from tests.tiny import tiny_model

HOT = {"sink_tokens": 4, "window_tokens": 16}
NEW_TOKENS = 10
# policy name -> TandemConfig fields; the first four keep every host entry (DynamicCache's tokens in float32)
POLICIES = {
    "full": {"policy": "full"},
    "quest-all": {"policy": "quest", "quest": {"budget": 1.0}},
    "fluxion-tau0": {"policy": "fluxion", "fluxion": {"tau": 0.0}},
    "hgca-all": {"policy": "hgca", "hgca": {"beta": 1e-9, "span": 1}},
    "quest": {"policy": "quest", "quest": {"budget": 0.2}},
    "hgca": {"policy": "hgca"},
    "streaming": {"policy": "streaming"},
}
LOSSLESS = ("full", "quest-all", "fluxion-tau0", "hgca-all")
CERTIFIABLE = ("quest", "quest-all", "fluxion-tau0")  # epsilon is for quest and fluxion


@dataclasses.dataclass(frozen=True)
class Build:
    policy: str
    batch: int
    dtype: str  # "float32" | "bfloat16"
    host_dtype: str | None  # None | "int8"
    forward: str  # "own" | "hf"
    graphs: bool
    certified: bool
    device: str

    def config(self) -> TandemConfig:
        fields = dict(POLICIES[self.policy], **HOT, host={"dtype": self.host_dtype})
        if self.certified:
            fields.update(certified={"epsilon": 0.05})
        return TandemConfig(**fields)

    @property
    def exact(self) -> bool:
        """Whether DynamicCache's greedy tokens are this build's reference: every entry kept, float32, no codes, and
        no certificate (quest's epsilon replaces its budget, so it may skip mass up to epsilon)."""
        return (
            self.policy in LOSSLESS
            and self.dtype == "float32"
            and self.host_dtype is None
            and not self.certified
        )

    def prompt(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) [batch, T]: this build's own prompts, left-padded to the longest."""
        gen = torch.Generator().manual_seed(zlib.crc32(repr(self).encode()))
        lengths = torch.randint(40, 130, (self.batch,), generator=gen)
        total = int(lengths.max())
        ids = torch.randint(1, 128, (self.batch, total), generator=gen)
        mask = (torch.arange(total)[None, :] >= (total - lengths)[:, None]).long()
        return ids * mask, mask


def plan(count: int, seed: int, device: str) -> list[Build]:
    """`count` builds drawn in a seeded random order; on CPU the graphs axis is off (no CUDA graphs there)."""
    rng = random.Random(seed)
    builds = []
    for _ in range(count):
        policy = rng.choice(list(POLICIES))
        certified = policy in CERTIFIABLE and rng.random() < 0.3
        builds.append(
            Build(
                policy=policy,
                batch=rng.randint(1, 8),
                dtype=rng.choice(["float32", "bfloat16"]),
                host_dtype=None if certified else rng.choice([None, "int8"]),
                forward=rng.choice(["own", "hf"]),
                graphs=device == "cuda" and rng.random() < 0.7,
                certified=certified,
                device=device,
            )
        )
    return builds


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def model_for(build: Build):
    """The process's one tiny Llama per (device, dtype), shared by every build as a server shares its model."""
    key = (build.device, build.dtype)
    if key not in _MODELS:
        model = tiny_model("Llama").to(build.device, getattr(torch, build.dtype))
        model.generation_config.eos_token_id = None
        _MODELS[key] = model
    return _MODELS[key]


def tokens(build: Build) -> torch.Tensor:
    """Greedy tokens [batch, NEW_TOKENS] of one build; its runner and cache are gone when this returns."""
    model = model_for(build)
    ids, mask = (t.to(build.device) for t in build.prompt())
    runner = TandemRunner(
        model, TandemCache.for_model(model, build.config()), use_graphs=build.graphs, forward=build.forward
    )
    first = runner.prefill(ids, mask, chunk_tokens=48, max_new_tokens=NEW_TOKENS).argmax(-1)
    rest, _ = runner.decode(first, NEW_TOKENS - 1)
    return torch.cat([first.cpu()[:, None], rest], dim=1)


def dynamic_cache_tokens(build: Build) -> torch.Tensor:
    """model.generate's greedy tokens with DynamicCache for the build's prompts: an exact build's reference."""
    from tests.engine.test_engine import _hf_greedy

    ids, mask = (t.to(build.device) for t in build.prompt())
    return _hf_greedy(model_for(build), ids, mask, NEW_TOKENS)


def fresh_tokens(fields: dict) -> list:
    """`tokens` of one build in this process, which is meant to have run nothing else (a pool worker that takes
    one task), as a list: a tensor would travel back through shared memory that the exiting worker takes along."""
    return tokens(Build(**fields)).tolist()


def memory_levels(device: str) -> dict:
    """Device memory allocated and reserved, and pinned host memory allocated, after collecting garbage and
    emptying the device allocator's cache (zeros on CPU)."""
    gc.collect()
    if device != "cuda":
        return {"device_allocated": 0, "device_reserved": 0, "pinned_allocated": 0}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    return {
        "device_allocated": torch.cuda.memory_allocated(),
        "device_reserved": torch.cuda.memory_reserved(),
        "pinned_allocated": pinned,
    }
