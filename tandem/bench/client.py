"""One streamed OpenAI-compatible request, timed chunk by chunk.

The client speaks only the public protocol (``/v1/completions`` and
``/v1/chat/completions`` with ``stream: true`` and ``stream_options.include_usage``), so
it measures tandem, vLLM and SGLang alike. aiohttp carries the HTTP: under hundreds of
concurrent streams its per-chunk overhead stays small enough not to show up in ITL, which
is why vLLM's benchmark uses it too. The server-sent-events framing on top is parsed here
(:class:`SSEDecoder`), because the timing of each event is the measurement.

:func:`send_request` never raises for anything the server or network does: HTTP errors,
error events inside the stream, a connection cut mid-stream, a refused connection and the
per-request timeout all end up as a failed :class:`RequestRecord` with a one-line error.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import aiohttp

from tandem.bench.records import RequestRecord
from tandem.bench.structured import request_fields

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int]]
_MAX_ERROR_BODY = 4096


@dataclass
class ClientConfig:
    """How every request of a run is sent."""

    api_url: str  # full URL, e.g. http://127.0.0.1:8000/v1/completions
    model: str
    chat: bool = False  # True: /v1/chat/completions payloads and deltas
    api_key: Optional[str] = None
    ignore_eos: bool = True  # so each request produces exactly max_tokens (vLLM extension)
    temperature: float = 0.0
    timeout_s: float = 600.0  # whole request, first byte to last
    extra_body: dict[str, Any] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_payload(cfg: ClientConfig, prompt: Prompt, max_tokens: int,
                  schema: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The JSON body for one request. Token-id prompts go only to the completions endpoint;
    ``schema`` constrains the output (``tandem.bench.structured``)."""
    body: dict[str, Any] = {"model": cfg.model}
    if cfg.chat:
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint needs text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(max_tokens=max_tokens, temperature=cfg.temperature, stream=True,
                stream_options={"include_usage": True})
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if schema is not None:
        body.update(request_fields(schema, cfg.chat))
    body.update(cfg.extra_body)
    return body


class SSEDecoder:
    """Incremental server-sent-events parser: bytes in, the ``data`` of each complete event out.

    Bytes may split anywhere (inside a UTF-8 character, a line, or between ``\\r`` and
    ``\\n``). Comment lines (``:``, used as keep-alive pings) and non-data fields are
    dropped; an event's several ``data:`` lines are joined with newlines, per the spec.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += self._utf8.decode(chunk)
        events: list[str] = []
        while True:
            nl = self._buf.find("\n")
            if nl < 0:
                break
            line, self._buf = self._buf[:nl], self._buf[nl + 1:]
            self._line(line[:-1] if line.endswith("\r") else line, events)
        return events

    def flush(self) -> list[str]:
        """Events left when the stream ends without a final blank line."""
        events: list[str] = []
        self._buf += self._utf8.decode(b"", final=True)
        if self._buf:
            self._line(self._buf.rstrip("\r"), events)
            self._buf = ""
        self._line("", events)
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def error_message(body: str) -> str:
    """The human part of an error body: OpenAI ``{"error": {"message"}}``, vLLM's older
    ``{"object": "error", "message"}``, FastAPI's ``{"detail"}``, or the raw text."""
    try:
        data = json.loads(body)
    except ValueError:
        return _one_line(body) or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return _one_line(err["message"])
        if isinstance(err, str) and err:
            return _one_line(err)
        for key in ("message", "detail"):
            if data.get(key):
                v = data[key]
                return _one_line(v if isinstance(v, str) else json.dumps(v))
    return _one_line(body)


def _delta_text(choice: dict[str, Any], chat: bool) -> tuple[str, bool]:
    """The content of one streamed choice and whether it stands for generated tokens
    (a chat delta that only announces the role does not)."""
    if not chat:
        text = choice.get("text")
        return (text if isinstance(text, str) else ""), True
    delta = choice.get("delta") or {}
    for key in ("content", "reasoning_content", "reasoning"):
        v = delta.get(key)
        if isinstance(v, str) and v:
            return v, True
    # A delta naming the role opens the reply; others (content "" included) stand for tokens
    # that decoded to nothing yet, e.g. special tokens or bytes of an unfinished character.
    return "", ("role" not in delta and bool(delta)) or choice.get("finish_reason") is not None


async def _stream(session: aiohttp.ClientSession, cfg: ClientConfig, body: dict[str, Any],
                  rec: RequestRecord) -> None:
    """Send one request and fill ``rec`` as events arrive (so a timeout keeps what came)."""
    token_times: list[float] = []  # chunks that carried tokens, content or not (fallback)
    n_content = n_events = 0
    done = finished = False
    usage: dict[str, Any] = {}
    rec.start_time = time.perf_counter()
    async with session.post(cfg.api_url, json=body, headers=cfg.headers()) as resp:
        rec.status = resp.status
        if resp.status != 200:
            raw = await resp.content.read(_MAX_ERROR_BODY)
            rec.error = f"HTTP {resp.status}: {error_message(raw.decode('utf-8', 'replace'))}"
            rec.end_time = time.perf_counter()
            return
        sse = SSEDecoder()
        eof = False
        while not eof:
            chunk = await resp.content.readany()
            now = time.perf_counter()
            eof = not chunk
            for data in (sse.flush() if eof else sse.feed(chunk)):
                n_events += 1
                if done:
                    continue
                if data.strip() == "[DONE]":
                    done = True
                    rec.end_time = now
                    continue
                try:
                    event = json.loads(data)
                except ValueError:
                    rec.error = f"malformed stream event: {_one_line(data, 200)}"
                    rec.end_time = now
                    return
                if not isinstance(event, dict):
                    continue
                if "error" in event or event.get("object") == "error":
                    rec.error = f"error in stream: {error_message(json.dumps(event))}"
                    rec.end_time = now
                    return
                for choice in event.get("choices") or []:
                    if not isinstance(choice, dict):
                        continue
                    text, is_token = _delta_text(choice, cfg.chat)
                    if text:
                        rec.chunk_times.append(now)
                        rec.generated_text += text
                        n_content += 1
                    if is_token:
                        token_times.append(now)
                    if choice.get("finish_reason") is not None:
                        finished = True
                    break  # one choice per request (n=1)
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
    if not done:
        rec.end_time = time.perf_counter()
    if isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens = usage["completion_tokens"]
        rec.output_tokens_from_usage = True
    else:
        rec.output_tokens = n_content
    if isinstance(usage.get("prompt_tokens"), int):
        rec.prompt_tokens = usage["prompt_tokens"]
    if n_events == 0:
        rec.error = (f"no server-sent events in the response (Content-Type "
                     f"{resp.headers.get('Content-Type', '?')}); does the server stream?")
        return
    if not (done or finished):
        rec.error = "stream ended before [DONE]"
        return
    if not rec.chunk_times:
        # Only tokens that decode to nothing (e.g. special tokens): time those chunks instead.
        rec.chunk_times = token_times if rec.output_tokens > 0 else []
    if not rec.chunk_times:
        rec.error = "no output received"
        return
    rec.success = True


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig, prompt: Prompt,
                       prompt_len: int, max_tokens: int, index: int = -1,
                       schema: Optional[dict[str, Any]] = None) -> RequestRecord:
    """Send one streamed request and return its record; never raises for server or network
    trouble (only for cancellation). ``prompt_len`` stands until the server's usage says."""
    rec = RequestRecord(index=index, prompt_tokens=prompt_len)
    try:
        body = build_payload(cfg, prompt, max_tokens, schema)
        await asyncio.wait_for(_stream(session, cfg, body, rec), timeout=cfg.timeout_s)
    except asyncio.TimeoutError:
        rec.error = f"timed out after {cfg.timeout_s:g} s"
    except aiohttp.ClientConnectorError as e:
        rec.error = f"connection failed: {_one_line(str(e))}"
    except aiohttp.ServerDisconnectedError:
        rec.error = "server disconnected"
    except aiohttp.ClientPayloadError as e:
        rec.error = f"stream broken: {_one_line(str(e) or type(e).__name__)}"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {_one_line(str(e))}"
    if rec.error:
        rec.success = False
        if not rec.start_time:
            rec.start_time = time.perf_counter()
        if rec.end_time < rec.start_time:
            rec.end_time = time.perf_counter()
    return rec


async def fetch_models(session: aiohttp.ClientSession, base_url: str,
                       headers: Optional[dict[str, str]] = None, timeout_s: float = 30.0) -> list[str]:
    """Model ids that ``/v1/models`` lists, in order. Raises ``RuntimeError`` (one line)."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=headers or {},
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"GET {url}: HTTP {resp.status}: {error_message(text)}")
            data = json.loads(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise RuntimeError(f"cannot reach {url}: {type(e).__name__}: {_one_line(str(e))}") from None
    except ValueError:
        raise RuntimeError(f"GET {url}: answer is not JSON") from None
    items = data.get("data") if isinstance(data, dict) else None
    ids = [m["id"] for m in items or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if not ids:
        raise RuntimeError(f"GET {url}: the server lists no models")
    return ids
