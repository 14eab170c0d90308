"""Process checks shared by the leak guard in conftest and the executor tests (Linux /proc)."""
from __future__ import annotations

import os
import time


def live_children() -> dict[int, str]:
    """Live (non-zombie) processes whose parent is this test process, by pid -> command line."""
    me, found = os.getpid(), {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            if int(rest[1]) != me or rest[0] == "Z":
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                found[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
    return found


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone (possibly between open and read)
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
