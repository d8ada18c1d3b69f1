"""Request validation without a server: what `parse` accepts, the field each refusal names, stop strings, and a
request's Tandem fields merged into the server's config."""

import pytest

from tandem.config import TandemConfig, setting_names
from tandem.serve.protocol import (
    MAX_STOP,
    REQUEST_FIELDS,
    SERVER_FIELDS,
    APIError,
    ChatRequest,
    CompletionRequest,
    parse,
)

BASE = TandemConfig(policy="hgca", window_tokens=64)


def _completion(**fields):
    return parse(CompletionRequest, {"model": "m", "prompt": "hi", **fields})


def _chat(**fields):
    return parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def _refusal(call) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


def test_defaults_and_accepted_forms():
    request = _completion()
    assert (request.max_tokens, request.temperature, request.top_p, request.stream) == (None, 1.0, 1.0, False)
    assert _completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert _completion(prompt=["one"]).prompt == ["one"]
    assert _completion(temperature=0, top_p=1).temperature == 0  # JSON integers are numbers
    assert _completion(stream=True, stream_options={"include_usage": True}).stream_options.include_usage
    assert _completion(n=1, best_of=1, echo=False, logprobs=None, presence_penalty=0, logit_bias={}).n == 1
    assert _chat(response_format={"type": "text"}, logprobs=False).messages[0].role == "user"
    assert request.prefix_cache and not _completion(prefix_cache=False).prefix_cache  # Tandem's own field


def test_chat_content_parts_and_limits():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = parse(ChatRequest, {"model": "m", "messages": [{"role": "system", "content": None},
                                                              {"role": "user", "content": parts}]})  # fmt: skip
    assert [m.text(i) for i, m in enumerate(request.messages)] == ["", "ab"]
    image = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    err = _refusal(lambda: parse(ChatRequest, image).messages[0].text(0))
    assert err.param == "messages[0].content"
    assert _chat(max_tokens=5).limit() == 5
    assert _chat(max_tokens=5, max_completion_tokens=7).limit() == 7  # the newer name wins


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),  # past what torch.Generator takes: refused here, not at prefill
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 5]}, "stop"),
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"model": 5}, "model"),
        ({"stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options.include_usage"),
        ({"stream_options": {"colour": 1}, "stream": True}, "stream_options.colour"),
        ({"prefix_cache": "no"}, "prefix_cache"),
    ],
)
def test_a_wrong_type_names_the_field(fields, param):
    err = _refusal(lambda: _completion(**fields))
    assert err.param == param and err.message.startswith(f"{param}: ")


@pytest.mark.parametrize(
    "messages, param",
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "robot", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], "messages[1].content"),
        ([{"content": "hi"}], "messages[0].role"),
    ],
)
def test_a_bad_message_names_its_index(messages, param):
    assert _refusal(lambda: parse(ChatRequest, {"model": "m", "messages": messages})).param == param


def test_missing_fields_and_bodies_that_are_not_objects():
    assert _refusal(lambda: parse(CompletionRequest, {"prompt": "hi"})).param == "model"
    assert _refusal(lambda: parse(CompletionRequest, {"model": "m"})).param == "prompt"
    for body in ([1], "text", None, 3):
        err = _refusal(lambda body=body: parse(CompletionRequest, body))
        assert err.param is None and "JSON object" in err.message


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 3}, "n"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"presence_penalty": 0.1}, "presence_penalty"),
        ({"frequency_penalty": -0.1}, "frequency_penalty"),
        ({"logit_bias": {"1": 2.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_unsupported_completion_options_are_refused(fields, param):
    assert _refusal(lambda: _completion(**fields)).param == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 2}, "n"),
    ],
)
def test_unsupported_chat_options_are_refused(fields, param):
    assert _refusal(lambda: _chat(**fields)).param == param


def test_stop_strings():
    assert _completion().stops() == []
    assert _completion(stop="\n").stops() == ["\n"]
    assert _completion(stop=["a", "", "b"]).stops() == ["a", "b"]  # an empty stop would end every request
    assert _refusal(lambda: _completion(stop=["x"] * (MAX_STOP + 1)).stops()).param == "stop"


def test_tandem_fields_are_merged_into_the_servers_config():
    assert _completion().cache_config(BASE) is BASE
    config = _completion(policy="quest", quest={"budget": 0.25}).cache_config(BASE)
    assert (config.policy, config.quest.budget, config.window_tokens) == ("quest", 0.25, 64)
    assert BASE.policy == "hgca"  # the server's own is left alone
    dotted = _completion(**{"policy": "quest", "quest.budget": 0.25}).cache_config(BASE)
    assert dotted == config  # a sub-config's field dotted or nested: the same setting


def test_an_old_flat_request_field_is_refused_naming_the_new_one():
    err = _refusal(lambda: _completion(policy="quest", budget=0.25).cache_config(BASE))
    assert err.param == "budget"
    assert "'budget' moved to quest.budget" in err.message and '{"quest": {"budget": 0.25}}' in err.message
    err = _refusal(lambda: _completion(epsilon=0.02).cache_config(BASE))
    assert err.param == "epsilon" and "certified.epsilon" in err.message


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"policy": "quest", "quest": {"budget": 2}}, "quest.budget"),
        ({"policy": "quest", "quest.budget": 2}, "quest.budget"),
        (
            {"quest": {"budget": 0.1}},
            "quest.budget",
        ),  # the server's policy is hgca: quest's settings are unread
        ({"quest": 0.1}, "quest"),
        ({"quest": {"bugdet": 0.1}}, "quest.bugdet"),
        ({"budget": 0.1}, "budget"),
        ({"host_dtype": "int8"}, "host_dtype"),  # moved to host.dtype
        ({"cpu_threads": 2}, "cpu_threads"),  # moved to host.threads, a server setting
        ({"host": {"dtype": "int4"}}, "host.dtype"),
        ({"policy": "nope"}, "policy"),
        ({"sink_tokens": True}, "sink_tokens"),
        ({"window_tokens": "wide"}, "window_tokens"),
        ({"colour": "red"}, "colour"),
    ]
    + [({name: 1}, name) for name in SERVER_FIELDS]
    + [({"fluxion": {"profile": "/etc/passwd"}}, "fluxion.profile")],
)
def test_bad_tandem_fields_are_refused(fields, param):
    err = _refusal(lambda: _completion(**fields).cache_config(BASE))
    assert err.param == param


def test_request_fields_are_the_configs_minus_the_servers():
    assert set(REQUEST_FIELDS) | set(SERVER_FIELDS) == set(setting_names())
    assert not set(REQUEST_FIELDS) & set(SERVER_FIELDS)
    assert "fluxion.profile" in SERVER_FIELDS  # a file path on the server: never a client's choice
    assert {"host.threads", "host.huge_pages"} <= set(SERVER_FIELDS) and "host.dtype" in REQUEST_FIELDS
    assert "quest.budget" in REQUEST_FIELDS and "certified.epsilon" in REQUEST_FIELDS


def test_error_body_is_openai_shaped():
    err = APIError(429, "slow down", None, "queue_full", "rate_limit_error", headers={"Retry-After": "2"})
    assert err.body() == {"error": {"message": "slow down", "type": "rate_limit_error", "param": None,
                                    "code": "queue_full"}}  # fmt: skip
    assert err.headers == {"Retry-After": "2"}
