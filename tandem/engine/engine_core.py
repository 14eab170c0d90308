"""The engine core's step loop: schedule, launch, complete — with a bounded in-flight queue.

One loop serves both modes; only the queue depth differs (1 = synchronous, 2 = async, or
``TANDEM_ASYNC_DEPTH``).
Each ``step()`` does exactly one of two things, and it cannot do neither while work exists:

* **launch**: if the queue has room, ask the scheduler for a step; if it scheduled any
  tokens, hand it to the executor (non-blocking) and append it to the queue;
* **complete**: if nothing was launched, or the queue is now full, pop the *oldest*
  in-flight step, wait for its output and apply it.

Hence the three failure modes the overlap design is known for cannot occur here:
1. only a ``SchedulerOutput`` that was actually scheduled is ever queued or read;
2. no early return skips the queue: a step that launches nothing always completes one, so
   a non-empty queue drains (and an empty queue with unfinished requests is reported as a
   stall instead of spinning — unless some request's grammar is still compiling: then the
   step waits, bounded, for a compilation to end);
3. every launched step has a future that resolves exactly once (the executor contract),
   and so has each of the two calls of a constrained step.

**Constrained steps (structured outputs)** can be gated where the worker runs in this process
(``structured_outputs_sampling``, the default; ``tandem.structured_output.gated``): one call, like any
step, whose sampling waits on the device for the bitmask that the gated fill thread fills
meanwhile, after advancing the grammars by the earlier steps' tokens itself; the step's
refusals come back with its accept when the step is applied. Otherwise (split) they
run in two calls, as in vLLM: ``execute_model``
launches the forward pass only, and ``sample_tokens(GrammarOutput)`` applies the token
bitmask and samples. The bitmask of a request needs every token before it, so with a step
in flight that samples one of the step's constrained requests, sampling is deferred: the
oldest step is completed first (its tokens advance the grammars) while the new forward
runs, then the bitmask is filled (on CUDA, on the structured-output manager's fill thread,
while this thread finishes the completed step and schedules the next) and ``sample_tokens``
sent as soon as this thread finds the bitmask filled (after the serving loop has sent the
completed step's outputs, before scheduling the next step, or before building its inputs),
at the latest just before the next launch. Otherwise it is sent at once. No step is
launched while another awaits its sampling call, so the worker always sees forward N,
sample N, forward N+1, sample N+1. A step without constrained requests is one call, exactly
as before.

**Interrupts** (Ctrl-C, a signal handler's exception) never leave the engine half-changed:
the bookkeeping sections run under ``tandem.interrupts.deferred_interrupts``; a step whose
launch is interrupted is abandoned (its requests fail and free their blocks) before the
interrupt propagates; outputs produced before an interrupt wait in ``_undelivered`` for
the next ``step()``.
"""
from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, cast

from tandem import step_trace
from tandem.config import EngineConfig, ModelConfig
from tandem.engine.messages import CoreStats
from tandem.executor import Executor, create_executor
from tandem.interrupts import deferred_interrupts
from tandem.scheduler.kv_cache import KVCacheManager
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.spec import SpecScheduling
from tandem.structured_output import PendingGrammarOutput, StructuredOutputManager
from tandem.structured_output.gated import Refusals
from tandem.types.engine_output import EngineCoreOutput
from tandem.types.request import Request
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def spec_scheduling(config: EngineConfig) -> Optional[SpecScheduling]:
    sc = config.speculative_config
    if sc is None:
        return None
    lookahead = sc.num_speculative_tokens if sc.method == "draft_model" else 0
    return SpecScheduling(sc.num_speculative_tokens, sc.disable_by_batch_size, lookahead)


def _draft_counts(so: SchedulerOutput) -> dict[str, int]:
    """Drafts each request of ``so`` verifies (speculative decoding; empty without)."""
    return {sr.req_id: sr.num_draft_tokens for sr in so.requests if sr.num_draft_tokens} if so.num_draft_tokens else {}


class EngineStallError(RuntimeError):
    """Unfinished requests exist but nothing can be scheduled and nothing is in flight."""


# How long a step with nothing to run waits for a grammar to compile before returning (so a
# serving loop still reads new messages meanwhile).
GRAMMAR_WAIT_S = 0.05


@dataclass
class InFlightStep:
    """A launched step. ``output`` resolves to its tokens; for a split constrained step it is
    None until ``sample_tokens`` is sent, and ``forward`` is the future of the forward-only
    call. ``grammar``: the step's bitmask, filling (``_start_sampling``), until it is sent.
    ``gated``: a gated step's fill and accept futures (``StructuredOutputManager``)."""

    so: SchedulerOutput
    output: Optional[Future[ModelRunnerOutput]]
    forward: Optional[Future[Any]] = None
    grammar: Optional[PendingGrammarOutput] = None
    gated: Optional[tuple[Future[None], Future[Refusals]]] = None


@dataclass
class LoopStats:
    num_launched: int = 0
    num_completed: int = 0
    # Steps launched while an earlier step's output was still unprocessed: the overlap.
    num_launched_ahead: int = 0
    num_errors: int = 0
    # Constrained steps, and those whose sampling waited for an earlier step's tokens (their
    # forward ran while the engine completed that step and filled the bitmask).
    num_constrained: int = 0
    num_sampling_deferred: int = 0
    num_gated: int = 0  # constrained steps sampled behind their bitmask's gate (one call)


class EngineCore:
    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 executor: Optional[Executor] = None) -> None:
        self.config = config
        self.model_config = model_config
        self.depth = self._queue_depth(config, model_config)  # (checked before any worker starts)
        self.executor = executor or create_executor(config, model_config)
        try:
            self.gated_sampling = self._use_gated_sampling(config)
        except ValueError:
            self.executor.shutdown()  # its workers are up already
            raise
        if self.gated_sampling:  # before init_kv_cache, whose warm-up compiles its wait
            self.executor.collective_rpc("enable_gated_sampling")
        # Every worker must fit the cache: take the smallest count any of them reports.
        num_blocks = min(self.executor.collective_rpc("determine_num_kv_blocks"))
        self.executor.collective_rpc("init_kv_cache", num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # A CUDA worker in this process copies bitmasks to the device straight from pinned
        # buffers. Bitmasks fill on a thread of their own only when the model runs on CUDA
        # (on the CPU the forward needs the cores).
        cuda = model_config.device == "cuda"
        self.structured = StructuredOutputManager(config.structured_outputs_backend, model_config.tokenizer,
                                                  model_config.vocab_size, list(model_config.eos_token_ids),
                                                  pin_bitmasks=cuda and config.resolved_executor == "uniproc",
                                                  background_fills=cuda,
                                                  fill_threads=config.structured_outputs_fill_threads)
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=model_config.max_num_seqs,
            max_num_batched_tokens=model_config.max_num_batched_tokens,
            max_model_len=model_config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            spec=spec_scheduling(config),
            accept_grammar_tokens=self.structured.accept_tokens,  # type: ignore[arg-type]
        )
        self.batch_queue: deque[InFlightStep] = deque()
        # Build a step's inputs before the sampling call it must follow (``_launch_next``);
        # off only to measure what it saves (benchmarks/structured_offline.py).
        self.prepare_ahead = True
        self.stats = LoopStats()
        # For the queue-time histogram: arrival times of requests not scheduled yet, then the
        # wait of each scheduled request until its first output carries it. Only a serving
        # loop reports queue times, so only it turns this on.
        self.track_queue_times = False
        self._arrivals: dict[str, float] = {}
        self._queue_times: dict[str, float] = {}
        # Outputs produced but not returned yet: an interrupt after a step was applied (or
        # abandoned) defers them to the next ``step()``, it does not lose them.
        self._undelivered: list[EngineCoreOutput] = []

    @staticmethod
    def _queue_depth(config: EngineConfig, model_config: ModelConfig) -> int:
        """Steps in flight: 1 synchronous, 2 async, or ``TANDEM_ASYNC_DEPTH`` async."""
        depth = config.max_concurrent_batches
        wanted = model_config.env.async_depth
        if not config.async_scheduling or wanted == depth:
            return depth
        if wanted < 2:
            raise ValueError(f"TANDEM_ASYNC_DEPTH={wanted}: async scheduling keeps at least 2 steps in flight "
                             "(async_scheduling=False runs one)")
        if config.speculative_config is not None:
            raise ValueError(f"TANDEM_ASYNC_DEPTH={wanted} does not work with speculative decoding, whose "
                             "proposals follow the step before: leave it at 2")
        return wanted

    def _use_gated_sampling(self, config: EngineConfig) -> bool:
        """Gated sampling needs the worker in this process (its gate and pinned bitmask do
        not travel), one mask row per request (no speculative decoding) and, on CUDA,
        Triton (the device-side wait is a Triton kernel)."""
        import importlib.util

        mode = config.structured_outputs_sampling
        possible = (self.executor.in_process and config.speculative_config is None
                    and (self.model_config.device != "cuda" or importlib.util.find_spec("triton") is not None))
        if mode == "gated" and not possible:
            raise ValueError("structured_outputs_sampling='gated' needs the worker in the engine's process "
                             "(executor uniproc, one GPU), no speculative decoding and, on CUDA, Triton")
        # auto: gated wherever it can run. Served on an H100, fully constrained, it gave 10%
        # more tokens a second than split (benchmarks/RESULTS.md, 2026-12-07, fourth session).
        return mode == "gated" or (mode == "auto" and possible)

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        so_params = request.sampling_params.structured_outputs
        if so_params is not None and request.grammar is None:
            request.grammar = self.structured.grammar_for(so_params)
        with deferred_interrupts():
            self.scheduler.add_request(request)
            if self.track_queue_times:
                self._arrivals[request.request_id] = time.monotonic()

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        req_ids = list(req_ids)
        with deferred_interrupts():
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
            num_prefill_steps=sched.stats.num_prefill_steps,
            **self.spec_decode_stats(),
        )

    def spec_decode_stats(self) -> dict[str, Any]:
        """Speculative decoding's totals (``CoreStats``' ``spec_*`` fields; empty without it)."""
        spec = self.scheduler.spec
        if spec is None:
            return {}
        st = spec.stats
        return dict(spec_num_drafts=st.num_drafts, spec_num_draft_tokens=st.num_draft_tokens,
                    spec_num_accepted_tokens=st.num_accepted_tokens,
                    spec_accepted_per_position=list(st.accepted_per_position))

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue) or bool(self._undelivered)

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        launched = False
        if (len(self.batch_queue) < self.depth and self.scheduler.has_unfinished_requests()
                and self._bitmasks_started()):
            launched = self._launch_next()
        with deferred_interrupts():
            self._undelivered += self.scheduler.take_outputs()  # requests ended outside a step (bad grammars)
        if self.batch_queue and (not launched or len(self.batch_queue) >= self.depth):
            self._complete_oldest()
            with deferred_interrupts():
                self._sample_deferred()
        elif not launched and self.scheduler.has_unfinished_requests():
            if self.scheduler.waiting_for_grammar:  # not a stall: wait (bounded) for a compilation
                self.structured.wait_for_any((r.grammar for r in self.scheduler.waiting_for_grammar),  # type: ignore[misc]
                                             GRAMMAR_WAIT_S)
            else:
                raise EngineStallError(
                    f"nothing schedulable and nothing in flight with {len(self.scheduler.requests)} unfinished "
                    f"requests ({self.kv_cache.num_free_blocks}/{self.kv_cache.num_blocks} KV blocks free)"
                )
        outs, self._undelivered = self._undelivered, []
        return outs

    def _launch_next(self) -> bool:
        """Schedule a step and queue it launched; False if nothing was schedulable.

        The launch itself stays interruptible (on the CPU it is the whole forward pass). An
        interrupt (any ``BaseException``) that stops a scheduled step from being queued
        propagates only after the step is abandoned: its requests fail, their blocks are
        freed and the worker is told again to drop what the step told it to drop, so the
        engine is as if the step had never been scheduled.
        """
        so: Optional[SchedulerOutput] = None
        step: Optional[InFlightStep] = None
        try:
            with deferred_interrupts():
                self.send_filled_sampling()
                trace = step_trace.TRACE
                if trace is not None:
                    trace.mark("schedule", "b", -1)
                so = self.scheduler.schedule()
                if so.is_empty:
                    so = None
                    return False
                if trace is not None:
                    trace.mark("schedule", "e", so.step_id)
                if self._arrivals:
                    self._note_first_scheduled(so)
                # A step whose bitmask was filling meanwhile is sampled first: its sampling
                # must precede the next forward on the device (which reads its tokens). The
                # next step's inputs are built before (while the fill may still run), so
                # only its upload and launch follow the sampling call.
                self.send_filled_sampling()
                if self.prepare_ahead and any(w.output is None for w in self.batch_queue):
                    self.executor.prepare_model(so)
                for waiting in self.batch_queue:
                    self._send_sampling(waiting)
            if trace is not None:
                trace.mark("launch", "b", so.step_id)
            step = self._launch(so)
            if trace is not None:
                trace.mark("launch", "e", so.step_id)
            with deferred_interrupts():
                if self.batch_queue:
                    self.stats.num_launched_ahead += 1
                self.batch_queue.append(step)
                self.stats.num_launched += 1
                so = None
            return True
        except BaseException:
            if so is not None:
                with deferred_interrupts():
                    if step is not None:  # launched, then interrupted: it runs its course
                        self.batch_queue.append(step)
                        self.stats.num_launched += 1
                    else:
                        self._undelivered += self.scheduler.abandon_step(so, "interrupted while its step was "
                                                                              "being launched")
            raise

    # -- constrained steps: forward, then sampling with the bitmask -------------------------
    def _launch(self, so: SchedulerOutput) -> InFlightStep:
        """Hand ``so`` to the executor: one call, or the forward now and the sampling now or
        once the grammars have the tokens before it (``_sample_deferred``)."""
        if not so.grammar_req_ids:  # one call: its future resolves to the output
            return InFlightStep(so, cast("Future[ModelRunnerOutput]", self.executor.execute_model(so)))
        if self.gated_sampling:
            return self._launch_gated(so)
        step = InFlightStep(so, None, self.executor.execute_model(so))
        self.stats.num_constrained += 1
        if self._grammars_current(so):
            self._sample(step)
        else:
            self.stats.num_sampling_deferred += 1
        return step

    def _launch_gated(self, so: SchedulerOutput) -> InFlightStep:
        """One call, as for an unconstrained step: the bitmask's fill is queued on the gated
        fill thread first (after the accepts of every earlier step), then the step (its
        sampling waits on the device for the fill), then the accept of the step's own ids."""
        trace = step_trace.TRACE  # ("open": the fill queued; "queue_accept": the accept queued)
        if trace is not None:
            trace.mark("open", "b", so.step_id)
        grammars = [r.grammar for r in self.scheduler.step_requests(so.step_id, so.grammar_req_ids)]
        so.grammar, fill = self.structured.gated.open_step(so.step_id, so.grammar_req_ids, grammars)  # type: ignore[arg-type]
        if trace is not None:
            trace.mark("open", "e", so.step_id)
        output = cast("Future[ModelRunnerOutput]", self.executor.execute_model(so))
        if trace is not None:
            trace.mark("queue_accept", "b", so.step_id)
        accept = self.structured.gated.accept_step(so.grammar_req_ids, grammars, output,  # type: ignore[arg-type]
                                                   so.step_id)
        if trace is not None:
            trace.mark("queue_accept", "e", so.step_id)
        self.stats.num_constrained += 1
        self.stats.num_gated += 1
        return InFlightStep(so, output, gated=(fill, accept))

    def _grammars_current(self, so: SchedulerOutput) -> bool:
        """Every constrained request of ``so`` has received all its tokens before this step's
        (no other in-flight step samples it), so its bitmask can be filled now."""
        drafts = _draft_counts(so)
        return all(r.is_finished or r.num_output_placeholders <= 1 + drafts.get(r.request_id, 0)
                   for r in self.scheduler.step_requests(so.step_id, so.grammar_req_ids))

    def _bitmasks_started(self) -> bool:
        """No in-flight step awaits sampling with a bitmask not even started (its grammars
        wait for an earlier step's tokens): a step launched now would run its forward
        before that step's sampling. One whose bitmask is filling is sampled at launch."""
        return all(step.output is not None or step.grammar is not None for step in self.batch_queue)

    def _sample(self, step: InFlightStep) -> None:
        """Fill the step's bitmask and send ``sample_tokens`` now."""
        self._start_sampling(step, background=False)
        self._send_sampling(step)

    def _start_sampling(self, step: InFlightStep, background: bool = True) -> None:
        """Start filling the step's bitmask (on the manager's fill thread when it pays and
        ``background``); ``_send_sampling`` sends it. A failure fails the step."""
        so = step.so
        try:
            drafts = _draft_counts(so)
            requests = self.scheduler.step_requests(so.step_id, so.grammar_req_ids)
            if drafts:  # speculative decoding: rows over the drafts, filled here
                step.grammar = PendingGrammarOutput(self.structured.grammar_output(
                    so.step_id, so.grammar_req_ids, requests, [drafts.get(rid, 0) for rid in so.grammar_req_ids]))
            else:
                step.grammar = self.structured.start_grammar_output(so.step_id, so.grammar_req_ids, requests,
                                                                    background)
        except Exception as e:
            self._fail_sampling(step, e)

    def _send_sampling(self, step: InFlightStep) -> None:
        """Send the step's ``sample_tokens`` once its bitmask is filled (starting the fill
        first if nobody did); nothing if it was sent."""
        if step.output is not None:
            return
        if step.grammar is None:
            self._start_sampling(step, background=False)
            if step.output is not None:  # the fill failed
                return
        assert step.grammar is not None
        try:
            grammar = step.grammar.result()
        except Exception as e:
            self._fail_sampling(step, e)
            return
        step.grammar = None
        step.output = self.executor.sample_tokens(grammar)

    def send_filled_sampling(self) -> None:
        """Send the sampling call of a step whose bitmask is already filled, without waiting
        for the next step's scheduling and inputs: the device samples as soon as the running
        forward ends (instead of idling until the next launch), so that step's tokens are
        back when this thread comes to wait for them. The order on the device is the same:
        a step's sampling always precedes the next forward. The serving loop also calls it
        between a step's outputs and the next messages (``EngineCoreLoop``)."""
        with deferred_interrupts():
            for step in self.batch_queue:
                if step.output is None and step.grammar is not None and step.grammar.done():
                    self._send_sampling(step)

    @staticmethod
    def _fail_sampling(step: InFlightStep, exc: Exception) -> None:
        failed: Future[ModelRunnerOutput] = Future()
        failed.set_exception(exc)
        step.grammar = None
        step.output = failed

    def _early_sampling(self) -> Optional[Callable[[], None]]:
        """While the oldest step is being applied: if the one step left in flight awaits its
        sampling call, its grammars are current as soon as the applied step's tokens have
        advanced them (no other step holds its requests' tokens: none is launched while one
        awaits sampling). Its bitmask starts filling from there, on the fill thread, while
        this thread finishes that step's bookkeeping, returns its outputs and schedules the
        next step; the sampling call goes out before that step's launch (``_launch_next``).
        Not with speculative decoding (a step's drafts reach the grammars at the end of the
        update)."""
        if len(self.batch_queue) != 1 or self.batch_queue[0].output is not None or self.scheduler.spec is not None:
            return None
        step = self.batch_queue[0]
        return lambda: self._start_sampling(step)

    def _sample_deferred(self) -> None:
        for step in self.batch_queue:
            if step.output is None and step.grammar is None and self._grammars_current(step.so):
                self._start_sampling(step)

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

    def _complete_oldest(self) -> None:
        """Wait for the oldest in-flight step and apply it; its outputs join ``_undelivered``,
        so an interrupt raised after the step was applied loses none of them."""
        step = self.batch_queue[0]
        if step.output is None:  # nothing older is in flight: its grammars are current
            with deferred_interrupts():
                self._send_sampling(step)
        assert step.output is not None
        refusals: Optional[Refusals] = None
        trace, sid = step_trace.TRACE, step.so.step_id
        try:
            if trace is not None:
                trace.mark("wait_output", "b", sid)
            if step.forward is not None:
                step.forward.result()  # the forward's own error, if it failed
            result = step.output.result()
            if trace is not None:
                trace.mark("wait_output", "e", sid)
            if step.gated is not None:  # the fill's error fails the step; the accept's refusals
                step.gated[0].result()
                refusals = step.gated[1].result()
                if trace is not None:
                    trace.mark("wait_accept", "e", sid)
        except Exception as e:  # the step failed: fail its requests, keep the engine usable
            with deferred_interrupts():
                self.batch_queue.popleft()
                self._undelivered += self._fail_inflight(step.so, e)
            return
        # (An interrupt while waiting leaves the step queued: a later call completes it.)
        with deferred_interrupts():
            self.batch_queue.popleft()
            self.stats.num_completed += 1
            outs = self.scheduler.update_from_output(step.so, result, self._early_sampling(), refusals)
            self._undelivered += self._attach_queue_times(outs) if self._queue_times else outs
            if trace is not None:
                trace.mark("update", "e", sid)

    def _fail_inflight(self, so: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        """Later in-flight steps consumed this step's (missing) tokens: fail them too."""
        self.stats.num_errors += 1
        msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        logger.error("step %d failed: %s", so.step_id, msg)
        outs = self.scheduler.fail_step(so, msg)
        while self.batch_queue:
            later = self.batch_queue.popleft()
            if later.grammar is not None:  # a fill under way: let it end before the requests go
                try:
                    later.grammar.result()
                except Exception:
                    pass
            for fut in (later.forward, later.output, *(later.gated or ())):  # a deferred step is never sampled now
                if fut is not None:
                    try:
                        fut.result()
                    except Exception:
                        pass
            outs += self.scheduler.fail_step(later.so, msg)
        return self._attach_queue_times(outs)

    def drain(self) -> list[EngineCoreOutput]:
        """Complete every in-flight step (used at shutdown and by tests)."""
        while self.batch_queue:
            self._complete_oldest()
        outs, self._undelivered = self._undelivered, []
        return outs

    def shutdown(self) -> None:
        try:
            self.drain()
        finally:
            self.structured.shutdown()
            self.executor.shutdown()
            if step_trace.TRACE is not None:
                step_trace.TRACE.write()

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
