"""Runs the one worker inside the engine process.

Synchronous mode runs each step inline and hands back an already-completed future. Async
mode runs steps on one dedicated thread (FIFO, so steps execute in the order scheduled):
on the CPU the forward pass then overlaps the engine's Python work (torch releases the GIL
in its kernels); on CUDA the thread only launches kernels and the host copy is awaited
when the engine reads the future.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from tandem.config import EngineConfig
from tandem.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tandem.executor.base import Executor
from tandem.worker.model_runner import AsyncModelOutput
from tandem.worker.worker import Worker


class _StepFuture(Future):
    """Resolves a launched step into its output on first ``result()``: the host copy is
    waited on by the caller that needs the tokens, not by the thread that launched it."""

    def __init__(self, launched: "Future[AsyncModelOutput]") -> None:
        super().__init__()
        self._launched = launched
        self._lock = threading.Lock()

    def result(self, timeout: Optional[float] = None) -> ModelRunnerOutput:  # type: ignore[override]
        with self._lock:
            if not self.done():
                try:
                    self.set_result(self._launched.result(timeout).get())
                except BaseException as e:  # the worker's own error, re-raised below
                    self.set_exception(e)
        return super().result()


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, model_folder: str, max_model_len: int) -> None:
        self.worker = Worker(config, model_folder, max_model_len)
        self._pool: Optional[ThreadPoolExecutor] = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-step") if config.async_scheduling else None
        )

    def execute_model(self, so: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        if self._pool is None:
            launched: Future = Future()
            try:
                launched.set_result(self.worker.execute_model(so))
            except BaseException as e:
                launched.set_exception(e)
        else:
            launched = self._pool.submit(self.worker.execute_model, so)
        return _StepFuture(launched)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def check_health(self) -> None:
        self.worker.check_health()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
