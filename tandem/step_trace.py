"""A timeline of the engine core's steps, for finding where a served step's time goes.

``TANDEM_STEP_TRACE=PREFIX`` makes the engine core record, per step, when each phase began
and ended on the thread that ran it: scheduling, the launch, the waits for the step's ids
and for its grammar accept, the update, the gated fills and accepts on the fill thread;
within the launch, the model runner's "prepare" (inputs built), "forward" (upload and the
forward's launch) and "sample" (the sampling's launch), and a gated step's "open" (its fill
queued) and "queue_accept".
At shutdown the core writes them to ``PREFIX.<pid>.jsonl``, one event a line:
``[ns, cpu_us, vcsw, ivcsw, thread, phase, "b"|"e", step id]`` (-1 where a phase belongs
to no one step: the scheduling that has not yet numbered its step, the serving loop's
intake of new requests and publish of outputs). A profiler samples; this counts every
step and says which thread was where at once, which is what cross-thread waits need.

Each mark also reads its thread's CPU clock and (``getrusage``) its voluntary and
involuntary context switches so far. A phase whose wall time grows while its CPU time does
not was waiting: for the GIL or a lock (voluntary switches: the thread slept on a futex),
or for a CPU the OS gave to someone else (involuntary switches). A phase whose CPU time
grows ran slower or did more. That tells a served step's hypotheses apart (another thread
holding the GIL, an oversubscribed host, a neighbour slowing the core) where a profiler's
samples count all three alike.

Off (the default) it costs one ``is None`` test per mark. On, a mark appends a tuple to a
list (about two microseconds with the two clock reads), a dozen a step: some ten
thousand steps hold ~100k events.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import threading
import time
from typing import Optional

logger = logging.getLogger(__name__)


# Marks kept at most (~150 MB): a process that never writes its trace (a worker process of
# the multiprocess executor marks its launches too) must not grow without bound.
MAX_EVENTS = 1_000_000


class StepTrace:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.events: list[tuple[int, int, int, int, str, str, str, int]] = []

    def mark(self, phase: str, edge: str, step: int) -> None:
        if len(self.events) >= MAX_EVENTS:
            return
        # (CPU time from the thread's clock: getrusage's is sampled at the scheduler tick.)
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        self.events.append((time.perf_counter_ns(), time.thread_time_ns() // 1000, ru.ru_nvcsw, ru.ru_nivcsw,
                            threading.current_thread().name, phase, edge, step))

    def write(self) -> Optional[str]:
        """Write the events (``PREFIX.<pid>.jsonl``) and return the path; None if none."""
        if not self.events:
            return None
        path = f"{self.prefix}.{os.getpid()}.jsonl"
        with open(path, "w") as f:
            for ev in self.events:
                f.write(json.dumps(ev) + "\n")
        logger.info("step trace: %d events written to %s", len(self.events), path)
        self.events = []
        return path


# The process's trace, or None (``TANDEM_STEP_TRACE`` unset): read by the marks.
TRACE: Optional[StepTrace] = StepTrace(os.environ["TANDEM_STEP_TRACE"]) if os.environ.get("TANDEM_STEP_TRACE") \
    else None
