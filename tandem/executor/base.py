"""The interface the engine uses to run steps, whatever runs the workers.

``execute_model`` never blocks on the step's results: it returns a future, so the engine
can schedule and launch step N+1 before reading step N. Contract for every executor:
every call gets exactly one reply, in call order; a worker error is raised from that
call's future (never swallowed, never turned into a hang).
"""
from __future__ import annotations

import abc
from concurrent.futures import Future
from typing import Any

from tandem.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    @abc.abstractmethod
    def execute_model(self, so: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        """Launch one step; the future resolves to its output (or raises its error)."""

    @abc.abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every worker; one result per worker, in rank order."""

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...


def create_executor(config, model_folder: str, max_model_len: int) -> Executor:
    from tandem.executor.uniproc import UniProcExecutor

    if config.executor == "uniproc":
        return UniProcExecutor(config, model_folder, max_model_len)
    raise ValueError(f"unknown executor {config.executor!r}")
