"""Starting a child process through tandem's own entry point, and the child's half of it.

Why not ``multiprocessing``: its spawn start method re-imports the parent's ``__main__`` in
every child, so a script fed on stdin fails (``FileNotFoundError: '<stdin>'``) and a script
without an ``if __name__ == "__main__":`` guard starts children recursively. A child
started here is ``python -m <module> <args>``: it runs tandem's module, never the user's.

The secret travels on the child's stdin, never on argv or in the environment (any user can
read ``/proc/<pid>/cmdline``, and the environment is inherited by everything the child
starts). Stdin then stays open as the parent-death pipe: the parent writes nothing more and
closes it only when done with the child, so the child reading EOF means its parent exited
or was killed — including by SIGKILL, which no handler in the parent can catch.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from typing import Callable, Optional

from tandem.ipc.endpoints import SECRET_BYTES

__all__ = ["start_child", "read_secret", "exit_with_parent"]

logger = logging.getLogger(__name__)

_STDIN = 0


def _package_root() -> str:
    """The folder that holds the ``tandem`` package, so the child imports this very copy."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_child(module: str, args: list[str], secret: bytes, *, env: Optional[dict[str, str]] = None,
                stdout: Optional[int] = None) -> subprocess.Popen:
    """Start ``python -m module *args`` with ``secret`` on its stdin (kept open, see the
    module docstring). ``stdout`` is passed to ``Popen`` (a file descriptor, say 2 to keep
    the parent's stdout clean); stderr is inherited, so the child's crashes stay visible.

    The child gets a session of its own: a Ctrl-C in the terminal signals the terminal's
    foreground process group, and a child still importing torch would die of it with a
    traceback before it could ignore SIGINT. The parent owns its children's lifetime (it
    stops them; they exit when it dies, by stdin EOF), so only the parent hears the Ctrl-C."""
    if not sys.executable:
        raise RuntimeError("sys.executable is unknown: cannot start a child Python process")
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    child_env = dict(os.environ if env is None else env)
    paths = [_package_root()] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    child_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=stdout,
                            env=child_env, close_fds=True, start_new_session=True)
    stdin = proc.stdin
    assert stdin is not None  # stdin=PIPE
    try:
        stdin.write(secret)  # 32 bytes into an empty pipe: never blocks
        stdin.flush()
    except BrokenPipeError:  # the child died at once; the caller sees its exit status
        logger.debug("child %d closed its stdin before reading the secret", proc.pid)
    return proc


def read_secret() -> bytes:
    """In the child: the secret its parent wrote on stdin (exactly ``SECRET_BYTES``)."""
    data = b""
    while len(data) < SECRET_BYTES:
        chunk = os.read(_STDIN, SECRET_BYTES - len(data))
        if not chunk:
            raise EOFError("stdin closed before the secret arrived: start this module through "
                           "tandem.ipc.child.start_child")
        data += chunk
    return data


def exit_with_parent(cleanup: Callable[[], None]) -> threading.Thread:
    """In the child: a daemon thread that waits for EOF on stdin (the parent is gone or done),
    runs ``cleanup`` (best effort) and ends the process at once with ``os._exit``, so a
    child never outlives its parent even while its main thread is blocked."""

    def watch() -> None:
        try:
            while os.read(_STDIN, 4096):
                pass
        except OSError:
            pass
        try:
            cleanup()
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="tandem-parent-watch", daemon=True)
    thread.start()
    return thread
