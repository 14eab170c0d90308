"""Start the real server (``python -m tandem.entrypoints.openai``) on a loopback port, find its
engine-core process, read its /metrics, stop it and check that nothing is left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proc_utils import children_of, cmdline, descendants, free_port, pid_alive, wait_gone

# The tiny test tokenizer has no chat template: a plain one that shows every message (and, when
# a request gives them, a `hint` from chat_template_kwargs, the documents' texts, and t30 / t31
# for enable_thinking true / false).
CHAT_TEMPLATE = ("{% if hint is defined %}{{ hint }} {% endif %}{% for d in documents or [] %}{{ d['text'] }} "
                 "{% endfor %}{% if enable_thinking is defined %}{{ 't30' if enable_thinking else 't31' }} {% endif %}"
                 "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} t2 {% endfor %}"
                 "{% if add_generation_prompt %}t3{% endif %}")
START_TIMEOUT_S = 300.0  # a loaded two-core machine can take minutes to import torch twice


class ServerProcess:
    """One server process; ``stop()`` sends a signal and checks the exit and the leftovers."""

    def __init__(self, model: str, *args: str, tmp: Path, api_key: Optional[str] = None,
                 chat_template: bool = True) -> None:
        """``model=""``: the embedded default; ``chat_template``: give the test template."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tandem.entrypoints.openai", *([model] if model else []),
               "--port", str(self.port), *args]
        if chat_template:
            template = tmp / "template.jinja"
            template.write_text(CHAT_TEMPLATE)
            cmd += ["--chat-template", str(template)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = tmp / f"server-{self.port}.log"
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT)
        self._wait_healthy()
        cores = [p for p in children_of(self.proc.pid) if "tandem.engine.core_process" in cmdline(p)]
        assert len(cores) == 1, f"expected one engine-core process, found {cores}"
        self.core_pid = cores[0]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:  # healthy, and every API-server process up (the launcher says "serving" last)
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200 \
                        and "tandem: serving" in self.log.read_text():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise RuntimeError(f"server not healthy within {START_TIMEOUT_S} s:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels other than model_name folded into the name)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal the server; return its exit code once it and every process it started are gone."""
        family = [self.proc.pid] + descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                for p in family:
                    _kill(p)
            self._log_file.close()
        left = wait_gone([p for p in family if p != self.proc.pid], timeout=15)
        assert not left, f"processes left behind by the server: {left}"
        return code


def _kill(pid: int) -> None:
    if pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(server: ServerProcess, cond: Callable[[dict[str, float]], bool],
             timeout_s: float = 10.0) -> dict[str, float]:
    """The first /metrics reading that satisfies ``cond`` (the last stats arrive a step later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if cond(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def idle(m: dict[str, float]) -> bool:
    """No request running, no KV block held."""
    return m["tandem:num_requests_running"] == 0 and m["tandem:kv_cache_used_blocks"] == 0
