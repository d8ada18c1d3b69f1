"""A cache emptied for a new request (`TandemCache.reset`) decodes that request as a new cache would, while its
layers keep the buffers a recorded step reads where they were, so that the runner's recording serves it
(`TandemRunner.warm_up`, `engine.step.read_layout`).

Each test runs a request on a new cache, then the same request after another request (longer, other tokens)
in one cache that was reset in between: the tokens and logits must agree, whatever the other request left."""

import pytest
import torch

from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner
from tandem.engine.step import read_layout
from tests.engine.test_engine import DEVICES, _tiny
from tests.engine.test_reuse import HOT, POLICIES

# policies whose layers hold, after a reset and a prompt like the last one, every tensor where it was
REUSED = ("full", "quest", "streaming", "quest-epsilon", "quest-int8", "hgca")


def _request(runner, ids, new_tokens: int):
    """(the prompt's logits, the new tokens) of one request through `runner`."""
    logits = runner.prefill(ids, chunk_tokens=64, max_new_tokens=new_tokens)
    tokens, _ = runner.decode(logits.argmax(-1), new_tokens)
    return logits.cpu(), tokens


def _prompts(device):
    gen = torch.Generator().manual_seed(5)
    other = torch.randint(0, 128, (1, 230), generator=gen).to(device)
    ids = torch.randint(0, 128, (1, 150), generator=gen).to(device)
    return other, ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(POLICIES))
def test_a_reset_cache_decodes_as_a_new_one(name, device):
    model = _tiny(device=device)
    config = TandemConfig(**HOT, **POLICIES[name])
    other, ids = _prompts(device)
    new = TandemRunner(model, TandemCache.for_model(model, config))
    fresh_logits, fresh = _request(new, ids, 24)
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    _request(runner, other, 30)
    runner.cache.reset()
    logits, tokens = _request(runner, ids, 24)
    assert torch.equal(tokens, fresh)
    torch.testing.assert_close(logits, fresh_logits, rtol=1e-5, atol=1e-5)
    stats, fresh_stats = runner.cache.stats(), new.cache.stats()  # fluxion's and the certificate's too
    assert stats.keys() == fresh_stats.keys()
    for key, value in fresh_stats.items():
        assert stats[key] == pytest.approx(value), key


@pytest.mark.parametrize("name", REUSED)
def test_a_reset_keeps_what_a_recorded_step_reads_where_it_was(name):
    """The layout a recording compares a new request's layers to (`read_layout`) is the same after a reset and a
    prompt of the same length and answer, on CPU, where every tensor counts as the device's."""
    model = _tiny()
    config = TandemConfig(**HOT, **POLICIES[name])
    other, ids = _prompts("cpu")
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    _request(runner, ids[:, :140].flip(-1), 6)  # another prompt of the same length, the same answer's length
    layers = runner.cache.tandem_layers()
    before = read_layout(layers, runner.device)
    runner.cache.reset()
    runner.prefill(ids[:, :140], chunk_tokens=64, max_new_tokens=6)
    with torch.inference_mode():
        runner._step.prepare(layers)
    # the step just prepared reserved a slot the one before had not: that step's own bookkeeping aside, the same
    assert read_layout(layers, runner.device) == before


def test_the_layout_sees_a_buffer_moved_or_an_object_replaced():
    """A request whose host tier must grow past the last one's capacity, or whose policy is a new object, reads
    other addresses or objects than the recording did: its layout differs, and the runner records again."""
    model = _tiny()
    config = TandemConfig(**HOT, **POLICIES["quest"])
    _, ids = _prompts("cpu")
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    _request(runner, ids, 6)
    layers = runner.cache.tandem_layers()
    before = read_layout(layers, runner.device)
    runner.cache.reset()
    runner.prefill(ids, chunk_tokens=64, max_new_tokens=6)
    assert read_layout(layers, runner.device) == before
    layers[-1].policy = type(layers[-1].policy)(config)
    assert read_layout(layers, runner.device) != before
    runner.cache.reset()
    runner.prefill(torch.cat([ids, ids], dim=1), chunk_tokens=64, max_new_tokens=6)
    assert read_layout(layers, runner.device) != before


def _after_one_request():
    """(runner, its cache's first layer, the prompt) once a quest request of a few tokens has run on CPU."""
    model = _tiny()
    _, ids = _prompts("cpu")
    runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(**HOT, policy="quest")))
    _request(runner, ids, 4)
    return runner, runner.cache.tandem_layers()[0], ids


def test_a_reset_layer_takes_its_tiers_again_only_where_they_fit():
    runner, layer, ids = _after_one_request()
    cache = runner.cache
    hot, host = layer.hot, layer.host
    cache.reset()
    assert layer.hot is None and layer.host is None and layer.seq_len == 0
    assert not host.valid.any() and not hot.valid.any() and host.rows == 0
    _request(runner, ids, 4)
    assert layer.hot is hot and layer.host is host
    cache.reset()
    _request(runner, torch.cat([ids, ids]), 4)  # a batch of two: new tiers, at new generations
    assert layer.hot is not hot and layer.hot.generation > hot.generation
    assert layer.host is not host and layer.host.generation > host.generation


def test_a_failed_layer_keeps_nothing_for_the_next_request():
    runner, layer, ids = _after_one_request()
    cache = runner.cache
    hot, policy = layer.hot, layer.policy
    cache.mark_failed(RuntimeError("half a step"))
    cache.reset()
    _request(runner, ids, 4)
    assert layer.hot is not hot and layer.policy is not policy and layer.failed is None


def test_warm_up_leaves_the_runners_cache_empty_and_sized_for_the_request():
    model = _tiny()
    config = TandemConfig(**HOT, policy="quest")
    _, ids = _prompts("cpu")
    fresh_logits, fresh = _request(TandemRunner(model, TandemCache.for_model(model, config)), ids, 24)
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    runner.warm_up(ids.shape[1], max_new_tokens=24)
    assert runner.cache.get_seq_length() == 0
    capacity = runner.cache.tandem_layers()[0]._spare[2].capacity
    logits, tokens = _request(runner, ids, 24)
    assert runner.cache.tandem_layers()[0].host.capacity == capacity  # sized once, by the warm-up
    assert torch.equal(tokens, fresh)
    torch.testing.assert_close(logits, fresh_logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="warm_up runs before"):
        runner.warm_up(8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("name", list(POLICIES))
def test_the_warm_ups_recording_serves_the_request_that_follows(name):
    """On CUDA the request after `warm_up` replays the warm-up's recording from its first step, with no eager
    step and no new recording, where its layers hold what the recording reads (the policies of `REUSED`), and
    decodes the tokens a new runner decodes."""
    model = _tiny(device="cuda")
    config = TandemConfig(**HOT, **POLICIES[name])
    _, ids = _prompts("cuda")
    fresh_logits, fresh = _request(TandemRunner(model, TandemCache.for_model(model, config)), ids, 24)
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    runner.warm_up(ids.shape[1], max_new_tokens=24)
    assert runner.recordings == 1
    logits, tokens = _request(runner, ids, 24)
    assert torch.equal(tokens, fresh)
    torch.testing.assert_close(logits, fresh_logits, rtol=1e-3, atol=1e-3)
    if name in REUSED:
        assert runner.recordings == 1


@pytest.fixture
def recorded_on_cpu(monkeypatch):
    """The runner's recording logic on CPU: a "recording" keeps the step's body, a replay calls it. Returns the
    list of what each decode step did ("eager", "record", "replay")."""
    from tandem.engine.step import DecodeStep

    done = []

    def capture(step, body):
        step.captures += 1
        step.segments = [(body, None)]
        done.append("record")

    def replay(step):
        done.append("replay")
        step.segments[0][0]()

    monkeypatch.setattr(DecodeStep, "capture", capture)
    monkeypatch.setattr(DecodeStep, "replay", replay)
    return done


def _graphed_runner(model, config, done):
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    runner.use_graphs = True  # (the CPU stand-in above records and replays)
    body = runner._step_body

    def eager_or_recorded():
        done.append("body")
        body()

    runner._step_body = eager_or_recorded
    return runner


def _kinds(done) -> list[str]:
    """Each step's kind, from its events: "record" then "replay" (a step recorded, then run by its replay),
    "replay" alone, or the body alone (an eager step); a replay's body is its own."""
    kinds, i = [], 0
    while i < len(done):
        if done[i] == "record":
            kinds.append("record")
            i += 3  # record, replay, the replay's body
        elif done[i] == "replay":
            kinds.append("replay")
            i += 2
        else:
            kinds.append("eager")
            i += 1
    return kinds


@pytest.mark.parametrize("name", REUSED)
def test_after_warm_up_a_request_replays_the_recording_from_its_first_step(recorded_on_cpu, name):
    """The runner's own logic, on CPU: the request after `warm_up` runs no eager step and records nothing, and
    decodes the tokens of a runner that records its own step; a request whose layers changed an object the
    recording holds starts as a new one (an eager step, then its own recording)."""
    done = recorded_on_cpu
    model = _tiny()
    config = TandemConfig(**HOT, **POLICIES[name])
    _, ids = _prompts("cpu")
    _, fresh = _request(_graphed_runner(model, config, done), ids, 12)
    assert _kinds(done) == ["eager", "record"] + ["replay"] * 10
    runner = _graphed_runner(model, config, done)
    runner.warm_up(ids.shape[1], max_new_tokens=12)
    done.clear()
    _, tokens = _request(runner, ids, 12)
    assert _kinds(done) == ["replay"] * 12 and runner.recordings == 1
    assert torch.equal(tokens, fresh)
    runner.cache.reset()
    layer = runner.cache.tandem_layers()[-1]
    layer.policy = type(layer.policy)(config)  # an object the recording's host side held is gone
    done.clear()
    _, tokens = _request(runner, ids, 12)
    assert _kinds(done) == ["eager", "record"] + ["replay"] * 10 and runner.recordings == 2
    assert torch.equal(tokens, fresh)
