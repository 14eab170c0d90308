"""The interface the engine uses to run steps, whatever runs the workers.

``execute_model`` never blocks on the step's results: it returns a future, so the engine
can schedule and launch step N+1 before reading step N. Contract for every executor:
every call gets exactly one reply, in call order; a worker error is raised from that
call's future (never swallowed, never turned into a hang).
"""
from __future__ import annotations

import abc
import traceback
from concurrent.futures import Future
from typing import Any

from tandem.core.sched_output import ModelRunnerOutput, SchedulerOutput


class ExecutorError(RuntimeError):
    """The executor cannot run steps any more (a worker died, hung, or failed to start)."""


class WorkerDiedError(ExecutorError):
    """A worker process or actor is gone; every pending and later call fails with this."""


class WorkerTimeoutError(ExecutorError):
    """A worker did not answer within ``rpc_timeout_s``; it is treated as hung."""


class WorkerError(RuntimeError):
    """An exception raised inside a worker, carrying the worker's own traceback text."""

    def __init__(self, rank: int, method: str, exc_type: str, message: str, traceback_text: str) -> None:
        self.rank, self.method, self.exc_type = rank, method, exc_type
        self.worker_traceback = traceback_text
        super().__init__(f"worker rank {rank} raised {exc_type} in {method}: {message}\n"
                         f"--- worker traceback ---\n{traceback_text.rstrip()}")


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


def error_payload(exc: BaseException) -> tuple[str, str, str]:
    """What a worker sends back for an exception: type name, message, full traceback text."""
    return type(exc).__name__, str(exc), "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


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


def create_executor(config, model_folder: str, max_model_len: int) -> Executor:
    """The executor ``config.executor`` names; multiproc and ray import their extras lazily."""
    kind = config.resolved_executor
    if config.tensor_parallel_size > 1:
        from tandem.distributed.parallel_state import check_tensor_parallel_shapes
        from tandem.models.loader import load_hf_config

        check_tensor_parallel_shapes(load_hf_config(model_folder), config.tensor_parallel_size)
    if kind == "uniproc":
        from tandem.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, model_folder, max_model_len)
    if kind == "multiproc":
        from tandem.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_folder, max_model_len)
    if kind == "ray":
        from tandem.executor.ray_executor import RayExecutor

        return RayExecutor(config, model_folder, max_model_len)
    raise ValueError(f"unknown executor {config.executor!r}")
