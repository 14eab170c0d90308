"""The worker's call protocol in one process: the allow-list, and every argument decoded into
the type its parameter declares (so a call can carry nothing a method does not take)."""
from __future__ import annotations

from typing import Any, Optional

import msgspec
import pytest

from tandem.ipc import decode, encode
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput
from tandem.worker.worker import Worker
from tandem.worker.worker_process import Call, MethodTable


class _Echo(Worker):
    """A worker that builds nothing and echoes what it was called with."""

    def __init__(self) -> None:  # no device, no weights
        pass

    def execute_model(self, so):  # unannotated override: the base class's annotation applies
        return so

    def mixed(self, a: int, *rest: str, b: float = 1.0, **flags: bool) -> tuple:
        return a, rest, b, flags

    def untyped(self, x):
        return x


def _wire(method: str, *args, **kwargs) -> Call:
    """A call as the worker receives it: encoded by the driver, decoded here."""
    return decode(encode(Call.of(0, method, args, kwargs)), Call)


@pytest.mark.timeout(30)
def test_arguments_arrive_as_the_declared_types():
    table, worker = MethodTable(_Echo), _Echo()
    so = table.invoke(worker, _wire("execute_model", SchedulerOutput(step_id=3, requests=[])))
    assert isinstance(so, SchedulerOutput) and so.step_id == 3
    assert table.invoke(worker, _wire("mixed", 1, "x", "y", b=2, on=True)) == (1, ("x", "y"), 2.0, {"on": True})
    assert table.invoke(worker, _wire("untyped", {"k": [1, 2]})) == {"k": [1, 2]}  # Any: plain data only


@pytest.mark.timeout(30)
def test_wrong_arguments_fail_like_a_local_call():
    table, worker = MethodTable(_Echo), _Echo()
    with pytest.raises(msgspec.ValidationError):
        table.invoke(worker, _wire("execute_model", {"step_id": "not an int", "requests": []}))
    with pytest.raises(msgspec.ValidationError):
        table.invoke(worker, _wire("mixed", "one"))
    with pytest.raises(TypeError):
        table.invoke(worker, _wire("execute_model"))


@pytest.mark.timeout(30)
def test_only_public_methods_are_callable():
    table = MethodTable(_Echo)
    assert table.allowed("execute_model") and table.allowed("get_pid")
    for name in ("__init__", "__class__", "__reduce__", "_private", "no_such_method", "config"):
        assert not table.allowed(name)
        with pytest.raises(AttributeError, match="not a method _Echo exposes"):
            table.invoke(_Echo(), _wire(name))


@pytest.mark.timeout(30)
def test_results_decode_into_what_worker_declares():
    table = MethodTable(Worker)
    assert table.result_type("execute_model") == Optional[ModelRunnerOutput]  # AsyncModelOutput resolved
    assert table.result_type("get_pid") is int
    assert table.result_type("set_fault") is Any  # a subclass's own method: plain data
