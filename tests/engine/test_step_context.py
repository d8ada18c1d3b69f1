"""The layers see a fixed-address step only through its `StepContext`: whatever the attention, cache, policy and
integration code reads of the engine's step, during eager steps and recorded ones, is part of that contract."""

from __future__ import annotations

import sys

import pytest
import torch

from tandem import TandemCache, TandemConfig
from tandem.attention.context import StepContext
from tandem.config import FluxionConfig, QuestConfig
from tandem.engine import TandemRunner
from tandem.engine import runner as runner_module
from tandem.engine.step import DecodeStep
from tests.tiny import tiny_model

ENGINE_FREE = ("tandem.attention", "tandem.cache", "tandem.policies", "tandem.integrations")
CONTRACT = {name for name in dir(StepContext) if not name.startswith("_")} | set(vars(StepContext("cpu")))


class WatchedStep(DecodeStep):
    """A DecodeStep that notes which of its attributes the engine-free packages read."""

    reads: list = []

    def __getattribute__(self, name):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith(ENGINE_FREE):
            WatchedStep.reads.append((caller, name))
        return super().__getattribute__(name)


@pytest.mark.parametrize(
    "device,policy,handoff",
    [
        ("cpu", "quest", "auto"),
        ("cpu", "streaming", "auto"),
        *[
            pytest.param(
                "cuda", policy, handoff,
                marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")],
            )
            for policy in ("quest", "streaming", "certified")
            for handoff in ("memops", "launches")
        ],
    ],
)  # fmt: skip
def test_the_layers_read_only_the_step_contexts_contract(monkeypatch, device, policy, handoff):
    monkeypatch.setattr(runner_module, "DecodeStep", WatchedStep)
    monkeypatch.setattr(WatchedStep, "reads", [])
    model = tiny_model("Llama", num_key_value_heads=2).to(device)
    config = TandemConfig(
        policy=policy,
        sink_tokens=4,
        window_tokens=8,
        block_size=4,
        **({"quest": QuestConfig(gpu_cache=0)} if policy == "quest" else {}),
    )
    runner = TandemRunner(model, TandemCache.for_model(model, config), handoff=handoff)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1)).to(device)
    runner.decode(
        runner.prefill(ids, max_new_tokens=8).argmax(-1), 7
    )  # eager steps, then recorded ones on CUDA
    names = {name for _, name in WatchedStep.reads}
    assert {"slot", "defers_host_work"} <= names  # the watch sees the layers' reads
    outside = sorted({(caller, name) for caller, name in WatchedStep.reads if name not in CONTRACT})
    assert not outside, outside


@pytest.mark.parametrize("policy", ["certified", "quest", "fluxion"])
def test_a_steps_preparation_makes_what_a_recording_adds_to(policy):
    """`DecodeStep.prepare` (eager, before any recording) makes the device tensors a step adds to or reads as
    its state: quest's block count, the certificate's and fluxion's counters. A request's first decode step may be
    part of a recording (a server's growing batch): made inside it, such a tensor would be made again, zeroed, at
    every replay, and a certified step refused to record at all (a copy from pageable host memory)."""
    model = tiny_model("Llama", num_key_value_heads=2)
    overrides = {
        "quest": {"quest": QuestConfig(gpu_cache=0)},
        "fluxion": {"fluxion": FluxionConfig(tau=0.0)},  # no profile needed
    }.get(policy, {})
    block = 16 if policy == "fluxion" else 4
    config = TandemConfig(
        policy=policy, sink_tokens=4, window_tokens=2 * block, block_size=block, **overrides
    )
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache)
    ids = torch.randint(0, 128, (1, 10 * block), generator=torch.Generator().manual_seed(1))
    runner.prefill(ids, max_new_tokens=4)
    layers = cache.tandem_layers()
    with torch.inference_mode():
        DecodeStep(torch.device("cpu")).prepare(layers)
    for layer in layers:
        policy_of = layer.policy
        if policy_of.certifier is not None:
            assert policy_of.certifier._counters is not None
        if policy == "quest":
            assert int(policy_of._k) == policy_of.blocks_this_step(layer) > 0
        if policy == "fluxion":
            assert policy_of._counters is not None
