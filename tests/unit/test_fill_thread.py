"""``FillThreads``: the structured-output manager's bitmask fills run on them in order, their
errors reach the waiter, a job starts as it is handed over, not when the submitting
thread's pure-Python work next lets go of the GIL, and the shares of a step run at once."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from tandem.structured_output.manager import FillThreads

pytestmark = pytest.mark.timeout(60)


def test_jobs_run_in_order_and_errors_reach_the_waiter():
    t = FillThreads("test-fill")
    try:
        seen: list[int] = []
        futs = [t.submit([lambda i=i: seen.append(i)])[0] for i in range(50)]
        for f in futs:
            assert f.result(timeout=10) is None
        assert seen == list(range(50))

        def boom() -> None:
            raise ValueError("fill failed")

        with pytest.raises(ValueError, match="fill failed"):
            t.submit([boom])[0].result(timeout=10)
        assert t.submit([lambda: seen.append(99)])[0].result(timeout=10) is None  # still usable
        assert seen[-1] == 99
    finally:
        t.shutdown()
    t.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        t.submit([lambda: None])


def test_shutdown_waits_for_the_running_job():
    t = FillThreads("test-fill")
    done = threading.Event()
    fut = t.submit([lambda: (time.sleep(0.2), done.set())])[0]
    t.shutdown()
    assert done.is_set() and fut.done()


def test_a_job_starts_while_the_submitter_keeps_the_gil_busy():
    """A pool thread merely woken would wait for the GIL until the switch interval (set long
    here) or until the submitter blocks; the handshake lets the job in at once."""
    t = FillThreads("test-fill")
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    try:
        started: list[float] = []

        def job() -> None:
            started.append(time.perf_counter())
            time.sleep(0.01)  # stands for the fill's native, GIL-releasing call

        t0 = time.perf_counter()
        fut = t.submit([job])[0]
        x = 0
        while time.perf_counter() - t0 < 0.3:  # pure-Python work that never releases the GIL
            x += 1
        fut.result(timeout=10)
        assert started[0] - t0 < 0.15, f"the job started {1e3 * (started[0] - t0):.1f} ms after submit"
    finally:
        sys.setswitchinterval(old)
        t.shutdown()


def test_the_shares_of_a_step_run_at_once_each_on_its_thread():
    """Each job of one ``submit`` runs on a thread of its own, all at the same time (a
    barrier they must all reach), and waiting for each waits for all of them."""
    t = FillThreads("test-fill", num_threads=3)
    try:
        barrier = threading.Barrier(3, timeout=10)
        names: list[str] = []

        def job() -> None:
            names.append(threading.current_thread().name)
            barrier.wait()  # a BrokenBarrierError unless the three run at once

        for _ in range(5):
            futs = t.submit([job, job, job])
            for f in futs:
                assert f.result(timeout=10) is None
        assert len(set(names)) == 3
        one = t.submit([lambda: names.append("one")])  # fewer jobs than threads
        assert len(one) == 1 and one[0].result(timeout=10) is None and names[-1] == "one"
        with pytest.raises(AssertionError):
            t.submit([job] * 4)
    finally:
        t.shutdown()
