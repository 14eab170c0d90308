"""Executors run steps on the workers: in this process, in worker processes, or on Ray actors."""
from tandem.executor.base import Executor, create_executor

__all__ = ["Executor", "create_executor"]
