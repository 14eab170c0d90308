"""The streaming client: SSE parsing, and records against a real local HTTP test double."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from openai_stub import FakeOpenAIServer, unused_port
from tandem.bench.client import ClientConfig, SSEDecoder, build_payload, error_message, fetch_models, send_request
from tandem.bench.records import RequestRecord

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- parsing


def test_sse_decoder_handles_any_split():
    stream = (b'data: {"a": 1}\n\n: ping\n\ndata: {"b": "\xc3\xa9"}\r\n\r\n'
              b"event: message\ndata: line1\ndata: line2\n\ndata:[DONE]\n\n")
    want = ['{"a": 1}', '{"b": "\u00e9"}', "line1\nline2", "[DONE]"]
    for step in (1, 2, 3, 7, len(stream)):
        dec = SSEDecoder()
        got = []
        for i in range(0, len(stream), step):
            got += dec.feed(stream[i:i + step])
        got += dec.flush()
        assert got == want, step


def test_sse_decoder_flushes_unterminated_event():
    dec = SSEDecoder()
    assert dec.feed(b'data: {"x": 1}') == []
    assert dec.flush() == ['{"x": 1}']
    assert dec.flush() == []


def test_error_message_forms():
    assert error_message('{"error": {"message": "too long", "type": "BadRequestError"}}') == "too long"
    assert error_message('{"object": "error", "message": "old vllm"}') == "old vllm"
    assert error_message('{"detail": [{"loc": ["body"], "msg": "field required"}]}').startswith('[{"loc"')
    assert error_message('{"error": "plain"}') == "plain"
    assert error_message("Internal\nServer Error") == "Internal Server Error"
    assert error_message("") == "(empty body)"


def test_payloads():
    cfg = ClientConfig(api_url="http://h/v1/completions", model="m", extra_body={"top_p": 0.5})
    body = build_payload(cfg, [1, 2, 3], 7)
    assert body == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "top_p": 0.5}
    chat = ClientConfig(api_url="http://h/v1/chat/completions", model="m", chat=True, ignore_eos=False,
                        temperature=0.7)
    body = build_payload(chat, "hi", 3)
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in body
    assert body["temperature"] == 0.7
    with pytest.raises(ValueError):
        build_payload(chat, [1, 2], 3)


# ----------------------------------------------------------------- against a real server


def run_requests(base_url: str, items: list[tuple[Any, int]], chat: bool = False, timeout_s: float = 10.0,
                 api_key: str | None = None) -> list[RequestRecord]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    cfg = ClientConfig(api_url=base_url + path, model="stub-model", chat=chat, timeout_s=timeout_s,
                       api_key=api_key)

    async def go() -> list[RequestRecord]:
        async with aiohttp.ClientSession() as s:
            return list(await asyncio.gather(*(send_request(s, cfg, p, 5, n, i) for i, (p, n) in enumerate(items))))

    return asyncio.run(go())


def check_ok(r: RequestRecord, n_tokens: int, prompt_tokens: int) -> None:
    assert r.success, r.error
    assert r.error == "" and r.status == 200
    assert r.output_tokens == n_tokens and r.output_tokens_from_usage
    assert r.prompt_tokens == prompt_tokens
    assert len(r.chunk_times) == n_tokens and len(r.itl) == n_tokens - 1
    assert r.generated_text == "".join(f" w{i}" for i in range(n_tokens))
    assert 0 < r.ttft <= r.e2el and r.start_time <= r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time
    assert all(g >= 0 for g in r.itl)
    assert r.tpot is not None and r.tpot > 0


@pytest.mark.parametrize("split", [False, True])
def test_completions_stream(split: bool):
    with FakeOpenAIServer(split_events=split) as srv:
        recs = run_requests(srv.base_url, [([1, 2, 3, 4], 6), ("t1 t2", 1)])
        body = srv.requests[0]
    check_ok(recs[0], 6, 4)
    assert recs[1].success and recs[1].output_tokens == 1 and recs[1].tpot is None and recs[1].prompt_tokens == 2
    assert recs[0].index == 0 and recs[1].index == 1
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 6 and body["temperature"] == 0.0


def test_chat_stream_ignores_role_chunk():
    with FakeOpenAIServer() as srv:
        recs = run_requests(srv.base_url, [("t1 t2 t3", 4)], chat=True)
        body = srv.requests[0]
    check_ok(recs[0], 4, 3)
    assert body["messages"] == [{"role": "user", "content": "t1 t2 t3"}]


def test_http_error_mid_stream_cut_and_stream_error():
    with FakeOpenAIServer() as srv:
        t0 = time.monotonic()
        bad, cut, err, no_done, no_stream, good = run_requests(srv.base_url, [
            ("BAD_REQUEST", 4), ("CUT", 8), ("STREAM_ERROR", 8), ("NO_DONE", 3), ("NO_STREAM", 2), ("t1", 3)])
        assert time.monotonic() - t0 < 5
    assert not bad.success and bad.status == 400
    assert bad.error == "HTTP 400: This model's maximum context length is 16 tokens."
    assert not cut.success and cut.error.startswith("stream broken") and len(cut.chunk_times) == 2
    assert not err.success and err.error == "error in stream: engine died" and len(err.chunk_times) == 1
    assert not no_done.success and no_done.error == "stream ended before [DONE]"
    assert no_done.output_tokens == 3 and not no_done.output_tokens_from_usage  # counted chunks
    assert not no_stream.success and no_stream.status == 200
    assert no_stream.error.startswith("no server-sent events in the response (Content-Type application/json")
    assert good.success  # the others did not disturb it
    for r in (bad, cut, err, no_done, no_stream):
        assert r.end_time >= r.start_time > 0


def test_timeout_never_hangs():
    with FakeOpenAIServer(slow_s=1.0) as srv:
        t0 = time.monotonic()
        (rec,) = run_requests(srv.base_url, [("SLOW", 3)], timeout_s=0.2)
        assert time.monotonic() - t0 < 0.9
    assert not rec.success and rec.error == "timed out after 0.2 s"
    assert 0.15 < rec.e2el < 0.9


def test_connection_refused():
    t0 = time.monotonic()
    (rec,) = run_requests(f"http://127.0.0.1:{unused_port()}", [("t1", 3)])
    assert time.monotonic() - t0 < 5
    assert not rec.success and rec.error.startswith("connection failed") and rec.status is None


def test_api_key_sent_as_bearer():
    with FakeOpenAIServer(api_key="sekrit") as srv:
        ok, denied = run_requests(srv.base_url, [("t1", 2)], api_key="sekrit")[0], \
            run_requests(srv.base_url, [("t1", 2)], api_key="wrong")[0]
        assert srv.headers[0]["Authorization"] == "Bearer sekrit"
    assert ok.success
    assert not denied.success and denied.error == "HTTP 401: invalid api key"


def test_fetch_models():
    async def go(url: str) -> list[str]:
        async with aiohttp.ClientSession() as s:
            return await fetch_models(s, url)

    with FakeOpenAIServer(model="my/model") as srv:
        assert asyncio.run(go(srv.base_url)) == ["my/model", "other-model"]
    with pytest.raises(RuntimeError, match="cannot reach"):
        asyncio.run(go(f"http://127.0.0.1:{unused_port()}"))
