"""OpenAI request bodies, validated: what is honoured, what is refused (and why), Tandem's own fields."""

from __future__ import annotations

from typing import Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import FEATURES, MOVED, TandemConfig, moved_message, setting_names

# TandemConfig settings a request may set, by their `--set` names: core fields, and sub-config fields either dotted
# ("quest.budget": 0.1) or nested ("quest": {"budget": 0.1}); the rest are the server's: the device and prefill
# chunk, and each sub-config's `SERVER_ONLY` fields (threads, memory layout, and the fluxion profile: a file path
# on the server, which a client must not choose)
SERVER_FIELDS = (
    "device",
    "prefill_chunk",
    *(f"{key}.{name}" for key, cls in FEATURES.items() for name in cls.SERVER_ONLY),
)
REQUEST_FIELDS = tuple(name for name in setting_names() if name not in SERVER_FIELDS)
MAX_STOP = 16


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator takes
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Tandem's: start from a prompt prefix the server keeps, and keep this prompt's (`tandem serve`'s prefix cache)
    prefix_cache: bool = True

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: allowed n=1 (send n requests instead)", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name} is not supported: allowed 0 (or leave it out)", name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported: leave it out or pass {}", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop has {len(stops)} strings: allowed at most {MAX_STOP}", "stop")
        return [s for s in stops if s]

    def cache_config(self, base: TandemConfig) -> TandemConfig:
        """The server's config with this request's Tandem fields (extra body fields) applied and checked."""
        settings = request_settings(dict(self.model_extra or {}))
        if not settings:
            return base
        try:
            return base.with_settings(settings)
        except (ValueError, TypeError) as err:
            raise config_error(err, settings) from None


def request_settings(extras: dict) -> dict:
    """A request's Tandem fields as dotted settings ({"quest": {"budget": 0.1}} -> {"quest.budget": 0.1}); an
    APIError names a server setting, an old flat spelling (with its new one) or an unknown field."""
    settings = {}
    for name, value in extras.items():
        if name in FEATURES and isinstance(value, dict):
            settings.update({f"{name}.{sub}": item for sub, item in value.items()})
        elif name in FEATURES:
            raise APIError(
                400, f"'{name}' must be an object of its fields, e.g. {{\"{name}\": {{...}}}}", name
            )
        else:
            settings[name] = value
    for name in settings:
        if name in SERVER_FIELDS:
            raise APIError(
                400, f"'{name}' is a server setting (a `tandem serve` flag), not a request field", name
            )
        if name in MOVED and ".".join(MOVED[name]) in SERVER_FIELDS:
            raise APIError(
                400,
                f"'{name}' is a server setting (a `tandem serve` flag; now {'.'.join(MOVED[name])}), not a "
                "request field",
                name,
            )
        if name in MOVED:
            raise APIError(400, moved_message(name, settings[name]), name)
        if name not in REQUEST_FIELDS:
            raise APIError(
                400,
                f"unknown field '{name}': allowed are the OpenAI fields this endpoint takes and Tandem's cache "
                f"fields {', '.join(REQUEST_FIELDS)} (a sub-config's fields dotted or as an object: "
                '"quest.budget": 0.1 or "quest": {"budget": 0.1})',
                name,
            )
    return settings


def config_error(err: Exception, names) -> APIError:
    """A 400 for a `TandemConfig` refusal, its `param` the field among `names` that the message names."""
    param = next((n for n in names if f"TandemConfig.{n}=" in str(err)), None)
    return APIError(400, str(err), param)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None:
            raise APIError(400, "logprobs is not supported: leave it out (null)", "logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported: allowed false", "echo")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of={self.best_of} is not supported: allowed 1", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported: leave it out", "suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise APIError(
                    400, f"prompt holds {len(self.prompt)} prompts: allowed one per request", "prompt"
                )
        if not self.prompt:
            raise APIError(400, "prompt is empty: allowed a non-empty string or list of token ids", "prompt")


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict] | None = None

    def text(self, index: int) -> str:
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400, "only text content parts are supported ({'type': 'text', 'text': ...})",
                    f"messages[{index}].content",
                )  # fmt: skip
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise APIError(400, "logprobs is not supported: allowed false", "logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported: leave them out", "tools")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(
                400, "response_format is not supported: allowed {'type': 'text'}", "response_format"
            )

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse(model_type, body) -> BaseModel:
    """A validated request, or APIError 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = model_type.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = _field_path(model_type, first["loc"])
        raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None
    request.refuse_unsupported()
    return request


def _field_path(model_type, loc: tuple) -> str | None:
    """The field a validation error's location names, written `messages[0].content`: pydantic's tags of union
    members (`prompt.str`, `stop.list[str]`) are not part of it."""
    path, fields = "", model_type.model_fields
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif fields:  # a field of a model, or a key its extra="forbid" refuses
            path += f".{part}" if path else part
            fields = _model_fields(fields[part].annotation) if part in fields else {}
    return path or None


def _model_fields(annotation) -> dict:
    """The fields of the model an annotation holds (`list[Message]`, `StreamOptions | None`), else {}."""
    if get_origin(annotation) is None and isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.model_fields
    for arg in get_args(annotation):
        if found := _model_fields(arg):
            return found
    return {}
