"""Read the README's fenced code blocks into runnable units, and run them as a user would.

A bash block becomes one ``Command`` per command: backslash continuations are joined, ``#``
comments dropped, and each line split on ``&&`` (shell quoting as ``shlex`` reads it; leading
``NAME=value`` words become the command's environment). Any other block (``python``, a plain
``````` block) is one ``Snippet``. The tests decide, per unit, whether to run it or skip it.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from proc_utils import descendants, pid_alive, wait_gone

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SHELL_LANGS = ("bash", "sh", "shell")
_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its info string (``""`` when none), its text and the README line
    number of its opening fence."""
    lang: str
    text: str
    line: int


@dataclass(frozen=True)
class Command:
    """One command of a shell block: ``argv`` after ``env`` assignments, and the whole
    logical source line it came from (several commands share a line joined by ``&&``)."""
    argv: tuple[str, ...]
    env: dict = field(default_factory=dict, compare=False, hash=False)
    source: str = ""
    line: int = 0

    def __str__(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), *map(shlex.quote, self.argv)])


@dataclass(frozen=True)
class Snippet:
    """A non-shell block, whole (a Python script, a text diagram)."""
    lang: str
    text: str
    line: int = 0

    def __str__(self) -> str:
        first = self.text.strip().splitlines()[0] if self.text.strip() else ""
        return f"```{self.lang} block at README line {self.line}: {first!r}"


Unit = Union[Command, Snippet]


def code_blocks(text: str) -> list[Block]:
    """Every fenced (```) code block of a Markdown text, in order. An unclosed fence is an error
    (a README that renders wrong should not pass silently)."""
    blocks, lang, start, body = [], None, 0, []
    for no, raw in enumerate(text.splitlines(), 1):
        m = _FENCE.match(raw.strip()) if raw.lstrip().startswith("```") else None
        if lang is None:
            if m:
                lang, start, body = m.group(1), no, []
        elif raw.strip() == "```":
            blocks.append(Block(lang, "\n".join(body) + "\n", start))
            lang = None
        else:
            body.append(raw)
    if lang is not None:
        raise ValueError(f"README line {start}: code block never closed")
    return blocks


def logical_lines(text: str) -> list[tuple[int, str]]:
    """A shell block's lines with backslash-newline continuations joined, each with the number
    (within the block, from 0) of its first physical line."""
    out, buf, first = [], "", 0
    for i, raw in enumerate(text.splitlines()):
        if not buf:
            first = i
        if raw.endswith("\\"):
            buf += raw[:-1] + " "
            continue
        out.append((first, buf + raw))
        buf = ""
    if buf:
        out.append((first, buf))
    return out


def shell_commands(block: Block) -> list[Command]:
    """The commands of one shell block: comments dropped, ``&&`` chains split, leading
    ``NAME=value`` words taken as the environment."""
    cmds = []
    for offset, line in logical_lines(block.text):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        chain: list[list[str]] = [[]]
        for w in words:
            if w == "&&":
                chain.append([])
            else:
                chain[-1].append(w)
        for part in chain:
            if not part:
                raise ValueError(f"README line {block.line + 1 + offset}: empty command in {line!r}")
            env = {}
            while part and _ENV_WORD.match(part[0]):
                k, v = part.pop(0).split("=", 1)
                env[k] = v
            cmds.append(Command(tuple(part), env, line.strip(), block.line + 1 + offset))
    return cmds


def readme_units(text: Optional[str] = None) -> list[Unit]:
    """Every command and snippet of the README (or of ``text``), in order."""
    units: list[Unit] = []
    for b in code_blocks(README.read_text() if text is None else text):
        if b.lang in SHELL_LANGS:
            units += shell_commands(b)
        else:
            units.append(Snippet(b.lang, b.text, b.line))
    return units


def option(argv, name: str) -> Optional[str]:
    """The value of ``--name VALUE`` (or ``--name=VALUE``) in ``argv``, or None."""
    argv = list(argv)
    for i, w in enumerate(argv):
        if w == name and i + 1 < len(argv):
            return argv[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def without(argv, *names: str) -> tuple[str, ...]:
    """``argv`` without the options ``names`` and their values (``--name VALUE`` form)."""
    out, skip = [], False
    for w in argv:
        if skip:
            skip = False
        elif w in names:
            skip = True
        else:
            out.append(w)
    return tuple(out)


# -- running ------------------------------------------------------------------------------

def user_path() -> str:
    """PATH with this interpreter's scripts folder first, so ``tandem`` is this install's."""
    return os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])


def tandem_exe() -> list[str]:
    """How to run ``tandem``: the console script, as a user would, when it is on PATH (this
    interpreter's own first); else ``python -m tandem.entrypoints.cli``."""
    exe = shutil.which("tandem", path=user_path())
    return [exe] if exe else [sys.executable, "-m", "tandem.entrypoints.cli"]


def resolve(argv) -> list[str]:
    """``argv`` with a leading ``tandem`` replaced by ``tandem_exe()``."""
    argv = list(argv)
    return tandem_exe() + argv[1:] if argv[:1] == ["tandem"] else argv


# The test machine runs other suites beside this one. Two OpenMP threads per process on two
# shared cores spin against each other: one decode step of the default model measured 1.7 s
# with two threads and 0.2 s with one, and a 16-prompt prefill 33 s (past the server's 30 s
# hang detection) against 8 s. One thread unless the caller's environment says otherwise.
THREAD_ENV = {"OMP_NUM_THREADS": "1"}


def run_env(extra: Optional[dict] = None) -> dict:
    """The environment for a README command: ours (``THREAD_ENV`` where we set nothing),
    PATH as in ``user_path``, plus ``extra``."""
    return {**THREAD_ENV, **os.environ, "PATH": user_path(), **(extra or {})}


def run(argv, timeout: float, cwd: Optional[Path] = None, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run a command (``tandem`` resolved), capturing text output; killed after ``timeout``."""
    return subprocess.run(resolve(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=run_env(env), stdin=subprocess.DEVNULL)


def run_python(source: str, path: Path, timeout: float) -> subprocess.CompletedProcess:
    """Write ``source`` to ``path`` and run it with this interpreter, as ``python path``."""
    path.write_text(source)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                          cwd=path.parent, env=run_env(), stdin=subprocess.DEVNULL)


def describe(r: subprocess.CompletedProcess) -> str:
    """A failed run, for an assertion message: the command, status and both outputs' tails."""
    return f"$ {shlex.join(map(str, r.args))}\nexit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n" \
           f"--- stderr\n{r.stderr[-4000:]}"


class BackgroundServer:
    """A README server command running in the background, its output in ``log``."""

    def __init__(self, argv, log: Path) -> None:
        self.argv = resolve(argv)
        self.log = log
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=run_env())
        self.family: list[int] = []

    def output(self) -> str:
        """What the server printed so far."""
        self._log_file.flush()
        return self.log.read_text(errors="replace")

    def wait_healthy(self, url: str, timeout: float) -> None:
        """Poll ``url`` until it answers 200; fail early if the server exits."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{shlex.join(self.argv)} exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    self.family = descendants(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{url} not healthy within {timeout:.0f} s:\n{self.output()}")

    def interrupt(self, timeout: float) -> tuple[int, list[int]]:
        """SIGINT, as Ctrl-C would; returns the exit status and the pids of processes it
        started that are still alive 15 s later."""
        family = sorted(set(self.family) | set(descendants(self.proc.pid)))
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout)
        return code, wait_gone(family, timeout=15)

    def kill(self) -> None:
        """Make sure nothing is left: SIGKILL the server and everything it started."""
        for p in sorted(set(self.family) | set(descendants(self.proc.pid))) + [self.proc.pid]:
            if pid_alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self._log_file.close()
