"""A server with an API key and a model slow enough to leave mid-request: auth, the loopback
bind, disconnects (streaming or not) that abort and free the KV blocks, and a SIGTERM with
requests in flight that ends every one of them and leaves no process behind."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from server_utils import ServerProcess, idle, wait_for

pytestmark = pytest.mark.timeout(600)

KEY = "sk-test-key"
LONG = {"prompt": "t5 t6 t7", "max_tokens": 450, "temperature": 0, "ignore_eos": True}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def srv(slow_model, tmp_path_factory):
    s = ServerProcess(slow_model, "--max-model-len", "512", "--num-kv-blocks", "256", "--served-model-name",
                      "slow", "alias", "--shutdown-timeout-s", "3", tmp=tmp_path_factory.mktemp("lifecycle"),
                      api_key=KEY)
    yield s
    s.stop()  # a no-op check if the SIGTERM test already stopped it


def aborted(m: dict[str, float]) -> float:
    return m.get("tandem:request_success_total{finished_reason=abort}", 0.0)


def test_api_key_guards_v1_only(srv):
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "t5", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    bad = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": KEY}).status_code == 401  # not Bearer
    models = httpx.get(f"{srv.url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["slow", "alias"]
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(srv.url + path).status_code == 200
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    r2 = c.completions.create(model="alias", prompt="t5", max_tokens=2)
    assert r2.model == "slow" and r2.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_binds_loopback_only(srv):
    """Without --host the listening socket is 127.0.0.1:port (/proc/net/tcp, state 0A = LISTEN)."""
    port = f"{srv.port:04X}"
    with open("/proc/net/tcp") as f:
        listening = [line.split()[1] for line in f.readlines()[1:] if line.split()[3] == "0A"]
    assert f"0100007F:{port}" in listening
    assert f"00000000:{port}" not in listening


def test_streaming_disconnect_aborts_and_frees_blocks(srv):
    before = wait_for(srv, idle)
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={**LONG, "stream": True}, headers=AUTH,
                      timeout=60) as s:
        seen = 0
        lines = s.iter_lines()  # held: dropping a half-read iterator would close the connection now
        for line in lines:
            seen += line.startswith("data: {")
            if seen == 3:
                break
        during = srv.metrics()
        assert during["tandem:num_requests_running"] == 1 and during["tandem:kv_cache_used_blocks"] > 0, during
    # Leaving the block closed the connection mid-stream.
    after = wait_for(srv, lambda m: idle(m) and aborted(m) > aborted(before), timeout_s=5)
    assert idle(after) and aborted(after) == aborted(before) + 1, after
    assert after["tandem:generation_tokens_total"] - before["tandem:generation_tokens_total"] < 450


def test_non_streaming_disconnect_aborts_and_frees_blocks(srv):
    before = wait_for(srv, idle)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=LONG, headers=AUTH, timeout=httpx.Timeout(10, read=2))
    after = wait_for(srv, lambda m: idle(m) and aborted(m) > aborted(before), timeout_s=5)
    assert idle(after) and aborted(after) == aborted(before) + 1, after
    assert after["tandem:generation_tokens_total"] - before["tandem:generation_tokens_total"] < 450


def test_sigterm_with_requests_in_flight(srv):
    """Every open request ends (finished, or cut with an error after --shutdown-timeout-s), the
    server exits 0, the engine core and every other child are gone, and no client hangs."""
    results: dict[int, str] = {}
    started = threading.Barrier(5)

    def stream(i: int) -> None:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=60)
        try:
            chunks = c.completions.create(model="slow", prompt="t5 t6", max_tokens=450, stream=True,
                                          extra_body={"ignore_eos": True})
            first = True
            for _ in chunks:
                if first:
                    started.wait(30)
                    first = False
            results[i] = "finished"
        except (openai.APIError, httpx.HTTPError) as e:
            results[i] = f"error: {type(e).__name__}"

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)  # every stream has its first chunk
    t0 = time.monotonic()
    assert srv.stop(signal.SIGTERM, timeout_s=60) == 0, srv.log.read_text()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert len(results) == 4, results
    assert time.monotonic() - t0 < 60
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health", timeout=5)
