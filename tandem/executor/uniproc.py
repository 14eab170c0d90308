"""Runs the one worker inside the engine process.

Steps run inline by default and hand back a future whose ``result()`` waits for the step's
host copy. On CUDA that is already asynchronous: kernel launches return at once and the
copy is awaited only when the engine reads the future. ``step_thread=True`` instead runs
steps on one dedicated thread (FIFO, so they execute in the order scheduled), which lets a
CPU forward pass overlap the engine's Python work where torch releases the GIL.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from tandem.config import EngineConfig, ModelConfig
from tandem.executor.base import Executor
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput
from tandem.worker.async_output import AsyncModelOutput
from tandem.worker.worker import resolve_worker_class


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
    def __init__(self, config: EngineConfig, model_config: ModelConfig, step_thread: bool = False) -> None:
        self.worker = resolve_worker_class(config.worker_cls)(config, model_config)
        self._pool: Optional[ThreadPoolExecutor] = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-step")
            if step_thread and config.async_scheduling else None
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
        """Nothing to check: the worker lives in this process, so if we run, it runs."""

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
