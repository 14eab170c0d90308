"""Interrupts that cannot tear the engine's bookkeeping in half.

A signal handler (Python's own for Ctrl-C, or a program's: a ``SIGALRM`` timeout that raises
``KeyboardInterrupt``) runs between any two bytecodes of the main thread, and what it raises
surfaces there. Raised between ``Scheduler.schedule()`` and queueing the launched step, or
inside ``update_from_output``, it leaves requests counted as in flight in a step nobody will
ever complete, and their KV blocks are never freed; raised between two ranks' sends, it
leaves the workers out of step. Such sections run inside ``deferred_interrupts()``: a signal
that arrives there is held and its handler runs when the section ends, so the exception lands
between consistent states. Everything that takes time (a forward pass, waiting for a step)
stays interruptible; the engine puts that state right itself before re-raising.

Handlers only run in the main thread, so only the main thread's sections hold them. Holding
needs the signal routed through this module's gate: ``gated_signals()`` routes every signal
that has a Python handler for the span of a call (``LLM.generate``), which makes each section
cost a counter; a section outside such a span routes SIGINT alone, for its own duration.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType, TracebackType
from typing import Any, Callable, Iterable, Iterator, Optional

_Handler = Callable[[int, Optional[FrameType]], Any]


class _Gate:
    """Where routed signals arrive: passed on to their own handler at once, or held while
    the main thread is inside a section and passed on when it leaves."""

    def __init__(self) -> None:
        self.handlers: dict[int, _Handler] = {}  # routed signal -> the handler it had
        self.depth = 0  # main-thread sections entered and not left
        self.held: list[tuple[int, Optional[FrameType]]] = []

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.depth:
            self.held.append((signum, frame))
        else:
            self.handlers[signum](signum, frame)

    def route(self, signals: Iterable[int]) -> dict[int, _Handler]:
        """Route those of ``signals`` that have a Python handler; returns what was routed."""
        routed: dict[int, _Handler] = {}
        for s in signals:
            h = signal.getsignal(s)
            if callable(h) and h is not self:
                routed[s] = h
        for s, h in routed.items():
            signal.signal(s, self)
            self.handlers[s] = h
        return routed

    def unroute(self, routed: dict[int, _Handler]) -> None:
        for s, h in routed.items():
            signal.signal(s, h)
            del self.handlers[s]

    def release(self) -> None:
        """Run the held handlers (the first that raises wins; the rest are dropped)."""
        held, self.held = self.held, []
        for signum, frame in held:
            h = self.handlers.get(signum) or signal.getsignal(signum)
            if callable(h):
                h(signum, frame)


_GATE = _Gate()
_MAIN = threading.main_thread()


@contextlib.contextmanager
def gated_signals() -> Iterator[None]:
    """Route every signal that has a Python handler through the gate while the block runs
    (main thread only; a nested call does nothing). The handlers themselves are unchanged:
    each runs as before, only never inside a section."""
    if threading.current_thread() is not _MAIN or _GATE.handlers:
        yield
        return
    routed = _GATE.route(signal.valid_signals())
    try:
        yield
    finally:
        _GATE.unroute(routed)


class deferred_interrupts:
    """``with deferred_interrupts(): ...``: hold routed signals until the block ends, then run
    their handlers (whatever they raise is raised there). Nests; a no-op outside the main
    thread."""

    __slots__ = ("_routed", "_main")

    def __enter__(self) -> None:
        self._main = threading.current_thread() is _MAIN
        self._routed: Optional[dict[int, _Handler]] = None
        if self._main:
            if not _GATE.handlers:
                self._routed = _GATE.route((signal.SIGINT,))
            _GATE.depth += 1

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if not self._main:
            return
        _GATE.depth -= 1
        if _GATE.depth:
            return
        try:
            _GATE.release()
        finally:
            if self._routed:
                _GATE.unroute(self._routed)
