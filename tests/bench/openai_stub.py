"""FakeOpenAIServer: a TEST DOUBLE of the OpenAI streaming protocol, not a model server.

It serves just enough of what ``tandem bench serve`` talks to (``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` with SSE streaming and usage,
``/tokenize``, ``/detokenize``) on 127.0.0.1 with a free port, from a background thread
with its own event loop, so both async tests and ``main()`` (which runs its own loop) can
use it. Generated "tokens" are the words `` w0 w1 ...``; a prompt word ``t17`` is token 17.

Misbehaviour on demand, chosen by a marker word in the prompt:

- ``BAD_REQUEST``: HTTP 400 with an OpenAI error body;
- ``CUT``: two tokens, then the connection is closed mid-stream;
- ``SLOW``: waits ``slow_s`` before answering;
- ``STREAM_ERROR``: one token, then an error event;
- ``NO_DONE``: tokens, then a clean end without ``finish_reason`` or ``[DONE]``;
- ``NO_STREAM``: one plain JSON answer, no SSE;

or for the whole server: ``fail_every=N`` (every Nth generation request gets HTTP 500),
``strict_fields`` (``/tokenize``/``/detokenize`` refuse fields beyond the bare form with
422), ``api_key`` (401 without that Bearer token).
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any, Optional

from aiohttp import web

TOKEN_DELAY_S = 0.002


def word_ids(text: str) -> list[int]:
    """The stub's tokenizer: ``t17`` -> 17, any other word -> 3."""
    return [int(w[1:]) if w[:1] == "t" and w[1:].isdigit() else 3 for w in text.split()]


class FakeOpenAIServer:
    """Context manager running the test double; ``base_url`` and ``requests`` (bodies seen)."""

    def __init__(self, model: str = "stub-model", token_delay_s: float = TOKEN_DELAY_S,
                 fail_every: int = 0, strict_fields: bool = False, api_key: Optional[str] = None,
                 split_events: bool = False, slow_s: float = 1.0) -> None:
        self.model = model
        self.token_delay_s = token_delay_s
        self.fail_every = fail_every
        self.strict_fields = strict_fields
        self.api_key = api_key
        self.split_events = split_events
        self.slow_s = slow_s
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._count = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner: Optional[web.AppRunner] = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> "FakeOpenAIServer":
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=serve, name="fake-openai-server", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    # -- handlers -----------------------------------------------------------------------

    @staticmethod
    def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return web.json_response(body, status=status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "stub"},
            {"id": "other-model", "object": "model", "owned_by": "stub"}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.strict_fields and set(body) != {"prompt"}:
            return self._error(422, f"unexpected fields {sorted(set(body) - {'prompt'})}")
        ids = word_ids(body["prompt"])
        return web.json_response({"tokens": ids, "count": len(ids)})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.strict_fields and set(body) != {"tokens"}:
            return self._error(422, "unexpected fields")
        return web.json_response({"prompt": " ".join(f"t{i}" for i in body["tokens"])})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self._count += 1
        chat = request.path.endswith("chat/completions")
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return self._error(401, "invalid api key", "AuthenticationError")
        if self.fail_every and self._count % self.fail_every == 0:
            return self._error(500, "injected failure", "InternalServerError")
        if chat:
            text = body["messages"][-1]["content"]
            prompt_tokens = len(word_ids(text))
        else:
            prompt = body["prompt"]
            text = prompt if isinstance(prompt, str) else ""
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(word_ids(prompt))
        if "BAD_REQUEST" in text:
            return self._error(400, "This model's maximum context length is 16 tokens.")
        if "NO_STREAM" in text:  # a server that ignores stream: true
            return web.json_response({"id": "x", "object": "text_completion",
                                      "choices": [{"index": 0, "text": "a b", "finish_reason": "length"}]})
        if "SLOW" in text:
            await asyncio.sleep(self.slow_s)
        n = int(body.get("max_tokens") or 16)

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        rid = f"cmpl-{self._count}"
        created = int(time.time())

        async def send(obj: Any) -> None:
            data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            if self.split_events:  # one event over two writes, split inside the JSON
                half = len(data) // 2
                await resp.write(data[:half])
                await asyncio.sleep(0.001)
                await resp.write(data[half:])
            else:
                await resp.write(data)

        def chunk(text_piece: Optional[str], finish: Optional[str] = None, role: bool = False) -> dict:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text_piece is not None:
                    delta["content"] = text_piece
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                return {"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": body["model"], "choices": [choice]}
            return {"id": rid, "object": "text_completion", "created": created, "model": body["model"],
                    "choices": [{"index": 0, "text": text_piece or "", "finish_reason": finish}]}

        if chat:
            await send(chunk(None, role=True))
        await resp.write(b": keep-alive ping\n\n")
        for i in range(n):
            await asyncio.sleep(self.token_delay_s)
            if "STREAM_ERROR" in text and i == 1:
                await send({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
                await resp.write_eof()
                return resp
            if "CUT" in text and i == 2:
                request.transport.close()
                return resp
            last = i == n - 1 and "NO_DONE" not in text
            await send(chunk(f" w{i}", "length" if last else None))
        if "NO_DONE" in text:
            await resp.write_eof()
            return resp
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"id": rid, "object": "chunk", "created": created, "model": body["model"], "choices": [],
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                  "total_tokens": prompt_tokens + n}})
        await send("[DONE]")
        await resp.write_eof()
        return resp


def unused_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
