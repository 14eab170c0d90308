"""The interface the engine uses to run steps, whatever runs the workers.

``execute_model`` never blocks on the step's results: it returns a future, so the engine
can schedule and launch step N+1 before reading step N. Contract for every executor:
every call gets exactly one reply, in call order; a worker error is raised from that
call's future (never swallowed, never turned into a hang). An interrupt (a
``BaseException`` that is not an ``Exception``: Ctrl-C, a signal handler's exception) is
nobody's step error: it propagates from ``execute_model`` itself, and the engine abandons
the step (``EngineCore._launch_next``).

A step with constrained requests (``SchedulerOutput.grammar_req_ids``) takes two calls:
``execute_model`` runs the forward pass only, its future resolving to None, and
``sample_tokens(GrammarOutput)`` — sent before the next step's ``execute_model`` — applies
the bitmask, samples, and its future resolves to the step's output. A gated step (its
``SchedulerOutput.grammar`` set; in-process executors only) is one call, as an
unconstrained step is: the worker samples behind the bitmask's gate.
"""
from __future__ import annotations

import abc
import logging
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, MutableMapping, Optional

from tandem.config import EngineConfig, ModelConfig
from tandem.interrupts import deferred_interrupts
from tandem.types.errors import ErrorPayload, ExecutorError, WorkerDiedError, WorkerError, WorkerTimeoutError
from tandem.types.grammar import GrammarOutput
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput

__all__ = ["Executor", "RemoteExecutor", "RemoteFuture", "create_executor", "ExecutorError", "WorkerDiedError",
           "WorkerError", "WorkerTimeoutError"]

logger = logging.getLogger(__name__)


class Executor(abc.ABC):
    # The worker runs in the engine's process: a step may carry objects that cannot travel
    # (a gated step's bitmask and its gate, ``SchedulerOutput.grammar``).
    in_process = False

    @abc.abstractmethod
    def execute_model(self, so: SchedulerOutput) -> "Future[Optional[ModelRunnerOutput]]":
        """Launch one step; the future resolves to its output (or raises its error) — to None
        for a constrained step, whose output comes from ``sample_tokens``."""

    def prepare_model(self, so: SchedulerOutput) -> None:
        """Optional: build step ``so``'s inputs now, before the sampling call of the step
        launched last; ``execute_model(so)`` follows that call and only launches. Never
        raises a step's error (``execute_model(so)``'s future does). Executors whose workers
        live elsewhere do nothing: their workers take calls in order on their own."""

    @abc.abstractmethod
    def sample_tokens(self, grammar: GrammarOutput) -> "Future[ModelRunnerOutput]":
        """Sample the constrained step whose forward ``execute_model`` launched last, with
        its bitmask; the future resolves to the step's output."""

    @abc.abstractmethod
    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every worker; one result per worker, in rank order."""

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...


class RemoteFuture(Future):
    """One call to every rank: resolves to rank 0's result, and ``all_results`` holds every
    rank's (in rank order) once it succeeded. Several threads may race to settle it (a
    reply, a death, a timeout, shutdown): the first wins, the others are no-ops."""

    def __init__(self, seq: int, method: str) -> None:
        super().__init__()
        self.seq = seq
        self.method = method
        self.all_results: Optional[list[Any]] = None

    def settle(self, value: Any = None, exc: Optional[BaseException] = None) -> bool:
        """Resolve unless already resolved; True if this call did it."""
        try:
            if exc is not None:
                self.set_exception(exc)
            else:
                self.set_result(value)
        except InvalidStateError:
            return False
        return True


class RemoteExecutor(Executor):
    """Shared front and failure path of the executors whose workers live elsewhere
    (processes, Ray actors).

    A subclass supplies how a call reaches the ranks (``_submit``), how its workers are
    stopped when the executor breaks (``_stop_workers``) and after an orderly shutdown
    (``_release``), and how to look for a dead rank (``_find_dead_rank``). Everything
    else is here, once: sequence numbers, the pending calls, the first failure (recorded
    and logged once, raised by every later call), the error messages, shutdown.

    Failure semantics: a dead worker (``WorkerDiedError``) or one that does not answer
    within ``rpc_timeout_s`` (``WorkerTimeoutError``) breaks the executor for good: every
    pending call fails with that error, later calls fail fast, and the workers are stopped
    so none is left blocked in a collective. A worker's exception (``WorkerError``) fails
    only its call while there is one rank; with tensor parallelism its peers are stuck in a
    collective that will never complete, so the executor breaks at once — reporting a
    dead peer as the cause when there is one (a peer's death usually surfaces first as a
    survivor's "connection reset").
    """

    SHUTDOWN_METHOD = "shutdown"

    def __init__(self, config: EngineConfig, pending: MutableMapping[int, RemoteFuture]) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.rpc_timeout_s = config.rpc_timeout_s
        self._lock = threading.Lock()
        self._pending = pending  # seq -> future of a call not answered yet
        self._next_seq = 0
        self._failure: Optional[ExecutorError] = None
        self._closed = False

    # -- what a subclass supplies ----------------------------------------------------------
    @abc.abstractmethod
    def _submit(self, seq: int, method: str, args: tuple, kwargs: dict) -> RemoteFuture:
        """Send call ``seq`` to every rank (under the executor's lock, so ranks see calls in
        ``seq`` order) and return its future."""

    @abc.abstractmethod
    def _stop_workers(self) -> None:
        """Stop every worker now (the executor is broken); must not wait long."""

    @abc.abstractmethod
    def _release(self, graceful: bool) -> None:
        """After shutdown: let the workers exit (``graceful``: they acknowledged the shutdown
        call, so they are on their way out; else nobody told them), then free everything."""

    @abc.abstractmethod
    def _find_dead_rank(self, fut: RemoteFuture) -> Optional[WorkerDiedError]:
        """With tensor parallelism, after a rank failed in ``fut``: a short look (about a
        second) for a rank that died, as the error to report, or None."""

    @property
    @abc.abstractmethod
    def worker_pids(self) -> list[Optional[int]]: ...

    @property
    def _started(self) -> bool:
        return bool(self.worker_pids) and all(p is not None for p in self.worker_pids)

    # -- calls -------------------------------------------------------------------------------
    def _call(self, method: str, args: tuple, kwargs: dict) -> RemoteFuture:
        """Send one call to every rank; raises the failure at once if the executor is broken.

        An interrupt is held while the call is numbered and sent: it is raised before the
        call or after every rank has it, never between ranks or between numbering and
        sending (which would leave the workers out of step for good)."""
        with deferred_interrupts(), self._lock:
            self._raise_if_unusable()
            seq = self._next_seq
            self._next_seq += 1
            fut = self._submit(seq, method, args, kwargs)
            self._pending[seq] = fut
        return fut

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise ExecutorError("the executor is shut down")

    def execute_model(self, so: SchedulerOutput) -> "Future[Optional[ModelRunnerOutput]]":
        """Send the step to every rank; never blocks. A broken executor returns a failed
        future, so the engine reports the step's requests as failed like any step error."""
        return self._step_call("execute_model", so)

    def sample_tokens(self, grammar: GrammarOutput) -> "Future[ModelRunnerOutput]":
        """Every rank gets the call (under tensor parallelism the LM head and the broadcast
        of the sampled ids are collectives); rank 0 alone reads the bitmask."""
        return self._step_call("sample_tokens", grammar)

    def _step_call(self, method: str, arg: Any) -> Future:
        try:
            return self._call(method, (arg,), {})
        except ExecutorError as e:
            fut: Future = Future()
            fut.set_exception(e)
            return fut

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        fut = self._call(method, args, kwargs)
        fut.result()
        return fut.all_results  # type: ignore[return-value]

    def _complete(self, fut: RemoteFuture, results: list[Any]) -> None:
        """Every rank answered ``fut``."""
        with self._lock:
            self._pending.pop(fut.seq, None)
        fut.all_results = results
        fut.settle(results[0])

    # -- the one failure path ----------------------------------------------------------------
    def _fail(self, err: ExecutorError) -> None:
        """Break the executor: record the first failure (logged once), fail every pending
        call with it, stop the workers."""
        with self._lock:
            if self._failure is None:
                self._failure = err
                logger.error("%s", err)
            err = self._failure
            pending = list(self._pending.values())
            self._pending.clear()
        for fut in pending:
            fut.settle(exc=err)
        self._stop_workers()

    def _on_worker_error(self, fut: RemoteFuture, rank: int, payload: ErrorPayload) -> None:
        """Rank ``rank`` raised in call ``fut`` (see the class docstring for what follows)."""
        summary = f"{payload.exc_type}: {payload.message}"
        if self.world_size > 1:
            death = self._find_dead_rank(fut)
            if death is not None:
                self._fail(WorkerDiedError(f"{death}; rank {rank} then failed in {fut.method}: {summary}"))
                return
        with self._lock:
            self._pending.pop(fut.seq, None)
        fut.settle(exc=WorkerError(rank, fut.method, payload))
        if self.world_size > 1:
            self._fail(ExecutorError(f"tensor-parallel rank {rank} failed in {fut.method}; its peers are out "
                                     f"of step, so the executor stops: {summary}"))

    def _on_timeout(self, fut: RemoteFuture, missing: list[int]) -> None:
        self._fail(WorkerTimeoutError(
            f"worker rank(s) {missing} did not answer {fut.method} (call #{fut.seq}) within "
            f"{self.rpc_timeout_s:g} s (rpc_timeout_s); treating them as hung"))

    def _death(self, rank: int, how: str) -> WorkerDiedError:
        """The error for rank ``rank`` having died (``how``: "was killed by SIGKILL", ...)."""
        pids = self.worker_pids
        pid = pids[rank] if rank < len(pids) else None
        return WorkerDiedError(f"worker rank {rank} (pid {pid}) {how}; the executor cannot run more steps")

    def check_health(self) -> None:
        with self._lock:
            self._raise_if_unusable()

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask the workers to exit (one more call, one more reply each), fail what is still
        pending, then release everything. Idempotent; logs nothing unless a worker could
        not say goodbye."""
        if self._closed:
            return
        graceful = False
        if self._failure is None and self._started:
            try:
                self._call(self.SHUTDOWN_METHOD, (), {}).result(timeout=10)
                graceful = True
            except Exception as e:  # a worker that cannot say goodbye is stopped by _release
                logger.warning("workers did not acknowledge shutdown (%r); stopping them", e)
        with self._lock:
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
        for fut in pending:
            fut.settle(exc=ExecutorError("the executor was shut down"))
        self._release(graceful)


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
