"""The engine (chunked prefill + fixed-address decode steps) against Hugging Face generation with DynamicCache.

On CPU the fixed-address step runs eagerly with the CPU part inline; on CUDA it is captured in CUDA graphs,
with either hand-off to the host (the `cuda`-marked cases: one graph with flags, or two graphs per layer).
All must give DynamicCache's greedy tokens with every entry kept."""

from collections import Counter

import pytest
import torch
from transformers import DynamicCache

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.config import HgcaConfig, QuestConfig
from tandem.engine import TandemRunner
from tandem.kernels import gpu as gpu_kernels
from tandem.kernels.ops import native_cpu_available
from tests.tiny import tiny_model

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
    ),
]


def _tiny(arch="Llama", num_kv_heads=2, device="cpu"):
    overrides = {"sliding_window": None} if arch == "Mistral" else {}
    model = tiny_model(arch, num_key_value_heads=num_kv_heads, **overrides).to(device)
    model.generation_config.eos_token_id = None  # the runner has no stop token: compare whole sequences
    return model


def _hf_greedy(model, ids, mask, new_tokens, cache=None):
    """model.generate's greedy tokens with `cache` (default: a new DynamicCache)."""
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        **generate_cache_kwargs(model, DynamicCache() if cache is None else cache),
    )
    return out[:, ids.shape[1] :].cpu()


def _run(model, ids, mask, config, new_tokens, chunk_tokens=7, use_graphs="auto", handoff="auto"):
    runner = TandemRunner(model, TandemCache.for_model(model, config), use_graphs=use_graphs, handoff=handoff)
    logits = runner.prefill(ids, mask, chunk_tokens=chunk_tokens, max_new_tokens=new_tokens)
    first = logits.argmax(-1)
    tokens, seconds = runner.decode(first, new_tokens - 1)
    assert len(seconds) == new_tokens - 1
    return torch.cat([first.cpu()[:, None], tokens], dim=1), runner


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch,num_kv_heads", [("Llama", 2), ("Qwen2", 2), ("Mistral", 1), ("Llama", 4)])
def test_full_policy_matches_dynamic_cache_across_chunks_and_evictions(device, arch, num_kv_heads):
    model = _tiny(arch, num_kv_heads, device=device)
    ids = torch.randint(0, 128, (2, 61), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # ragged: the second request is left-padded
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=12, block_size=4)
    base = _hf_greedy(model, ids, mask, 40)
    ours, runner = _run(model, ids, mask, config, 40)
    assert torch.equal(base, ours)
    layer = runner.cache.tandem_layers()[0]
    assert layer.host.rows > 61  # decode evicted ring blocks to the host tier along the way
    assert runner.cache.stats()["mean_fraction_attended"] == 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["quest", "hgca"])
def test_sparse_policies_at_full_budget_match_dynamic_cache(device, policy):
    model = _tiny(device=device)
    ids = torch.randint(0, 128, (1, 83), generator=torch.Generator().manual_seed(2)).to(device)
    mask = torch.ones_like(ids)
    extra = (
        {"quest": QuestConfig(budget=1.0)} if policy == "quest" else {"hgca": HgcaConfig(beta=1e-9, span=1)}
    )
    config = TandemConfig(policy=policy, sink_tokens=4, window_tokens=12, block_size=4, **extra)
    ours, runner = _run(model, ids, mask, config, 24, chunk_tokens=32)
    assert torch.equal(_hf_greedy(model, ids, mask, 24), ours)
    if policy == "hgca" and device == "cpu" and native_cpu_available():
        # hgca keeps its lists across steps: the decode path ran the prepared compiled call over them
        assert runner.cache.tandem_layers()[0].decode_buffers._prepared_call is not None


CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]


@pytest.mark.parametrize("handoff", [pytest.param(h, marks=CUDA) for h in ("memops", "launches")])
@pytest.mark.parametrize("policy", ["full", "quest"])
def test_graph_handoffs_match_dynamic_cache(handoff, policy):
    """Both ways a replayed step hands q to the host and takes the CPU part back give HF's greedy tokens; quest
    at full budget also exercises the device share (half the ranked host blocks read by the GPU)."""
    model = _tiny(device="cuda")
    ids = torch.randint(0, 128, (2, 77), generator=torch.Generator().manual_seed(6)).to("cuda")
    extra = {"quest": QuestConfig(budget=1.0, gpu_share=0.5)} if policy == "quest" else {}
    config = TandemConfig(policy=policy, sink_tokens=4, window_tokens=12, block_size=4, **extra)
    ours, runner = _run(model, ids, None, config, 30, chunk_tokens=32, handoff=handoff)
    assert runner.handoff == handoff and runner.use_graphs
    assert torch.equal(_hf_greedy(model, ids, None, 30), ours)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_memops_step_with_a_failing_cpu_part_raises_and_does_not_hang(monkeypatch):
    from tandem.attention import decode

    model = _tiny(device="cuda")
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(7)).to("cuda")
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=12, block_size=4)
    runner = TandemRunner(model, TandemCache.for_model(model, config), handoff="memops")
    first = runner.prefill(ids, chunk_tokens=32, max_new_tokens=12).argmax(-1)
    calls = []
    original = decode.host_part

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 5 * len(runner.layers):  # past warm-up and capture: inside a replay
            raise RuntimeError("injected CPU-part failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(decode, "host_part", failing)
    with pytest.raises(RuntimeError, match="injected"):
        runner.decode(first, 10)
    torch.cuda.synchronize()  # the graph was released: this returns


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_logits_equal_one_shot(device):
    model = _tiny(device=device)
    ids = torch.randint(0, 128, (2, 90), generator=torch.Generator().manual_seed(4)).to(device)
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=16, block_size=4)
    logits = []
    for chunk in (90, 13):
        runner = TandemRunner(model, TandemCache.for_model(model, config))
        logits.append(runner.prefill(ids, chunk_tokens=chunk))
        assert runner.cache.tandem_layers()[1].host.rows > 0
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not gpu_kernels.triton_available("cpu"), reason="no Triton interpreter")
@pytest.mark.parametrize("fused", ["all", "declines", "off", "not yet"])
@pytest.mark.parametrize("padded", [True, False])
def test_flash_append_matches_the_reference_append(monkeypatch, padded, fused):
    """The exact append with `gpu.prefill_attention` (what CUDA runs) gives the reference path's logits; here
    under Triton's interpreter on CPU tensors, with host rows from earlier chunks, a ragged batch or not.

    Host rows that are all real tokens go through the fused kernel (cuDNN on CUDA; here a plain-torch stand-in)
    in calls of FUSED_PIECES rows, the queries padded, and the rest through the Triton kernel; a padding row
    needs the Triton kernel's key mask, so the fused kernel is not asked. Where it declines a call midway, the
    Triton kernel takes the rows left. Host rows under FUSED_MIN_HOST_ROWS ask it only once it has run in the
    process (else "not yet")."""
    from tandem.attention import hybrid
    from tandem.kernels import ops

    asked = []

    def stand_in(q, keys, values, scale):
        assert q.is_contiguous() and keys.is_contiguous() and values.is_contiguous()
        asked.append((q.shape[2], keys.shape[2]))
        if fused == "declines" and len(asked) == 2:
            return None
        out, lse = ops.attention_lse(q, keys, values, scale)
        return out.to(q.dtype), lse

    monkeypatch.setattr(ops, "fused_attention_runs", lambda device, dtype: fused != "off")
    monkeypatch.setattr(ops, "fused_attention_lse", stand_in)
    monkeypatch.setattr(hybrid, "FUSED_PIECES", (8, 4))
    monkeypatch.setattr(hybrid, "FUSED_QUERY_STEP", 8)
    monkeypatch.setattr(hybrid, "FUSED_MIN_QUERIES", 1)
    # fewer host rows than FUSED_MIN_HOST_ROWS: asked only once the kernel has run in the process
    monkeypatch.setattr(hybrid, "FUSED_MIN_HOST_ROWS", 1 << 30)
    monkeypatch.setattr(ops, "fused_attention_ran", lambda device, dtype: fused != "not yet")
    model = _tiny()
    ids = torch.randint(0, 128, (2, 75), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :11] = 0
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=16, block_size=4)
    logits = []
    for flash in (False, True):
        monkeypatch.setattr(hybrid, "flash_prefill_available", lambda q, flash=flash: flash)
        runner = TandemRunner(model, TandemCache.for_model(model, config))
        logits.append(runner.prefill(ids, mask, chunk_tokens=20))
        assert runner.cache.tandem_layers()[0].host.rows > 0
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    if fused in ("off", "not yet"):
        assert not asked
        return
    # 20-query chunks padded to 24, the last (15) to 16; pieces of 8 rows, then of 4
    assert {q_len for q_len, _ in asked} == {24, 16} and {rows for _, rows in asked} == {8, 4}
    # a host row that is padding: the Triton kernel attends every row, that one left out
    layer = runner.cache.tandem_layers()[0]
    q = torch.randn(2, layer.num_q_heads, 3, layer.head_dim)
    k_new = torch.randn(2, layer.num_kv_heads, 3, layer.head_dim)
    valid_new = torch.ones(2, 3, dtype=torch.bool)
    with torch.inference_mode():
        before = len(asked)
        expected = hybrid._append_exact_flash(layer, q, k_new, k_new, valid_new, 0.3)
        assert len(asked) > before
        layer.host.valid[1, 0] = False
        before = len(asked)
        masked = hybrid._append_exact_flash(layer, q, k_new, k_new, valid_new, 0.3)
    assert len(asked) == before
    assert not torch.allclose(masked[1], expected[1])
    torch.testing.assert_close(masked[0], expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_fused_host_rows_match_the_triton_kernel_on_cuda(monkeypatch):
    """On CUDA a long chunk's host rows go through cuDNN's fused attention (`hybrid._fused_rows`) where it runs:
    the chunked prefill's logits match those of the Triton kernel alone."""
    from tandem.attention import hybrid
    from tandem.kernels import ops

    model = tiny_model("Llama", hidden_size=256, max_position_embeddings=8192).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (1, 6144), generator=torch.Generator().manual_seed(3)).cuda()
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=256, block_size=16)
    fused_calls, fused = [], ops.fused_attention_lse

    def counted(*args):
        result = fused(*args)
        fused_calls.append(result is not None)
        return result

    monkeypatch.setattr(ops, "fused_attention_lse", counted)
    monkeypatch.setattr(hybrid, "FUSED_MIN_HOST_ROWS", 0)  # a 6K prompt's rows ask the kernel
    logits = []
    for runs in (ops.fused_attention_runs, lambda device, dtype: False):
        monkeypatch.setattr(ops, "fused_attention_runs", runs)
        runner = TandemRunner(model, TandemCache.for_model(model, config))
        logits.append(runner.prefill(ids, chunk_tokens=2048).float())
    if not any(fused_calls):
        pytest.skip("this torch's cuDNN declines the layout: the Triton kernel runs instead")
    torch.testing.assert_close(logits[0], logits[1], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_stream_yields_decodes_tokens_and_stops_early(device):
    """`stream` yields what `decode` returns, one step at a time; stopping early leaves the cache usable."""
    model = _tiny(device=device)
    ids = torch.randint(0, 128, (2, 45), generator=torch.Generator().manual_seed(9)).to(device)
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=12, block_size=4)
    runners, firsts = [], []
    for _ in range(2):
        runner = TandemRunner(model, TandemCache.for_model(model, config))
        firsts.append(runner.prefill(ids, chunk_tokens=16, max_new_tokens=12).argmax(-1))
        runners.append(runner)
    expected, _ = runners[0].decode(firsts[0], 8)
    steps = runners[1].stream(firsts[1], 8)
    got = []
    for token in steps:
        got.append(token.cpu())
        if len(got) == 5:
            break
    steps.close()
    assert torch.equal(torch.stack(got, dim=1), expected[:, :5])
    assert runners[1].cache.step_context is None
    rest, _ = runners[1].decode(got[-1].to(device), 3)  # picks up where the stream stopped
    assert torch.equal(rest, expected[:, 5:])


@pytest.mark.skipif(not native_cpu_available(), reason="no compiled CPU kernels")
def test_full_policy_attends_every_block_through_one_prepared_call():
    """`full`'s CPU part is one prepared compiled call over all blocks, kept across steps: its index tensor is the
    same object step after step, its length the live block count; the tokens are DynamicCache's."""
    model = _tiny()
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(6))
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=8, block_size=4)
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    first = runner.prefill(ids, max_new_tokens=12).argmax(-1)
    seen, tokens = [], [first]
    for token in runner.stream(first, 11):
        bufs = runner.layers[0].decode_buffers
        seen.append((id(bufs._all_blocks.indices), id(bufs._prepared_call)))
        tokens.append(token)
    layer = runner.layers[0]
    assert len(set(seen[1:])) == 1  # one index tensor and one prepared call for all steps
    assert int(layer.decode_buffers._all_blocks.lengths.max()) == -(-layer.host.rows // 4)
    assert runner.cache.stats()["mean_fraction_attended"] == 1.0
    assert torch.equal(torch.stack(tokens, dim=1), _hf_greedy(model, ids, None, 12))


def test_streaming_policy_runs_and_differs_from_full():
    model = _tiny()
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(5))
    full, _ = _run(
        model, ids, None, TandemConfig(policy="full", sink_tokens=4, window_tokens=8, block_size=4), 12
    )
    stream, runner = _run(
        model, ids, None, TandemConfig(policy="streaming", sink_tokens=4, window_tokens=8, block_size=4), 12
    )
    assert runner.cache.stats()["mean_fraction_attended"] == 0.0
    assert stream.shape == full.shape


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("handoff", ["memops", "launches"])
def test_streaming_graph_has_no_hand_off_and_matches_eager(handoff):
    """A policy that attends no host row records no CPU part in the graph (no q copy, flag or merge); its tokens
    equal the eager step's and its statistics count what the eager step's count."""
    model = _tiny(device="cuda")
    ids = torch.randint(0, 128, (2, 90), generator=torch.Generator().manual_seed(5)).cuda()
    config = TandemConfig(policy="streaming", sink_tokens=4, window_tokens=8, block_size=4)
    results = []
    for use_graphs in (False, True):
        runner = TandemRunner(
            model, TandemCache.for_model(model, config), use_graphs=use_graphs, handoff=handoff
        )
        first = runner.prefill(ids, max_new_tokens=16).argmax(-1)
        tokens, steps = [], []
        for token in runner.stream(first, 15):
            tokens.append(token.cpu())
            steps.append(runner.cache.step_context)
        results.append((torch.stack(tokens, 1), [layer.decode_steps for layer in runner.layers], runner))
    (eager, eager_counts, _), (graphs, graph_counts, runner) = results
    assert torch.equal(eager, graphs)
    assert graph_counts == eager_counts and min(graph_counts) > 0
    step = steps[-1]
    assert step.segments and step.actions == [] and len(step.after) == len(runner.layers)
    if handoff == "launches":
        assert len(step.segments) == 1  # no CPU part cut the recording
    assert runner.cache.stats()["mean_fraction_attended"] == 0.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("budget", [1.0, 0.3])
def test_quest_read_wholly_by_the_device_has_no_hand_off_and_matches_eager(budget):
    """quest with gpu_share 1 and its recall cache leaves the CPU nothing: the graph records no hand-off, and its
    tokens and statistics equal the eager step's (at full budget, DynamicCache's tokens too)."""
    model = _tiny(device="cuda")
    ids = torch.randint(0, 128, (2, 90), generator=torch.Generator().manual_seed(8)).cuda()
    config = TandemConfig(
        policy="quest",
        quest=QuestConfig(budget=budget, gpu_share=1.0),
        sink_tokens=4,
        window_tokens=8,
        block_size=4,
    )
    results = []
    for use_graphs in (False, True):
        runner = TandemRunner(model, TandemCache.for_model(model, config), use_graphs=use_graphs)
        first = runner.prefill(ids, max_new_tokens=16).argmax(-1)
        tokens, steps = [first.cpu()], []
        for token in runner.stream(first, 15):
            tokens.append(token.cpu())
            steps.append(runner.cache.step_context)
        for layer in runner.layers:
            layer.collect_statistics()
        counts = [(layer.rows_attended, layer.rows_available, layer.decode_steps) for layer in runner.layers]
        results.append((torch.stack(tokens, 1), counts, steps[-1], runner))
    (eager, eager_counts, _, _), (graphs, graph_counts, step, runner) = results
    assert runner.use_graphs and runner.layers[0].recall is not None
    assert step.actions == [] and len(step.after) == len(runner.layers)  # no CPU part in the graph
    assert torch.equal(eager, graphs)
    assert graph_counts == eager_counts and min(c[0] for c in graph_counts) > 0
    if budget == 1.0:
        assert torch.equal(graphs, _hf_greedy(model, ids, torch.ones_like(ids), 16))


def test_evictions_are_staged_across_the_block_period(monkeypatch):
    """Each layer writes the ring block it evicts next into the host tier at another step of the block period
    (`LayerKV._stage_next_eviction`): after the first step, which catches up, no step stages more than
    ceil(layers / block_size) blocks, and every decode eviction makes a staged block live instead of copying it
    then (but in the first step, if the prompt left the ring's newest block full). The tokens stay DynamicCache's."""
    from tandem.cache.host import HostTier

    model = tiny_model("Llama", num_key_value_heads=2, num_hidden_layers=8)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 128, (2, 61), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    calls = []
    for name in ("stage", "append"):
        original = getattr(HostTier, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name + ("_staged" if kwargs.get("staged") else ""))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(HostTier, name, counted)
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=12, block_size=4)
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    first = runner.prefill(ids, mask, chunk_tokens=32, max_new_tokens=24).argmax(-1)
    calls.clear()
    per_step, tokens = [], [first.cpu()]
    for token in runner.stream(first, 23):
        per_step.append(Counter(calls))
        calls.clear()
        tokens.append(token.cpu())
    assert torch.equal(torch.stack(tokens, dim=1), _hf_greedy(model, ids, mask, 24))
    assert max(step["stage"] for step in per_step[1:]) <= -(-8 // 4)
    assert sum(step["append_staged"] for step in per_step) >= 8 * 4  # every layer, every 4 steps
    # only a block that was full before decoding began can leave unstaged: in the first step
    assert sum(step["append"] for step in per_step[1:]) == 0


@pytest.mark.parametrize("with_flags", [True, False])
def test_prepare_leaves_no_copy_pending_for_a_replay_with_hand_off_flags(monkeypatch, with_flags):
    """With hand-off flags the graph's launch can stay inside the driver until the GPU has passed hand-offs that the
    serving thread serves, so that thread must make no CUDA call meanwhile: `DecodeStep.prepare` waits for every
    layer's host copies (`HostTier.wait`) before the launch. Without flags (eager steps) it does not, and the
    copies overlap the step."""
    from tandem.cache.host import HostTier
    from tandem.engine import DecodeStep, handoff

    model = tiny_model("Llama", num_key_value_heads=2, num_hidden_layers=3)
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=8, block_size=4)
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache)
    runner.prefill(
        torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3)), max_new_tokens=8
    )
    waited = []
    original = HostTier.wait
    monkeypatch.setattr(HostTier, "wait", lambda self: (waited.append(self), original(self))[1])
    flags = handoff.HostFlags(len(runner.layers), None) if with_flags else None
    step = DecodeStep(torch.device("cpu"), flags)
    with torch.inference_mode():  # as the runner's steps run
        step.prepare(runner.layers)
    hosts = [layer.host for layer in runner.layers]
    if with_flags:
        assert all(any(w is host for w in waited) for host in hosts)
    else:
        assert not waited


def test_runner_refuses_bad_input():
    model = _tiny()
    cache = TandemCache.for_model(model, TandemConfig(policy="full"))
    runner = TandemRunner(model, cache)
    with pytest.raises(ValueError, match="prefill"):
        runner.decode(torch.zeros(1, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="input_ids"):
        runner.prefill(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_tokens"):
        runner.prefill(torch.zeros(1, 5, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="attention_mask"):
        runner.prefill(torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 4))
    runner.prefill(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="empty cache"):
        runner.prefill(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="first_tokens"):
        runner.decode(torch.zeros(2, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="exceeds the model's maximum"):
        runner.decode(torch.zeros(1, dtype=torch.long), 2000)
    with pytest.raises(ValueError, match="use_graphs"):
        TandemRunner(model, cache, use_graphs="sometimes")
    with pytest.raises(ValueError, match="handoff must be one of auto, memops, launches"):
        TandemRunner(model, cache, handoff="flags")
    assert TandemRunner(model, cache).handoff == "launches"  # no graphs on CPU: nothing to hand off
    with pytest.raises(ValueError, match="CUDA"):
        TandemRunner(model, cache, use_graphs=True)
    with pytest.raises(ValueError, match="TandemCache"):
        TandemRunner(model, DynamicCache())


@pytest.mark.model
def test_real_model_greedy_matches_dynamic_cache(smollm, prose):
    model, tok = smollm
    ids = tok(prose, return_tensors="pt").input_ids[:, :700]
    config = TandemConfig(policy="full", sink_tokens=16, window_tokens=64)
    ours, runner = _run(model, ids, None, config, 12, chunk_tokens=256)
    assert torch.equal(_hf_greedy(model, ids, None, 12), ours)
    assert runner.cache.stats()["host_rows"] > 500


@pytest.mark.parametrize("device", DEVICES)
def test_warm_up_leaves_the_runners_cache_empty_and_the_answer_unchanged(device):
    model = _tiny(device=device)
    config = TandemConfig(
        policy="quest",
        sink_tokens=4,
        window_tokens=8,
        block_size=4,
        quest=QuestConfig(budget=0.5, gpu_cache=0),
    )
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(8)).to(device)
    cold = TandemRunner(model, TandemCache.for_model(model, config)).generate(ids, 10)
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    assert runner.warm_up(ids.shape[1]) > 0
    assert runner.layers[0].seq_len == 0 and runner.next_position is None
    assert torch.equal(runner.generate(ids, 10), cold)
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        runner.warm_up(0)


@pytest.mark.parametrize("policy", ["full", "quest", "certified", "hgca", "streaming"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_next_turn_appended_to_the_cache_answers_as_the_whole_conversation(device, policy):
    """A conversation's second turn appended to the cache (`generate(append=True)`, led by the first answer's last
    token, which no step fed) gives the tokens of one prompt holding the whole conversation; the cache then holds
    every token but the last answer's last."""
    model = _tiny(device=device)
    config = TandemConfig(policy=policy, sink_tokens=4, window_tokens=16, block_size=4)
    first = torch.randint(0, 128, (1, 45), generator=torch.Generator().manual_seed(11)).to(device)
    second = torch.randint(0, 128, (1, 23), generator=torch.Generator().manual_seed(12)).to(device)
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    answer = runner.generate(first, 9, chunk_tokens=20)
    turn = torch.cat([answer[-1:].to(device)[None], second], dim=1)
    reply = runner.generate(turn, 7, chunk_tokens=20, append=True)
    held = runner.cache.get_seq_length()
    assert held == 45 + 9 + 23 + 7 - 1
    whole = torch.cat([first, answer[None].to(device), second], dim=1)
    fresh = TandemRunner(model, TandemCache.for_model(model, config))
    assert torch.equal(reply, fresh.generate(whole, 7, chunk_tokens=20))
    with pytest.raises(ValueError, match="append=True"):
        runner.prefill(second)
    with pytest.raises(ValueError, match="no attention_mask"):
        runner.prefill(second, torch.ones_like(second), append=True)
    with pytest.raises(ValueError, match="without append first"):
        TandemRunner(model, TandemCache.for_model(model, config)).prefill(second, append=True)
