"""Quest's device share (`gpu_share`): the compute device attends the best-ranked part of each step's host blocks
straight from host memory while the CPU attends the rest; together they attend exactly what the CPU alone would.

On CPU the same orchestration runs with the torch reference in place of the zero-copy GPU kernel (the host tier
mirrors its digests on the CPU when a share is asked for); the `cuda` cases run the Triton kernel over pinned
memory, inside captured CUDA graphs for the engine."""

import dataclasses

import pytest
import torch

from tandem import TandemCache, TandemConfig
from tandem.config import DEFAULT_GPU_SHARE, QuestConfig
from tandem.policies.quest import QuestPolicy
from tests.engine.test_engine import _hf_greedy, _run, _tiny
from tests.policies.test_quest_device import _host, _Layer

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
    ),
]


def test_config_refuses_a_share_out_of_range_or_without_quest():
    with pytest.raises(ValueError, match=r"gpu_share=1\.5 .*\[0, 1\]"):
        TandemConfig(policy="quest", quest=QuestConfig(gpu_share=1.5))
    with pytest.raises(ValueError, match=r"gpu_share=-0\.1"):
        TandemConfig(policy="quest", quest=QuestConfig(gpu_share=-0.1))
    with pytest.raises(ValueError, match="gpu_share=0.5 .*policy='quest'"):
        TandemConfig(policy="hgca", quest=QuestConfig(gpu_share=0.5))
    # the default: a share for quest with a CUDA hot tier only
    assert TandemConfig(policy="hgca").quest.gpu_share is None
    assert TandemConfig(policy="hgca").gpu_share_on("cuda") == 0.0
    assert TandemConfig(policy="quest").gpu_share_on("cuda") == DEFAULT_GPU_SHARE > 0
    assert TandemConfig(policy="quest").gpu_share_on("cpu") == 0.0
    assert TandemConfig(policy="quest", quest=QuestConfig(gpu_share=0)).gpu_share_on("cuda") == 0.0


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_device_and_cpu_shares_split_the_selection(share):
    """The device's ranks and the CPU's selection are disjoint and together are the unsplit selection."""
    budget = 0.3
    split = QuestPolicy(TandemConfig(policy="quest", quest=QuestConfig(budget=budget, gpu_share=share)))
    whole = QuestPolicy(TandemConfig(policy="quest", quest=QuestConfig(budget=budget)))
    layer = _Layer(_host(True))
    layer.gpu_share = share
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(3))
    ranked = split.device_select(layer, q)
    k = split.blocks_this_step(layer)
    skip = split.device_share(layer)
    assert skip == min(k, int(share * k + 0.5)) and skip > 0
    cpu = split.select(layer, q[:, :, None], ranked, skip)
    every = whole.select(layer, q[:, :, None], ranked)
    limit = layer.host.capacity // layer.host.block_size
    for b in range(2):
        for h in range(2):
            device_ids = {i for i in ranked[b, h, :skip].tolist() if i < limit}
            cpu_ids = (
                set(cpu.indices[b, h, : int(cpu.lengths[b, h])].tolist()) if cpu.kind == "blocks" else set()
            )
            assert not device_ids & cpu_ids
            assert device_ids | cpu_ids == set(every.indices[b, h, : int(every.lengths[b, h])].tolist())
    if share == 1.0:
        assert cpu.kind == "none"


def _config(**extra):
    # the device share alone: the recall cache on top of it (on by default on CUDA) has its own tests
    # (tests/cache/test_recall_cache.py)
    quest = extra.pop("quest", QuestConfig())
    if quest.gpu_cache is None:
        extra["quest"] = dataclasses.replace(quest, gpu_cache=0)
    else:
        extra["quest"] = quest
    return TandemConfig(policy="quest", sink_tokens=4, window_tokens=12, block_size=4, **extra)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_split_at_full_budget_matches_dynamic_cache(device, share):
    """Every block attended, half (or all) of them by the device: greedy tokens equal DynamicCache's, through
    the engine (graphs on CUDA) and through model.generate (eager), for a left-padded batch."""
    model = _tiny(device=device)
    ids = torch.randint(0, 128, (2, 83), generator=torch.Generator().manual_seed(2)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    base = _hf_greedy(model, ids, mask, 24)
    ours, runner = _run(
        model, ids, mask, _config(quest=QuestConfig(budget=1.0, gpu_share=share)), 24, chunk_tokens=32
    )
    assert torch.equal(base, ours)
    cache = runner.cache
    layers = cache.tandem_layers()
    device_rows = sum(layer.rows_attended_device for layer in layers)
    all_rows = sum(layer.rows_attended for layer in layers)
    assert 0 < device_rows <= all_rows
    assert (device_rows == all_rows) == (share == 1.0)
    assert cache.stats()["mean_fraction_attended"] == 1.0
    eager = TandemCache.for_model(model, _config(quest=QuestConfig(budget=1.0, gpu_share=share)))
    assert torch.equal(base, _hf_greedy(model, ids, mask, 24, eager))
    assert sum(layer.rows_attended_device for layer in eager.tandem_layers()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_split_attends_what_the_cpu_alone_attends(device):
    """At a sparse budget the split reads the same blocks as the CPU alone: same fraction attended and the same
    greedy tokens (only the order of the exact merges differs)."""
    model = _tiny(device=device)
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(6)).to(device)
    mask = torch.ones_like(ids)
    alone, alone_runner = _run(
        model, ids, mask, _config(quest=QuestConfig(budget=0.3, gpu_share=0)), 16, chunk_tokens=32
    )
    split, split_runner = _run(
        model, ids, mask, _config(quest=QuestConfig(budget=0.3, gpu_share=0.5)), 16, chunk_tokens=32
    )
    alone_cache, split_cache = alone_runner.cache, split_runner.cache
    assert torch.equal(alone, split)
    assert (
        split_cache.stats()["mean_fraction_attended"] == alone_cache.stats()["mean_fraction_attended"] < 1.0
    )
    assert sum(layer.rows_attended_device for layer in split_cache.tandem_layers()) > 0
    assert sum(layer.rows_attended_device for layer in alone_cache.tandem_layers()) == 0


def test_compiled_ranked_call_equals_select_then_attend(monkeypatch):
    """The decode path's one-call CPU part (`cpu.RankedAttention`: sort the CPU's ranks, attend, count) gives the
    tokens and statistics of the policy's select() followed by host_attention."""
    from tandem.kernels import ops

    if not ops.native_cpu_available():
        pytest.skip("CPU kernels unavailable")
    model = _tiny(device="cpu")
    ids = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, :21] = 0

    def run():
        tokens, runner = _run(
            model, ids, mask, _config(quest=QuestConfig(budget=0.3, gpu_share=0.5)), 12, chunk_tokens=32
        )
        stats = [
            (layer.rows_attended, layer.rows_attended_device, layer.rows_available, layer.decode_steps)
            for layer in runner.cache.tandem_layers()
        ]
        return tokens, stats

    calls = []
    original = ops.ranked_attention_call
    monkeypatch.setattr(ops, "ranked_attention_call", lambda *a, **k: calls.append(1) or original(*a, **k))
    fused = run()
    assert calls
    monkeypatch.setattr(QuestPolicy, "ranked_range", lambda self, layer, ranked, skip: None)
    plain = run()
    assert torch.equal(fused[0], plain[0])
    assert fused[1] == plain[1]
