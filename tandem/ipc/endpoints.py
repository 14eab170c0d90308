"""Private IPC endpoints: socket files in a directory only this user can enter, and a secret.

Why a directory and not Linux's abstract socket namespace (``ipc://@name``): abstract
sockets carry no permissions, so any local user in the same network namespace can connect.
A socket *file* inside a ``0700`` directory cannot even be reached by path by another user
(the kernel checks search permission on the directory before ``connect``). The secret
then separates this engine from other processes of the *same* user (see ``channel.py``).

The directory lives under ``$XDG_RUNTIME_DIR`` (per-user, tmpfs, removed at logout) when
it is set and short enough for a socket path, else under the temp dir (``/tmp``).
"""
from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
from typing import Optional

__all__ = ["PrivateDir", "new_secret", "runtime_base", "SECRET_BYTES", "DIR_PREFIX"]

SECRET_BYTES = 32
DIR_PREFIX = "tandem-ipc-"
# sun_path holds 108 bytes on Linux (104 on macOS); leave room for the socket's own name.
_MAX_DIR_LEN = 80


def new_secret() -> bytes:
    """A fresh random secret for one engine's channels (``secrets``: a CSPRNG)."""
    return secrets.token_bytes(SECRET_BYTES)


def runtime_base() -> str:
    """Where private endpoint directories are created (see the module docstring)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK) and len(xdg) < _MAX_DIR_LEN - 20:
        return xdg
    return tempfile.gettempdir()


class PrivateDir:
    """A ``0700`` directory holding one engine's socket files; ``address(name)`` is the
    ZeroMQ endpoint of socket ``name`` in it. ``remove()`` deletes it (idempotent)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def create(cls, base: Optional[str] = None) -> "PrivateDir":
        """mkdtemp creates the directory with mode 0700 atomically (no window where it is
        open to others); the mode is checked anyway, since an odd filesystem could ignore it."""
        path = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=base or runtime_base())
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode != 0o700:
            shutil.rmtree(path, ignore_errors=True)
            raise PermissionError(f"private IPC directory {path} has mode {mode:o}, expected 700")
        return cls(path)

    def address(self, name: str) -> str:
        if "/" in name or not name:
            raise ValueError(f"endpoint name must be a plain file name, got {name!r}")
        return f"ipc://{os.path.join(self.path, name)}"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __repr__(self) -> str:
        return f"PrivateDir({self.path!r})"
