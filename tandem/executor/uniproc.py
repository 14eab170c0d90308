"""Runs the one worker inside the engine process.

Each step runs inline: ``execute_model`` launches it on the worker and hands back a future
whose ``result()`` waits for the step's host copy. On CUDA that is already asynchronous:
kernel launches return at once and the copy is awaited only when the engine reads the
future. On the CPU the forward itself runs inside ``execute_model``; async scheduling still
builds step N+1 before it applies step N's tokens. (A dedicated step thread would let a
CPU forward overlap the engine's Python work, but it fights the main thread for the GIL
and the cores and was measured slower; see ``benchmarks/RESULTS.md``.)
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Optional

from tandem.config import EngineConfig, ModelConfig
from tandem.executor.base import Executor
from tandem.types.grammar import GrammarOutput
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput
from tandem.worker.async_output import AsyncModelOutput
from tandem.worker.worker import resolve_worker_class


class _StepFuture(Future):
    """A launched step, resolved into its output on the first ``result()``: the host copy is
    waited on by the caller that needs the tokens, not when the step is launched.

    ``AsyncModelOutput.get()`` must run once (it releases its pinned buffer), and a future
    may be read from any thread, so the resolution is serialized by a lock.
    """

    def __init__(self, launched: AsyncModelOutput) -> None:
        super().__init__()
        self._launched = launched
        self._lock = threading.Lock()

    def result(self, timeout: Optional[float] = None) -> ModelRunnerOutput:  # type: ignore[override]
        with self._lock:
            if not self.done():
                try:
                    out = self._launched.get()
                except Exception as e:  # the worker's own error, re-raised below
                    self.set_exception(e)
                else:
                    self.set_result(out)
                # A KeyboardInterrupt while waiting is not the step's error: it propagates
                # with the future unresolved, and a later ``result()`` completes the step.
        return super().result()


class UniProcExecutor(Executor):
    in_process = True

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.worker = resolve_worker_class(config.worker_cls)(config, model_config)

    def execute_model(self, so: SchedulerOutput) -> "Future[Optional[ModelRunnerOutput]]":
        return self._launch(self.worker.execute_model, so, forward_only=bool(so.grammar_req_ids) and so.grammar is None)

    def prepare_model(self, so: SchedulerOutput) -> None:
        self.worker.prepare_model(so)

    def sample_tokens(self, grammar: GrammarOutput) -> "Future[ModelRunnerOutput]":
        return self._launch(self.worker.sample_tokens, grammar, forward_only=False)

    @staticmethod
    def _launch(call: Any, arg: Any, forward_only: bool) -> Future:
        try:
            launched = call(arg)
        except Exception as e:  # a launch error is the step's error, raised from its future
            failed: Future = Future()
            failed.set_exception(e)
            return failed
        # An interrupt (KeyboardInterrupt, SystemExit) is nobody's step error: kept in the
        # future, every later read of the step would raise it again and the engine could
        # never run another step. It propagates; the engine abandons the step.
        if forward_only:  # the forward is launched; the output comes from sample_tokens
            done: Future = Future()
            done.set_result(None)
            return done
        assert launched is not None, "the only rank is rank 0, which always reports its output"
        return _StepFuture(launched)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def check_health(self) -> None:
        """Nothing to check: the worker lives in this process, so if we run, it runs."""

    def shutdown(self) -> None:
        """Nothing to stop, but the worker's device memory is given back now."""
        self.worker.shutdown()
