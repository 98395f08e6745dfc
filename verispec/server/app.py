"""The FastAPI application: OpenAI-compatible endpoints over an :class:`EngineRunner`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(streaming as server-sent events ending with ``data: [DONE]``, or one JSON body, both with
``usage``), ``GET /health`` and ``GET /metrics`` (Prometheus text).

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input (malformed JSON and wrong types included; FastAPI's 422 is mapped to 400 as
OpenAI and vLLM answer), 401 for a wrong API key, 404 for an unknown model or route, 413 for a
body over ``max_request_bytes``, 429 with ``Retry-After`` when the waiting queue is full, 503
with ``Retry-After`` while shutting down, 500 for anything unexpected (logged; never a stack
trace). ``/openapi.json`` documents each route's errors.

The API key and the body size of ``/v1/`` requests are checked by a pure ASGI middleware
(:class:`_Gate`) before any body is parsed, so neither an unauthenticated client nor an
oversized body costs more than its headers and the bytes up to the limit. With
``api_key_for_metrics_and_docs`` the key guards every other route too (``/metrics``, ``/docs``,
``/redoc``, ``/openapi.json``) but ``/health``, which liveness probes call without one.
Tokenization runs in a worker thread: the size limit bounds its work, and the event loop
(``/health``, streams) stays responsive meanwhile; large prompts have a pool of their own, so
that a small request never waits behind them. Only a token-id prompt is refused for length
before that: a token may span many characters and a normalizer may drop some, so no character
count proves a text prompt too long for the context.

While a server runs, the heap the process had when serving began (torch, transformers, the
models: hundreds of thousands of objects) is frozen (``gc.freeze``, as vLLM's server does), so
the collector's full passes walk only what serving allocates. Unfrozen, a full pass walks that
whole heap while holding the GIL, which stalls the event loop and the engine thread for as long,
whatever runs in worker threads. Several servers in one process share the freeze:
the first to start freezes, the last to stop unfreezes.

A client that disconnects cancels its request: a stream notices when its generator is
cancelled, a plain request has a task waiting for the connection's disconnect message while
tokens flow. Either way the engine thread
aborts the sequence and its slot is free for the next request.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from verispec.config import MAX_REQUEST_BYTES, SamplingParams
from verispec.constraints import Grammar
from verispec.engine.engine import Engine
from verispec.logprobs import TokenLogprob
from verispec.metrics import SpecMetrics
from verispec.models.tokenizer import Tokenizer
from verispec.sequence import Sequence
from verispec.server import protocol
from verispec.server.metrics import ServerMetrics
from verispec.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from verispec.server.runner import EngineDead, EngineRunner, Event, QueueFull, ShuttingDown, abort_event
from verispec.server.runner import Request as EngineRequest
from verispec.tools import ToolCall, ToolCallStream, ToolParser, parser_for, template_messages

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a client told to come back later should wait
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # arrival to last token; `verispec serve --request-timeout`
# one engine call (a whole prompt's prefill, until prefill is chunked) past which /health is 503
DEFAULT_MAX_STEP_S = 120.0
DEFAULT_BODY_TIMEOUT_S = 30.0  # a /v1 body's arrival after its headers; then 408
MAX_STREAM_BACKLOG = 256  # unread stream events after which a slow reader's request is cancelled
_ERROR_TYPES = {400: "invalid_request_error", 499: "cancelled", 503: "service_unavailable", 504: "timeout"}
# Tokenization runs in two pools (threads are shared by every app in the process): prompts over
# LARGE_PROMPT_CHARS characters in a small one of their own, the rest in another, so small
# requests never queue behind large ones, and large ones cannot take every core.
LARGE_PROMPT_CHARS = 64 * 1024
LARGE_PROMPT_WORKERS = 1
_SMALL_PROMPTS = ThreadPoolExecutor(4, thread_name_prefix="verispec-tokenize")
_LARGE_PROMPTS = ThreadPoolExecutor(LARGE_PROMPT_WORKERS, thread_name_prefix="verispec-tokenize-large")


_serving = 0  # servers of this process between their start and their stop
_serving_lock = threading.Lock()


def _freeze_heap() -> None:
    """Freeze the heap when the first server of the process starts (see the module docstring)."""
    global _serving
    with _serving_lock:
        _serving += 1
        if _serving == 1:
            gc.collect()  # what is garbage now is collected, not frozen
            gc.freeze()


def _unfreeze_heap() -> None:
    global _serving
    with _serving_lock:
        _serving -= 1
        if _serving == 0:
            gc.unfreeze()


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.headers, self.param = headers, param


def build_app(engine: Engine, model_name: str, *, api_key: str | None = None,
              api_key_for_metrics_and_docs: bool = False, max_queue: int = 64,
              shutdown_grace_s: float = 5.0, max_request_bytes: int = MAX_REQUEST_BYTES,
              request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S,
              max_stream_backlog: int = MAX_STREAM_BACKLOG, max_step_s: float | None = DEFAULT_MAX_STEP_S,
              body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S,
              on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """The app serving ``engine`` as model ``model_name``; the engine thread runs with the app.

    ``request_timeout_s`` bounds each request from arrival to its last token (None: no limit),
    answered at the deadline even while an engine step runs; ``/health`` is 503 while one engine
    call (a prefill or a step) has run longer than ``max_step_s`` (None: never);
    a stream whose client leaves more than ``max_stream_backlog`` events unread is cancelled;
    a ``/v1/`` request body over ``max_request_bytes`` is refused (413), and one that has not all
    arrived ``body_timeout_s`` after its headers gets 408;
    ``on_fatal`` is called if the engine thread dies (see :mod:`verispec.server.runner`);
    ``api_key_for_metrics_and_docs`` makes every route but ``/health`` require ``api_key``."""
    if api_key_for_metrics_and_docs and api_key is None:
        raise ValueError("api_key_for_metrics_and_docs needs an api_key")
    runner = EngineRunner(engine, ServerMetrics(), max_queue, shutdown_grace_s, on_fatal)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        _freeze_heap()
        try:
            yield
        finally:
            await asyncio.to_thread(runner.stop)
            _unfreeze_heap()

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.runner = runner
    _add_error_handlers(app)
    app.add_middleware(_Gate, api_key=api_key, max_request_bytes=max_request_bytes,
                       everywhere=api_key_for_metrics_and_docs, body_timeout_s=body_timeout_s)
    app.openapi = lambda: _openapi(app, secured=api_key is not None, everywhere=api_key_for_metrics_and_docs)
    service = _Service(runner, model_name, request_timeout_s, max_stream_backlog)

    @app.get("/health", responses={503: {"description": "the engine thread has died, or one engine step has run "
                                                       "past its bound (see `error`)"}})
    async def health() -> JSONResponse:
        if not runner.alive:
            return JSONResponse({"status": "engine stopped", "error": runner.fatal}, status_code=503)
        stalled = runner.stalled_for()
        if max_step_s is not None and stalled > max_step_s:
            return JSONResponse({"status": "engine stalled", "error": f"an engine step has run for {stalled:.1f} s "
                                 f"(the bound is {max_step_s:g} s)"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics() -> Response:
        return Response(generate_latest(runner.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=None, responses={200: {"model": protocol.ModelList}})
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "verispec",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", responses=_generation_responses(protocol.CompletionResponse,
                                                                  protocol.CompletionChunk))
    async def completions(body: CompletionRequest, http: Request) -> Response:
        service.check(body)
        prompt_ids = await service.tokenize(service.completion_prompt, body)
        return await service.handle(body, http, prompt_ids, chat=False)

    @app.post("/v1/chat/completions", responses=_generation_responses(protocol.ChatCompletionResponse,
                                                                       protocol.ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        service.check(body)
        prompt_ids = await service.tokenize(service.chat_prompt, body)
        return await service.handle(body, http, prompt_ids, chat=True)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        problems = protocol.describe_errors(e.errors())
        return JSONResponse(error_body(f"invalid request: {problems}", param=protocol.error_param(e.errors())),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.kind, param=e.param, code=e.code), status_code=e.status,
                        headers=e.headers)


class _Gate:
    """Pure ASGI middleware. On ``/v1/`` it checks the API key, then reads the body up to
    ``max_request_bytes`` (refused at once when ``Content-Length`` says it is larger) within
    ``body_timeout_s``, before
    the app parses anything; with ``everywhere`` it checks the key on every other route but
    ``/health`` too. On every route it turns an unexpected exception into a logged 500 with the
    error envelope (or, once the response has started, lets the server close it)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int, everywhere: bool = False,
                 body_timeout_s: float | None = None) -> None:
        self.app = app
        self.expected = None if api_key is None else api_key.encode()
        self.max_request_bytes = max_request_bytes
        self.everywhere = everywhere
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if scope["path"].startswith("/v1/"):
                self._check_key(scope)
                replay = await self._read_body(scope, receive)
                if replay is None:
                    return  # the client left while sending its body
                receive = replay
            elif self.everywhere and scope["path"] != "/health":
                self._check_key(scope)
        except APIError as e:
            await _error_response(e)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if started:
                raise
            body = error_body("internal server error", "server_error", code="internal_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)

    def _check_key(self, scope: Scope) -> None:
        if self.expected is None:
            return
        scheme, _, token = _header(scope, b"authorization").partition(b" ")
        # Constant-time comparison: timing reveals nothing about how much of the key matched.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
            raise APIError(401, "invalid or missing API key", "authentication_error", "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})

    async def _read_body(self, scope: Scope, receive: Receive) -> Receive | None:
        """Check the size; return a ``receive`` that replays the body (None: the client left)."""
        too_large = APIError(413, f"the request body is larger than {self.max_request_bytes} bytes",
                             code="request_too_large")
        length = _header(scope, b"content-length")
        if length.isdigit() and int(length) > self.max_request_bytes:
            raise too_large
        chunks, size, more = [], 0, True
        deadline = None if self.body_timeout_s is None else time.monotonic() + self.body_timeout_s
        while more:
            try:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                               code="request_timeout") from None
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                raise too_large
            more = message.get("more_body", False)
        first: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal first
            if first is None:
                return await receive()  # after the body: the disconnect, when it comes
            message, first = first, None
            return message

        return replay


def _header(scope: Scope, name: bytes) -> bytes:
    """The first value of header ``name`` (lower case), or b""."""
    return next((value for key, value in scope["headers"] if key == name), b"")


_ERROR_DESCRIPTIONS = {
    400: "invalid request: malformed JSON, a wrong type or value, or a prompt too long for the context",
    401: "invalid or missing API key",
    404: "no such model",
    408: "the request body did not arrive in time",
    413: "the request body is over the server's limit",
    429: "the waiting queue is full; retry after Retry-After seconds",
    500: "unexpected server error",
    503: "shutting down (retry after Retry-After seconds) or the engine stopped",
    504: "the request timed out",
}


def _generation_responses(model: type, chunk: type) -> dict:
    """OpenAPI responses of a generation route: one JSON body or, with ``stream``, server-sent
    events (each a JSON chunk or error, then ``[DONE]``); the route's own errors (see
    :func:`_openapi`, which adds the chunk schemas). Open API 3.1 has ``schema`` describe each
    event of a stream."""
    json_data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": f"#/components/schemas/{chunk.__name__}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}}
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}}}
    ok = {"model": model, "description": "the completion, or its server-sent events with `stream`",
          "content": {"text/event-stream": {"schema": event}}}
    errors = {s: {"model": protocol.ErrorResponse, "description": _ERROR_DESCRIPTIONS[s]}
              for s in (400, 404, 429, 503, 504)}
    return {200: ok, **errors}


def _openapi(app: FastAPI, secured: bool, everywhere: bool) -> dict:
    """FastAPI's OpenAPI document made to match the server: no 422 (validation errors are
    400), the gate's 408 and 413 on ``/v1/`` routes and its 401 (with a key) on the routes it guards
    (``/v1/`` ones, or with ``everywhere`` all but ``/health``), 500 on every route."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for model in (protocol.CompletionChunk, protocol.ChatCompletionChunk):  # only named by the SSE schemas
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    # The generation routes put ErrorResponse into the components.
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc["paths"].items():
        sized = path.startswith("/v1/")
        keyed = secured and (sized or (everywhere and path != "/health"))
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)
            for status in ([401] if keyed else []) + ([408, 413] if sized else []) + [500]:
                responses[str(status)] = {"description": _ERROR_DESCRIPTIONS[status], **error}
            if keyed:
                operation["security"] = [{"bearer": []}]
    app.openapi_schema = doc
    return doc


class _Service:
    """Turns validated requests into engine requests and engine events into responses."""

    def __init__(self, runner: EngineRunner, model_name: str, request_timeout_s: float | None,
                 max_stream_backlog: int) -> None:
        self.runner = runner
        self.engine = runner.engine
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s
        self.max_stream_backlog = max_stream_backlog

    # ---- prompts -----------------------------------------------------------------------------

    async def tokenize(self, prompt: Callable[[protocol.SamplingRequest], list[int]],
                       body: protocol.SamplingRequest) -> list[int]:
        """``prompt(body)`` in a worker thread: a request whose text is over ``LARGE_PROMPT_CHARS``
        in its own pool of ``LARGE_PROMPT_WORKERS`` threads, so that however many large prompts
        are being tokenized, a small one never waits behind them."""
        pool = _LARGE_PROMPTS if _text_size(body) > LARGE_PROMPT_CHARS else _SMALL_PROMPTS
        return await asyncio.get_running_loop().run_in_executor(pool, prompt, body)

    def check(self, body: protocol.SamplingRequest) -> None:
        """The cheap checks, before the prompt is tokenized."""
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model_not_found", param="model")
        refusal = body.refused()
        if refusal is not None:
            raise APIError(400, refusal.message, param=refusal.param)
        if isinstance(body, ChatCompletionRequest) and not self.engine.target.tokenizer.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        if isinstance(body, ChatCompletionRequest) and body.uses_tools():
            self.tool_parser(body)
        if isinstance(body, CompletionRequest) and isinstance(body.prompt, list):
            self._check_prompt_length(len(body.prompt), "prompt")  # token ids: their count is known already

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        """Token ids of the prompt (blocking: runs in a worker thread)."""
        if isinstance(body.prompt, str):
            ids = self.engine.target.tokenizer.encode(body.prompt)
        else:
            vocab = self.engine.model.config.vocab_size
            bad = [t for t in body.prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", param="prompt")
            ids = list(body.prompt)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return ids

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """Token ids of the conversation (blocking: runs in a worker thread)."""
        try:
            messages = template_messages([m.for_template() for m in body.messages])
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.uses_tools() else None
        return self.engine.target.tokenizer.apply_chat_template(messages, tools=tools)

    def tool_parser(self, body: ChatCompletionRequest) -> ToolParser | None:
        """The parser of the model's calls where the request uses tools (a 400 where the
        model's template does not render tools, or writes calls in a format not known here)."""
        if not body.uses_tools():
            return None
        template = self.engine.target.tokenizer.chat_template or ""
        parser = parser_for(template)
        if parser is None:
            why = "does not render tools" if "tools" not in template else \
                "writes tool calls in a format verispec has no parser for"
            raise APIError(400, f"this model's chat template {why}", param="tools")
        return parser

    # ---- one request -------------------------------------------------------------------------

    async def handle(self, body: protocol.SamplingRequest, http: Request, prompt_ids: list[int],
                     chat: bool) -> Response:
        params = self._sampling_params(body, len(prompt_ids))
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def put(event: Event) -> None:  # on the event loop
            queue.put_nowait(event)
            if not event.done and queue.qsize() > self.max_stream_backlog:
                self.runner.cancel(request, "slow_reader")  # the client does not keep up

        def deliver(event: Event) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(put, event)
            except RuntimeError:
                pass  # the event loop is gone (server shut down); nobody is listening

        request = EngineRequest(prompt_ids, params, self._request_k(body), deliver, n=body.choices(),
                                timeout_s=self.request_timeout_s)
        try:
            self.runner.submit(request)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", "rate_limit_error", "queue_full",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDead as e:
            raise APIError(503, str(e), "service_unavailable", "engine_dead") from None
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        tools = None
        if isinstance(body, ChatCompletionRequest) and body.uses_tools():
            parser, parallel = self.tool_parser(body), body.parallel_tool_calls is not False
            tools = functools.partial(parser.stream, parallel)  # a reader per choice
        reply = _Reply(self.model_name, chat, len(prompt_ids), self.engine.target.tokenizer, params.logprobs,
                       include_usage, body.choices(), tools)
        if body.stream:
            return StreamingResponse(self._stream(request, queue, reply), media_type="text/event-stream")
        return await self._collect(request, queue, reply, http)

    def _check_prompt_length(self, prompt_len: int, param: str) -> None:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"the prompt has {prompt_len} tokens but this model's maximum context "
                           f"length is {limit} tokens", code="context_length_exceeded", param=param)

    def _sampling_params(self, body: protocol.SamplingRequest, prompt_len: int) -> SamplingParams:
        chat = isinstance(body, ChatCompletionRequest)
        self._check_prompt_length(prompt_len, "messages" if chat else "prompt")
        limit = self.engine.max_model_len
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = limit - prompt_len
        if prompt_len + max_tokens > limit:
            param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but "
                           f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                           f"{max_tokens} for the completion)", code="context_length_exceeded", param=param)
        vocab = self.engine.model.config.vocab_size
        bias = body.token_biases()
        outside = sorted(t for t in bias if t >= vocab)
        if outside:
            raise APIError(400, f"logit_bias token ids must be in [0, {vocab}); got {outside[:5]}", param="logit_bias")
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={body.min_tokens} is more than the {max_tokens} tokens the completion "
                           "may have", param="min_tokens")
        if body.choices() > self.engine.cache.num_slots:
            raise APIError(400, f"n={body.choices()} is more than this server's max_num_seqs "
                           f"({self.engine.cache.num_slots}): the n samples run together", param="n")
        try:
            grammar = body.grammar()  # compiled here: a bad one is a 400 before anything runs
            if chat and body.forces_calls():
                grammar = self._calls_grammar(body)
        except ValueError as e:
            raise APIError(400, str(e), param="tools" if chat and body.forces_calls() else body.grammar_field()) from None
        try:
            return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                  min_p=body.min_p, max_tokens=max_tokens, stop=body.stop_strings(),
                                  ignore_eos=body.ignore_eos, stop_token_ids=frozenset(body.stop_token_ids or ()),
                                  seed=body.seed, logprobs=body.requested_logprobs(),
                                  presence_penalty=body.presence_penalty or 0.0,
                                  frequency_penalty=body.frequency_penalty or 0.0,
                                  repetition_penalty=body.repetition_penalty, logit_bias=bias,
                                  min_tokens=body.min_tokens, grammar=grammar)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def _calls_grammar(self, body: ChatCompletionRequest) -> Grammar:
        """The grammar of an answer that is only calls, in the template's format: to any of the
        tools (``required``) or to the named one."""
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
        if isinstance(body.tool_choice, protocol.NamedToolChoice):
            tools = [t for t in tools if t["function"]["name"] == body.tool_choice.function.name]
        return Grammar.lark(self.tool_parser(body).grammar(tools, parallel=body.parallel_tool_calls is not False))

    def _request_k(self, body: protocol.SamplingRequest) -> int | None:
        opts = body.speculative
        if opts is None or (opts.enabled and opts.num_speculative_tokens is None):
            return None
        if not opts.enabled:
            return 0
        k = opts.num_speculative_tokens
        if k > self.engine.k:
            why = "speculative decoding is off on this server" if self.engine.drafter is None else (
                f"the server drafts at most {self.engine.k} tokens per round")
            raise APIError(400, f"speculative.num_speculative_tokens={k} is too large: {why}",
                           param="speculative.num_speculative_tokens")
        return k

    async def _collect(self, request: EngineRequest, queue: asyncio.Queue[Event], reply: _Reply,
                       http: Request) -> Response:
        """Wait for the whole completion, or for the client to disconnect (noticed at once: a
        task waits for the connection's disconnect message, whatever the tokens do)."""
        pieces: list[list[str]] = [[] for _ in range(reply.n)]  # per choice
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(reply.n)]
        event = Event()
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            while not event.done:
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, gone}, timeout=_time_left(request), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    if gone.done():
                        return Response(status_code=499)  # nobody reads it; `finally` cancels
                    event = _timed_out(self.runner, request)  # answered now, whatever the engine does
                    break
                event = get.result()
                pieces[event.index].append(event.text)
                logprobs[event.index].extend(event.logprobs)
        finally:
            gone.cancel()
            if not event.done:
                self.runner.cancel(request)
        if event.error is not None:
            headers = {"Retry-After": str(RETRY_AFTER_S)} if event.status == 503 else None
            raise APIError(event.status, f"request not completed: {event.error}",
                           _ERROR_TYPES.get(event.status, "server_error"), headers=headers)
        return JSONResponse(reply.full(["".join(p) for p in pieces], logprobs, event.final))

    async def _stream(self, request: EngineRequest, queue: asyncio.Queue[Event],
                      reply: _Reply) -> AsyncIterator[str]:
        done = False
        try:
            if reply.chat:
                for index in range(reply.n):
                    yield _sse(reply.chunk({"role": "assistant", "content": ""}, index))
            while not done:
                try:
                    event = await asyncio.wait_for(queue.get(), _time_left(request))
                except asyncio.TimeoutError:
                    event = _timed_out(self.runner, request)  # answered now, whatever the engine does
                done = event.done
                if event.error is not None:
                    if event.text:
                        yield _sse(reply.chunk(event.text, event.index))
                    yield _sse(error_body(f"request not completed: {event.error}",
                                          _ERROR_TYPES.get(event.status, "server_error")))
                elif event.text or event.logprobs or event.choice is not None:
                    for chunk in reply.chunks(event.text, event.index, event.choice, event.logprobs,
                                              event.final):
                        yield _sse(chunk)
                    if event.final is not None and reply.include_usage:
                        yield _sse(reply.usage_chunk(event.final))
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (the generator was cancelled or closed)
                self.runner.cancel(request)


def _text_size(body: protocol.SamplingRequest) -> int:
    """Characters of text a request asks to tokenize (its prompt, or its messages and tools)."""
    if isinstance(body, CompletionRequest):
        return len(body.prompt) if isinstance(body.prompt, str) else 0
    size = sum(len(m.text() or "") + sum(len(c.function.arguments) for c in m.tool_calls or ())
               for m in body.messages)
    return size + sum(len(json.dumps(t.function.parameters or {})) for t in body.tools or ())


def _time_left(request: EngineRequest) -> float | None:
    """Seconds until ``request``'s deadline (None: it has none)."""
    deadline = request.deadline
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def _timed_out(runner: EngineRunner, request: EngineRequest) -> Event:
    """The deadline passed while the engine was busy: the request is cancelled as timed out (the
    engine thread drops its work when its call returns) and answered with this event now."""
    runner.cancel(request, "timeout")
    return abort_event("timeout")


async def _disconnected(http: Request) -> None:
    """Return when the client has disconnected. The body has been read, so the server's next
    ASGI message for this request is the disconnect (or the end of the response)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Reply:
    """Builds the response bodies of one request (completion or chat, whole or chunks).

    ``top_logprobs`` is how many top logprobs each token comes with (None: the request asked for
    no logprobs, and every ``logprobs`` is null). A token's text is its own decoding, special
    tokens included (a piece of a multi-byte character reads U+FFFD; its ``bytes`` are the real
    ones); ``text_offset`` counts those texts from the start of the choice's completion.

    ``n`` choices: each chunk carries one choice's delta (``index``), and each choice's last chunk
    its ``finish_reason``. The stream's last chunk carries ``usage`` (the prompt once, the
    choices' tokens summed, as OpenAI counts them) and ``speculative_stats`` (summed over the
    choices); with ``include_usage`` (``stream_options``) usage goes instead in a chunk of its own
    after it, with no choices, as OpenAI sends it.

    With ``tools`` (a chat request that uses tools: what makes a reader of one answer's calls)
    each choice's text is read for calls (:mod:`verispec.tools`): an answer's calls go in
    ``tool_calls``, and its finish reason is ``tool_calls`` where it stopped after making one; in
    a stream each call is one delta once its text is complete, and text that may begin a call
    waits until that is known."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int, tokenizer: Tokenizer, top_logprobs: int | None,
                 include_usage: bool = False, n: int = 1,
                 tools: Callable[[], ToolCallStream] | None = None) -> None:
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.tokenizer, self.top_logprobs, self.include_usage, self.n = tokenizer, top_logprobs, include_usage, n
        self.tools = None if tools is None else [tools() for _ in range(n)]  # one reader per choice
        self.calls_sent = [0] * n  # a stream's calls so far, per choice: the index of the next
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text_offset = [0] * n  # completions: where each choice's next token's text starts

    def _envelope(self, kind: str, choices: list[dict], seqs: tuple[Sequence, ...] | None,
                  usage: bool = True) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if seqs is not None:
            if usage:
                body["usage"] = protocol.usage(self.prompt_tokens, sum(len(s.output_ids) for s in seqs),
                                               seqs[0].metrics.cached_prompt_tokens)
            metrics = SpecMetrics()
            for seq in seqs:
                metrics.merge(seq.metrics)
            body["speculative_stats"] = protocol.speculative_stats(metrics)
        return body

    def full(self, texts: list[str], logprobs: list[list[TokenLogprob]], seqs: tuple[Sequence, ...]) -> dict:
        if self.chat:
            choices = [self._message(i, text, lp, seq) for i, (text, lp, seq) in enumerate(zip(texts, logprobs, seqs))]
            return self._envelope("chat.completion", choices, seqs)
        choices = [{"index": i, "text": text, "logprobs": self._logprobs(lp, i), "finish_reason": seq.finish_reason}
                   for i, (text, lp, seq) in enumerate(zip(texts, logprobs, seqs))]
        return self._envelope("text_completion", choices, seqs)

    def _message(self, index: int, text: str, logprobs: list[TokenLogprob], seq: Sequence) -> dict:
        """Chat choice ``index`` of a whole answer."""
        message: dict = {"role": "assistant", "content": text}
        finish = seq.finish_reason
        if self.tools is not None:
            reader = self.tools[index]
            items = reader.feed(text) + reader.finish()
            calls = [i.openai() for i in items if isinstance(i, ToolCall)]
            content = "".join(i for i in items if isinstance(i, str))
            message["content"] = None if calls and not content.strip() else content
            if calls:
                message["tool_calls"] = calls
                finish = _tools_finish(finish)
        return {"index": index, "message": message, "logprobs": self._logprobs(logprobs, index), "finish_reason": finish}

    def chunk(self, delta: str | dict, index: int = 0, choice: Sequence | None = None,
              logprobs: tuple[TokenLogprob, ...] = (), final: tuple[Sequence, ...] | None = None) -> dict:
        """Choice ``index``'s delta; ``choice`` (its sequence) once it has ended; ``final`` (every
        choice's sequence) on the request's last chunk."""
        finish = None if choice is None else choice.finish_reason
        lp = self._logprobs(logprobs, index) if logprobs else None
        if self.chat:
            content = delta if isinstance(delta, dict) else {"content": delta}
            body = {"index": index, "delta": content, "logprobs": lp, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [body], final, usage=not self.include_usage)
        body = {"index": index, "text": delta, "logprobs": lp, "finish_reason": finish}
        return self._envelope("text_completion", [body], final, usage=not self.include_usage)

    def chunks(self, text: str, index: int, choice: Sequence | None, logprobs: tuple[TokenLogprob, ...],
               final: tuple[Sequence, ...] | None) -> list[dict]:
        """The chunks of one engine event (:meth:`chunk`'s arguments): one, or with tools, the
        content and calls the event's text settles (its logprobs ride on the first chunk, the
        finish and ``final`` on the last)."""
        if self.tools is None:
            return [self.chunk(text, index, choice, logprobs, final)]
        reader = self.tools[index]
        items = reader.feed(text) + (reader.finish() if choice is not None else [])
        deltas: list[dict] = []
        for item in items:
            if isinstance(item, ToolCall):
                deltas.append({"tool_calls": [item.openai(index=self.calls_sent[index])]})
                self.calls_sent[index] += 1
            else:
                deltas.append({"content": item})
        if not deltas and (logprobs or choice is not None or final is not None):
            deltas.append({"content": ""})
        out = []
        for j, delta in enumerate(deltas):
            last = j == len(deltas) - 1
            chunk = self.chunk(delta, index, choice if last else None, logprobs if j == 0 else (),
                               final if last else None)
            if last and choice is not None and self.calls_sent[index]:
                chunk["choices"][0]["finish_reason"] = _tools_finish(choice.finish_reason)
            out.append(chunk)
        return out

    def usage_chunk(self, seqs: tuple[Sequence, ...]) -> dict:
        """The chunk after the last one when ``include_usage`` is set: usage, no choices."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], seqs)
        del body["speculative_stats"]  # the last chunk with a choice has them
        return body

    def _logprobs(self, entries: list[TokenLogprob] | tuple[TokenLogprob, ...], index: int = 0) -> dict | None:
        """The ``logprobs`` of choice ``index`` (or its chunk) holding ``entries``, in OpenAI's shape."""
        if self.top_logprobs is None:
            return None
        if self.chat:
            return {"content": [{**self._token(t.token_id, t.logprob),
                                 "top_logprobs": [self._token(i, lp) for i, lp in t.top]} for t in entries]}
        tokens = [self._text(t.token_id) for t in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset[index])
            self.text_offset[index] += len(token)
        return {"tokens": tokens, "token_logprobs": [_finite(t.logprob) for t in entries],
                "top_logprobs": [{**{self._text(i): _finite(lp) for i, lp in t.top},
                                  self._text(t.token_id): _finite(t.logprob)} for t in entries],
                "text_offset": offsets}

    def _token(self, token_id: int, logprob: float) -> dict:
        return {"token": self._text(token_id), "logprob": _finite(logprob),
                "bytes": list(self.tokenizer.token_bytes(token_id))}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _tools_finish(reason: str | None) -> str | None:
    """The finish reason of an answer that made calls: ``tool_calls`` where the model stopped
    by itself, as OpenAI reports it (a length or abort cut-off says so)."""
    return "tool_calls" if reason == "stop" else reason


def _finite(logprob: float) -> float:
    """JSON has no -inf: a token the model rules out gets ``LOGPROB_FLOOR``, as in vLLM."""
    return max(logprob, protocol.LOGPROB_FLOOR)
