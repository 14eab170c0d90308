"""Process checks shared by the leak guard in conftest and the executor tests (Linux /proc)."""
from __future__ import annotations

import os
import socket
import time


def _live_parents() -> dict[int, int]:
    """pid -> parent pid of every live (non-zombie) process, from /proc."""
    parents = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone between listdir and open
        if rest[0] != "Z":
            parents[int(d)] = int(rest[1])
    return parents


def cmdline(pid: int) -> str:
    """The process's command line ('' once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    return [p for p, parent in _live_parents().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    kids: dict[int, list[int]] = {}
    for p, parent in _live_parents().items():
        kids.setdefault(parent, []).append(p)
    out, todo = [], [pid]
    while todo:
        found = kids.get(todo.pop(), [])
        out += found
        todo += found
    return out


def live_children() -> dict[int, str]:
    """Live (non-zombie) processes whose parent is this test process, by pid -> command line."""
    return {p: cmdline(p) for p in children_of(os.getpid())}


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
