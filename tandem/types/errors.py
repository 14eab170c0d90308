"""Errors that cross a process boundary, and the payload a remote exception travels as.

A worker (or the engine-core process) cannot send an exception object to its driver over
a typed channel; it sends ``ErrorPayload`` (type name, message, traceback text) and the
driver raises ``WorkerError`` from it, so the user sees the remote traceback.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass


@dataclass
class ErrorPayload:
    exc_type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> "ErrorPayload":
        return cls(type(exc).__name__, str(exc),
                   "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


class ExecutorError(RuntimeError):
    """The executor cannot run steps any more (a worker died, hung, or failed to start)."""


class WorkerDiedError(ExecutorError):
    """A worker process or actor is gone; every pending and later call fails with this."""


class WorkerTimeoutError(ExecutorError):
    """A worker did not answer within ``rpc_timeout_s``; it is treated as hung."""


class WorkerError(RuntimeError):
    """An exception raised inside a worker, carrying the worker's own traceback text."""

    def __init__(self, rank: int, method: str, payload: ErrorPayload) -> None:
        self.rank, self.method, self.exc_type = rank, method, payload.exc_type
        self.worker_traceback = payload.traceback
        super().__init__(f"worker rank {rank} raised {payload.exc_type} in {method}: {payload.message}\n"
                         f"--- worker traceback ---\n{payload.traceback.rstrip()}")
