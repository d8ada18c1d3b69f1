"""Prompts that begin with a kept prefix (`cache.prefix`, `TandemRunner.prefill(prefix_cache=...)`): the request
starts from the prefix's state and prefills only the rest, and gives the logits, tokens and statistics of a cold
prefill, for every policy; requests sharing a prefix never see each other's tokens; the store keeps to its budget
and never drops a prefix being copied."""

import gc

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from tandem import TandemCache, TandemConfig
from tandem.cache.prefix import PrefixCache
from tandem.cache.snapshot import SlidingPart
from tandem.config import FluxionConfig, HostConfig
from tandem.engine import TandemRunner
from tandem.engine.prefill import kept_ends, observed_tokens, prefix_end
from tests.engine.test_engine import DEVICES, _tiny

HOT = {"sink_tokens": 4, "window_tokens": 16, "block_size": 4}
CHUNK = 16
POLICIES = {
    "full": TandemConfig(policy="full", **HOT),
    "quest": TandemConfig(policy="quest", **HOT),
    "certified": TandemConfig(policy="certified", **HOT),
    "hgca": TandemConfig(policy="hgca", **HOT),
    "streaming": TandemConfig(policy="streaming", **HOT),
    "fluxion": TandemConfig(policy="fluxion", fluxion=FluxionConfig(tau=0.0), **{**HOT, "block_size": 16}),
    "quest-int8": TandemConfig(policy="quest", host=HostConfig(dtype="int8"), **HOT),
}


def _ids(length: int, seed: int, device) -> torch.Tensor:
    return torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed)).to(device)


def _answer(model, config, ids, steps, store=None):
    """(prefill logits, greedy tokens, cache statistics, tokens taken from `store`) of one prompt in a new cache."""
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    logits = runner.prefill(ids, chunk_tokens=CHUNK, max_new_tokens=steps, prefix_cache=store)
    reused = runner.reused_tokens
    tokens, _ = runner.decode(logits.argmax(-1), steps)
    return logits, tokens, runner.cache.stats(), reused


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("device", DEVICES)
def test_a_prompt_from_a_kept_prefix_answers_as_a_cold_prefill(device, policy):
    """A document kept by one question's request serves another question's: only the question is prefilled, and
    the logits, the greedy tokens and the cache's statistics (certified's included) equal a cold prefill's."""
    model = _tiny(device=device)
    config = POLICIES[policy]
    document = _ids(70, 1, device)
    first = torch.cat([document, _ids(13, 2, device)], dim=1)
    second = torch.cat([document, _ids(9, 3, device)], dim=1)
    cold = _answer(model, config, second, 12)
    store = PrefixCache()
    _answer(model, config, first, 5, store)
    observed = observed_tokens(config)
    expected = prefix_end(
        second.shape[1], CHUNK, observed
    )  # the document's last boundary the second can take
    assert store.stats()["entries"] == 2 and expected in kept_ends(first.shape[1], CHUNK, observed)
    warm = _answer(model, config, second, 12, store)
    assert warm[3] == expected > 0 and cold[3] == 0
    assert torch.equal(warm[0], cold[0])
    assert torch.equal(warm[1], cold[1])
    assert warm[2] == cold[2]
    stats = store.stats()
    assert (stats["hits"], stats["hit_tokens"]) == (1, expected)
    for entry in store._entries.values():  # a kept prefix holds host memory alone
        for part in entry.parts:
            held = [part.keys, part.values, part.valid] if isinstance(part, SlidingPart) else [
                *part.hot.values(), *part.host.values()]  # fmt: skip
            assert all(t is None or t.device.type == "cpu" for t in held)


@pytest.mark.parametrize("device", DEVICES)
def test_requests_sharing_a_prefix_never_see_each_others_tokens(device):
    """The request that kept a prefix decodes on, and one that took it decodes too, each into its own tiers past
    the prefix: a third request from the same prefix still answers as a cold prefill, and so do the first two."""
    model = _tiny(device=device)
    config = POLICIES["quest"]
    document = _ids(70, 4, device)
    prompts = [torch.cat([document, _ids(n, 5 + n, device)], dim=1) for n in (11, 7, 5)]
    cold = [_answer(model, config, ids, 24)[1] for ids in prompts]
    store = PrefixCache()
    runners = [TandemRunner(model, TandemCache.for_model(model, config)) for _ in prompts]
    streams = []
    for runner, ids in zip(runners[:2], prompts[:2], strict=True):
        logits = runner.prefill(ids, chunk_tokens=CHUNK, max_new_tokens=24, prefix_cache=store)
        streams.append(runner.stream(logits.argmax(-1), 23))
    assert runners[1].reused_tokens == 64
    tokens = [[], []]
    for _ in range(23):  # the two requests' steps interleave, each appending past the shared rows
        for i, steps in enumerate(streams):
            tokens[i].append(next(steps))
    for steps in streams:
        steps.close()
    third = _answer(model, config, prompts[2], 24, store)
    assert third[3] == 64
    assert torch.equal(third[1], cold[2])
    for i in range(2):  # (a stream yields the token it is fed first)
        assert torch.equal(torch.stack([t.cpu() for t in tokens[i]], dim=1), cold[i][:, :23])


@pytest.mark.parametrize("policy", ["quest", "hgca", "certified", "quest-int8"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_prefix_whose_request_ended_is_taken_over_without_a_copy(device, policy):
    """The request that kept a document ended: the next one from it takes its host rows over (no copy), and the
    same request's longer prefix, whose rows it now overwrites, is dropped; a request from the same prefix while
    that one runs copies it. Both answer as a cold prefill."""
    model = _tiny(device=device)
    config = POLICIES[policy]
    document = _ids(70, 40, device)
    second = torch.cat([document, _ids(9, 42, device)], dim=1)
    cold = _answer(model, config, second, 12)
    store = PrefixCache()
    _answer(model, config, torch.cat([document, _ids(13, 41, device)], dim=1), 5, store)
    gc.collect()  # the request's cache is gone: no tier writes into its host rows
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    logits = runner.prefill(second, chunk_tokens=CHUNK, max_new_tokens=12, prefix_cache=store)
    taken, _ = runner.decode(logits.argmax(-1), 12)
    stats = store.stats()
    assert runner.reused_tokens > 0 and (stats["adopted"], stats["bytes_restored"]) == (1, 0)
    assert stats["entries"] == 1 and stats["evictions"] == 1
    assert torch.equal(taken, cold[1])
    copied = _answer(model, config, second, 12, store)  # the first one still runs in those buffers
    stats = store.stats()
    assert copied[3] == runner.reused_tokens and stats["adopted"] == 1 and stats["bytes_restored"] > 0
    assert torch.equal(copied[1], cold[1])


def test_a_request_that_outgrows_the_rows_it_took_over_leaves_them_to_the_next():
    """A request that takes a prefix's host rows over but needs more room than they have moves to larger buffers of
    its own (a copy, as growing a tier always is), and the next request from the prefix takes the old ones over
    again while the first still runs. Both answer as a cold prefill."""
    model = _tiny()
    config = POLICIES["quest"]
    document = _ids(70, 50, "cpu")
    second = torch.cat([document, _ids(9, 52, "cpu")], dim=1)
    cold = [_answer(model, config, second, steps)[1] for steps in (200, 6)]
    store = PrefixCache()
    _answer(model, config, torch.cat([document, _ids(13, 51, "cpu")], dim=1), 1, store)
    gc.collect()
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    logits = runner.prefill(second, chunk_tokens=CHUNK, max_new_tokens=200, prefix_cache=store)
    taken = runner.cache.tandem_layers()[0].host
    assert store.stats()["adopted"] == 1 and taken.claim is None  # moved to buffers of its own
    grown, _ = runner.decode(logits.argmax(-1), 200)
    assert torch.equal(grown, cold[0])
    again = _answer(model, config, second, 6, store)  # the first still runs, in buffers of its own
    assert store.stats()["adopted"] == 2 and torch.equal(again[1], cold[1])


def test_a_kept_prefix_outlives_its_request_and_its_cache_reuse():
    """The request that kept a prefix ends and its cache serves another prompt (`TandemCache.reset`): the kept
    host rows are not emptied for it, and the prefix still answers as a cold prefill."""
    model = _tiny()
    config = POLICIES["hgca"]
    document = _ids(70, 7, "cpu")
    prompt = torch.cat([document, _ids(6, 8, "cpu")], dim=1)
    cold = _answer(model, config, prompt, 10)
    store = PrefixCache()
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    runner.generate(
        torch.cat([document, _ids(12, 9, "cpu")], dim=1), 4, chunk_tokens=CHUNK, prefix_cache=store
    )
    runner.cache.reset()
    runner.generate(_ids(90, 10, "cpu"), 4, chunk_tokens=CHUNK)  # another prompt in the same cache
    warm = _answer(model, config, prompt, 10, store)
    assert warm[3] == prefix_end(76, CHUNK, observed_tokens(config)) > 0 and torch.equal(warm[1], cold[1])


def test_a_prefix_kept_under_other_settings_or_chunks_is_not_taken():
    model = _tiny()
    document = _ids(70, 11, "cpu")
    store = PrefixCache()
    _answer(model, POLICIES["quest"], torch.cat([document, _ids(5, 12, "cpu")], dim=1), 2, store)
    prompt = torch.cat([document, _ids(5, 13, "cpu")], dim=1)
    assert _answer(model, POLICIES["full"], prompt, 2, store)[3] == 0
    runner = TandemRunner(model, TandemCache.for_model(model, POLICIES["quest"]))
    runner.prefill(prompt, chunk_tokens=CHUNK * 2, prefix_cache=store)
    assert runner.reused_tokens == 0
    assert _answer(model, POLICIES["quest"], _ids(75, 14, "cpu"), 2, store)[3] == 0  # other tokens
    assert _answer(model, POLICIES["quest"], prompt, 2, store)[3] == 64


def test_the_store_keeps_to_its_budget_and_never_drops_a_prefix_in_use():
    model = _tiny()
    config = POLICIES["quest"]
    store = PrefixCache()
    _answer(model, config, _ids(70, 20, "cpu"), 1, store)
    one = store.nbytes  # a prompt's two prefixes, which read the same host tier
    assert one > 0 and len(store) == 2
    small = PrefixCache(max_bytes=1)  # no prefix fits: none is kept
    _answer(model, config, _ids(70, 20, "cpu"), 1, small)
    assert small.stats()["entries"] == 0 and small.nbytes == 0
    store = PrefixCache(max_bytes=one + one // 2)  # one prompt's fit: the second's replace the first's
    first, second = _ids(70, 21, "cpu"), _ids(70, 22, "cpu")
    _answer(model, config, first, 1, store)
    _answer(model, config, second, 1, store)
    stats = store.stats()
    assert (stats["entries"], stats["evictions"]) == (2, 2) and stats["bytes"] <= store.max_bytes
    assert store.lookup(config, CHUNK, first[0].tolist(), 64) is None
    in_use = store.lookup(config, CHUNK, second[0].tolist(), 64)
    assert in_use is not None and in_use.users == 1
    store.evict(0)
    assert len(store) == 1 and store.nbytes > 0  # the one being copied from is kept
    store.done(in_use)
    assert store.evict(0) > 0 and len(store) == 0 and store.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(max_bytes=-1)


def test_sliding_window_layers_restore_their_window():
    """Gemma 3's mix of sliding-window and global layers: the kept prefix holds both kinds, and a prompt from it
    answers as a cold prefill."""
    torch.manual_seed(0)
    text = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    model = Gemma3ForCausalLM(text).eval()
    model.generation_config.eos_token_id = None
    config = POLICIES["full"]
    document = _ids(70, 30, "cpu")
    prompt = torch.cat([document, _ids(9, 31, "cpu")], dim=1)
    cold = _answer(model, config, prompt, 10)
    store = PrefixCache()
    _answer(model, config, torch.cat([document, _ids(4, 32, "cpu")], dim=1), 1, store)
    warm = _answer(model, config, prompt, 10, store)
    assert warm[3] == 64
    assert torch.equal(warm[0], cold[0]) and torch.equal(warm[1], cold[1])
