"""`RowsRunner`: decode steps over requests that each keep their own cache. A request decodes the same tokens
alone, in a batch, or joining and leaving a running batch; on CUDA the recorded steps equal the eager ones."""

import gc
import threading
import weakref

import pytest
import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.attention import rows as rows_module
from tandem.config import QuestConfig
from tandem.engine.handoff import HostFlags
from tandem.engine.rows import RowContext, RowsRunner, choose_tokens
from tandem.engine.sampling import sample, seed_key
from tandem.engine.step import DecodeStep
from tests.tiny import tiny_model

POLICIES = ("full", "hgca", "quest", "certified", "streaming")
LENGTHS = (39, 71, 53, 46, 60)
STEPS = 8


def _config(policy: str) -> TandemConfig:
    """policy, or "quest+share": quest with a device share (its device ranking then runs on the CPU too), or
    "quest+cache": with a recall cache too."""
    # window 16 + 4 sinks: prompts of 39-71 tokens put most of themselves in the host tier
    quest = {"quest": QuestConfig(budget=0.5)}
    if policy == "quest+share":
        policy, quest = "quest", {"quest": QuestConfig(budget=0.5, gpu_share=0.5)}
    elif policy == "quest+cache":
        policy, quest = "quest", {"quest": QuestConfig(budget=0.5, gpu_share=0.5, gpu_cache=2.0)}
    return TandemConfig(
        policy=policy,
        sink_tokens=4,
        window_tokens=16,
        block_size=16,
        **(quest if policy == "quest" else {}),
    )


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_model("Llama")


def _prompt(model, length: int, seed: int) -> torch.Tensor:
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def _prefill(model, prompt: torch.Tensor, policy: str, device, runner=None):
    """A prefilled cache of the prompt [1, T] and its first greedy token (a row of `runner`'s pool first, where it
    has one)."""
    cache = TandemCache.for_model(model, _config(policy))
    if runner is not None:
        runner.attach(cache)
    out = model(
        input_ids=prompt.to(device), use_cache=True, logits_to_keep=1, **generate_cache_kwargs(model, cache)
    )
    return cache, int(out.logits[0, -1].argmax())


def _alone(model, prompt, policy, steps, device, cache_out: list | None = None):
    """Greedy tokens of the request decoded alone through the drop-in (transformers' forward over its cache), and
    each step's logits [V]; its cache is appended to `cache_out` where given."""
    cache, token = _prefill(model, prompt, policy, device)
    tokens, logits = [token], []
    for step in range(steps):
        out = model(
            input_ids=torch.tensor([[token]], device=device),
            position_ids=torch.tensor([[prompt.shape[1] + step]], device=device),
            use_cache=True, **generate_cache_kwargs(model, cache),
        )  # fmt: skip
        logits.append(out.logits[0, -1].float().cpu())
        token = int(logits[-1].argmax())
        tokens.append(token)
    if cache_out is not None:
        cache_out.append(cache)
    return tokens, logits


class _Row:
    def __init__(self, model, prompt, policy, device, runner=None) -> None:
        self.prompt = prompt
        self.cache, token = _prefill(model, prompt, policy, device, runner)
        self.tokens = [token]
        self.logits = []

    @property
    def position(self) -> int:
        return self.prompt.shape[1] + len(self.tokens) - 1


def _grow(model, runner, prompts, policy, device):
    """A batch that grows by one request a step, as a server's fills (request t joins at step t), each request
    decoding STEPS tokens: (the rows, the steps at which the runner made a recording, how each step ran)."""
    rows, recorded_at, kinds = [], [], []
    for t in range(STEPS + len(prompts)):
        if t < len(prompts):
            rows.append(_Row(model, prompts[t], policy, device, runner))
        running = [row for row in rows if len(row.tokens) <= STEPS]
        if not running:
            break
        recordings = runner.recordings
        _step(runner, running)
        kinds.append(runner.last_step)
        if runner.recordings > recordings:
            recorded_at.append(t)
    return rows, recorded_at, kinds


def _step(runner, rows) -> None:
    logits = runner.step([r.cache for r in rows], [r.tokens[-1] for r in rows], [r.position for r in rows])
    for row, token, row_logits in zip(rows, logits.argmax(-1).tolist(), logits.float().cpu(), strict=True):
        row.tokens.append(token)
        row.logits.append(row_logits)


def _check_joined_and_left(model, device, tolerance=None, policies=POLICIES, **runner_options) -> RowsRunner:
    """Five requests of other lengths and policies: two start, three join after 2, 3 and 5 steps, the first
    leaves after 4; each decodes what it decodes alone."""
    prompts = [_prompt(model, n, seed) for seed, n in enumerate(LENGTHS)]
    alone = [_alone(model, p, policy, STEPS, device) for p, policy in zip(prompts, policies, strict=True)]
    tolerance = tolerance or dict(atol=1e-4, rtol=1e-4)
    runner = RowsRunner(model, config=_config("full"), **runner_options)
    rows = [_Row(model, p, policy, device, runner) for p, policy in zip(prompts, policies, strict=True)]
    running = rows[:2]
    for t in range(STEPS + 5):
        if t in (2, 3, 5):
            running.append(rows[{2: 2, 3: 3, 5: 4}[t]])
        running = [r for r in running if len(r.tokens) <= STEPS and not (r is rows[0] and t == 4)]
        if not running:
            break
        _step(runner, running)
    for row, (tokens, logits) in zip(rows, alone, strict=True):
        # the first leaves after 4 steps, the others decode all
        assert row.tokens == tokens[: len(row.tokens)]
        # fp32 weights; the own forward concatenates q/k/v and gate/up, which changes the sums' order
        torch.testing.assert_close(
            torch.stack(row.logits), torch.stack(logits[: len(row.logits)]), **tolerance
        )
    assert [len(row.tokens) for row in rows] == [5] + [STEPS + 1] * 4
    runner.test_rows = rows  # for the caller's checks of what the runner held
    return runner


@torch.inference_mode()
def test_rows_decode_alone_batched_and_joined_mid_stream(tiny):
    runner = _check_joined_and_left(tiny, torch.device("cpu"))
    assert runner.recordings == 0 and runner.last_step == "eager"  # no graphs on the CPU


@torch.inference_mode()
def test_rows_decode_with_transformers_layer_code(tiny):
    _check_joined_and_left(tiny, torch.device("cpu"), forward="hf")


@pytest.mark.parametrize("slots", [5, 3])
@torch.inference_mode()
def test_pooled_rows_decode_as_alone(tiny, slots, monkeypatch):
    """With a pool of hot tiers the requests decode what they decode alone: pooled ones (full, quest, certified,
    streaming) as one batch, hgca (a moving average the pool does not hold) and, with 3 rows, the request that
    found every row taken, alone within the step; the first request stays attached after it leaves, so later
    steps hold a row without a request. The pooled requests whose policy attends every host row (full, and
    certified on the CPU) are attended in one call per layer."""
    gathered = []
    every_row_call = rows_module._every_row_call

    def counted(hosts, *args):
        gathered.append(sum(host is not None for host in hosts))
        return every_row_call(hosts, *args)

    monkeypatch.setattr(rows_module, "_every_row_call", counted)
    runner = _check_joined_and_left(tiny, torch.device("cpu"), slots=slots)
    assert max(gathered) == (2 if slots == 5 else 1)  # full and certified together; with 3 rows full alone
    own = _check_joined_and_left(tiny, torch.device("cpu"))
    # the statistics the policies record (rows attended and available per layer) as each request's own
    assert _counts(runner.test_rows) == _counts(own.test_rows)
    rows = [runner.pool.row(row.cache) for row in runner.test_rows]
    assert rows == ([0, None, 2, 3, 4] if slots == 5 else [0, None, 2, None, None])
    assert runner.pool.free == []
    del runner.test_rows
    gc.collect()
    assert sorted(runner.pool.free) == list(range(slots))  # a collected cache gives its row back


@torch.inference_mode()
def test_a_row_goes_back_when_its_counts_cannot_be_read(tiny, monkeypatch):
    """Detaching a request whose recall-cache counts cannot be read (a failed device) still frees its row for
    the next request, and raises the error."""
    runner = RowsRunner(tiny, config=_config("full"), slots=2)
    row = _Row(tiny, _prompt(tiny, 40, 0), "quest", torch.device("cpu"), runner)
    kv = row.cache.tandem_layers()[0]

    def failed():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    kv.recall_row = (None, 0)
    monkeypatch.setattr(kv, "collect_statistics", failed)
    assert runner.pool.row(row.cache) == 0 and 0 not in runner.pool.free
    with pytest.raises(RuntimeError, match="illegal memory access"):
        runner.detach(row.cache)
    assert 0 in runner.pool.free


QUEST_ROWS = ("quest+share", "quest", "quest+share", "quest+share", "full")


@torch.inference_mode()
def test_a_recorded_steps_host_side_follows_the_requests_it_serves(tiny):
    """What a recording re-points to serve other requests (`RowsRunner._serve`; on CUDA before a replay, here on
    the CPU's same host side): the joint hand-off's call reads each row's request's host tiers after a join and
    after a leave, only the rows that changed are re-pointed, a row without a request reads a member's store, and
    no tier of a request that left is held."""
    cpu = torch.device("cpu")
    runner = RowsRunner(tiny, config=_config("full"), slots=3)
    a, b = (_Row(tiny, _prompt(tiny, n, seed), "quest+share", cpu, runner) for seed, n in ((0, 60), (1, 55)))
    _step(runner, [a, b])
    layer_rows = list(runner._rows[1].values())

    def reads():  # per row, the keys each layer's call reads
        return [[pooled.ranked.call.tensors[1][r][0] for pooled in layer_rows] for r in range(2)]

    def keys(row):
        return [kv.host.keys for kv in row.cache.tandem_layers()]

    def same(got, want):
        return all(x is y for x, y in zip(got, want, strict=True))

    assert same(reads()[0], keys(a)) and same(reads()[1], keys(b))
    runner._served = runner._served_rows([a.cache, b.cache])  # as a recording of the two leaves it
    gone = weakref.ref(a.cache.tandem_layers()[0].host)
    runner.detach(a.cache)
    a.cache = None
    c = _Row(tiny, _prompt(tiny, 50, 2), "quest+share", cpu, runner)
    assert runner.pool.row(c.cache) == 0
    set_store = rows_module.ops.ranked_rows_set_store
    repointed = []

    def counted(call, row, store):
        repointed.append(row)
        set_store(call, row, store)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rows_module.ops, "ranked_rows_set_store", counted)
        runner._serve([c.cache, b.cache])
    assert same(reads()[0], keys(c)) and same(reads()[1], keys(b))
    assert repointed == [0] * len(layer_rows) and gone() is None
    runner._serve([c.cache, None])  # b leaves: its row reads c's store (the fallback), and b's is not held
    assert same(reads()[0], keys(c)) and same(reads()[1], keys(c))
    assert all(pooled.ranked.members == [0] for pooled in layer_rows)


@torch.inference_mode()
def test_ended_requests_are_freed_without_the_garbage_collector(tiny):
    """Once its requests have ended and the runner is released, their host tiers are freed by reference counting
    alone: nothing a step kept (the joint hand-off's parts and calls, the pool's rows) holds them in a reference
    cycle, which only the cyclic garbage collector frees (a server freezes its heap and collects the oldest
    objects rarely, so their memory would stay taken)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        runner = _check_joined_and_left(tiny, torch.device("cpu"), policies=QUEST_ROWS, slots=5)
        caches = [row.cache for row in runner.test_rows]
        tiers = [
            weakref.ref(kv.host) for cache in caches for kv in cache.tandem_layers() if kv.host is not None
        ]
        for cache in caches:
            runner.detach(cache)
        del runner.test_rows, caches, cache
        runner.release()
        assert tiers and [ref() for ref in tiers] == [None] * len(tiers)
    finally:
        if enabled:
            gc.enable()


def test_a_closed_step_holds_none_of_its_requests():
    """A recorded step's host-side parts hold their requests' layers, and each part's timing callback holds its
    request's context, which holds the step: once the step is closed (`RowsRunner.release`), that cycle must not
    keep the layers (and their host tiers) for the garbage collector to find."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        step = DecodeStep(torch.device("cpu"), HostFlags(1, None))
        context = RowContext(step)
        layer = torch.nn.Linear(2, 2)  # a request's layer, as a part keeps it
        ranked = rows_module.RankedRows()
        ranked.begin({0: layer})
        context.host_work(ranked.part(False, context.add_host_seconds), wait=False)  # as a recording keeps it
        held = weakref.ref(layer)
        del layer, ranked
        step.close()
        del step, context
        assert held() is None
    finally:
        if enabled:
            gc.enable()


@torch.inference_mode()
def test_pooled_quest_rows_hand_off_together(tiny, monkeypatch):
    """The pooled requests whose policy keeps a range of the device's ranking (quest with a device share: on the CPU
    its ranking runs there too) hand their CPU parts to the host as one call per layer (`rows.RankedRows`), and
    decode what they decode alone, with the statistics they record alone; quest without a ranking (no device
    share on the CPU) hands its part off alone."""
    joined, ranked = [], []
    part_call = rows_module.RankedRowsPart.__call__
    rank = rows_module.PooledRows.rank

    def counted(part):
        joined.append(len(part.members))
        return part_call(part)

    def counted_rank(pooled, *args):
        ranking, rows = rank(pooled, *args)
        ranked.append(len(rows))
        return ranking, rows

    monkeypatch.setattr(rows_module.RankedRowsPart, "__call__", counted)
    monkeypatch.setattr(rows_module.PooledRows, "rank", counted_rank)
    runner = _check_joined_and_left(tiny, torch.device("cpu"), policies=QUEST_ROWS, slots=5)
    # rows 0, 2 and 3 have a device share: 2 joins at step 2, 3 at step 3, 0 leaves at step 4; their rankings
    # are made at once over the pool's digest mirrors (`PooledRows.rank`), each with its own block count
    assert max(joined) == 3 and min(joined) == 1
    assert max(ranked) == 3
    own = _check_joined_and_left(tiny, torch.device("cpu"), policies=QUEST_ROWS)
    assert _counts(runner.test_rows) == _counts(own.test_rows)
    assert [sum(kv.rows_attended_device for kv in r.cache.tandem_layers()) > 0 for r in runner.test_rows] == [
        True, False, True, True, False
    ]  # fmt: skip


@torch.inference_mode()
def test_pooled_quest_rows_plan_their_recall_caches_together(tiny, monkeypatch):
    """Pooled quest requests with a recall cache plan their device shares in one plan per layer over the pool's
    recall cache (`PooledRows.plan_recall`: one row each, its own block count and counts) and attend them in one
    call, and decode what they decode alone, attending as many rows; each request's row counts what its device
    attended from the cache."""
    planned = []
    plan_recall = rows_module.PooledRows.plan_recall

    def counted(pooled, *args):
        cache, plan, rows = plan_recall(pooled, *args)
        planned.append(len(rows))
        return cache, plan, rows

    monkeypatch.setattr(rows_module.PooledRows, "plan_recall", counted)
    policies = ("quest+cache", "quest", "quest+cache", "quest+cache", "full")
    runner = _check_joined_and_left(tiny, torch.device("cpu"), policies=policies, slots=5)
    assert max(planned) == 3
    own = _check_joined_and_left(tiny, torch.device("cpu"), policies=policies)
    assert _counts(runner.test_rows) == _counts(own.test_rows)
    for rows in (runner, own):
        for kv in (kv for r in rows.test_rows for kv in r.cache.tandem_layers()):
            kv.collect_statistics()
    assert _counts(runner.test_rows) == _counts(own.test_rows)  # with the cache's rows: each row once
    device = [[sum(getattr(kv, name) for kv in r.cache.tandem_layers()) for r in rows.test_rows]
              for rows in (runner, own) for name in ("rows_attended_device", "rows_attended_cached")]  # fmt: skip
    assert [d > 0 for d in device[0]] == [
        True,
        False,
        True,
        True,
        False,
    ]  # copied in by the pooled cache's rows
    assert [c > 0 for c in device[1]] == [True, False, True, True, False]  # and hits
    # the pooled cache has at least the own caches' slots: it copies in no more than they do
    assert all(p <= o for p, o in zip(device[0], device[2], strict=True))


@pytest.mark.parametrize("replayed", [False, True])
@torch.inference_mode()
def test_the_pool_stages_its_requests_evictions_as_they_stage_their_own(tiny, monkeypatch, replayed):
    """Over 40 steps (evictions every 16), the pool stages its requests' evicted blocks one layer at a time for all
    of them (`SlotPool.stage_evictions`): the host tiers (rows, valid flags, digests and their device mirror) hold
    what each request's own staging writes, and the tokens are the same. Replayed (the CPU stand-ins of
    `_cpu_recordings`), the staged rows' host copies are the replay's idle work."""
    if replayed:
        _cpu_recordings(monkeypatch)
    _check_pool_staging(tiny, torch.device("cpu"), monkeypatch, use_graphs=replayed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("handoff", ["memops", "launches"])
@torch.inference_mode()
def test_recorded_pooled_steps_stage_evictions_as_requests_stage_their_own(monkeypatch, handoff):
    """The same on CUDA with recorded steps: the staged rows' host copies are made during each replay (between its
    hand-offs with flags, after its launches without), from staging buffers nothing waited for before the launch."""
    torch.manual_seed(0)
    model = tiny_model("Llama").cuda()
    _check_pool_staging(model, torch.device("cuda"), monkeypatch, use_graphs=True, handoff=handoff)


def _check_pool_staging(model, device, monkeypatch, use_graphs: bool, **runner_args) -> None:
    """Four requests over 40 steps in a pool of 4 rows and each staging its own evictions (no pool): the same
    tokens, and host tiers that hold the same rows."""
    from tandem.cache import host as host_module

    written = []
    stage_written = host_module.HostTier.stage_written

    def counted(tier, *args, **kwargs):
        written.append(tier)
        return stage_written(tier, *args, **kwargs)

    monkeypatch.setattr(host_module.HostTier, "stage_written", counted)
    policies = ("full", "quest+share", "streaming", "quest+share")
    prompts = [_prompt(model, n, seed) for seed, n in enumerate((39, 71, 53, 46))]
    tiers = []
    for slots in (4, 0):
        graphs = use_graphs and bool(slots)
        if device.type == "cuda":
            runner_args["use_graphs"] = graphs
            if graphs:
                runner_args["record_after"] = 1
        runner = RowsRunner(model, config=_config("full"), slots=slots, **runner_args)
        if device.type != "cuda":
            runner.use_graphs = graphs  # the CPU stand-ins record and replay
        rows = [_Row(model, p, policy, device, runner) for p, policy in zip(prompts, policies, strict=True)]
        for _ in range(40):
            _step(runner, rows)
        if graphs:
            assert runner.last_step == "replayed"
        tiers.append([[kv.host for kv in row.cache.tandem_layers()] for row in rows])
        tokens = [row.tokens for row in rows]
        if slots:
            pooled_tokens = tokens
    assert tokens == pooled_tokens
    assert len(written) >= 4 * 2 * 2  # every request's layers, twice in 40 steps
    names = ("keys", "values", "valid", "key_min", "key_max", "key_min_dev", "key_max_dev", "block_valid_dev")
    for pooled, own in zip(*tiers, strict=True):
        for a, b in zip(pooled, own, strict=True):
            assert a.rows == b.rows  # staged rows may differ: the pool stages at its own period's steps
            for name in names:
                x, y = getattr(a, name), getattr(b, name)
                if x is None:
                    assert y is None
                    continue
                per_block = name not in ("keys", "values", "valid")
                rows_dim = 1 if x.dim() == 2 else 2
                live = (a.rows + min(a.staged, b.staged)) // (a.block_size if per_block else 1)
                # the same rows, up to the float sums of the pooled step's attention (the other test's tolerance)
                torch.testing.assert_close(
                    x.narrow(rows_dim, 0, live), y.narrow(rows_dim, 0, live), atol=1e-4, rtol=1e-4
                )


def _cpu_recordings(monkeypatch) -> None:
    """Stand-ins for `DecodeStep`'s recording and replay on the CPU: a "recording" keeps the step's body and a
    "replay" runs it, then the host work the replay is given to do while the GPU would run (`idle`)."""
    from tandem.engine.step import DecodeStep

    def capture(step, body):
        step.captures += 1
        step.segments = [(body, None)]

    def replay(step, idle=()):
        step.segments[0][0]()
        for work in idle:
            work()

    monkeypatch.setattr(DecodeStep, "capture", capture)
    monkeypatch.setattr(DecodeStep, "replay", replay)


@torch.inference_mode()
def test_a_growing_batch_is_recorded_at_its_second_step_in_a_width(tiny, monkeypatch):
    """The runner's orchestration of recordings, on the CPU (where a "recording" here keeps the step's body and a
    "replay" runs it): while a request joins at every step, each new width of rows runs one eager step and the
    next batch in those rows is recorded at once (`RowsRunner._record_grown`), not only a batch that repeats;
    every request still decodes as alone."""
    _cpu_recordings(monkeypatch)
    cpu = torch.device("cpu")
    prompts = [_prompt(tiny, 40 + 3 * i, i) for i in range(6)]
    alone = [_alone(tiny, p, "quest+share", STEPS, cpu) for p in prompts]
    runner = RowsRunner(tiny, config=_config("full"), slots=8)
    runner.use_graphs = True  # the recording's orchestration, with the stand-ins above
    rows, recorded_at, kinds = _grow(tiny, runner, prompts, "quest+share", cpu)
    # widths 1, 2, 4, 4, 8, 8: the second batch in 4 rows and in 8 rows is recorded; the batch of all six then
    # repeats its recording until the first request leaves
    assert recorded_at[:2] == [3, 5]
    assert kinds[:7] == ["eager"] * 3 + ["recorded", "eager", "recorded", "replayed"]
    assert [t for t, kind in enumerate(kinds) if kind == "recorded"] == recorded_at
    for row, (tokens, logits) in zip(rows, alone, strict=True):
        assert row.tokens == tokens[: len(row.tokens)]
        torch.testing.assert_close(
            torch.stack(row.logits), torch.stack(logits[: len(row.logits)]), atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("own_staging", [True, False])
@torch.inference_mode()
def test_a_caches_layers_reserve_their_slots_together(tiny, own_staging):
    """`reserve_decode_slots` (a cache's layers in one pass, the common step inline) leaves every layer as each
    layer's own `reserve_decode_slot` does over 40 steps (sink slots, new blocks, evictions, staging), and says
    `moved` exactly at the steps where some layer did more than take its newest block's next slot."""
    from tandem.cache.layer import reserve_decode_slots

    def state(kv):
        hot, host = kv.hot, kv.host
        return (kv.seq_len, hot.sink_used, hot.tail_fill, list(hot.order), host.rows, host.staged)

    prompt = _prompt(tiny, 30, 4)  # 4 sinks, 16-token blocks: the ring fills, then evicts every 16 steps
    caches = [_prefill(tiny, prompt, "quest+share", torch.device("cpu"))[0] for _ in range(2)]
    for cache in caches:
        for kv in cache.tandem_layers():
            kv.stages_own_evictions = own_staging
    together, alone = (cache.tandem_layers() for cache in caches)
    moves = 0
    for _ in range(40):
        before = [state(kv) for kv in alone]
        slots = {kv.reserve_decode_slot() for kv in alone}
        slot, moved = reserve_decode_slots(together)
        assert {slot} == slots
        assert [state(kv) for kv in together] == [state(kv) for kv in alone]
        inline = all(
            (b[0] + 1, b[2] + 1, b[3:]) == (a[0], a[2], a[3:]) for b, a in zip(before, map(state, alone))
        )
        assert moved == (not inline)
        moves += moved
    assert 2 <= moves < 40
    together[1].hot.tail_fill -= 1  # a layer one token behind: the cache is inconsistent
    with pytest.raises(RuntimeError, match="disagree on the decode slot"):
        reserve_decode_slots(together)


@torch.inference_mode()
def test_a_steps_device_share_is_worked_out_again_when_it_may_change(tiny):
    """`DecodeStep.prepare` keeps a cache's device share and its policies' step state from the last step while no
    layer moved; an eviction, or a recording (which may make new step tensors), works them out again."""
    from tandem.engine.step import DecodeStep

    cache, _ = _prefill(tiny, _prompt(tiny, 71, 5), "quest+share", torch.device("cpu"))
    layers = cache.tandem_layers()
    step = DecodeStep(torch.device("cpu"))
    calls = []
    for kv in layers:
        original = kv.policy.prepare_step
        kv.policy.prepare_step = lambda layer, original=original: (calls.append(layer), original(layer))[1]
    for _ in range(40):
        rows = layers[0].host.rows
        calls.clear()
        step.prepare(layers)
        moved = layers[0].host.rows != rows
        assert len(calls) in ((len(layers),) if moved else (0, len(layers)))
        assert step.device_blocks_value == layers[0].policy.device_share(layers[0]) > 0
        for kv in layers:
            kv.policy.step_blocks(kv, torch.device("cpu"))  # the step tensor the device ranking reads
    calls.clear()
    step.prepare(layers)
    assert calls == []  # nothing moved
    for kv in layers:  # a recording makes its own step tensors, left for `prepare` to fill (`step_blocks`)
        kv.policy._k, kv.policy._k_value = torch.zeros(1, dtype=torch.long), None
    step.captures += 1
    step.prepare(layers)
    assert len(calls) == len(layers)
    assert all(int(kv.policy._k) == kv.policy.blocks_this_step(kv) > 0 for kv in layers)


@torch.inference_mode()
def test_pooled_rows_follow_host_tiers_that_grow(tiny):
    """Host tiers that outgrow their first allocation while their requests decode pooled (4-token blocks: a tier
    starts at 256 rows): the joint quest hand-off's call, the pool's staging and the pooled digest mirrors follow
    the moved buffers (the mirrors of a tier that does not grow, the last one's, move with the others'), and every
    request decodes the tokens and logits of its own steps."""
    quest = QuestConfig(budget=0.5, gpu_share=0.5)
    configs = [
        TandemConfig(policy=policy, sink_tokens=4, window_tokens=8, block_size=4, **extra)
        for policy, extra in (("quest", {"quest": quest}),) * 2 + (("full", {}), ("quest", {"quest": quest}))
    ]
    prompts = [_prompt(tiny, n, seed) for seed, n in enumerate((236, 228, 241, 60))]
    results = []
    for slots in (4, 0):
        runner = RowsRunner(tiny, config=configs[2], slots=slots)
        caches, tokens, logits = [], [], []
        for prompt, config in zip(prompts, configs, strict=True):
            cache = TandemCache.for_model(tiny, config)
            runner.attach(cache)
            out = tiny(
                input_ids=prompt, use_cache=True, logits_to_keep=1, **generate_cache_kwargs(tiny, cache)
            )
            caches.append(cache)
            tokens.append([int(out.logits[0, -1].argmax())])
        first = [[kv.host.generation for kv in cache.tandem_layers()] for cache in caches]
        for step in range(48):
            out = runner.step(caches, [t[-1] for t in tokens], [p.shape[1] + step for p in prompts])
            logits.append(out.float().cpu())
            for t, token in zip(tokens, out.argmax(-1).tolist(), strict=True):
                t.append(token)
        grown = [[kv.host.generation for kv in cache.tandem_layers()] for cache in caches]
        moved = [all(g > f for g, f in zip(gs, fs, strict=True)) for gs, fs in zip(grown, first, strict=True)]
        assert moved == [True, True, True, bool(slots)]
        if slots:
            # the quest requests' digest mirrors grew with their host tiers and stayed rows of the pool's
            assert [runner.pool.mirrored(cache, runner.pool.row(cache)) for cache in caches] == [
                True, True, False, True
            ]  # fmt: skip
            mirror = next(iter(runner.pool.mirrors.values()))[0]
            assert mirror.shape[2] * 4 > 256  # wider than the first allocation of a tier
        results.append((tokens, torch.stack(logits)))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", ["quest+share", "quest+cache"])
@torch.inference_mode()
def test_a_freed_row_keeps_no_blocks_of_its_last_request(tiny, policy):
    """A quest request that takes the pool row of one that ended (a longer prompt, more host blocks) ranks only its
    own blocks in the pooled digest mirror, finds none of them in the pooled recall cache, and decodes the tokens
    and logits it decodes alone."""
    runner = RowsRunner(tiny, config=_config("full"), slots=1)
    first = _Row(tiny, _prompt(tiny, 150, 0), policy, torch.device("cpu"), runner)
    for _ in range(3):
        _step(runner, [first])
    runner.detach(first.cache)
    runner.release()
    prompt = _prompt(tiny, 45, 1)
    tokens, logits = _alone(tiny, prompt, policy, STEPS, torch.device("cpu"))
    row = _Row(tiny, prompt, policy, torch.device("cpu"), runner)
    assert runner.pool.mirrored(row.cache, 0)
    for _ in range(STEPS):
        _step(runner, [row])
    assert row.tokens == tokens
    torch.testing.assert_close(torch.stack(row.logits), torch.stack(logits), atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_pooled_mirrors_that_would_not_fit_stay_each_requests_own(tiny, monkeypatch):
    """Where the pool's digest mirrors of every layer would take more than their share of the free memory
    (`slots.MIRROR_HEADROOM`), each host tier keeps its own mirror and its request ranks its blocks alone, decoding
    what it decodes alone."""
    from tandem.engine import slots as slots_module

    monkeypatch.setattr(slots_module, "free_bytes", lambda device: 1000)
    cpu = torch.device("cpu")
    prompts = [_prompt(tiny, n, seed) for seed, n in enumerate((71, 53))]
    alone = [_alone(tiny, p, "quest+share", 4, cpu) for p in prompts]
    runner = RowsRunner(tiny, config=_config("full"), slots=2)
    rows = [_Row(tiny, p, "quest+share", cpu, runner) for p in prompts]
    for _ in range(4):
        _step(runner, rows)
    assert not runner.pool.mirrors and not any(runner.pool.mirrored(r.cache, b) for b, r in enumerate(rows))
    assert all(kv.host.key_min_dev is not None for r in rows for kv in r.cache.tandem_layers())
    assert [r.tokens for r in rows] == [tokens for tokens, _ in alone]


@torch.inference_mode()
def test_rows_refuse_bad_batches(tiny):
    runner = RowsRunner(tiny)
    row = _Row(tiny, _prompt(tiny, 20, 0), "full", torch.device("cpu"))
    with pytest.raises(ValueError, match="caches must hold at least one"):
        runner.step([], [], [])
    with pytest.raises(ValueError, match="each TandemCache once"):
        runner.step([row.cache, row.cache], [1, 2], [20, 20])
    with pytest.raises(ValueError, match="one entry per cache"):
        runner.step([row.cache], [1, 2], [20])
    with pytest.raises(ValueError, match=r"caches\[0\] is empty"):
        runner.step([TandemCache.for_model(tiny, _config("full"))], [1], [0])
    with pytest.raises(ValueError, match=r"caches\[0\] is a DynamicCache"):
        from transformers import DynamicCache

        runner.step([DynamicCache()], [1], [0])
    pair = TandemCache.for_model(tiny, _config("full"))
    tiny(input_ids=_prompt(tiny, 20, 1).repeat(2, 1), use_cache=True, **generate_cache_kwargs(tiny, pair))
    with pytest.raises(ValueError, match="holds a batch of 2"):
        runner.step([pair], [1], [20])
    _step(runner, [row])  # the refusals changed nothing
    assert row.cache.get_seq_length() == 21


def test_choose_tokens_is_the_engine_draw():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert choose_tokens(logits, [0, 0, 0], [1, 1, 1], [1, 2, 3], [0, 0, 0]) == logits.argmax(-1).tolist()
    temps, tops, seeds, steps = [0.0, 0.7, 1.3], [1.0, 0.9, 1.0], [seed_key(s) for s in (1, 2, -3)], [0, 5, 9]
    expected = sample(
        logits,
        torch.tensor(temps),
        torch.tensor(tops),
        torch.tensor(seeds),
        torch.tensor(steps),
        nucleus=True,
    )
    assert choose_tokens(logits, temps, tops, seeds, steps) == expected.tolist()


def _counts(rows) -> list:
    return [
        [(kv.rows_attended, kv.rows_available, kv.decode_steps) for kv in r.cache.tandem_layers()]
        for r in rows
    ]


@torch.inference_mode()
def test_a_freed_row_is_not_an_empty_row(tiny):
    """Pooled requests in rows 0 and 1; the first ends and is freed: the next step over the second lays out row 0
    empty, which is a new batch, not the old one whose row 0 is now a dead reference."""
    cpu = torch.device("cpu")
    runner = RowsRunner(tiny, slots=2, config=_config("full"))
    a, b = (_Row(tiny, _prompt(tiny, n, seed), "full", cpu, runner) for seed, n in ((0, 40), (1, 45)))
    expected = _alone(tiny, b.prompt, "full", 4, cpu)[0]
    _step(runner, [a, b])
    swapped = runner.step([b.cache, a.cache], [b.tokens[-1], a.tokens[-1]], [b.position, a.position])
    assert runner._steps_same == 2  # the same rows, asked for in another order: logits in the order asked
    b.tokens.append(int(swapped[0].argmax()))
    del a, swapped
    gc.collect()
    _step(runner, [b])
    _step(runner, [b])
    assert b.tokens == expected and runner._steps_same == 2
    assert runner.pool.free == [0]
    runner.detach(b.cache)  # its row goes back, and the cache, whose hot tier was there, refuses further use
    assert sorted(runner.pool.free) == [0, 1]
    with pytest.raises(RuntimeError, match="row 1 of the hot-tier pool went back"):
        _step(runner, [b])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("slots", [0, 5, 3])
@pytest.mark.parametrize("handoff", ["memops", "launches"])
@torch.inference_mode()
def test_rows_recorded_steps_decode_as_alone(handoff, slots):
    torch.manual_seed(0)
    model = tiny_model("Llama").cuda()
    runner = _check_joined_and_left(
        model, torch.device("cuda"), use_graphs=True, handoff=handoff, record_after=1, slots=slots
    )
    assert runner.recordings >= 2  # the batch changed and was recorded again
    if slots:
        rows = [runner.pool.row(row.cache) for row in runner.test_rows]
        assert rows == ([0, None, 2, 3, 4] if slots == 5 else [0, None, 2, None, None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("policy", ["quest", "quest+cache"])
@torch.inference_mode()
def test_a_recorded_step_serves_the_pools_next_requests(policy):
    """Pooled quest requests (on CUDA: their rankings, recall plans and hand-offs joined): once a batch of them is
    recorded, the batches that follow as requests leave are served by that recording, re-pointed at them
    (`RowsRunner._rebind`), and every request still decodes the tokens and logits it decodes alone."""
    torch.manual_seed(0)
    model = tiny_model("Llama").cuda()
    runner = _check_joined_and_left(
        model, torch.device("cuda"), policies=(policy,) * 5, use_graphs=True, handoff="memops", record_after=1,
        slots=5,
    )  # fmt: skip
    assert runner.rebinds >= 2 and runner.recordings >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("policy", ["quest", "quest+cache"])
@torch.inference_mode()
def test_a_request_joins_a_recorded_step(policy):
    """As the server runs them: a request ends (its row detached, its cache dropped, the host tier that the
    recorded step's rows without a request read gone with it) and a new one takes its row, its first decode step a
    replay of the recording; later ones end and one more joins. One recording serves the batches in its rows, each
    request decodes the tokens and logits it decodes alone, and no host tier of a request that left is kept once
    a step has run without it."""
    torch.manual_seed(0)
    model = tiny_model("Llama").cuda()
    cuda = torch.device("cuda")
    prompts = [_prompt(model, n, seed) for seed, n in enumerate((60, 55, 50, 47, 52))]
    alone = [_alone(model, p, policy, STEPS, cuda) for p in prompts]
    runner = RowsRunner(
        model, config=_config("full"), use_graphs=True, handoff="memops", record_after=1, slots=4
    )  # fmt: skip
    rows = [_Row(model, p, policy, cuda, runner) for p in prompts[:3]]  # rows 0-2 of a 4-row step
    running, left, steps, kinds = list(rows), [], 0, []
    for _ in range(3 * STEPS):
        for i, row in enumerate(running):
            if len(row.tokens) > (4 if row is rows[2] else STEPS):
                left.append((weakref.ref(row.cache.tandem_layers()[0].host), steps))
                runner.detach(row.cache)
                row.cache = running[i] = None
                if len(rows) < len(prompts):
                    running[i] = _Row(model, prompts[len(rows)], policy, cuda, runner)
                    rows.append(running[i])
        running = [row for row in running if row is not None]
        if not running:
            break
        gc.collect()
        _step(runner, running)
        kinds.append(runner.last_step)
        steps += 1
    assert [len(row.tokens) for row in rows] == [STEPS + 1] * 2 + [5] + [STEPS + 1] * 2
    assert runner.rebinds >= 2 and runner.recordings <= runner.rebinds
    assert kinds.count("recorded") == runner.recordings and kinds.count("rebound") >= runner.rebinds
    for row, (tokens, logits) in zip(rows, alone, strict=True):
        assert row.tokens == tokens[: len(row.tokens)]
        torch.testing.assert_close(
            torch.stack(row.logits), torch.stack(logits[: len(row.logits)]), atol=1e-4, rtol=1e-4
        )
    gc.collect()
    assert [ref() is None for ref, at in left if at < steps] == [True] * sum(at < steps for _, at in left)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("policy", ["quest", "quest+cache"])
@torch.inference_mode()
def test_a_batch_that_grows_at_every_step_is_recorded(policy):
    """As a server's batch fills: a request joins at every step, so no batch repeats. Each width of rows runs one
    eager step; the next batch in those rows is recorded (`RowsRunner._record_grown`), its newest request's first
    step part of the recording, and the batches after it replay it; every request decodes as alone. Once they
    have ended and the runner is released, their host tiers are freed without the garbage collector (a server's
    memory after a load)."""
    torch.manual_seed(0)
    model = tiny_model("Llama").cuda()
    cuda = torch.device("cuda")
    prompts = [_prompt(model, 40 + 3 * i, i) for i in range(6)]
    alone = [_alone(model, p, policy, STEPS, cuda) for p in prompts]
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        runner = RowsRunner(
            model, config=_config("full"), use_graphs=True, handoff="memops", record_after=1, slots=8
        )  # fmt: skip
        rows, recorded_at, _ = _grow(model, runner, prompts, policy, cuda)
        assert {3, 5} <= set(recorded_at)  # the second batch of 3-4 rows and of 5-8 rows: recorded, not eager
        assert runner.rebinds >= 2 and runner.recordings <= 4
        for row, (tokens, logits) in zip(rows, alone, strict=True):
            assert row.tokens == tokens[: len(row.tokens)]
            torch.testing.assert_close(
                torch.stack(row.logits), torch.stack(logits[: len(row.logits)]), atol=1e-4, rtol=1e-4
            )
        tiers = [
            weakref.ref(kv.host) for row in rows for kv in row.cache.tandem_layers() if kv.host is not None
        ]
        for row in rows:
            runner.detach(row.cache)
        del rows, row
        runner.release()
        assert tiers and [ref() for ref in tiers] == [None] * len(tiers)
    finally:
        if enabled:
            gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@torch.inference_mode()
def test_a_requests_first_step_in_a_recording_counts_as_alone():
    """A request that joins a growing batch has its first decode step in the batch's recording
    (`RowsRunner._record_grown`). What its policy adds to at each step (here the default's certificate counters)
    is made before the recording (`Policy.prepare_step`): the batch records, every request decodes the tokens it
    decodes alone, and its certificates are counted at every step, as alone."""
    torch.manual_seed(0)
    model = tiny_model("Llama").cuda()
    cuda = torch.device("cuda")
    prompts = [_prompt(model, 40 + 3 * i, i) for i in range(4)]
    runner = RowsRunner(
        model, config=_config("full"), use_graphs=True, handoff="memops", record_after=1, slots=4
    )
    rows, _, _ = _grow(model, runner, prompts, "certified", cuda)
    assert runner.recordings >= 2
    for row, prompt in zip(rows, prompts, strict=True):
        caches = []
        assert row.tokens == _alone(model, prompt, "certified", STEPS, cuda, caches)[0]
        cache = caches[0]
        for ours, alone in zip(row.cache.tandem_layers(), cache.tandem_layers(), strict=True):
            got, expected = ours.policy.certifier.statistics(), alone.policy.certifier.statistics()
            assert got["head_steps"] == expected["head_steps"] > 0
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@torch.inference_mode()
def test_pooled_rows_decode_eagerly_on_cuda():
    torch.manual_seed(0)
    model = tiny_model("Llama").cuda()
    runner = _check_joined_and_left(model, torch.device("cuda"), use_graphs=False, slots=5)
    assert runner.recordings == 0 and runner.pool is not None


@torch.inference_mode()
def test_a_batch_is_its_caches_not_their_addresses(tiny):
    """A recording belongs to the caches it was made over: a cache that replaces a freed one (which may take its
    address) starts a new batch, so a replay can never read a freed cache's memory."""

    runner = RowsRunner(tiny)
    cpu = torch.device("cpu")
    a, b = (_Row(tiny, _prompt(tiny, n, seed), "full", cpu) for seed, n in ((0, 20), (1, 25)))
    _step(runner, [a, b])
    assert runner._same_batch([a.cache, b.cache])
    b_ref = weakref.ref(b.cache)
    del b
    gc.collect()
    assert b_ref() is None  # nothing the runner holds keeps a request's cache alive
    c = _Row(tiny, _prompt(tiny, 25, 2), "full", cpu)
    assert not runner._same_batch([a.cache, c.cache])
    _step(runner, [a, c])
    assert runner._same_batch([a.cache, c.cache]) and runner._steps_same == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_a_cache_attaches_outside_inference_mode_after_pooled_steps():
    """The pool's digest mirrors are made by inference-mode steps; attaching the next request from plain code (as
    `RowsRunner`'s example does) empties its row of them all the same."""
    torch.manual_seed(0)
    model = tiny_model("Llama").cuda()
    cuda = torch.device("cuda")
    runner = RowsRunner(model, config=_config("quest"), use_graphs=True, slots=2)
    with torch.inference_mode():
        row = _Row(model, _prompt(model, 60, 0), "quest", cuda, runner)
        _step(runner, [row])
    assert runner.pool.mirrors  # made by the step
    runner.detach(row.cache)
    cache = TandemCache.for_model(model, _config("quest"))
    assert runner.attach(cache) is not None


@torch.inference_mode()
def test_a_detach_from_another_thread_waits_for_the_step_in_flight(tiny, monkeypatch):
    """A server's prefill thread attaches and detaches requests while the scheduler's thread steps: the pool's
    rows change only between steps (`SlotPool.lock`, which a step holds to its end)."""
    runner = RowsRunner(tiny, config=_config("quest"), slots=4)
    rows = [_Row(tiny, _prompt(tiny, n, seed), "quest", "cpu", runner) for seed, n in enumerate((39, 46))]
    in_step, go_on = threading.Event(), threading.Event()
    body = runner._body

    def held(*args):
        in_step.set()
        assert go_on.wait(30)
        return body(*args)

    monkeypatch.setattr(runner, "_body", held)
    stepping = threading.Thread(target=_step, args=(runner, rows))
    stepping.start()
    assert in_step.wait(30)
    detached = threading.Event()
    other = threading.Thread(target=lambda: (runner.detach(rows[1].cache), detached.set()))
    other.start()
    try:
        assert not detached.wait(0.3), "the row went back while a step over it ran"
    finally:
        go_on.set()
        stepping.join(30)
        other.join(30)
    assert detached.is_set() and runner.pool.row(rows[1].cache) is None and len(rows[0].tokens) == 2
