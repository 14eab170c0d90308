"""Gated sampling's paced wait for a step's ids (``TANDEM_GATED_WAIT=paced``): the fill
thread sleeps through the part of the wait that earlier steps say is certain, spins for the
rest, never returns before the ids are there, and sleeps less once a sleep overshoots."""
from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from tandem.config import EnvSwitches
from tandem.structured_output.gated import GatedFills, WaitPacer

pytestmark = pytest.mark.timeout(60)


class DeviceStep(Future):
    """A step whose ids reach the host ``wait_s`` after it is made; ``result()`` spins
    until then, as CUDA's event wait does, and counts its polls."""

    def __init__(self, wait_s: float, error: Exception | None = None) -> None:
        super().__init__()
        self.at = time.perf_counter() + wait_s
        self.error = error
        self.spins = 0

    def ready(self) -> bool:
        return time.perf_counter() >= self.at

    def result(self, timeout=None):
        while not self.ready():
            self.spins += 1
        if self.error is not None:
            raise self.error
        return "ids"


def test_the_sleep_learns_the_wait_minus_the_margin_and_never_returns_early():
    pacer = WaitPacer(margin_s=0.004, max_sleep_s=0.05)
    for _ in range(30):
        step = DeviceStep(0.030)
        pacer.wait(step)
        assert step.ready()  # never before the ids are there
    assert pacer.num_waits == 30
    # Converged below the wait (the margin covers a late wake); a busy machine may wake
    # later still, which only shortens the sleep.
    assert 0.010 < pacer.sleep_s < 0.030
    step = DeviceStep(0.030)
    pacer.wait(step)
    spun_paced = step.spins
    fresh = DeviceStep(0.030)
    WaitPacer(max_sleep_s=0.05).wait(fresh)  # a first wait spins throughout
    assert spun_paced < fresh.spins


def test_a_wait_over_before_the_sleep_ends_shortens_the_next_sleep():
    pacer = WaitPacer(margin_s=0.002)
    pacer.sleep_s = 0.020
    step = DeviceStep(0.002)
    pacer.wait(step)
    assert step.ready() and step.spins == 0
    assert pacer.num_overslept == 1 and pacer.sleep_s == pytest.approx(0.014)
    for _ in range(15):
        pacer.wait(DeviceStep(0.002))
    assert pacer.sleep_s < 0.002


def test_ready_futures_and_futures_without_ready_are_not_waited_for():
    pacer = WaitPacer()
    pacer.sleep_s = 1.0  # would time the test out if it slept
    done: Future = Future()
    done.set_result("ids")
    pacer.wait(done)  # a plain future (another executor's): left to its own result()
    step = DeviceStep(0.0)
    pacer.wait(step)
    assert pacer.num_waits == 0


def test_a_failed_step_raises_from_the_wait_and_the_pacer_goes_on():
    pacer = WaitPacer(margin_s=0.001)
    with pytest.raises(RuntimeError, match="device lost"):
        pacer.wait(DeviceStep(0.005, RuntimeError("device lost")))
    pacer.wait(DeviceStep(0.005))
    assert pacer.num_waits == 2 and 0 <= pacer.sleep_s < 0.005


def test_the_switch_reaches_the_gated_fill_thread():
    assert EnvSwitches.from_environ({}).gated_wait == "spin"
    assert EnvSwitches.from_environ({"TANDEM_GATED_WAIT": "Paced"}).gated_wait == "paced"
    with pytest.raises(ValueError, match="TANDEM_GATED_WAIT='nap': expected one of spin, paced"):
        EnvSwitches.from_environ({"TANDEM_GATED_WAIT": "nap"})
    backend = lambda: None  # noqa: E731
    assert GatedFills(4, frozenset(), True, False, backend, "paced").pacer is not None
    assert GatedFills(4, frozenset(), True, False, backend).pacer is None
