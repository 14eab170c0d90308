"""A Worker that misbehaves on request, for fault-injection tests of every executor.

Run it through ``EngineConfig(worker_cls="faulty_worker.FaultyWorker")`` (this folder must be
importable in the worker: multiproc workers get the driver's ``sys.path``; Ray actors need it
on ``PYTHONPATH``) and arm it with ``executor.collective_rpc("set_fault", kind, at_step, rank)``.
Steps are counted per worker from the moment the fault is armed; ``at_step=1`` means the next
``execute_model`` call.

Kinds: ``raise`` (an exception inside the step), ``kill`` (SIGKILL to itself mid-step, as
the OOM killer would), ``exit`` (``os._exit(3)``, as a segfaulting extension might end),
``hang`` (sleeps, as a stuck collective would), ``raise_in_sampling`` (an exception in the
``at_step``-th ``sample_tokens`` call, the second call of a constrained step).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

from tandem.worker.worker import Worker

FAULT_KINDS = ("raise", "kill", "exit", "hang", "raise_in_sampling")


class InjectedFault(RuntimeError):
    pass


class FaultyWorker(Worker):
    _fault: Optional[tuple[str, int]] = None
    _steps_since_armed = 0

    def set_fault(self, kind: str, at_step: int = 1, rank: Optional[int] = None) -> bool:
        """Arm ``kind`` to fire at this worker's ``at_step``-th next step (only on ``rank`` if given)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {FAULT_KINDS}")
        if rank is None or rank == self.rank:
            self._fault = (kind, at_step)
            self._steps_since_armed = 0
        return True

    def clear_fault(self) -> bool:
        self._fault = None
        return True

    def execute_model(self, so):
        self._count_towards_fault(so.step_id, sampling=False)
        return super().execute_model(so)

    def sample_tokens(self, grammar):
        self._count_towards_fault(grammar.step_id, sampling=True)
        return super().sample_tokens(grammar)

    def _count_towards_fault(self, step_id: int, sampling: bool) -> None:
        if self._fault is None or (self._fault[0] == "raise_in_sampling") != sampling:
            return
        self._steps_since_armed += 1
        kind, at = self._fault
        if self._steps_since_armed == at:
            self._fault = None
            self._fire(kind, step_id)

    def _fire(self, kind: str, step_id: int) -> None:
        if kind in ("raise", "raise_in_sampling"):
            raise InjectedFault(f"injected fault in rank {self.rank} at step {step_id}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "exit":
            os._exit(3)
        if kind == "hang":
            time.sleep(3600)

    def crash_now(self) -> None:
        """Die inside an RPC that is not a step (collective_rpc path)."""
        os.kill(os.getpid(), signal.SIGKILL)


class ExitsWhileStarting(Worker):
    """A worker whose process ends before it can report anything (a crash in a C extension
    while loading, the OOM killer): the driver must say so at once, not wait for READY."""

    def __init__(self, *args, **kwargs) -> None:
        os._exit(5)
