"""The scheduler's side of speculative decoding: how many drafts a request verifies in a
step, and how a verify step's tokens are applied.

A request verifying ``k`` drafts is scheduled ``1 + k`` tokens (its last real token, whose
id may still be a placeholder on the device, and the ``k`` drafts the worker's proposer
wrote after it) and counts ``1 + k`` output placeholders: the most the step can emit. When
its tokens arrive (``1 + a`` of them, ``a`` drafts accepted), the other ``k - a``
placeholders are taken back and ``num_computed_tokens`` goes back by as many: the rejected
positions' KV slots are free for the next step to overwrite. The scheduler never needs the
drafts themselves, so async scheduling works unchanged: a step scheduled while a verify step
is in flight has positions that are optimistic by that step's rejected count, and the
worker, which knows the count on the device, subtracts it (``ScheduledRequest.correct_drafts``).

``k`` is capped so that no step can emit past ``max_tokens`` or ``max_model_len`` (counting
every placeholder as a token), and is 0 for prefill chunks and in steps with at least
``disable_by_batch_size`` running requests. A constrained request speculates too: the
worker returns the drafts it proposed for it (``note_drafts``), and the engine core masks
each draft position with the grammar's state after the drafts before it, cutting drafts the
grammar refuses (``StructuredOutputManager.grammar_output``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from tandem.types.engine_output import EngineCoreOutput
from tandem.types.request import Request, RequestStatus
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from tandem.scheduler.scheduler import Scheduler

WAIT = -1  # ``num_drafts``: do not schedule the request in this step


@dataclass
class SpecStats:
    """Totals since the engine started (vLLM's names: one draft = one request's proposal)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose position i was accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class SpecScheduling:
    """Draft counts per request (``num_drafts``) and the application of verify steps."""

    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: Optional[int],
                 num_lookahead_slots: int = 0) -> None:
        self.k = num_speculative_tokens
        self.num_lookahead_slots = num_lookahead_slots
        self.disable_by_batch_size = disable_by_batch_size
        self.stats = SpecStats(accepted_per_position=[0] * num_speculative_tokens)

    def lookahead(self, num_tokens: int, max_model_len: int) -> int:
        """KV slots to allocate past a step's ``num_tokens`` positions: a draft model writes
        its proposals' KV there (``tandem.worker.speculative.DraftProposer``)."""
        return max(0, min(self.num_lookahead_slots, max_model_len - num_tokens))

    def enabled_for_step(self, num_running: int) -> bool:
        return self.disable_by_batch_size is None or num_running < self.disable_by_batch_size

    def num_drafts(self, req: Request, n_out: int, n_tok: int, budget: int, max_model_len: int, on: bool) -> int:
        """Drafts ``req`` verifies in a decode step (``n_out``/``n_tok``: its output and
        total token counts with placeholders), or ``WAIT``.

        WAIT: a request short of ``min_tokens`` whose verify step is in flight. Which
        positions must forbid EOS depends on that step's accepted count, which only the
        device knows yet; waiting one step for it keeps the host's mask exact."""
        if req.spec_steps_in_flight and len(req.output_token_ids) < req.sampling_params.min_tokens:
            return WAIT
        if not on:
            return 0
        return max(0, min(self.k, req.max_tokens - n_out - 1, max_model_len - n_tok - 1, budget - 1))

    def account(self, req: Request, k: int) -> None:
        """A verify step of ``1 + k`` tokens was scheduled for ``req`` (already advanced)."""
        req.num_output_placeholders += 1 + k
        if k:
            req.spec_steps_in_flight += 1

    @staticmethod
    def note_drafts(result: ModelRunnerOutput, step_reqs: dict[str, Request]) -> None:
        """Keep the drafts the worker proposed for constrained requests (their next masks
        cover the draft positions)."""
        assert result.draft_token_ids is not None
        for rid, drafts in result.draft_token_ids.items():
            req = step_reqs.get(rid)
            if req is not None:
                req.spec_drafts = drafts

    def apply(self, sched: "Scheduler", so: SchedulerOutput, result: ModelRunnerOutput,
              step_reqs: dict[str, Request], outputs: list[EngineCoreOutput]) -> None:
        """Apply a verify step's tokens: each request's emitted run, token by token, as
        plain decoding would have received them (a stop ends the run there). Appends one
        output per request that is still live to ``outputs``."""
        assert result.spec_token_ids is not None
        drafts = {sr.req_id: sr.num_draft_tokens for sr in so.requests if sr.num_draft_tokens}
        for rid, k in drafts.items():
            step_reqs[rid].spec_steps_in_flight -= 1
        stats = self.stats
        for i, rid in enumerate(result.req_ids):
            req = step_reqs[rid]
            tokens = result.spec_token_ids[i]
            k = drafts.get(rid, 0)
            if k:
                accepted = len(tokens) - 1
                stats.num_drafts += 1
                stats.num_draft_tokens += k
                stats.num_accepted_tokens += accepted
                for p in range(accepted):
                    stats.accepted_per_position[p] += 1
            if req.is_finished:
                sched.stats.num_dropped_tokens += len(tokens)
                continue  # tokens after the end, or for an aborted request
            req.num_output_placeholders -= 1 + k
            assert req.num_output_placeholders >= 0, f"placeholders went negative: {req}"
            out = EngineCoreOutput(rid, [], num_cached_tokens=req.num_cached_tokens)
            outputs.append(out)
            lps = result.spec_logprobs[i] if result.spec_logprobs is not None else None
            for j, token in enumerate(tokens):
                if req.grammar is not None and not req.grammar.accept_token(token):
                    refused = sched._grammar_refused(req, token)
                    out.finish_reason, out.error, out.error_kind = "error", refused.error, refused.error_kind
                    break
                req.output_token_ids.append(token)
                out.new_token_ids.append(token)
                if lps is not None:
                    out.logprobs.append(lps[j])
                status = sched._check_stop(req, token)
                if status is not None:
                    sched._finish(req, status)
                    out.finish_reason = status.finish_reason
                    out.stop_reason = req.stop_reason
                    break
            if req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:  # (preempted: recomputed from 0 anyway)
                req.num_computed_tokens -= 1 + k - len(tokens)
            sched.kv.cache_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))

    @staticmethod
    def fail(so: SchedulerOutput, step_reqs: dict[str, Request]) -> None:
        for sr in so.requests:
            if sr.num_draft_tokens and sr.req_id in step_reqs:
                step_reqs[sr.req_id].spec_steps_in_flight -= 1
