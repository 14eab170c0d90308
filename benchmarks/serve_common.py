"""Helpers of the serving benchmarks: start/stop a real ``tandem serve`` process, make
token-id prompts, stream one completion, read /metrics.

Heavy imports stay inside functions so ``--help`` is instant.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

START_TIMEOUT_S = 900.0  # the first start converts the embedded GGUF (minutes on a busy CPU)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Optional[str], engine_args: list[str], log_path: str,
                 env: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, str]:
    """``python -m tandem.entrypoints.openai`` on a free loopback port (``env``: the server's
    environment, default this one); returns once /health is 200."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "tandem.entrypoints.openai", *([model] if model else []), "--port", str(port),
           *engine_args]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.close()
            tail = open(log_path, "rb").read()[-3000:].decode(errors="replace")
            raise RuntimeError(f"server exited with {proc.returncode}; {log_path} ends:\n{tail}")
        try:  # healthy, and every API-server process up (the launcher says "serving" last)
            if httpx.get(f"{url}/health", timeout=2).status_code == 200 and b"tandem: serving" in open(
                    log_path, "rb").read():
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not healthy within {START_TIMEOUT_S:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 120.0) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def random_prompts(vocab_size: int, n: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts away from the ends of the vocabulary (where special tokens live)."""
    rng = random.Random(seed)
    lo, hi = min(100, vocab_size // 4), vocab_size - min(100, vocab_size // 4)
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(n)]


@dataclass
class StreamResult:
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    chunks: int = 0
    disconnected: bool = False


async def stream_completion(client: Any, url: str, body: dict[str, Any],
                            disconnect_after: Optional[int] = None) -> StreamResult:
    """Stream one completion (``client``: an ``httpx.AsyncClient``); with ``disconnect_after``,
    close the connection after that many chunks, as a client that goes away would."""
    res = StreamResult()
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                res.error = data["error"]["message"]
                return res
            if data.get("usage"):
                res.completion_tokens = data["usage"]["completion_tokens"]
            for c in data["choices"]:
                res.chunks += 1
                res.finish_reason = c.get("finish_reason") or res.finish_reason
            if disconnect_after is not None and res.chunks >= disconnect_after:
                res.disconnected = True
                return res  # leaving the block closes the connection mid-stream
    return res


def read_metrics(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "python": sys.version.split()[0]}
