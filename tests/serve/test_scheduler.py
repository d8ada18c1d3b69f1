"""The continuous-batching scheduler on a small random-weight model: admission (batch, queue, memory budget),
refusals (QueueFull, TooLarge), the events a request sends, cancellation, failures, shutdown; and greedy tokens
equal to a plain prefill + decode with the same cache settings, whatever the prefill chunk."""

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.attention import TaskPool
from tandem.config import HgcaConfig
from tandem.serve.scheduler import Limits, QueueFull, Request, Scheduler, TooLarge
from tests.tiny import tiny_model

CONFIG = TandemConfig(
    policy="hgca", sink_tokens=2, window_tokens=8, block_size=4, hgca=HgcaConfig(observation_tokens=6)
)
TIMEOUT = 30.0


class LetterTokenizer:
    def decode(self, tokens, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in tokens)


@pytest.fixture
def model():
    # no end-of-sequence token: every request runs to its max_tokens
    return tiny_model("Llama", eos_token_id=None)


def _scheduler(model, **limits) -> Scheduler:
    return Scheduler(model, LetterTokenizer(), Limits(**limits), TaskPool(1))


def _job(prompt_tokens: int, max_tokens: int, config: TandemConfig = CONFIG, first: int = 3):
    """A greedy request and what it receives: `events`, and `done` set by its last event."""
    events, done = [], threading.Event()

    def emit(event):
        events.append(event)
        if event[0] != "text":
            done.set()

    ids = [(first + 7 * i) % 128 for i in range(prompt_tokens)]
    request = Request(prompt_ids=ids, max_tokens=max_tokens, config=config, emit=emit, temperature=0.0)
    return SimpleNamespace(request=request, events=events, done=done)


def _reference(model, ids: list[int], max_tokens: int, config: TandemConfig) -> list[int]:
    """Greedy tokens from one whole prefill and a decode loop on a TandemCache of the same settings."""
    cache = TandemCache.for_model(model, config)
    kwargs = generate_cache_kwargs(model, cache)
    tokens = []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True, **kwargs)
        for step in range(max_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            position = torch.tensor([[len(ids) + step]])
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]), position_ids=position, use_cache=True, **kwargs
            )
    return tokens


def test_a_request_fitting_the_batch_never_waits_in_the_queue(model):
    scheduler = _scheduler(model, max_batch=1, max_queue=0)  # not started: admission happens at submit
    scheduler.submit(_job(5, 4).request)
    with pytest.raises(QueueFull) as caught:
        scheduler.submit(_job(5, 4).request)
    assert caught.value.retry_after >= 1.0 and "--max-queue 0" in str(caught.value)
    counts = scheduler.counts()
    assert (counts["prefilling"], counts["waiting"]) == (1, 0)


def test_the_queue_holds_max_queue_requests(model):
    scheduler = _scheduler(model, max_batch=1, max_queue=2)
    for _ in range(3):
        scheduler.submit(_job(5, 4).request)
    with pytest.raises(QueueFull):
        scheduler.submit(_job(5, 4).request)
    counts = scheduler.counts()
    assert (counts["prefilling"], counts["waiting"]) == (1, 2)


def test_a_request_past_the_budget_is_too_large_and_not_queued(model):
    one = _scheduler(model).size(_job(5, 100).request)
    scheduler = _scheduler(model, host_bytes=one.on_host, device_bytes=1)  # a CPU model needs no device bytes
    scheduler.submit(_job(5, 100).request)
    with pytest.raises(TooLarge, match="--host-memory"):
        scheduler.submit(_job(5, 100_000).request)
    assert scheduler.counts()["waiting"] == 0


def test_the_host_budget_admits_requests_in_turn_and_all_is_freed(model):
    jobs = [_job(11, 6, first=f) for f in (3, 4, 5)]
    one = _scheduler(model).size(jobs[0].request)
    scheduler = _scheduler(model, host_bytes=one.on_host)
    for job in jobs:
        scheduler.submit(job.request)
    counts = scheduler.counts()
    assert (counts["prefilling"], counts["waiting"], counts["reserved_host_bytes"]) == (1, 2, one.on_host)
    scheduler.start()
    try:
        assert all(job.done.wait(TIMEOUT) for job in jobs)
    finally:
        scheduler.stop()
    for job in jobs:
        *texts, last = job.events
        assert last == ("done", "length") and len(texts) == 6 == job.request.generated
        assert "".join(t for _, t in texts) == LetterTokenizer().decode(job.request.tokens)
    assert jobs[0].request.last_token <= jobs[1].request.admitted <= jobs[2].request.admitted
    assert scheduler.counts() == dict.fromkeys(scheduler.counts(), 0)  # no cache left alive, without a gc


@pytest.mark.parametrize(
    "config",
    [CONFIG, TandemConfig(policy="full", sink_tokens=2, window_tokens=8, block_size=4)],
    ids=["hgca", "full"],
)
def test_greedy_tokens_equal_one_prefill_for_any_chunk(model, config):
    """Chunks of 3 and 5 (hgca's last chunk then grows to its 6 observed tokens), or the whole prompt at once;
    three requests of different lengths decoding in one batch."""
    jobs = [_job(n, 7, config, first=n) for n in (13, 29, 37)]
    expected = [_reference(model, job.request.prompt_ids, 7, config) for job in jobs]
    for chunk in (3, 5, 64):
        runs = [_job(n, 7, config, first=n) for n in (13, 29, 37)]
        scheduler = _scheduler(model, prefill_chunk=chunk)
        scheduler.start()
        try:
            for run in runs:
                scheduler.submit(run.request)
            assert all(run.done.wait(TIMEOUT) for run in runs)
        finally:
            scheduler.stop()
        assert [run.request.tokens for run in runs] == expected, f"prefill chunk {chunk}"


def _turns(model, jobs, **limits) -> list[str]:
    """Run `jobs` and return the scheduler's turns in order: "p" for each prefill chunk, "d<B>" for each decode
    step of B requests."""
    scheduler = _scheduler(model, **limits)
    events = []
    scheduler.stats.on_prefill_chunk = lambda seconds: events.append("p")
    scheduler.stats.on_decode_step = lambda seconds, batch, kind: events.append(f"d{batch}")
    for job in jobs:  # admitted before the thread starts: every prompt waits at the first turn
        scheduler.submit(job.request)
    scheduler.start()
    try:
        assert all(job.done.wait(TIMEOUT) for job in jobs)
    finally:
        scheduler.stop()
    return events


def test_a_step_budget_runs_the_chunks_that_fit_beside_the_decoding_requests(model):
    """Prompts of 3 chunks of 8: one chunk a turn without a budget; with 26 tokens a whole prompt a turn beside up
    to two decoding requests (a request decodes from the turn after its last chunk), two chunks beside three; the
    same greedy tokens."""
    plain = [_job(24, 6, first=i) for i in range(4)]
    assert _turns(model, plain, prefill_chunk=8)[:8] == ["p", "p", "p", "p", "d1", "p", "d1", "p"]
    budgeted = [_job(24, 6, first=i) for i in range(4)]
    turns = _turns(model, budgeted, prefill_chunk=8, step_tokens=26)
    assert turns[:14] == ["p", "p", "p", "p", "p", "p", "d1", "p", "p", "p", "d2", "p", "p", "d3"]
    assert [job.request.tokens for job in budgeted] == [job.request.tokens for job in plain]


def test_a_step_budget_and_a_prefill_thread_are_refused_together(model):
    with pytest.raises(ValueError, match="Limits.prefill_thread runs the chunks beside the steps"):
        _scheduler(model, step_tokens=64, prefill_thread=True)


def test_a_budget_smaller_than_a_chunk_still_runs_one_chunk_a_turn(model):
    jobs = [_job(24, 4, first=i) for i in range(2)]
    assert _turns(model, jobs, prefill_chunk=8, step_tokens=1)[:7] == ["p", "p", "p", "p", "d1", "p", "d1"]


def test_cancelling_frees_a_running_and_a_waiting_request(model):
    scheduler = _scheduler(model, max_batch=1)
    running, waiting = _job(9, 1000), _job(9, 1000)
    first_token = threading.Event()
    emit = running.request.emit
    running.request.emit = lambda event: (emit(event), first_token.set())
    scheduler.start()
    try:
        scheduler.submit(running.request)
        scheduler.submit(waiting.request)
        assert first_token.wait(TIMEOUT)
        scheduler.cancel(waiting.request)
        assert waiting.done.wait(TIMEOUT) and waiting.events == [("done", "cancelled")]
        scheduler.cancel(running.request)
        assert running.done.wait(TIMEOUT) and running.events[-1] == ("done", "cancelled")
        assert running.request.generated < 1000 and running.request.cache is None
        assert scheduler.counts() == dict.fromkeys(scheduler.counts(), 0)
    finally:
        scheduler.stop()


def test_a_request_that_fails_ends_with_an_error_and_the_others_go_on(model):
    # fluxion's shipped profile is the default model's: this model's shapes are refused when its cache is made
    broken = _job(9, 3, TandemConfig(policy="fluxion"))
    fine = _job(9, 3)
    scheduler = _scheduler(model)
    scheduler.start()
    try:
        scheduler.submit(broken.request)
        scheduler.submit(fine.request)
        assert broken.done.wait(TIMEOUT) and fine.done.wait(TIMEOUT)
        (kind, message), *_ = broken.events
        assert kind == "error" and "profile" in message
        assert fine.events[-1] == ("done", "length") and scheduler.alive
    finally:
        scheduler.stop()


@pytest.mark.parametrize("beside", [False, True], ids=["turns", "prefill-thread"])
def test_shutdown_ends_running_requests_and_refuses_new_ones(model, beside):
    scheduler = _scheduler(model, prefill_thread=beside)
    job = _job(9, 100_000)
    scheduler.start()
    scheduler.submit(job.request)
    scheduler.stop()
    assert job.done.is_set() and job.events[-1] == ("error", "the server is shutting down")
    assert not scheduler.alive
    with pytest.raises(RuntimeError, match="shutting down"):
        scheduler.submit(_job(5, 4).request)


def test_a_failed_device_still_answers_every_request(model, monkeypatch):
    """A device that failed (a CUDA error stays: the step raises, and so does freeing a cache's row, which reads
    its counts) ends the step's requests with its error, and the scheduler goes on: no request waits on a
    scheduler that died freeing a cache."""
    scheduler = _scheduler(model)
    jobs = [_job(9, 1000, first=first) for first in (3, 4)]

    def failed(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(scheduler.runner, "step", failed)
    monkeypatch.setattr(scheduler.runner, "detach", failed)
    scheduler.start()
    try:
        for job in jobs:
            scheduler.submit(job.request)
        assert all(job.done.wait(TIMEOUT) for job in jobs)
        for job in jobs:
            kind, message = job.events[-1]
            assert kind == "error" and "illegal memory access" in message
        assert scheduler.alive and scheduler.counts()["decoding"] == 0
    finally:
        scheduler.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(
    "beside, where",
    [(False, "_decode_step"), (True, "_decode_step"), (True, "_prefill_chunk")],
    ids=["turns", "prefill-thread, decode", "prefill-thread, prefill"],
)
def test_a_fault_in_the_scheduler_fails_every_request_instead_of_hanging_it(
    model, monkeypatch, beside, where
):
    scheduler = _scheduler(model, max_batch=1, prefill_thread=beside)
    running, waiting = _job(9, 1000), _job(9, 1000)

    def fault(request_or_batch):
        raise RuntimeError("a bug")

    monkeypatch.setattr(scheduler, where, fault)
    scheduler.submit(running.request)  # both in before the thread that fails starts
    scheduler.submit(waiting.request)
    scheduler.start()
    try:
        assert running.done.wait(TIMEOUT) and waiting.done.wait(TIMEOUT)
        failed = ("error", "the server's scheduler failed: RuntimeError: a bug")
        assert running.events[-1] == failed and waiting.events == [failed]
        assert not scheduler.alive and isinstance(scheduler.failure, RuntimeError)
        with pytest.raises(RuntimeError):
            scheduler.submit(_job(5, 4).request)
    finally:
        scheduler.stop()


def test_warm_up_steps_every_batch_size_and_keeps_nothing(model, monkeypatch):
    scheduler = _scheduler(model, max_batch=4)
    prompts, steps = [], []
    forward, step = model.forward, scheduler.runner.step

    def watched_forward(*args, **kwargs):
        prompts.append(kwargs["input_ids"].shape)
        return forward(*args, **kwargs)

    def watched_step(caches, tokens, positions):
        steps.append(len(caches))
        return step(caches, tokens, positions)

    monkeypatch.setattr(model, "forward", watched_forward)
    monkeypatch.setattr(scheduler.runner, "step", watched_step)
    assert scheduler.warm_up(CONFIG, prompt_tokens=5) > 0
    assert prompts[:4] == [(1, 5)] * 4 and steps == [1, 2, 3, 4]  # four prompts, then steps of 1..4 rows
    assert scheduler.counts()["live_caches"] == 0
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        scheduler.warm_up(CONFIG, prompt_tokens=0)
    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(scheduler.runner, "step", step)
    scheduler.start()
    try:
        with pytest.raises(RuntimeError, match="warm_up runs before start"):
            scheduler.warm_up(CONFIG)
        job = _job(12, 5)  # requests after the warm-up decode as without it
        scheduler.submit(job.request)
        assert job.done.wait(TIMEOUT)
        assert job.request.tokens == _reference(model, job.request.prompt_ids, 5, CONFIG)
    finally:
        scheduler.stop()


def test_a_prefill_thread_gives_the_same_greedy_tokens(model):
    """Prompts prefilled on the prefill thread beside the decode steps: the tokens of one whole prefill, for
    requests of different lengths arriving together and one after another."""
    for config in (CONFIG, TandemConfig(policy="full", sink_tokens=2, window_tokens=8, block_size=4)):
        jobs = [_job(n, 7, config, first=n) for n in (13, 29, 37)]
        expected = [_reference(model, job.request.prompt_ids, 7, config) for job in jobs]
        scheduler = _scheduler(model, prefill_chunk=5, prefill_thread=True)
        scheduler.start()
        try:
            for job in jobs[:2]:
                scheduler.submit(job.request)
            assert jobs[0].done.wait(TIMEOUT)
            scheduler.submit(jobs[2].request)
            assert all(job.done.wait(TIMEOUT) for job in jobs)
            assert scheduler.alive
        finally:
            scheduler.stop()
        assert [job.request.tokens for job in jobs] == expected, config.policy
        assert [job.events[-1] for job in jobs] == [("done", "length")] * 3


def _held_chunk(scheduler, monkeypatch, job, start: int):
    """Hold `job`'s chunk that starts at `start` inside the runner until `go_on` is set; `inside` is set then."""
    inside, go_on = threading.Event(), threading.Event()
    chunk = scheduler.runner.prefill_chunk

    def held(cache, ids, at, last):
        if cache is job.request.cache and at == start:
            inside.set()
            assert go_on.wait(TIMEOUT)
        return chunk(cache, ids, at, last)

    monkeypatch.setattr(scheduler.runner, "prefill_chunk", held)
    return inside, go_on


def _wait_for(condition) -> bool:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@contextlib.contextmanager
def _stream_beside_a_held_chunk(model, monkeypatch):
    """A server with a prefill thread, a running stream, and a 40-token prompt whose second chunk of 8 is held
    inside the model until `go_on` is set; yields them once that chunk is held, and stops the server after."""
    scheduler = _scheduler(model, prefill_chunk=8, prefill_thread=True)
    running, prompt = _job(9, 1000), _job(40, 5, first=5)
    inside, go_on = _held_chunk(scheduler, monkeypatch, prompt, start=8)
    scheduler.start()
    try:
        scheduler.submit(running.request)
        assert _wait_for(lambda: running.request.generated >= 1)
        scheduler.submit(prompt.request)
        assert inside.wait(TIMEOUT)
        yield SimpleNamespace(scheduler=scheduler, running=running, prompt=prompt, go_on=go_on)
        scheduler.cancel(running.request)
        assert running.done.wait(TIMEOUT)
    finally:
        go_on.set()
        scheduler.stop()


def test_with_a_prefill_thread_a_stream_decodes_while_a_prompt_prefills(model, monkeypatch):
    """A prompt's chunk held inside the model: the running stream goes on decoding meanwhile (in turns it would
    wait for the chunk), and the prompt's request then decodes as it would have."""
    with _stream_beside_a_held_chunk(model, monkeypatch) as run:
        generated = run.running.request.generated
        assert _wait_for(lambda: run.running.request.generated >= generated + 5)
        run.go_on.set()
        assert run.prompt.done.wait(TIMEOUT) and run.prompt.events[-1] == ("done", "length")
    prompt = run.prompt.request
    assert prompt.tokens == _reference(model, prompt.prompt_ids, 5, CONFIG)


def test_a_prompt_cancelled_inside_its_chunk_on_the_prefill_thread_ends_there(model, monkeypatch):
    """The prefill thread owns a prefilling request's cache: cancelled while its chunk runs (and a stream decodes
    beside it), the request ends after that chunk, from that thread, and everything is freed."""
    with _stream_beside_a_held_chunk(model, monkeypatch) as run:
        prompt, scheduler = run.prompt, run.scheduler
        scheduler.cancel(prompt.request)
        generated = run.running.request.generated
        assert _wait_for(
            lambda: run.running.request.generated >= generated + 3
        )  # the decode thread went round
        assert not prompt.done.is_set()  # its chunk still runs over its cache
        run.go_on.set()
        assert prompt.done.wait(TIMEOUT) and prompt.events == [("done", "cancelled")]
        assert prompt.request.cache is None and prompt.request.prefilled == 16
        counts = scheduler.counts  # the running stream's alone
        assert _wait_for(
            lambda: (counts()["prefilling"], counts()["decoding"], counts()["live_caches"]) == (0, 1, 1)
        )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("policy", ["quest", "full"])
def test_a_prefill_thread_on_cuda_gives_the_tokens_of_turns(policy):
    """On CUDA the prefill thread runs its chunks on a stream of its own beside recorded decode steps over the
    pooled hot tiers: every request's greedy tokens equal those of the same requests run in turns."""
    from tandem.config import QuestConfig

    model = tiny_model("Llama", eos_token_id=None).cuda()
    extra = {"quest": QuestConfig(budget=0.5, gpu_share=0.5)} if policy == "quest" else {}
    config = TandemConfig(policy=policy, sink_tokens=4, window_tokens=16, block_size=16, **extra)
    tokens = []
    for beside in (False, True):
        jobs = [_job(n, 24, config, first=n) for n in (70, 45, 90, 61, 33)]
        scheduler = Scheduler(
            model,
            LetterTokenizer(),
            Limits(max_batch=4, prefill_chunk=16, prefill_thread=beside),
            TaskPool(2),
        )
        scheduler.start()
        try:
            for job in jobs[:2]:
                scheduler.submit(job.request)
            assert _wait_for(lambda jobs=jobs: jobs[0].request.generated >= 3)
            for job in jobs[2:]:
                scheduler.submit(job.request)
            assert all(job.done.wait(TIMEOUT) for job in jobs)
            assert [job.events[-1] for job in jobs] == [("done", "length")] * 5
        finally:
            scheduler.stop()
        tokens.append([job.request.tokens for job in jobs])
    assert tokens[0] == tokens[1]
