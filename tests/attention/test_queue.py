"""The step's task queue (`tandem.attention.queue`): quest's selected host blocks split between the GPU and the CPU
by a plan of pieces that both sides take, each exactly once, settled by a handshake of stores and fences.

On CPU a thread stands in for the GPU with the same protocol (`cpu.queue_gpu_claim`) and the torch reference per
piece, so the compiled CPU worker, the plan and the decode path run in CI; the `cuda` cases run the Triton worker
(persistent programs reading pinned memory) and the engine's CUDA graphs."""

import math
import types

import pytest
import torch

from tandem import TandemCache, TandemConfig
from tandem.attention import queue
from tandem.config import SCHEDULER_BASELINES, CertifiedConfig, HostConfig, QuestConfig
from tandem.engine import TandemRunner
from tandem.kernels import cpu, ops
from tests.cache.test_recall_cache import _config, _padded_prompts
from tests.engine.test_engine import _hf_greedy, _run, _tiny
from tests.tolerances import assert_close

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="needs the compiled CPU kernels")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
    ),
]


def _layer(batch, num_kv_heads, rows, head_dim, block_size, seed, pad=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, num_kv_heads, rows, head_dim)
    pin = device == "cuda"
    keys = torch.randn(shape, generator=gen).to(torch.bfloat16)
    values = torch.randn(shape, generator=gen).to(torch.bfloat16)
    valid = torch.ones(batch, rows, dtype=torch.bool)
    valid[-1, :pad] = False
    if pin:
        keys, values, valid = keys.pin_memory(), values.pin_memory(), valid.pin_memory()
    host = types.SimpleNamespace(
        keys=keys, values=values, valid=valid, block_size=block_size, capacity=rows, generation=0, scales=dict
    )
    return types.SimpleNamespace(
        host=host, config=types.SimpleNamespace(host=types.SimpleNamespace(threads=2))
    )


def _ids(batch, num_kv_heads, width, num_blocks, lengths, seed):
    """[B, Hkv, width] block ids: segment s has lengths[s] distinct blocks ascending, then invalid picks."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((batch, num_kv_heads, width), num_blocks, dtype=torch.long)
    for s, n in enumerate(lengths):
        b, h = divmod(s, num_kv_heads)
        ids[b, h, :n] = torch.randperm(num_blocks, generator=gen)[:n].sort().values
    return ids


def _reference(layer, q, ids, lengths, group, scale):
    host = layer.host
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:2], float("-inf"))
    num_kv_heads = ids.shape[1]
    for s, n in enumerate(lengths):
        b, h = divmod(s, num_kv_heads)
        rows = (ids[b, h, :n, None] * host.block_size + torch.arange(host.block_size)).reshape(-1)
        rows = rows[host.valid[b, rows]]
        if rows.numel() == 0:
            continue
        scores = (q[b, h * group : (h + 1) * group].float() @ host.keys[b, h, rows].float().T) * scale
        lse[b, h * group : (h + 1) * group] = torch.logsumexp(scores, -1)
        out[b, h * group : (h + 1) * group] = torch.softmax(scores, -1) @ host.values[b, h, rows].float()
    return out, lse


def _step(scheduler, lengths, seed, share=0.4, let_gpu_start=True, batch=2, num_kv_heads=2, group=4):
    """One queue step on CPU tensors: (merged out, reference out, cpu owner, gpu taken, plan n, split)."""
    head_dim, block_size, rows, width = 32, 4, 1024, 120
    layer = _layer(batch, num_kv_heads, rows, head_dim, block_size, seed, pad=37)
    ids = _ids(batch, num_kv_heads, width, rows // block_size, lengths, seed)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(torch.bfloat16)
    scale = 1 / math.sqrt(head_dim)
    buffers = queue.QueueBuffers(batch, num_kv_heads, group, head_dim, width, torch.device("cpu"))
    buffers.make_plan(ids, torch.tensor([width]), rows // block_size, scheduler, share)
    buffers.stage(False)
    out_c = torch.zeros(batch, num_kv_heads * group, head_dim)
    lse_c = torch.full((batch, num_kv_heads * group), float("-inf"))
    call = buffers.cpu_call(layer, q, ids, out_c, lse_c, scale)
    role = queue.GpuRole(buffers, layer, q, ids, scale)
    if let_gpu_start:
        role.started.wait()
    rows_all, rows_cpu = call()
    role.join()
    out_g, lse_g = queue.finish_gpu_role(buffers)
    out, _ = ops.merge_lse(out_c, lse_c, out_g, lse_g)
    ref, _ = _reference(layer, q, ids, lengths, group, scale)
    n, split = int(buffers.control[0]), int(buffers.control[1])
    owner = call.owner[:n].bool()
    return out, ref, owner, sorted(role.taken), n, split, (rows_all, rows_cpu)


@pytest.mark.parametrize("scheduler", ["queue", "cpu", "heads", "volume"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_piece_once_and_the_result_is_attention_over_the_selection(scheduler, seed):
    lengths = [[120, 37, 60, 5], [0, 90, 16, 17], [1, 2, 3, 120]][seed]
    out, ref, owner, taken, n, split, (rows_all, rows_cpu) = _step(scheduler, lengths, seed)
    assert n == sum(math.ceil(length / queue.PIECE_BLOCKS) for length in lengths)
    gpu = torch.zeros(n, dtype=torch.bool)
    gpu[taken] = True
    assert not (gpu & owner).any() and (gpu | owner).all()  # every piece exactly once
    assert rows_all == sum(lengths) * 4
    assert 0 <= rows_cpu <= rows_all and (rows_cpu == rows_all) == (not gpu.any() or n == 0)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    if scheduler == "cpu":
        assert split == 0 and not gpu.any()
    elif scheduler in ("heads", "volume"):
        assert gpu.sum() == split and bool(gpu[:split].all())  # the static GPU share: the front of the list
    else:
        assert split > n


def test_the_plan_lists_segments_largest_first_and_splits_as_each_scheduler_says():
    lengths = [20, 120, 60, 5]  # pieces of 16 blocks: 2, 8, 4, 1
    buffers = queue.QueueBuffers(2, 2, 4, 32, 120, torch.device("cpu"))
    ids = _ids(2, 2, 120, 256, lengths, 0)
    control = buffers.control
    splits = {}
    for scheduler in ("queue", "cpu", "heads", "volume"):
        buffers.make_plan(ids, torch.tensor([120]), 256, scheduler, 0.5)
        n = int(control[0])
        entries = control[2 : 2 + n].tolist()
        segments = [e // buffers.pieces_max for e in entries]
        assert segments == [1] * 8 + [2] * 4 + [0] * 2 + [3]
        assert [e % buffers.pieces_max for e in entries[:8]] == list(range(8))
        assert control[2 + buffers.capacity : 2 + buffers.capacity + 4].tolist() == lengths
        splits[scheduler] = int(control[1])
    # heads: half the segments (the two largest); volume: segments while within half the blocks (120 of 205)
    assert splits == {"queue": 16, "cpu": 0, "heads": 12, "volume": 8}
    # the step's k caps each segment's list (entries past it are not this step's)
    buffers.make_plan(ids, torch.tensor([10]), 256, "queue", 0.5)
    assert control[2 + buffers.capacity : 2 + buffers.capacity + 4].tolist() == [10, 10, 10, 5]


def test_both_sides_take_pieces_when_both_run():
    """Many small pieces and a stand-in GPU that starts first: the two sides meet somewhere inside the list, and
    the pieces each took are contiguous from its own end (apart from where they met)."""
    shares = []
    for seed in range(6):
        lengths = [120] * 8
        out, ref, owner, taken, n, split, _ = _step("queue", lengths, seed, batch=4, group=2)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        shares.append(len(taken) / n)
        assert taken and taken[0] == 0
        assert owner[-1]
    assert 0 < min(shares) and max(shares) < 1


def test_a_gpu_that_never_decides_is_a_clear_error_not_a_hang():
    """The GPU flagged a piece but never wrote its decision: the CPU waits up to its timeout and raises."""
    batch, num_kv_heads, group, head_dim, width = 1, 2, 2, 32, 40
    layer = _layer(batch, num_kv_heads, 512, head_dim, 4, 0)
    ids = _ids(batch, num_kv_heads, width, 128, [40, 40], 0)
    q = torch.randn(batch, num_kv_heads * group, head_dim).to(torch.bfloat16)
    buffers = queue.QueueBuffers(batch, num_kv_heads, group, head_dim, width, torch.device("cpu"))
    buffers.make_plan(ids, torch.tensor([width]), 128, "queue", 0.4)
    buffers.stage(False)
    gpu_flags, _, _ = buffers.flags()
    gpu_flags.fill_(1)  # the GPU reached every piece, and then stalled
    out = torch.zeros(batch, num_kv_heads * group, head_dim)
    lse = torch.zeros(batch, num_kv_heads * group)
    call = buffers.cpu_call(layer, q, ids, out, lse, 0.1)
    with pytest.raises(RuntimeError, match="did not answer"):
        call(timeout=0.2)


def _run_split(model, ids, mask, budget: float, split: str):
    """`_run` with quest.scheduler="queue" and every layer's split set to `split`: the queue itself, or one of
    benchmarks/bench_scheduler.py's static baselines through its hook (`LayerKV.queue_split`)."""
    cache = TandemCache.for_model(model, _config(quest=QuestConfig(budget=budget, scheduler="queue")))
    for layer in cache.tandem_layers():
        layer.queue_split = split
    runner = TandemRunner(model, cache)
    first = runner.prefill(ids, mask, chunk_tokens=32, max_new_tokens=24).argmax(-1)
    tokens, _ = runner.decode(first, 23)
    return torch.cat([first.cpu()[:, None], tokens], dim=1), runner


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", ["queue", *SCHEDULER_BASELINES])
def test_decode_with_each_split_equals_the_static_share(device, split):
    """A sparse budget and a left-padded batch: the same greedy tokens and rows attended as quest's static split
    (engine on CUDA: CUDA graphs), and at a full budget DynamicCache's tokens."""
    model = _tiny(device=device)
    ids, mask = _padded_prompts(device)
    base, base_runner = _run(
        model,
        ids,
        mask,
        _config(quest=QuestConfig(budget=0.3, gpu_share=0.5, gpu_cache=0)),
        24,
        chunk_tokens=32,
    )
    ours, runner = _run_split(model, ids, mask, 0.3, split)
    assert torch.equal(base, ours)
    layers, base_layers = runner.cache.tandem_layers(), base_runner.cache.tandem_layers()
    assert sum(x.rows_attended for x in layers) == sum(x.rows_attended for x in base_layers) > 0
    device_rows = sum(x.rows_attended_device for x in layers)
    assert (device_rows == 0) == (split == "cpu")
    full, _ = _run_split(model, ids, mask, 1.0, split)
    assert torch.equal(full, _hf_greedy(model, ids, mask, 24))


def test_a_baseline_split_needs_the_queue_scheduler():
    """The hook replaces the queue's split; on a cache whose scheduler is "share" it is refused, not ignored."""
    model = _tiny()
    ids, mask = _padded_prompts("cpu")
    cache = TandemCache.for_model(model, _config(quest=QuestConfig(budget=0.3, gpu_share=0.5, gpu_cache=0)))
    for layer in cache.tandem_layers():
        assert layer.queue_split == "share"  # the config's scheduler until the benchmark sets one
        layer.queue_split = "heads"
    runner = TandemRunner(model, cache)
    first = runner.prefill(ids, mask, chunk_tokens=32, max_new_tokens=4).argmax(-1)
    with pytest.raises(ValueError, match=r"queue_split='heads' needs TandemConfig\.quest\.scheduler='queue'"):
        runner.decode(first, 3)


def test_config_names_the_scheduler_and_what_it_needs():
    with pytest.raises(ValueError, match=r"scheduler='lanes' .*\"share\" or \"queue\""):
        TandemConfig(policy="quest", quest=QuestConfig(scheduler="lanes"))
    for baseline in SCHEDULER_BASELINES:  # the benchmark's, set on the layers (LayerKV.queue_split)
        with pytest.raises(ValueError, match=rf"scheduler='{baseline}' .*bench_scheduler.py.*queue_split"):
            TandemConfig(policy="quest", quest=QuestConfig(scheduler=baseline))
    with pytest.raises(ValueError, match=r"scheduler='queue' .*policy='quest'"):
        TandemConfig(policy="hgca", quest=QuestConfig(scheduler="queue"))
    with pytest.raises(ValueError, match=r"scheduler='queue' .*epsilon"):
        TandemConfig(
            policy="quest", quest=QuestConfig(scheduler="queue"), certified=CertifiedConfig(epsilon=0.05)
        )
    with pytest.raises(ValueError, match=r"gpu_cache=4\.0 .*scheduler='queue'"):
        TandemConfig(policy="quest", quest=QuestConfig(scheduler="queue", gpu_cache=4))
    with pytest.raises(ValueError, match=r"host.dtype='int8' .*scheduler='queue'"):
        TandemConfig(policy="quest", quest=QuestConfig(scheduler="queue"), host=HostConfig(dtype="int8"))
    with pytest.raises(ValueError, match=r"gpu_share=0\.4 .*scheduler='queue'"):
        TandemConfig(policy="quest", quest=QuestConfig(scheduler="queue", gpu_share=0.4))
    config = TandemConfig(policy="quest", quest=QuestConfig(scheduler="queue"))
    assert config.gpu_share_on("cuda") == 0.0 and config.gpu_cache_on("cuda") == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("scheduler", ["queue", "cpu", "heads", "volume"])
def test_triton_worker_with_the_cpu_worker_on_cuda(scheduler):
    """The persistent Triton programs and the compiled CPU worker share one plan in pinned memory: every piece
    once (the GPU's by its part slots), and the merged result equals attention over the whole selection."""
    batch, num_kv_heads, group, head_dim, block_size, rows, width = 4, 8, 4, 128, 16, 65536, 400
    for seed in range(3):
        lengths = [max(1, width - 11 * s) for s in range(batch * num_kv_heads)]
        layer = _layer(batch, num_kv_heads, rows, head_dim, block_size, seed, pad=999, device="cuda")
        ids = _ids(batch, num_kv_heads, width, rows // block_size, lengths, seed)
        q = torch.randn(batch, num_kv_heads * group, head_dim).to(torch.bfloat16)
        scale = 1 / math.sqrt(head_dim)
        dev = torch.device("cuda")
        buffers = queue.QueueBuffers(batch, num_kv_heads, group, head_dim, width, dev)
        buffers.make_plan(ids.to(dev), torch.tensor([width], device=dev), rows // block_size, scheduler, 0.4)
        buffers.stage(True)
        torch.cuda.synchronize()
        q_host = q.pin_memory()
        out_c = torch.zeros(batch, num_kv_heads * group, head_dim, pin_memory=True)
        lse_c = torch.full((batch, num_kv_heads * group), float("-inf"), pin_memory=True)
        ids_host = ids.pin_memory()
        call = buffers.cpu_call(layer, q_host, ids_host, out_c, lse_c, scale)
        out_g, lse_g = buffers.gpu_part(layer, q.to(dev), ids.to(dev), scale)
        call()
        torch.cuda.synchronize()
        n, split = int(buffers.control[0]), int(buffers.control[1])
        gpu = (buffers.part_lse[:n] > float("-inf")).any(-1).cpu()
        owner = call.owner[:n].bool()
        assert not (gpu & owner).any() and (gpu | owner).all()
        if scheduler in ("heads", "volume"):
            assert int(gpu.sum()) == split
        out, _ = ops.merge_lse(out_c, lse_c, out_g.cpu(), lse_g.cpu())
        ref, _ = _reference(layer, q, ids, lengths, group, scale)
        assert_close(out, ref, torch.bfloat16)  # the GPU's p @ V runs in bf16
