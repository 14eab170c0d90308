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

from tandem.config import EngineConfig, ModelConfig
from tandem.types.errors import ExecutorError, WorkerDiedError, WorkerError, WorkerTimeoutError
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput

__all__ = ["Executor", "RemoteExecutor", "create_executor", "ExecutorError", "WorkerDiedError", "WorkerError",
           "WorkerTimeoutError"]


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


class RemoteExecutor(Executor):
    """Shared front of the executors whose workers live elsewhere (processes, Ray actors).

    Subclasses implement ``_call``: send one call to every rank and return a future that
    resolves to rank 0's result and carries every rank's in ``all_results``; it raises
    ``ExecutorError`` at once if the executor is already broken or shut down.
    """

    @abc.abstractmethod
    def _call(self, method: str, args: tuple, kwargs: dict) -> Future: ...

    def execute_model(self, so: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        """Send the step to every rank; never blocks. A broken executor returns a failed
        future, so the engine reports the step's requests as failed like any step error."""
        try:
            return self._call("execute_model", (so,), {})
        except ExecutorError as e:
            fut: Future = Future()
            fut.set_exception(e)
            return fut

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        fut = self._call(method, args, kwargs)
        fut.result()
        return fut.all_results  # type: ignore[attr-defined]


def create_executor(config: EngineConfig, model_config: ModelConfig) -> Executor:
    """The executor ``config.executor`` names; multiproc and ray import their extras lazily."""
    kind = config.resolved_executor
    if kind == "uniproc":
        from tandem.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, model_config)
    if kind == "multiproc":
        from tandem.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_config)
    if kind == "ray":
        from tandem.executor.ray_executor import RayExecutor

        return RayExecutor(config, model_config)
    raise ValueError(f"unknown executor {config.executor!r}")
