"""The HTTP side of `tandem serve`: OpenAI-compatible endpoints on FastAPI, server-sent events for streams.

Endpoints: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (streamed or not), `/health`, `/metrics`.
Handlers validate and tokenize, then hand the request to the `Scheduler`, whose thread sends events back
through an asyncio queue. A client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..config import TandemConfig
from ..integrations.hf import TandemCache
from .metrics import Metrics
from .protocol import REQUEST_FIELDS, APIError, ChatRequest, CompletionRequest, config_error, parse
from .scheduler import QueueFull, Scheduler, TooLarge
from .scheduler import Request as Job

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
DISCONNECT_POLL_SECONDS = 0.5


class Server:
    """A model, its tokenizer and the scheduler that runs requests on them, with the server's defaults."""

    def __init__(self, model, tokenizer, model_name: str, config: TandemConfig, scheduler: Scheduler) -> None:
        self.model, self.tokenizer, self.model_name, self.config = model, tokenizer, model_name, config
        self.scheduler = scheduler
        self.tokenizer_lock = scheduler.tokenizer_lock
        self.metrics = Metrics(scheduler)
        self.created = int(time.time())
        self.max_positions = scheduler.max_positions

    # ---- requests -> jobs -----------------------------------------------------------------------------------
    def tokenize(self, request) -> list[int]:
        tok = self.tokenizer
        with self.tokenizer_lock:
            if isinstance(request, ChatRequest):
                if not getattr(tok, "chat_template", None):
                    raise APIError(
                        400, "this model's tokenizer has no chat template: use /v1/completions", "messages"
                    )
                messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(request.messages)]
                ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
                    "input_ids"
                ]
                return list(ids)
            prompt = request.prompt
            if isinstance(prompt, list) and isinstance(prompt[0], int):
                vocab = len(tok)
                bad = next((t for t in prompt if not 0 <= t < vocab), None)
                if bad is not None:
                    raise APIError(
                        400, f"prompt token id {bad} is out of range: allowed 0 to {vocab - 1}", "prompt"
                    )
                return list(prompt)
            text = prompt[0] if isinstance(prompt, list) else prompt
            return list(tok(text).input_ids)

    def job(self, request, ids: list[int], emit) -> Job:
        if request.model != self.model_name:
            raise APIError(
                404, f"the model '{request.model}' does not exist: this server serves '{self.model_name}'",
                "model", "model_not_found",
            )  # fmt: skip
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", "prompt")
        asked = request.limit() if isinstance(request, ChatRequest) else request.max_tokens
        context = self.max_positions
        if context is not None and len(ids) >= context:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens and this model's context is {context} tokens: shorten the prompt",
                "messages" if isinstance(request, ChatRequest) else "prompt", "context_length_exceeded",
            )  # fmt: skip
        room = None if context is None else context - len(ids)
        if asked is not None:
            if room is not None and asked > room:
                raise APIError(
                    400,
                    f"the prompt has {len(ids)} tokens and max_tokens is {asked}: together {len(ids) + asked}, over "
                    f"this model's context of {context} tokens; lower max_tokens to at most {room}",
                    "max_tokens", "context_length_exceeded",
                )  # fmt: skip
            limit = asked
        elif isinstance(request, CompletionRequest):
            limit = (
                COMPLETION_DEFAULT_MAX_TOKENS if room is None else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
            )
        elif room is not None:
            limit = room  # chat: up to the context's end
        else:
            raise APIError(400, "max_tokens is required: this model states no context length", "max_tokens")
        return Job(
            prompt_ids=ids,
            max_tokens=limit,
            config=self.cache_config(request),
            emit=emit,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=request.stops(),
            prefix_cache=request.prefix_cache,
        )

    def cache_config(self, request) -> TandemConfig:
        """The request's cache settings, refused here (400) where its cache would refuse them at prefill: a window
        past the model's context, fluxion settings its profile was not calibrated for."""
        config = request.cache_config(self.config)
        if config is not self.config:
            try:  # builds the layers' bookkeeping only: tensors come with the prefill
                TandemCache.for_model(self.model, config, pool=self.scheduler.pool)
            except (ValueError, FileNotFoundError) as err:
                raise config_error(err, REQUEST_FIELDS) from None
        return config

    def submit(self, job: Job) -> None:
        try:
            self.scheduler.submit(job)
        except QueueFull as err:
            self.metrics.requests.labels("rejected").inc()
            raise APIError(
                429, str(err), None, "queue_full", "rate_limit_error",
                headers={"Retry-After": str(int(round(err.retry_after)))},
            ) from None  # fmt: skip
        except TooLarge as err:
            raise APIError(400, str(err), "max_tokens", "request_too_large") from None
        except RuntimeError as err:
            raise APIError(503, str(err), None, "unavailable", "server_error") from None
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))


def create_app(server: Server) -> FastAPI:
    """The ASGI app of `server`; starts its scheduler on startup and stops it on shutdown."""

    @asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(server.scheduler.stop)

    app = FastAPI(title="Tandem", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        if err.status == 400:
            server.metrics.requests.labels("invalid").inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.get("/health")
    async def health():
        if not server.scheduler.alive:
            return JSONResponse(
                {"status": "failed", "detail": str(server.scheduler.failure)}, status_code=503
            )
        return {"status": "ok", "pid": os.getpid()}  # which process answered (one of the replicas, with Ray)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "tandem"}
            ],
        }

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await _generate(server, http, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        return await _generate(server, http, ChatRequest)

    return app


async def _body(http: Request):
    raw = await http.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None


async def _generate(server: Server, http: Request, model_type):
    request = parse(model_type, await _body(http))
    chat = model_type is ChatRequest
    ids = await anyio.to_thread.run_sync(server.tokenize, request)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    closed = threading.Event()

    def emit(event) -> None:  # on the scheduler's thread
        if not closed.is_set():
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is gone (shutdown)
                pass

    job = server.job(request, ids, emit)
    server.submit(job)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if request.stream:
        usage = request.stream_options is not None and request.stream_options.include_usage
        return StreamingResponse(
            _stream(server, job, events, closed, rid, created, chat, usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        text, reason = await _collect(http, job, events, server)
    finally:
        closed.set()
    return _response(server, job, rid, created, chat, text, reason)


def _usage(job: Job) -> dict:
    return {
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": job.generated,
        "total_tokens": len(job.prompt_ids) + job.generated,
        # as OpenAI reports prompt caching: the prompt tokens taken from a kept prefix
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }


async def _collect(http: Request, job: Job, events: asyncio.Queue, server: Server) -> tuple[str, str]:
    """The whole text of a non-streamed request; a client that disconnects cancels it (checked every
    DISCONNECT_POLL_SECONDS, also while tokens keep coming)."""
    pieces = []
    deadline = time.monotonic() + DISCONNECT_POLL_SECONDS
    while True:
        if time.monotonic() >= deadline:
            if await http.is_disconnected():
                server.scheduler.cancel(job)
                raise APIError(499, "the client closed the request", None, "cancelled")
            deadline = time.monotonic() + DISCONNECT_POLL_SECONDS
        try:
            kind, value = await asyncio.wait_for(events.get(), deadline - time.monotonic())
        except asyncio.TimeoutError:
            continue
        if kind == "text":
            pieces.append(value)
        elif kind == "done":
            return "".join(pieces), value
        else:
            raise APIError(500, value, None, "generation_failed", "server_error")


def _response(server, job, rid, created, chat, text, reason) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}  # fmt: skip
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": server.model_name,
        "choices": [choice],
        "usage": _usage(job),
    }


def _sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


async def _stream(server, job, events, closed, rid, created, chat, include_usage):
    """Server-sent events in OpenAI's chunk format, then `data: [DONE]`. Leaving early (the client went away)
    cancels the request."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, reason: str | None, role: bool = False) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        out = {"id": rid, "object": kind, "created": created, "model": server.model_name, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    finished = False
    try:
        if chat:
            yield _sse(chunk(None, None, role=True))
        while True:
            event, value = await events.get()
            if event == "text":
                yield _sse(chunk(value, None))
            elif event == "done":
                yield _sse(chunk(None if chat else "", value))
                if include_usage:
                    yield _sse({"id": rid, "object": kind, "created": created, "model": server.model_name,
                                "choices": [], "usage": _usage(job)})  # fmt: skip
                break
            else:
                yield _sse({"error": {"message": value, "type": "server_error", "param": None,
                                      "code": "generation_failed"}})  # fmt: skip
                break
        finished = True
        yield _sse("[DONE]")
    finally:
        closed.set()
        if not finished:  # the client went away mid-stream
            server.scheduler.cancel(job)
