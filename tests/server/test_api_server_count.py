"""``tandem serve --api-server-count 2``: two API-server processes over one engine core.

Both processes serve (each answers requests and spends CPU), a greedy answer is the same
whichever answers, /metrics from either counts every request of both, aborts and client
disconnects leave no KV block held (also under a 1,000-request soak), neither API-server
process imports torch, and the server lives and dies as one: Ctrl-C stops every process,
a dead API server or a dead engine core takes the whole server down with status 1.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

from proc_utils import children_of, cmdline, descendants, wait_gone
from server_utils import ServerProcess, idle, wait_for

pytestmark = pytest.mark.timeout(600)

ARGS = ("--api-server-count", "2", "--max-model-len", "256", "--num-kv-blocks", "512", "--block-size", "16",
        "--max-num-seqs", "64")


def api_servers(srv: ServerProcess) -> list[int]:
    return [p for p in children_of(srv.proc.pid) if "tandem.entrypoints.openai.server_process" in cmdline(p)]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def complete(url: str, body: dict) -> tuple[str, dict]:
    """One request on a fresh connection (the kernel picks the process per connection)."""
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-tandem-api-server"], r.json()


@pytest.fixture(scope="module")
def server2(tiny_llama, tmp_path_factory):
    s = ServerProcess(tiny_llama, *ARGS, tmp=tmp_path_factory.mktemp("server2"))
    yield s
    assert s.stop(signal.SIGINT) == 0, s.log.read_text()  # Ctrl-C: every process stops, nothing left (stop checks)


def test_two_processes_no_torch_in_them(server2):
    pids = api_servers(server2)
    assert len(pids) == 2
    for pid in [server2.proc.pid, *pids]:  # the launcher and the API servers
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read(), cmdline(pid)
    log = server2.log.read_text()
    assert "2 API-server processes" in log
    assert log.count(" ready in ") == 2 and "torch imported" not in log, log  # each process's own report


def test_both_serve_and_answer_alike(server2):
    pids = api_servers(server2)
    cpu_before = {p: cpu_seconds(p) for p in pids}
    body = {"prompt": "t5 t6 t7", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    answers: dict[str, list[str]] = {}
    for _ in range(40):
        index, out = complete(server2.url, body)
        answers.setdefault(index, []).append(out["choices"][0]["text"])
    assert set(answers) == {"1", "2"}, answers  # both processes answered (the kernel spreads connections)
    assert min(len(v) for v in answers.values()) >= 3, {k: len(v) for k, v in answers.items()}
    assert len({t for v in answers.values() for t in v}) == 1, answers  # the same greedy text from each
    for p in pids:
        assert cpu_seconds(p) > cpu_before[p], "an API-server process did no work"


def test_metrics_count_every_request_of_both(server2):
    before = wait_for(server2, idle)["tandem:request_success_total{finished_reason=length}"]
    served = set()
    for i in range(16):
        index, _ = complete(server2.url, {"prompt": f"t{10 + i}", "max_tokens": 3, "ignore_eos": True})
        served.add(index)
    assert served == {"1", "2"}
    readings = set()
    for _ in range(6):  # scrapes land on both processes; each reports the whole server
        with httpx.Client(timeout=10) as c:
            r = c.get(f"{server2.url}/metrics")
        readings.add(r.headers["x-tandem-api-server"])
        text = r.text
        line = next(x for x in text.splitlines()
                    if x.startswith("tandem:request_success_total") and 'finished_reason="length"' in x)
        assert float(line.rsplit(" ", 1)[1]) == before + 16, line
    m = wait_for(server2, idle)
    assert m["tandem:generation_tokens_total"] >= 48 and m["tandem:kv_cache_used_blocks"] == 0


async def _soak(url: str, n: int, concurrency: int, share_leaving: float, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    counts = {"completed": 0, "left": 0, "errors": 0}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)  # new connection each time
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(i: int) -> None:
            leave_after = rng.randint(1, 7) if rng.random() < share_leaving else None
            body = {"prompt": [5 + i % 50, 6], "max_tokens": 8, "temperature": 0.8, "seed": i, "ignore_eos": True,
                    "stream": True}
            async with sem:
                chunks = 0
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        counts["errors"] += 1
                        return
                    async for line in r.aiter_lines():
                        if line.startswith('data: {"error"'):
                            counts["errors"] += 1
                            return
                        if line.startswith("data: {"):
                            chunks += 1
                            if leave_after is not None and chunks >= leave_after:
                                counts["left"] += 1
                                return  # leaving the block closes the connection mid-stream
                counts["completed" if chunks == 8 else "errors"] += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return counts


def test_disconnects_and_soak_leak_no_blocks(server2):
    counts = asyncio.run(_soak(server2.url, 1000, 32, 0.2))
    assert counts["errors"] == 0, counts
    assert counts["completed"] + counts["left"] == 1000 and counts["left"] > 100, counts
    m = wait_for(server2, idle, timeout_s=30)
    assert m["tandem:kv_cache_used_blocks"] == 0 and m["tandem:num_requests_running"] == 0, m
    assert m["tandem:num_requests_waiting"] == 0


async def _stream_until_error(url: str, results: list[str], started: asyncio.Semaphore) -> None:
    body = {"prompt": "t5 t6", "max_tokens": 240, "ignore_eos": True, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                first = True
                async for line in r.aiter_lines():
                    if first and line.startswith("data: {"):
                        first = False
                        started.release()
                    if line.startswith('data: {"error"'):
                        results.append("error")
                        return
        results.append("finished")
    except httpx.HTTPError as e:
        results.append(f"error: {type(e).__name__}")


def test_dead_engine_core_fails_requests_and_stops_the_server(slow_model, tmp_path):
    srv = ServerProcess(slow_model, *ARGS, tmp=tmp_path)
    family = [srv.proc.pid] + descendants(srv.proc.pid)
    try:
        async def main() -> list[str]:
            results: list[str] = []
            started = asyncio.Semaphore(0)
            tasks = [asyncio.ensure_future(_stream_until_error(srv.url, results, started)) for _ in range(6)]
            for _ in range(6):
                await asyncio.wait_for(started.acquire(), 120)
            os.kill(srv.core_pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return results

        results = asyncio.run(main())
        assert len(results) == 6 and all(r.startswith("error") for r in results), results
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
    log = srv.log.read_text()
    assert "engine core process" in log and "killed by SIGKILL" in log, log
    assert not wait_gone(family, timeout=15)


def test_dead_api_server_stops_the_server(tiny_llama, tmp_path):
    srv = ServerProcess(tiny_llama, *ARGS, tmp=tmp_path)
    family = [srv.proc.pid] + descendants(srv.proc.pid)
    try:
        victim = api_servers(srv)[0]
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        assert srv.proc.wait(60) == 1
        assert time.monotonic() - t0 < 30
    finally:
        srv.stop()
    assert f"(pid {victim}) exited with code -9: stopping the server" in srv.log.read_text()
    assert not wait_gone(family, timeout=15)
