"""Shared by the executor tests: the engine settings they compare, and process checks."""
from __future__ import annotations

import time

VOCAB = 128
BASE = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=512)
SETTINGS = {
    "default": dict(),
    "preempt+chunked": dict(num_kv_blocks=40, max_num_batched_tokens=12),
}
FAULTY = "faulty_worker.FaultyWorker"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout: float = 15.0) -> list[int]:
    """Wait for every pid to exit; returns the ones still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]
