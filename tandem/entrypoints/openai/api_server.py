"""The FastAPI app: routes, body parsing, auth, size limit, and errors in OpenAI's shape.

Bodies are parsed by hand (JSON, then the strict pydantic model) rather than by FastAPI,
so that every refusal, from malformed JSON to an unknown field, comes back as a 400 with
an OpenAI error body naming the field, never as FastAPI's 422 list.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from typing import AsyncContextManager, AsyncIterator, Callable, Optional, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem._version import __version__
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.messages import EngineDeadError
from tandem.entrypoints.openai.chat import ChatServing
from tandem.entrypoints.openai.completions import CompletionServing
from tandem.entrypoints.openai.errors import APIError, bad_request, error_body, from_validation_error
from tandem.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from tandem.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                TokenizeRequest, refuse_unsupported)
from tandem.entrypoints.openai.serving import ServerSettings
from tandem.entrypoints.openai.tokenizer_info import tokenizer_info
from tandem.entrypoints.openai.tools import template_tools

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413, by Content-Length or while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await self._too_large(send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise self._error()
            return msg

        await self.app(scope, limited, send)

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of {self.max_bytes} bytes",
                        code="request_too_large")

    async def _too_large(self, send: Send) -> None:
        await self._error().response()({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class ApiKeyMiddleware:
    """Bearer-token check on /v1/* (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = APIError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


async def parse_body(request: Request, model: type[M], endpoint: Optional[str] = None) -> M:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    if endpoint is not None:
        refuse_unsupported(data, endpoint)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's JSON body: ours, a dead engine (503), Starlette's own
    HTTP errors (404, 405, ...) and anything unexpected (500, logged with its traceback)."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> Response:
        return APIError(503, f"the engine is not running: {e}", code="engine_dead").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> Response:
        logger.exception("unexpected error while serving a request")
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)


def build_app(engine: AsyncLLM, settings: ServerSettings, stat_logger: PrometheusStatLogger,
              lifespan: Optional[Callable[[FastAPI], AsyncContextManager[None]]] = None) -> FastAPI:
    app = FastAPI(title="tandem", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    stat_logger.set_max_model_len(engine.max_model_len)
    completions = CompletionServing(engine, settings)
    chat = ChatServing(engine, settings)
    created = int(time.time())

    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return APIError(503, f"the engine is not running: {engine.dead_error or 'shut down'}",
                        code="engine_dead").response()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    tokenizer_folder = os.path.abspath(engine.model.tokenizer)

    @app.get("/v1/models")
    async def models() -> Response:
        # "tokenizer": a folder clients (lm-eval, guidellm, aiperf) can load the same tokenizer from
        data = [{"id": name, "object": "model", "created": created, "owned_by": "tandem",
                 "root": engine.config.model or name, "max_model_len": engine.max_model_len,
                 "tokenizer": tokenizer_folder}
                for name in settings.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> Response:
        return JSONResponse(tokenizer_info(engine.tokenizer, tokenizer_folder, settings.chat_template))

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.create(await parse_body(request, CompletionRequest, "completions"), request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(await parse_body(request, ChatCompletionRequest, "chat"), request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, TokenizeRequest)
        completions.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
        if req.tools and req.messages is None:
            raise bad_request("tools reach the chat template: give them with 'messages'", "tools")
        if req.messages is not None:
            ids = chat.prompt_ids(req, req.messages, template_tools(req.tools) if req.tools else None)
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = engine.tokenize(req.prompt or "", add_special_tokens=add_special)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest)
        completions.check_model(req.model)
        try:
            text = engine.detokenize(req.tokens)
        except ValueError as e:
            raise bad_request(str(e), "tokens") from None
        return JSONResponse({"prompt": text})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    return app


def serve_app(engine: AsyncLLM, settings: ServerSettings, stat_logger: PrometheusStatLogger, sock: socket.socket, *,
              host: str, port: int, log_level: str, shutdown_timeout_s: float,
              on_ready: Optional[Callable[[], None]] = None, announce: bool = True, server_index: int = 0) -> int:
    """Serve on the listening ``sock`` until SIGINT/SIGTERM (0) or until the engine core dies
    (1, after its requests got their errors); 1 as well if uvicorn never started. The engine
    is shut down either way."""
    import uvicorn

    name = settings.served_model_names[0]
    dead: list[str] = []

    @asynccontextmanager
    async def lifespan(_: object) -> AsyncIterator[None]:
        engine.begin()
        if announce:
            print(f"tandem: serving {name} on http://{host}:{port} (OpenAI API under /v1)", file=sys.stderr, flush=True)
        if on_ready is not None:
            on_ready()
        yield
        await engine.shutdown()

    app = build_app(engine, settings, stat_logger, lifespan=lifespan)
    # uvloop and httptools when installed (they are dependencies): the API server's CPU per
    # streamed token bounds what the server delivers. The header says which API-server
    # process answered (0 when there is one), at no cost per streamed chunk.
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s,
                            headers=[("x-tandem-api-server", str(server_index))])
    server = uvicorn.Server(config)

    def on_dead(error: str) -> None:  # a half-alive server must not keep running
        dead.append(error)
        server.should_exit = True

    engine.on_dead = on_dead

    async def run() -> None:
        try:
            await server.serve(sockets=[sock])
        finally:  # uvicorn never started (e.g. the port is taken): the lifespan did not stop the engine
            await engine.shutdown()

    # uvicorn handles SIGINT/SIGTERM while it serves and raises them again once it has shut
    # down; by then everything is stopped, so these no-op handlers let the process exit 0.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if sys.version_info >= (3, 11):
            with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
                runner.run(run())
        else:  # pragma: no cover - Python 3.10 runs the default loop
            asyncio.run(run())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if dead:
        print(f"error: the engine is dead: {dead[0]}; the server stopped", file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1


def _ignore(signum: int, frame: object) -> None:
    """Signal handler that does nothing (the server has already shut down)."""
