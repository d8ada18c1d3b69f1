"""`tandem serve`'s refusals: status codes and OpenAI-style bodies {"error": {"message", "type", "param", "code"}},
as the official `openai` client receives them; a full queue (429, Retry-After) and a request past the memory
budget on a second, small server."""

from types import SimpleNamespace

import httpx2
import openai
import pytest

from tandem.config import TandemConfig
from tandem.models import attention_shape
from tandem.serve.scheduler import Limits
from tandem.serve.sizing import CacheShape, request_bytes
from tests.serve import live

pytestmark = pytest.mark.model

CONFIG = TandemConfig(policy="hgca", sink_tokens=8, window_tokens=32)
PROMPT = "The capital of France is"
CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings


def _client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def api(smollm):
    model, tok = smollm
    server = live.build(model, tok, CONFIG, Limits(max_batch=2, max_queue=2, prefill_chunk=64))
    with live.running(server) as base:
        yield SimpleNamespace(server=server, base=base, client=_client(base), tok=tok)


def _refused(call, error_class, status, param, code=None, kind="invalid_request_error") -> str:
    """Run `call`, which must fail with `error_class` / `status` and a body naming `param` and `code`; returns
    the message."""
    with pytest.raises(error_class) as caught:
        call()
    err = caught.value
    assert err.status_code == status
    body = err.response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (kind, param, code)
    assert (err.type, err.param, err.code) == (kind, param, code)  # as the client parsed them
    assert body["error"]["message"]
    return body["error"]["message"]


def _post(api, path, content, status=400) -> dict:
    response = httpx2.post(
        f"{api.base}/v1/{path}", content=content, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == status
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_malformed_json_is_400(api, path):
    error = _post(api, path, b'{"model": "smollm", "prompt": ')
    assert "not valid JSON" in error["message"] and error["param"] is None
    assert "JSON object" in _post(api, path, b"[1, 2]")["message"]
    assert "not valid JSON" in _post(api, path, b"\xff\xfe")["message"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"n": 2}, "n"),
        ({"logprobs": 1}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"42": 1.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [49152]}, "prompt"),  # past the vocabulary
    ],
)
def test_bad_completion_fields_are_400_naming_the_field(api, fields, param):
    body = {"model": live.NAME, "prompt": PROMPT, **fields}
    message = _refused(lambda: api.client.completions.create(**body), openai.BadRequestError, 400, param)
    assert param in message


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
        ),
        ({"logprobs": True}, "logprobs"),
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_bad_chat_fields_are_400_naming_the_field(api, fields, param):
    body = {"model": live.NAME, "messages": [{"role": "user", "content": "hi"}], **fields}
    _refused(lambda: api.client.chat.completions.create(**body), openai.BadRequestError, 400, param)


@pytest.mark.parametrize(
    "extra, param, says",
    [
        ({"policy": "quest", "quest": {"budget": 2}}, "quest.budget", "TandemConfig.quest.budget=2"),
        ({"budget": 0.1}, "budget", "'budget' moved to quest.budget"),
        ({"policy": "nope"}, "policy", "TandemConfig.policy='nope'"),
        ({"window_tokens": "wide"}, "window_tokens", "wrong type"),
        ({"host": {"dtype": "int4"}}, "host.dtype", "int8"),
        ({"host_dtype": "int8"}, "host_dtype", "'host_dtype' moved to host.dtype"),
        ({"colour": "red"}, "colour", "unknown field 'colour'"),
        ({"cpu_threads": 2}, "cpu_threads", "server setting"),
        ({"host": {"threads": 2}}, "host.threads", "server setting"),
        ({"prefill_chunk": 8}, "prefill_chunk", "server setting"),
        (
            {"fluxion": {"profile": "/etc/passwd"}},
            "fluxion.profile",
            "server setting",
        ),  # a client never picks a file to read
        # refused by the cache itself: checked before the request is queued, not failed at its prefill
        ({"window_tokens": CONTEXT + 1}, "window_tokens", f"maximum context of {CONTEXT}"),
        ({"policy": "fluxion", "fluxion": {"tau": 0.07}}, "fluxion.tau", "not calibrated"),
        (
            {"policy": "fluxion"},
            "sink_tokens",
            "with 64 sinks",
        ),  # this server's 8 are too few for the profile
    ],
)
def test_bad_tandem_fields_are_400(api, extra, param, says):
    call = lambda: api.client.completions.create(
        model=live.NAME, prompt=PROMPT, max_tokens=2, extra_body=extra
    )
    assert says in _refused(call, openai.BadRequestError, 400, param)


def test_unknown_model_is_404(api):
    message = _refused(
        lambda: api.client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2),
        openai.NotFoundError, 404, "model", "model_not_found",
    )  # fmt: skip
    assert "gpt-4" in message and live.NAME in message


def test_prompt_past_the_context_is_400_naming_both_lengths(api):
    ids = [100 + i % 1000 for i in range(CONTEXT + 8)]
    call = lambda: api.client.completions.create(model=live.NAME, prompt=ids, max_tokens=2)
    message = _refused(call, openai.BadRequestError, 400, "prompt", "context_length_exceeded")
    assert str(CONTEXT + 8) in message and str(CONTEXT) in message


def test_max_tokens_past_the_context_is_400(api):
    prompt_tokens = len(api.tok(PROMPT).input_ids)
    room = CONTEXT - prompt_tokens
    call = lambda: api.client.completions.create(model=live.NAME, prompt=PROMPT, max_tokens=room + 1)
    message = _refused(call, openai.BadRequestError, 400, "max_tokens", "context_length_exceeded")
    assert str(CONTEXT) in message and f"at most {room}" in message
    messages = [{"role": "user", "content": "hi"}]
    call = lambda: api.client.chat.completions.create(model=live.NAME, messages=messages, max_tokens=CONTEXT)
    _refused(call, openai.BadRequestError, 400, "max_tokens", "context_length_exceeded")


def test_refusals_are_counted_as_invalid(api):
    key = 'tandem_requests_total{outcome="invalid"}'
    before = live.metrics(api.base).get(key, 0)
    with pytest.raises(openai.BadRequestError):
        api.client.completions.create(model=live.NAME, prompt=PROMPT, n=2)
    assert live.metrics(api.base)[key] == before + 1


# ---- a small server: one request at a time, none waiting, a host budget -----------------------------------------
@pytest.fixture(scope="module")
def small(smollm):
    model, tok = smollm
    shape = CacheShape(*attention_shape(model.config), next(model.parameters()).dtype)
    budget = request_bytes(shape, CONFIG, 16, 2000, "cpu").on_host  # a prompt of 16 + 2000 tokens fits
    server = live.build(
        model, tok, CONFIG, Limits(max_batch=1, max_queue=0, prefill_chunk=64, host_bytes=budget)
    )
    with live.running(server) as base:
        yield SimpleNamespace(server=server, base=base, client=_client(base))


def _idle(base):
    m = live.metrics(base)
    return m if m["tandem_requests_decoding"] + m["tandem_requests_prefilling"] == 0 else None


def test_full_queue_is_429_with_retry_after(small):
    rejected = 'tandem_requests_total{outcome="rejected"}'
    before = live.metrics(small.base).get(rejected, 0)
    # greedy with full attention, this prompt runs past 200 tokens (PROMPT's answer ends after 30)
    body = {"model": live.NAME, "prompt": "Once upon a time", "max_tokens": 500, "temperature": 0}
    body.update(stream=True, policy="full")
    with (
        httpx2.Client(timeout=30) as http,
        http.stream("POST", f"{small.base}/v1/completions", json=body) as running,
    ):
        assert running.status_code == 200
        events = (line for line in running.iter_lines() if line.startswith("data: "))
        next(events)  # it holds the only slot (while `events` lives: closing it would close the response)
        call = lambda: small.client.completions.create(model=live.NAME, prompt=PROMPT, max_tokens=2)
        message = _refused(call, openai.RateLimitError, 429, None, "queue_full", "rate_limit_error")
        assert "--max-queue 0" in message
        with pytest.raises(openai.RateLimitError) as caught:
            call()
        assert int(caught.value.response.headers["retry-after"]) >= 1
    assert live.metrics(small.base)[rejected] == before + 2
    # once the slot is free again, a request is admitted at once (a queue of 0 means: no waiting)
    assert live.wait_for(lambda: _idle(small.base), 5.0) is not None
    out = small.client.completions.create(model=live.NAME, prompt=PROMPT, max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_request_past_the_host_budget_is_400(small):
    call = lambda: small.client.completions.create(model=live.NAME, prompt=PROMPT, max_tokens=4000)
    message = _refused(call, openai.BadRequestError, 400, "max_tokens", "request_too_large")
    assert "--host-memory" in message and "max_tokens 4000" in message
