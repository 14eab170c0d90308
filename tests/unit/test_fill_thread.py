"""``FillThread``: the structured-output manager's bitmask fills run on it in order, their
errors reach the waiter, and a job starts as it is handed over, not when the submitting
thread's pure-Python work next lets go of the GIL."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from tandem.structured_output.manager import FillThread

pytestmark = pytest.mark.timeout(60)


def test_jobs_run_in_order_and_errors_reach_the_waiter():
    t = FillThread("test-fill")
    try:
        seen: list[int] = []
        futs = [t.submit(lambda i=i: seen.append(i)) for i in range(50)]
        for f in futs:
            assert f.result(timeout=10) is None
        assert seen == list(range(50))

        def boom() -> None:
            raise ValueError("fill failed")

        with pytest.raises(ValueError, match="fill failed"):
            t.submit(boom).result(timeout=10)
        assert t.submit(lambda: seen.append(99)).result(timeout=10) is None  # still usable
        assert seen[-1] == 99
    finally:
        t.shutdown()
    t.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        t.submit(lambda: None)


def test_shutdown_waits_for_the_running_job():
    t = FillThread("test-fill")
    done = threading.Event()
    fut = t.submit(lambda: (time.sleep(0.2), done.set()))
    t.shutdown()
    assert done.is_set() and fut.done()


def test_a_job_starts_while_the_submitter_keeps_the_gil_busy():
    """A pool thread merely woken would wait for the GIL until the switch interval (set long
    here) or until the submitter blocks; the handshake lets the job in at once."""
    t = FillThread("test-fill")
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    try:
        started: list[float] = []

        def job() -> None:
            started.append(time.perf_counter())
            time.sleep(0.01)  # stands for the fill's native, GIL-releasing call

        t0 = time.perf_counter()
        fut = t.submit(job)
        x = 0
        while time.perf_counter() - t0 < 0.3:  # pure-Python work that never releases the GIL
            x += 1
        fut.result(timeout=10)
        assert started[0] - t0 < 0.15, f"the job started {1e3 * (started[0] - t0):.1f} ms after submit"
    finally:
        sys.setswitchinterval(old)
        t.shutdown()
