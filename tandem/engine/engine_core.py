"""The engine core's step loop: schedule, launch, complete — with a bounded in-flight queue.

One loop serves both modes; only the queue depth differs (1 = synchronous, 2 = async).
Each ``step()`` does exactly one of two things, and it cannot do neither while work exists:

* **launch**: if the queue has room, ask the scheduler for a step; if it scheduled any
  tokens, hand it to the executor (non-blocking) and append it to the queue;
* **complete**: if nothing was launched, or the queue is now full, pop the *oldest*
  in-flight step, wait for its output and apply it.

Hence the three failure modes the overlap design is known for cannot occur here:
1. only a ``SchedulerOutput`` that was actually scheduled is ever queued or read;
2. no early return skips the queue: a step that launches nothing always completes one, so
   a non-empty queue drains (and an empty queue with unfinished requests is reported as a
   stall instead of spinning);
3. every launched step has a future that resolves exactly once (the executor contract).
"""
from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterable, Optional

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.messages import CoreStats
from tandem.engine.interrupts import deferred_sigint
from tandem.executor import Executor, create_executor
from tandem.scheduler.kv_cache import KVCacheManager
from tandem.scheduler.scheduler import Scheduler
from tandem.types.engine_output import EngineCoreOutput
from tandem.types.request import Request
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class EngineStallError(RuntimeError):
    """Unfinished requests exist but nothing can be scheduled and nothing is in flight."""


@dataclass
class LoopStats:
    num_launched: int = 0
    num_completed: int = 0
    # Steps launched while an earlier step's output was still unprocessed: the overlap.
    num_launched_ahead: int = 0
    num_errors: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 executor: Optional[Executor] = None) -> None:
        self.config = config
        self.model_config = model_config
        self.executor = executor or create_executor(config, model_config)
        # Every worker must fit the cache: take the smallest count any of them reports.
        num_blocks = min(self.executor.collective_rpc("determine_num_kv_blocks"))
        self.executor.collective_rpc("init_kv_cache", num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.depth = config.max_concurrent_batches
        self.batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        self.stats = LoopStats()
        # For the queue-time histogram: arrival times of requests not scheduled yet, then the
        # wait of each scheduled request until its first output carries it. Only a serving
        # loop reports queue times, so only it turns this on.
        self.track_queue_times = False
        self._arrivals: dict[str, float] = {}
        self._queue_times: dict[str, float] = {}

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if self.track_queue_times:
            self._arrivals[request.request_id] = time.monotonic()

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        req_ids = list(req_ids)
        self.scheduler.abort_requests(req_ids)
        for rid in req_ids:
            self._arrivals.pop(rid, None)
            self._queue_times.pop(rid, None)

    def make_stats(self, idle_seconds: float = 0.0) -> CoreStats:
        """A snapshot for /metrics."""
        kv, sched = self.kv_cache, self.scheduler
        return CoreStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_kv_blocks=kv.num_blocks, num_free_kv_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.stats_queries, prefix_cache_hits=kv.stats_hits,
            num_preemptions=sched.stats.num_preemptions,
            num_steps_launched=self.stats.num_launched, num_steps_launched_ahead=self.stats.num_launched_ahead,
            num_step_errors=self.stats.num_errors, idle_seconds=idle_seconds,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        launched = False
        if len(self.batch_queue) < self.depth and self.scheduler.has_unfinished_requests():
            with deferred_sigint():  # a scheduled step is always queued (tandem/engine/interrupts.py)
                so = self.scheduler.schedule()
                if not so.is_empty:
                    if self._arrivals:
                        self._note_first_scheduled(so)
                    if self.batch_queue:
                        self.stats.num_launched_ahead += 1
                    self.batch_queue.append((so, self.executor.execute_model(so)))
                    self.stats.num_launched += 1
                    launched = True
        if self.batch_queue and (not launched or len(self.batch_queue) >= self.depth):
            return self._complete_oldest()
        if not launched and self.scheduler.has_unfinished_requests():
            raise EngineStallError(
                f"nothing schedulable and nothing in flight with {len(self.scheduler.requests)} unfinished "
                f"requests ({self.kv_cache.num_free_blocks}/{self.kv_cache.num_blocks} KV blocks free)"
            )
        return []

    def _note_first_scheduled(self, so: SchedulerOutput) -> None:
        now = time.monotonic()
        for sr in so.requests:
            if sr.new is not None:
                t = self._arrivals.pop(sr.req_id, None)
                if t is not None:
                    self._queue_times[sr.req_id] = now - t

    def _attach_queue_times(self, outs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Each request's first output carries how long it waited to be scheduled."""
        for out in outs:
            t = self._queue_times.pop(out.req_id, None)
            if t is not None:
                out.queue_time = t
        return outs

    def _complete_oldest(self) -> list[EngineCoreOutput]:
        so, fut = self.batch_queue[0]
        try:
            result = fut.result()
        except Exception as e:  # the step failed: fail its requests, keep the engine usable
            with deferred_sigint():
                self.batch_queue.popleft()
                return self._fail_inflight(so, e)
        # (A KeyboardInterrupt while waiting leaves the step queued: a later call completes it.)
        with deferred_sigint():
            self.batch_queue.popleft()
            self.stats.num_completed += 1
            outs = self.scheduler.update_from_output(so, result)
            return self._attach_queue_times(outs) if self._queue_times else outs

    def _fail_inflight(self, so: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """Later in-flight steps consumed this step's (missing) tokens: fail them too."""
        self.stats.num_errors += 1
        msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        logger.error("step %d failed: %s", so.step_id, msg)
        outs = self.scheduler.fail_step(so, msg)
        while self.batch_queue:
            later, fut = self.batch_queue.popleft()
            try:
                fut.result()
            except Exception:
                pass
            outs += self.scheduler.fail_step(later, msg)
        return self._attach_queue_times(outs)

    def drain(self) -> list[EngineCoreOutput]:
        """Complete every in-flight step (used at shutdown and by tests)."""
        outs: list[EngineCoreOutput] = []
        while self.batch_queue:
            outs += self._complete_oldest()
        return outs

    def shutdown(self) -> None:
        try:
            self.drain()
        finally:
            self.executor.shutdown()

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
