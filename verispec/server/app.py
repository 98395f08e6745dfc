"""The FastAPI application: OpenAI-compatible endpoints over an :class:`EngineRunner`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(streaming as server-sent events ending with ``data: [DONE]``, or one JSON body, both with
``usage``), ``GET /health`` and ``GET /metrics`` (Prometheus text).

Every error is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``:
400 for bad input (malformed JSON and wrong types included; FastAPI's 422 is mapped to 400 as
OpenAI and vLLM answer), 401 for a wrong API key, 404 for an unknown model or route, 429 with
``Retry-After`` when the waiting queue is full, 503 with ``Retry-After`` while shutting down.

A client that disconnects cancels its request: a stream notices when its generator is
cancelled, a plain request polls the connection while it waits. Either way the engine thread
aborts the sequence and its slot is free for the next request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.config import SamplingParams
from verispec.engine.engine import Engine
from verispec.engine.sequence import Sequence
from verispec.server import protocol
from verispec.server.metrics import ServerMetrics
from verispec.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from verispec.server.runner import EngineRunner, Event, QueueFull, ShuttingDown
from verispec.server.runner import Request as EngineRequest

RETRY_AFTER_S = 1  # what a client told to come back later should wait
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks its connection


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code
        self.headers, self.param = headers, param


def build_app(engine: Engine, model_name: str, *, api_key: str | None = None, max_queue: int = 64,
              shutdown_grace_s: float = 5.0) -> FastAPI:
    """The app serving ``engine`` as model ``model_name``; the engine thread runs with the app."""
    runner = EngineRunner(engine, ServerMetrics(), max_queue, shutdown_grace_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        await asyncio.to_thread(runner.stop)

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.runner = runner
    _add_error_handlers(app)
    auth = Depends(_key_checker(api_key))
    service = _Service(runner, model_name)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = runner.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(runner.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[auth])
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "verispec",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(body: CompletionRequest, http: Request) -> Response:
        return await service.handle(body, http, service.completion_prompt(body), chat=False)

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        return await service.handle(body, http, service.chat_prompt(body), chat=True)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError) -> JSONResponse:
        body = error_body(e.message, e.kind, param=e.param, code=e.code)
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: {err.get('msg')}"
            for err in e.errors()
        )
        return JSONResponse(error_body(f"invalid request: {problems}"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)


def _key_checker(api_key: str | None):
    expected = None if api_key is None else api_key.encode()

    def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Constant-time comparison: timing reveals nothing about how much of the key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "invalid or missing API key", "authentication_error", "invalid_api_key")

    return check


class _Service:
    """Turns validated requests into engine requests and engine events into responses."""

    def __init__(self, runner: EngineRunner, model_name: str) -> None:
        self.runner = runner
        self.engine = runner.engine
        self.model_name = model_name

    # ---- prompts -----------------------------------------------------------------------------

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            ids = self.engine.target.tokenizer.encode(body.prompt)
        else:
            vocab = self.engine.model.config.vocab_size
            bad = [t for t in body.prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
            ids = list(body.prompt)
        if not ids:
            raise APIError(400, "the prompt is empty")
        return ids

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tok = self.engine.target.tokenizer
        if not tok.has_chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        return tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])

    # ---- one request -------------------------------------------------------------------------

    async def handle(self, body: protocol.SamplingRequest, http: Request, prompt_ids: list[int],
                     chat: bool) -> Response:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model_not_found")
        problem = body.unsupported()
        if problem:
            raise APIError(400, problem)
        params = self._sampling_params(body, len(prompt_ids))
        queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def deliver(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:
                pass  # the event loop is gone (server shut down); nobody is listening

        request = EngineRequest(prompt_ids, params, self._request_k(body), deliver)
        try:
            self.runner.submit(request)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry later", "rate_limit_error", "queue_full",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        reply = _Reply(self.model_name, chat, len(prompt_ids))
        if body.stream:
            return StreamingResponse(self._stream(request, queue, reply), media_type="text/event-stream")
        return await self._collect(request, queue, reply, http)

    def _sampling_params(self, body: protocol.SamplingRequest, prompt_len: int) -> SamplingParams:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"the prompt has {prompt_len} tokens but this model's maximum context "
                           f"length is {limit} tokens", code="context_length_exceeded")
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but "
                           f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                           f"{max_tokens} for the completion)", code="context_length_exceeded")
        try:
            return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                  min_p=body.min_p, max_tokens=max_tokens, stop=body.stop_strings(),
                                  ignore_eos=body.ignore_eos, seed=body.seed)
        except ValueError as e:
            raise APIError(400, str(e)) from None

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
        pieces: list[str] = []
        done = False
        try:
            while not done:
                try:
                    event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return Response(status_code=499)  # nobody reads it; `finally` cancels
                    continue
                pieces.append(event.text)
                done = event.done
        finally:
            if not done:
                self.runner.cancel(request)
        if event.error is not None:
            raise APIError(503, f"request not completed: {event.error}", "service_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse(reply.full("".join(pieces), event.final))

    async def _stream(self, request: EngineRequest, queue: asyncio.Queue[Event],
                      reply: _Reply) -> AsyncIterator[str]:
        done = False
        try:
            if reply.chat:
                yield _sse(reply.chunk({"role": "assistant", "content": ""}))
            while not done:
                event = await queue.get()
                done = event.done
                if event.error is not None:
                    yield _sse(error_body(f"request not completed: {event.error}", "service_unavailable"))
                elif event.text or event.final is not None:
                    yield _sse(reply.chunk(event.text, event.final))
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (the generator was cancelled or closed)
                self.runner.cancel(request)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Reply:
    """Builds the response bodies of one request (completion or chat, whole or chunks)."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int) -> None:
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, kind: str, choice: dict, seq: Sequence | None) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}
        if seq is not None:
            body["usage"] = protocol.usage(self.prompt_tokens, len(seq.output_ids))
            body["speculative_stats"] = protocol.speculative_stats(seq.metrics)
        return body

    def full(self, text: str, seq: Sequence) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": seq.finish_reason}
            return self._envelope("chat.completion", choice, seq)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": seq.finish_reason}
        return self._envelope("text_completion", choice, seq)

    def chunk(self, delta: str | dict, seq: Sequence | None = None) -> dict:
        finish = None if seq is None else seq.finish_reason
        if self.chat:
            content = delta if isinstance(delta, dict) else {"content": delta}
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", choice, seq)
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion", choice, seq)
