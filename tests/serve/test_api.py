"""`tandem serve` through the official `openai` client, on the real default model: completions and chat, streamed
and not, usage, stop strings, per-request cache settings, concurrent requests, and greedy text equal to
`tandem generate`'s for the same prompt and policy (with the prompt prefilled in chunks)."""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx2
import openai
import pytest

import tandem.models
from tandem.cli import main
from tandem.config import TandemConfig
from tandem.serve.scheduler import Limits
from tests.serve import live

pytestmark = pytest.mark.model

# window 32 + sinks 8: a prompt of ~100 tokens reaches the host tier; chunks of 16 prefill it in 7 turns
CONFIG = TandemConfig(policy="hgca", sink_tokens=8, window_tokens=32)
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def api(smollm, prose):
    model, tok = smollm
    server = live.build(model, tok, CONFIG, Limits(max_batch=4, max_queue=8, prefill_chunk=16))
    with live.running(server) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        long_prompt = tok.decode(tok(prose).input_ids[:101])
        yield SimpleNamespace(server=server, base=base, client=client, tok=tok, long_prompt=long_prompt)


def _complete(api, prompt, **kwargs):
    return api.client.completions.create(model=live.NAME, prompt=prompt, temperature=0, **kwargs)


def _chat(api, content, **kwargs):
    messages = [{"role": "user", "content": content}]
    return api.client.chat.completions.create(model=live.NAME, messages=messages, temperature=0, **kwargs)


def _chat_ids(tok, content) -> list[int]:
    messages = [{"role": "user", "content": content}]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def test_models_and_health(api):
    assert [m.id for m in api.client.models.list().data] == [live.NAME]
    assert httpx2.get(f"{api.base}/health").json() == {
        "status": "ok",
        "pid": os.getpid(),
    }  # served in-process


def test_completion_streamed_equals_whole_with_a_usage_chunk(api):
    whole = _complete(api, PROMPT, max_tokens=8)
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.prompt_tokens == len(api.tok(PROMPT).input_ids)
    assert whole.usage.completion_tokens == 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8

    chunks = list(_complete(api, PROMPT, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    *pieces, last = chunks
    assert "".join(c.choices[0].text for c in pieces) == choice.text
    assert [c.choices[0].finish_reason for c in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert all(c.usage is None for c in pieces)
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()


def test_chat_streamed_equals_whole(api):
    whole = _chat(api, QUESTION, max_tokens=8)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert whole.usage.prompt_tokens == len(_chat_ids(api.tok, QUESTION))
    # the answer ends with the end-of-sequence token, which counts as generated but is not text
    assert choice.finish_reason == "stop"
    assert whole.usage.completion_tokens == len(api.tok(choice.message.content).input_ids) + 1 <= 8

    chunks = list(_chat(api, QUESTION, max_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)  # no usage chunk unless asked for
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")


def test_stop_string_ends_the_text_before_it(api):
    """The stop string straddles two tokens of the greedy text (a word's end, the space and the next word's
    start): the text ends right before it, and no piece of it is ever streamed."""
    text = _complete(api, PROMPT, max_tokens=12).choices[0].text
    space = text.index(" ", len(text) // 3)
    stop = text[space - 2 : space + 3]
    cut = text.index(stop)
    assert cut > 0

    whole = _complete(api, PROMPT, max_tokens=12, stop=["never appears", stop])
    assert whole.choices[0].text == text[:cut]
    assert whole.choices[0].finish_reason == "stop" and whole.usage.completion_tokens < 12

    chunks = list(_complete(api, PROMPT, max_tokens=12, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_in_chat(api):
    text = _chat(api, QUESTION, max_tokens=10).choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    chunks = list(_chat(api, QUESTION, max_tokens=10, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_request_cache_settings_are_applied(api, monkeypatch):
    """Tandem fields in the body set that request's cache: the scheduler gets them, the cache is built with
    them, and its decode attends what the policy says (all of the host tier, none of it, about the budget)."""
    scheduler = api.server.scheduler
    jobs, caches = [], []
    submit, new_cache = scheduler.submit, scheduler._new_cache
    monkeypatch.setattr(scheduler, "submit", lambda job: jobs.append(job) or submit(job))
    monkeypatch.setattr(scheduler, "_new_cache", lambda job: caches.append(new_cache(job)) or caches[-1])
    attended = {}
    for fields in (
        {"policy": "full"},
        {"policy": "streaming"},
        {"policy": "quest", "quest": {"budget": 0.5}},
    ):
        out = _complete(api, api.long_prompt, max_tokens=4, extra_body=fields)
        assert out.choices[0].text and out.usage.completion_tokens == 4
        assert caches[-1].config is jobs[-1].config
        config = jobs[-1].config
        assert config.policy == fields["policy"] and config.quest.budget == fields.get("quest", {}).get(
            "budget", 0.05
        )
        assert (config.window_tokens, config.sink_tokens) == (32, 8)  # the rest is the server's
        assert caches[-1].stats()["host_rows"] > 0
        attended[fields["policy"]] = caches[-1].stats()["mean_fraction_attended"]
    assert attended["full"] == 1.0 and attended["streaming"] == 0.0
    assert 0.4 <= attended["quest"] < 1.0
    assert api.server.config == CONFIG  # a request's settings never change the server's


def test_concurrent_requests_equal_their_solo_runs(api, monkeypatch):
    """Two greedy requests of different lengths and policies, decoded in one batch, give the text each gives
    alone."""
    requests = [
        dict(prompt=PROMPT, max_tokens=10, extra_body={"policy": "full"}),
        dict(prompt=api.long_prompt, max_tokens=8),
    ]
    solo = [_complete(api, **r).choices[0].text for r in requests]
    stats = api.server.scheduler.stats
    batches, observe = [], stats.on_decode_step
    monkeypatch.setattr(stats, "on_decode_step", lambda s, n, kind: batches.append(n) or observe(s, n, kind))
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda r: _complete(api, **r).choices[0].text, requests))
    assert together == solo
    assert max(batches) == 2  # they did share decode steps


def _tandem_generate(monkeypatch, capsys, smollm, prompt, policy, max_tokens, chat=False) -> dict:
    """`tandem generate --json` in-process on the session's model, with the server's cache settings."""
    monkeypatch.setattr(tandem.models, "load_model", lambda *a, **k: smollm)
    argv = ["generate", "--prompt", prompt, "--max-new-tokens", str(max_tokens), "--json", "--engine", "off"]
    argv += ["--dtype", "float32", "--policy", policy, "--window-tokens", "32", "--sink-tokens", "8"]
    capsys.readouterr()
    assert main(argv + (["--chat"] if chat else [])) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("policy, chat", [("full", False), ("hgca", False), ("hgca", True)])
def test_greedy_text_equals_tandem_generate(api, smollm, monkeypatch, capsys, policy, chat):
    """Same prompt, policy and max_tokens: the server (prompt prefilled 16 tokens at a time, decode through
    RowsCache) writes what `tandem generate` writes (one prefill, model.generate)."""
    prompt = ("Summarize in one sentence: " + api.long_prompt) if chat else api.long_prompt
    expected = _tandem_generate(monkeypatch, capsys, smollm, prompt, policy, 10, chat)
    assert expected["stats"]["host_rows"] > 0  # the host tier is in play
    fields = {"max_tokens": 10, "extra_body": {"policy": policy}}
    out = _chat(api, prompt, **fields) if chat else _complete(api, prompt, **fields)
    text = out.choices[0].message.content if chat else out.choices[0].text
    assert text == expected["text"]
    assert out.usage.prompt_tokens == expected["stats"]["prompt_tokens"] > 16
    assert out.usage.completion_tokens == expected["stats"]["generated_tokens"]


def test_metrics_count_requests_and_tokens(api):
    before = live.metrics(api.base)
    out = _complete(api, PROMPT, max_tokens=5)
    after = live.metrics(api.base)  # counted before the response is sent
    length = 'tandem_requests_total{outcome="length"}'
    assert after[length] == before.get(length, 0) + 1
    assert after["tandem_generation_tokens_total"] == before["tandem_generation_tokens_total"] + 5
    prompt = after["tandem_prompt_tokens_total"] - before["tandem_prompt_tokens_total"]
    assert prompt == out.usage.prompt_tokens
    ttft = "tandem_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    # the first token is the prefill's, the other four one decode step each, alone and eager on the CPU
    steps, step_time = (
        f'tandem_decode_{name}_total{{kind="eager",rows_at_most="1"}}'
        for name in ("steps", "step_time_seconds")
    )
    assert after[steps] == before.get(steps, 0) + 4
    step_seconds = "tandem_decode_step_seconds_sum"
    spent = after[step_time] - before.get(step_time, 0)
    assert spent > 0 and spent == pytest.approx(after[step_seconds] - before[step_seconds])
    # a step of 3 requests counts among those of at most 4
    api.server.metrics._decode_step(0.25, 3, "replayed")
    assert live.metrics(api.base)['tandem_decode_steps_total{kind="replayed",rows_at_most="4"}'] == 1
    assert after['tandem_budget_bytes{memory="host"}'] == -1  # unbounded in this server
