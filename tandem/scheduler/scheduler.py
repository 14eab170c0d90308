"""Continuous-batching scheduler with chunked prefill, prefix caching and preemption.

Each ``schedule()`` call fills one step's token budget: running requests first (decode or
the next prefill chunk), then waiting ones in arrival order. When KV blocks run out, the
most recently admitted running request is preempted (its blocks freed, to be recomputed).

Async scheduling needs nothing special here beyond *placeholder accounting*: when a step
will sample a token for a request, ``num_output_placeholders`` goes up at schedule time and
down when the token arrives in ``update_from_output``. Because ``num_computed_tokens`` also
advances at schedule time, the next ``schedule()`` sees one more token to compute (the
placeholder, whose id the worker reads from its device-side token table) and so the engine
can launch step N+1 before step N's tokens are known. The same code with a queue depth of 1
is the synchronous engine: there, placeholders are always back to 0 before scheduling.

Invariants (asserted where cheap):
- placeholders never go negative; a request is never scheduled past ``max_tokens`` or
  ``max_model_len`` counting its placeholders;
- a token for a finished or aborted request is dropped;
- a finished request's blocks are freed exactly once, after its last in-flight step;
- a preempted request resumes only when none of its steps are in flight, so the tokens it
  sends the worker are the ones the worker itself confirmed.

Structured outputs: a constrained request (``Request.grammar`` set by the engine core) waits
in ``WAITING_FOR_GRAMMAR`` until its grammar has compiled, skipped by admission so that it
holds up no one; a grammar that fails to compile ends the request with the compiler's
message (``take_outputs``). Each received token advances the request's grammar; each step
lists its constrained, sampling requests in ``SchedulerOutput.grammar_req_ids``.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import AbstractSet, Callable, Iterable, Mapping, Optional

from tandem.scheduler.kv_cache import KVCacheManager
from tandem.scheduler.spec import WAIT, SpecScheduling
from tandem.types.engine_output import INVALID_REQUEST, EngineCoreOutput
from tandem.types.grammar import RequestGrammar
from tandem.types.request import Request, RequestStatus
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

_NONE_REFUSED: frozenset[int] = frozenset()


def _accept_each(grammars: list[RequestGrammar], tokens: list[int]) -> list[bool]:
    """Advance each grammar by its token (without a batch-capable structured outputs manager)."""
    return [g.accept_token(t) for g, t in zip(grammars, tokens)]


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    num_dropped_tokens: int = 0  # tokens that arrived for requests already finished
    # Steps with more tokens than one per request and its drafts: prompt chunks (prefill),
    # alone or beside decodes. Served, most steps can be such, and none runs a decode graph.
    num_prefill_steps: int = 0


class _StepBuilder:
    """The step being filled by one ``schedule()`` call."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled: list[ScheduledRequest] = []
        self.reqs: dict[str, Request] = {}
        self.preempted: list[str] = []
        self.num_ending = 0  # running requests whose last token is already in flight

    def add(self, req: Request, sr: ScheduledRequest, n: int) -> None:
        self.scheduled.append(sr)
        self.reqs[req.request_id] = req
        self.budget -= n


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool,
        spec: Optional[SpecScheduling] = None,
        accept_grammar_tokens: Optional[Callable[[list[RequestGrammar], list[int]], list[bool]]] = None,
    ) -> None:
        self.kv = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}  # live (unfinished) requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished requests whose blocks wait for their in-flight steps to complete.
        self._pending_free: list[Request] = []
        # Ids the worker must drop; sent with the next non-empty step (an empty step is
        # never sent, so a notice raised while scheduling nothing must wait for one).
        self._finished_ids_to_send: list[str] = []
        self._preempted_ids_to_send: list[str] = []
        self._step_reqs: dict[int, dict[str, Request]] = {}  # step id -> requests in it
        self._next_step_id = 0
        self.stats = SchedulerStats()
        # Structured outputs: requests whose grammar is compiling, the number of live
        # constrained requests (0: no step needs the grammar bookkeeping), and outputs of
        # requests that ended outside a step (their grammar did not compile).
        self.waiting_for_grammar: list[Request] = []
        # A step's tokens advance its constrained requests' grammars in one call (the
        # engine core's StructuredOutputManager.accept_tokens, which skips ended grammars
        # and a Python layer per request: measurably less on the hot path than each
        # request's own accept_token).
        self.accept_grammar_tokens = accept_grammar_tokens or _accept_each
        self.num_grammar_requests = 0
        self._outputs: list[EngineCoreOutput] = []
        self.spec = spec  # speculative decoding (tandem.scheduler.spec), None: off

    # -- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running; ids must be unique "
                             "among live requests")
        need = self.kv.blocks_needed(min(request.num_prompt_tokens + request.max_tokens, self.max_model_len))
        if need > self.kv.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs up to {need} KV blocks but the cache has only "
                f"{self.kv.num_blocks}; lower max_tokens or enlarge the KV cache"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.grammar is not None:
            self.num_grammar_requests += 1
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)

    def abort_requests(self, req_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
                       ) -> list[Request]:
        """Finish live requests now. Unknown or already finished ids are a no-op."""
        done = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._finish(req, status)
            done.append(req)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_work(self) -> bool:
        """Unfinished requests, or finished ones still holding blocks."""
        return bool(self.requests) or bool(self._pending_free)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        assert not req.is_finished
        prev = req.status
        req.status = status
        req.num_output_placeholders = 0  # tokens still in flight for it will be dropped
        if prev == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if prev == RequestStatus.WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar.remove(req)
        if req.grammar is not None:
            self.num_grammar_requests -= 1
        del self.requests[req.request_id]
        self._finished_ids_to_send.append(req.request_id)
        if req.num_inflight_steps == 0:
            self.kv.free(req)
        else:
            self._pending_free.append(req)

    # -- scheduling --------------------------------------------------------------------
    def _at_end(self, req: Request) -> bool:
        """Every remaining token of the request is already scheduled (case: one token too many)."""
        n_out = len(req.output_token_ids) + req.num_output_placeholders
        if req.spec_steps_in_flight:  # its placeholders are a maximum: it may need more steps
            return False
        return n_out >= req.max_tokens or req.num_tokens_with_placeholders >= self.max_model_len

    def _preempt(self, req: Request, preempted: list[str]) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        preempted.append(req.request_id)
        self.stats.num_preemptions += 1
        logger.debug("preempted %s", req.request_id)

    def _account(self, req: Request, n: int) -> bool:
        """Advance a request by ``n`` scheduled tokens; return whether the step samples."""
        req.num_computed_tokens += n
        req.num_inflight_steps += 1
        samples = req.num_computed_tokens == req.num_tokens_with_placeholders
        if samples:
            req.num_output_placeholders += 1
        return samples

    def _account_spec(self, req: Request, start: int, k: int, new_blocks: list[int]) -> ScheduledRequest:
        """A decode step that verifies ``k`` drafts (``tandem.scheduler.spec``)."""
        assert self.spec is not None
        correct = req.spec_steps_in_flight > 0
        req.num_computed_tokens += 1 + k
        req.num_inflight_steps += 1
        self.spec.account(req, k)
        return ScheduledRequest(req.request_id, start, 1 + k, new_blocks, True,
                                num_draft_tokens=k, correct_drafts=correct)

    def take_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that ended outside a step (a grammar that did not compile)."""
        outs, self._outputs = self._outputs, []
        return outs

    def _check_grammars(self) -> None:
        """Make requests whose grammar has compiled schedulable; end those whose did not."""
        still = []
        for req in self.waiting_for_grammar:
            g = req.grammar
            assert g is not None
            if not g.is_ready:
                still.append(req)
            elif g.error is not None:
                req.status = RequestStatus.WAITING  # _finish must not look for it in the list
                self._finish(req, RequestStatus.FINISHED_ERROR)
                self._outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="error", error=g.error,
                                                      error_kind=INVALID_REQUEST if g.error_is_request_fault
                                                      else None))
            else:
                req.status = RequestStatus.WAITING
        self.waiting_for_grammar = still

    def schedule(self) -> SchedulerOutput:
        """Fill one step: running requests first, then waiting ones (see the module doc)."""
        if self.waiting_for_grammar:
            self._check_grammars()
        step = _StepBuilder(self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:  # a step that had to preempt admits no one
            self._schedule_waiting(step)
        # Prompt tokens are real: publish their full blocks now so later requests hit them.
        kv = self.kv
        if kv.enable_prefix_caching:
            for req in step.reqs.values():
                at = req.kv_publish_at  # a block may be full: cache_full_blocks' own test, inlined
                if req.num_computed_tokens >= at and len(req.prompt_token_ids) + len(req.output_token_ids) >= at:
                    kv.cache_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))
        return self._emit(step)

    def _schedule_running(self, step: "_StepBuilder") -> None:
        """Decode (or the next prefill chunk of) each running request, oldest first.

        A request whose every remaining token is already in flight (``_at_end``) takes no
        budget, no sequence slot and is never a preemption victim: in the synchronous loop it
        would already have finished and left ``running``, so async mode schedules exactly
        the batches sync schedules when finishes are predictable (max_tokens, max_model_len).
        """
        if self.spec is not None:
            self._schedule_running_spec(step)  # speculative decoding: its own loop
            return
        running = self.running
        max_len = self.max_model_len
        scheduled, reqs = step.scheduled, step.reqs
        budget = step.budget
        i = 0
        # The hot loop of every step: _at_end, _account, step.add and the no-new-block case
        # of allocate_slots inlined (this runs for every running request, 256 times a step
        # at full batch). ``step.budget`` is kept in a local and written back.
        while i < len(running) and budget > 0:
            req = running[i]
            n_out = len(req.output_token_ids) + req.num_output_placeholders
            n_tok = len(req.prompt_token_ids) + n_out  # known tokens + placeholders
            if n_out >= req.max_tokens or n_tok >= max_len:  # _at_end
                step.num_ending += 1
                i += 1
                continue  # stays running: its in-flight token will finish it
            start = req.num_computed_tokens
            n = n_tok - start
            if n > budget:
                n = budget
            assert n > 0, f"running request with nothing to compute: {req}"
            if start + n <= req.kv_num_slots:
                new_blocks: list[int] = []  # its blocks have room for the n tokens
            else:
                step.budget = budget
                allocated = self._allocate_or_preempt(req, n, step)
                if allocated is None:
                    break  # req itself was preempted; nothing after it is left
                new_blocks = allocated
            # _account
            computed = req.num_computed_tokens = start + n
            req.num_inflight_steps += 1
            samples = computed == n_tok
            if samples:
                req.num_output_placeholders += 1
            scheduled.append(ScheduledRequest(req.request_id, start, n, new_blocks, samples))
            reqs[req.request_id] = req
            budget -= n
            i += 1
        step.budget = budget
        # Requests past i were not visited (budget spent): count those that are ending too.
        if i < len(running):
            step.num_ending += sum(1 for r in running[i:] if self._at_end(r))

    def _schedule_running_spec(self, step: "_StepBuilder") -> None:
        """``_schedule_running`` with speculative decoding configured (``tandem.scheduler.spec``):
        a decode step may verify drafts (``1 + k`` tokens), a request with a verify step in
        flight is never counted as ending (its placeholders are a maximum), and lookahead
        slots are allocated for a draft model. Kept apart so the plain loop stays lean."""
        spec = self.spec
        assert spec is not None
        running = self.running
        max_len = self.max_model_len
        spec_on = spec.enabled_for_step(len(running))
        i = 0
        while i < len(running) and step.budget > 0:
            req = running[i]
            n_out = len(req.output_token_ids) + req.num_output_placeholders
            n_tok = len(req.prompt_token_ids) + n_out  # known tokens + placeholders
            if n_out >= req.max_tokens or n_tok >= max_len:  # _at_end
                if not req.spec_steps_in_flight:  # (else it may still need steps: it keeps its slot)
                    step.num_ending += 1
                i += 1
                continue  # stays running: its in-flight token will finish it
            start = req.num_computed_tokens
            n = min(n_tok - start, step.budget)
            assert n > 0, f"running request with nothing to compute: {req}"
            k = 0
            if n == 1:
                k = spec.num_drafts(req, n_out, n_tok, step.budget, max_len, spec_on)
                if k == WAIT:
                    i += 1
                    continue
            la = spec.lookahead(start + n + k, max_len)
            new_blocks = self._allocate_or_preempt(req, n + k + la, step)
            if new_blocks is None:
                break  # req itself was preempted; nothing after it is left
            if k or req.spec_steps_in_flight:  # verifies drafts, or its position is optimistic
                step.add(req, self._account_spec(req, start, k, new_blocks), 1 + k)
            else:
                step.add(req, ScheduledRequest(req.request_id, start, n, new_blocks, self._account(req, n)), n)
            i += 1
        # Requests past i were not visited (budget spent): count those that are ending too.
        if i < len(running):
            step.num_ending += sum(1 for r in running[i:] if self._at_end(r))

    def _allocate_or_preempt(self, req: Request, n: int, step: "_StepBuilder") -> Optional[list[int]]:
        """Blocks for ``n`` more tokens of ``req``, preempting the newest running requests
        (never one already scheduled in this step, never one that is ending) until they fit.
        None when ``req`` itself had to go."""
        while True:
            new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is not None:
                return new_blocks
            victim = next((r for r in reversed(self.running) if not self._at_end(r)), None)
            if victim is None or victim.request_id in step.reqs:
                return None  # nothing left to preempt: try again next step
            self._preempt(victim, step.preempted)
            if victim is req:
                return None

    def _schedule_waiting(self, step: "_StepBuilder") -> None:
        """Admit waiting requests in arrival order while budget, slots and blocks allow
        (passing over those whose grammar is still compiling)."""
        passed: list[Request] = []
        while self.waiting and step.budget > 0 and len(self.running) - step.num_ending < self.max_num_seqs:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                passed.append(self.waiting.popleft())
                continue
            if req.num_inflight_steps > 0:
                break  # preempted with a step in flight: resume once its tokens are in
            computed, num_hit = self.kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit
            if n > step.budget:
                if not self.enable_chunked_prefill:
                    break
                n = step.budget
            la = self.spec.lookahead(num_hit + n, self.max_model_len) if self.spec is not None else 0
            new_blocks = self.kv.allocate_slots(req, n + la, computed)
            if new_blocks is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            new = NewRequestData(
                token_ids=req.all_token_ids,
                num_prompt_tokens=req.num_prompt_tokens,
                sampling_params=req.sampling_params,
                eos_token_ids=req.eos_token_ids,
                sample_seed=req.sample_seed,
            )
            step.add(req, ScheduledRequest(req.request_id, num_hit, n, new_blocks, self._account(req, n), new), n)
        self.waiting.extendleft(reversed(passed))

    def _emit(self, step: "_StepBuilder") -> SchedulerOutput:
        """Number the step and attach the drop notices, unless nothing was scheduled."""
        self._preempted_ids_to_send += step.preempted
        out = SchedulerOutput(self._next_step_id, step.scheduled)
        if step.scheduled:
            out.finished_req_ids, self._finished_ids_to_send = self._finished_ids_to_send, []
            out.preempted_req_ids, self._preempted_ids_to_send = self._preempted_ids_to_send, []
            if self.num_grammar_requests:
                out.grammar_req_ids = [sr.req_id for sr in step.scheduled
                                       if sr.samples and step.reqs[sr.req_id].grammar is not None]
            if self.spec is not None:
                out.num_draft_tokens = sum(sr.num_draft_tokens for sr in step.scheduled)
            self._step_reqs[out.step_id] = step.reqs
            self._next_step_id += 1
            self.stats.num_steps += 1
            tokens = out.total_num_scheduled_tokens
            self.stats.num_scheduled_tokens += tokens
            if tokens > len(step.scheduled) + out.num_draft_tokens:
                self.stats.num_prefill_steps += 1
        # Else: nothing to run. That can still preempt (with two steps in flight, the only
        # schedulable request may need a block that an in-flight finished request holds);
        # the worker hears of it with the next step that is actually sent, before any
        # step that could resume the request.
        return out

    # -- results -----------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                           after_grammars: Optional[Callable[[], None]] = None,
                           refusals: Optional[Mapping[int, tuple[str, bool]]] = None) -> list[EngineCoreOutput]:
        """Apply a step's sampled tokens. ``after_grammars`` is called once the step's tokens
        have advanced the grammars of its constrained requests, before the rest of the
        bookkeeping (the engine core sends the next step's bitmask from there).
        ``refusals``: the step's tokens have advanced the grammars already (gated sampling's
        fill thread); the positions (in ``result``) a grammar refused, with the reason."""
        assert result.step_id == sched.step_id, "outputs must be applied in the order steps were scheduled"
        step_reqs = self._step_reqs.pop(sched.step_id)
        for req in step_reqs.values():
            req.num_inflight_steps -= 1
            assert req.num_inflight_steps >= 0

        outputs: list[EngineCoreOutput] = []  # one per request (its ids are unique in a step)
        kv = self.kv
        caching = kv.enable_prefix_caching
        max_len = self.max_model_len
        logprobs = result.logprobs
        finished = RequestStatus.FINISHED_STOPPED
        # The hot loop of every step (once per sampled request): _check_stop's common case
        # and cache_full_blocks' early return inlined.
        req_ids = result.req_ids
        if result.spec_token_ids is not None:  # a step that verified drafts
            assert self.spec is not None
            self.spec.apply(self, sched, result, step_reqs, outputs)
            req_ids = []
        if refusals is not None:
            refused: AbstractSet[int] = refusals.keys()
        else:
            refused = self._advance_grammars(req_ids, result.sampled_token_ids, step_reqs) \
                if self.num_grammar_requests else _NONE_REFUSED
        if after_grammars is not None:
            after_grammars()
        for k, (rid, token) in enumerate(zip(req_ids, result.sampled_token_ids)):
            req = step_reqs[rid]
            if req.status >= finished:  # req.is_finished, inlined (hot)
                self.stats.num_dropped_tokens += 1
                continue  # token after the end, or for an aborted request
            req.num_output_placeholders -= 1
            assert req.num_output_placeholders >= 0, f"placeholders went negative: {req}"
            if k in refused:
                outputs.append(self._grammar_refused(req, token, refusals.get(k) if refusals is not None else None))
                continue
            out_ids = req.output_token_ids
            out_ids.append(token)
            out = EngineCoreOutput(rid, [token], num_cached_tokens=req.num_cached_tokens)
            if logprobs is not None:
                out.logprobs.append(logprobs[k])
            outputs.append(out)
            num_tokens = len(req.prompt_token_ids) + len(out_ids)
            if len(out_ids) >= req.max_tokens or num_tokens >= max_len or token in req.stop_check_ids:
                status = self._check_stop(req, token)
                if status is not None:
                    self._finish(req, status)
                    out.finish_reason = status.finish_reason
                    out.stop_reason = req.stop_reason
                    continue
            if caching and num_tokens >= req.kv_publish_at and req.num_computed_tokens >= req.kv_publish_at:
                kv.cache_full_blocks(req, min(req.num_computed_tokens, num_tokens))

        if result.draft_token_ids:  # (speculative decoding, constrained requests)
            SpecScheduling.note_drafts(result, step_reqs)
        if result.prompt_logprobs:
            self._add_prompt_logprobs(sched, result, step_reqs, outputs)
        self._release_pending()
        return outputs

    def _advance_grammars(self, req_ids: list[str], tokens: list[int],
                          step_reqs: dict[str, Request]) -> AbstractSet[int]:
        """Advance the grammars of the step's live constrained requests by their tokens, in
        one batch; the positions (in ``req_ids``) whose token a grammar refused."""
        grammars: list[RequestGrammar] = []
        toks: list[int] = []
        where: list[int] = []
        finished = RequestStatus.FINISHED_STOPPED
        for k, rid in enumerate(req_ids):
            req = step_reqs[rid]
            if req.grammar is not None and req.status < finished:
                grammars.append(req.grammar)
                toks.append(tokens[k])
                where.append(k)
        if not grammars:
            return _NONE_REFUSED
        return {k for k, ok in zip(where, self.accept_grammar_tokens(grammars, toks)) if not ok}

    def _add_prompt_logprobs(self, sched: SchedulerOutput, result: ModelRunnerOutput, step_reqs: dict[str, Request],
                             outs: list[EngineCoreOutput]) -> None:
        """Attach the step's prompt logprobs to the requests' outputs (adding outputs as needed)."""
        outputs = {o.req_id: o for o in outs}
        starts = {sr.req_id: sr.num_computed_tokens for sr in sched.requests}
        for rid, plps in result.prompt_logprobs.items():
            req = step_reqs[rid]
            if req.is_finished and rid not in outputs:
                continue
            # The chunk covers positions start..; after a preemption it repeats some already sent.
            start, sent = starts[rid], req.num_prompt_logprobs_sent
            req.num_prompt_logprobs_sent = max(sent, start + len(plps))
            plps = plps[max(0, sent - start):]
            if not plps:
                continue
            plp_out = outputs.get(rid)
            if plp_out is None:
                plp_out = outputs[rid] = EngineCoreOutput(rid, [], num_cached_tokens=req.num_cached_tokens)
                outs.append(plp_out)
            plp_out.prompt_logprobs = plps

    def _grammar_refused(self, req: Request, token: int, reason: Optional[tuple[str, bool]] = None
                         ) -> EngineCoreOutput:
        """The sampled token breaks the request's constraint (the masked sampler cannot pick
        one unless no token at all was allowed): end the request, without the token.
        ``reason``: the grammar's explanation, when it was worked out already."""
        assert req.grammar is not None
        error, request_fault = reason or req.grammar.explain_refusal(token)
        logger.warning("request %s: %s", req.request_id, error)
        self._finish(req, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(req.request_id, [], finish_reason="error", error=error,
                                error_kind=INVALID_REQUEST if request_fault else None)

    def step_requests(self, step_id: int, req_ids: list[str]) -> list[Request]:
        """The requests ``req_ids`` of an in-flight step (finished ones included)."""
        reqs = self._step_reqs[step_id]
        return [reqs[rid] for rid in req_ids]

    def fail_step(self, sched: SchedulerOutput, error: str) -> list[EngineCoreOutput]:
        """A step raised: finish every live request it contained with an error."""
        step_reqs = self._step_reqs.pop(sched.step_id, {})
        if sched.num_draft_tokens:
            SpecScheduling.fail(sched, step_reqs)
        outs = []
        for req in step_reqs.values():
            req.num_inflight_steps -= 1
            # Blocks published at schedule time may never have been written: unpublish.
            self.kv.uncache(req)
            if not req.is_finished:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                outs.append(EngineCoreOutput(req.request_id, [], finish_reason="error", error=error))
        self._release_pending()
        return outs

    def abandon_step(self, sched: SchedulerOutput, error: str) -> list[EngineCoreOutput]:
        """A step whose launch was interrupted: the worker may have applied any part of it.

        Its requests fail (as in ``fail_step``), so the worker drops whatever state it made
        for them, and the drop notices the step carried are sent again with the next step
        (dropping an unknown request is a no-op for the worker, and the next step's drops
        come before its additions)."""
        self._finished_ids_to_send += sched.finished_req_ids
        self._preempted_ids_to_send += sched.preempted_req_ids
        return self.fail_step(sched, error)

    def _release_pending(self) -> None:
        still = []
        for req in self._pending_free:
            if req.num_inflight_steps == 0:
                self.kv.free(req)  # exactly once: the request left _pending_free
            else:
                still.append(req)
        self._pending_free = still

    def _check_stop(self, req: Request, token: int) -> Optional[RequestStatus]:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
