"""Ctrl-C that cannot tear the engine's bookkeeping in half.

A ``KeyboardInterrupt`` can be raised between any two bytecodes. Raised between
``Scheduler.schedule()`` and queueing the launched step, or inside ``update_from_output``,
it leaves requests counted as in flight in a step nobody will ever complete, and their KV
blocks are never freed (every interrupt leaked a few; enough of them starved the cache).
``deferred_sigint`` holds SIGINT for the few milliseconds of such a section and raises it
when the section is done, so the interrupt lands between consistent states. Waiting for a
step's output stays interruptible: the engine puts the step back before re-raising.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold SIGINT until the block ends, then raise ``KeyboardInterrupt``.

    Only in the main thread and only while Python's default SIGINT handler is installed
    (a program with its own handler keeps it untouched)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        received.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            raise KeyboardInterrupt
