"""Core outputs in, ``RequestOutput``s out: detokenize, stop strings, logprobs, ``n > 1``.

The output processor owns the front end's view of every live request. For each batch of
``EngineCoreOutput``s it appends tokens, decodes them incrementally, checks stop strings,
assembles logprobs and aggregates the children of an ``n > 1`` request into one
``RequestOutput``. It never talks to the core itself: what the core must be told (abort a
request that hit a stop string, add the siblings held back until the first child computed
the shared prompt) comes back in ``ProcessedOutputs`` for the caller to send, so the same
class serves the synchronous ``LLMEngine`` and the asyncio ``AsyncLLM``.

A request's text only grows: while a child is unfinished its text leaves out the last
``len(longest stop string) - 1`` characters, which could still turn out to start a stop
string, so a streamed prefix is never taken back.

Detokenization is lazy where nobody needs the text yet: with ``final_only`` (the offline
``LLM`` and the server's front end, which builds a stream's output only when its reader
reads it) a child without stop strings only collects its token ids, and the detokenizer
catches up on them when an output is built. Feeding the same ids later, all at once, gives
the same text as feeding them one step at a time (the detokenizer is a pure function of the
id sequence, and without stop strings nothing depends on the text before it is read), while
the engine's step loop no longer pays a decode call per request per step. A child with
stop strings is decoded at every step: a match must stop the request in the core.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.input_processor import ProcessedRequest
from tandem.engine.messages import EngineCoreRequest
from tandem.engine.stats import FinishedRequestStats, IterationStats
from tandem.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.types.engine_output import EngineCoreOutput
from tandem.types.runner_output import SampledLogprobs


@dataclass
class _Child:
    index: int
    core_id: str
    params: SamplingParams
    detok: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[PositionLogprobs]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    # Nothing to do per token but keep it: no stop strings, no logprobs of any kind (set
    # in __post_init__; the hot path of a lazy ``process_outputs``).
    plain: bool = False

    def __post_init__(self) -> None:
        self.plain = (self.logprobs is None and self.params.prompt_logprobs is None
                      and (self.detok is None or not self.detok.stop))

    def finished_stats(self, reason: str, state: "RequestState", now: float) -> FinishedRequestStats:
        n = len(self.token_ids)
        tpot = 0.0
        if n > 1 and self.first_token_time is not None and self.last_token_time is not None:
            tpot = (self.last_token_time - self.first_token_time) / (n - 1)
        return FinishedRequestStats(reason, now - state.arrival_time, len(state.prompt_token_ids), n, tpot)


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[_Child]
    pending: list[EngineCoreRequest]  # children held back until the first has computed the prompt
    arrival_time: float
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None
    error_kind: Optional[str] = None
    first_token_time: Optional[float] = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # With ``final_only``: unfinished requests that changed, whose output ``make_output``
    # builds when (and if) someone reads it.
    updated: list[str]
    core_aborts: list[str]  # core requests to stop (a stop string matched)
    core_adds: list[EngineCoreRequest]  # siblings released now that their prompt is cached
    stats: IterationStats


class OutputProcessor:
    def __init__(self, tokenizer: Any, share_prompt_blocks: bool, log_stats: bool = True) -> None:
        self.tokenizer = tokenizer
        # Off: no ``IterationStats`` are gathered (the offline engine reads none).
        self.log_stats = log_stats
        # With prefix caching, an n > 1 request runs its first child alone until the prompt
        # is computed; the siblings then hit its cached blocks instead of recomputing it.
        self.share_prompt_blocks = share_prompt_blocks
        self.requests: dict[str, RequestState] = {}
        self._child_of: dict[str, tuple[RequestState, _Child]] = {}
        self._aborted: list[FinishedRequestStats] = []  # reported with the next batch's stats

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, req: ProcessedRequest, arrival_time: Optional[float] = None) -> list[EngineCoreRequest]:
        """Track a validated request; return the core requests to send now."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use by a running request")
        params = req.params
        children = []
        for i, cr in enumerate(req.core_requests):
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                )
            children.append(_Child(i, cr.request_id, params, detok,
                                   logprobs=[] if params.logprobs is not None else None))
        share = len(req.core_requests) > 1 and self.share_prompt_blocks
        now_send = req.core_requests[:1] if share else list(req.core_requests)
        state = RequestState(req.request_id, req.prompt, req.prompt_token_ids, children,
                             req.core_requests[1:] if share else [],
                             time.monotonic() if arrival_time is None else arrival_time,
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.requests[req.request_id] = state
        for c in children:
            self._child_of[c.core_id] = (state, c)
        return now_send

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; return its core ids to abort (none if unknown or finished)."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        now = time.monotonic()
        for c in state.children:
            if c.finish_reason is None and self.log_stats:
                self._aborted.append(c.finished_stats("abort", state, now))
        self._forget(state)
        return [c.core_id for c in state.children]

    def fail_all(self, error: str) -> list[RequestOutput]:
        """The core is gone: finish every live request with ``error``."""
        outs = []
        for state in list(self.requests.values()):
            state.error = error
            for c in state.children:
                if c.finish_reason is None:
                    c.finish_reason = "error"
            outs.append(self._make_output(state))
            self._forget(state)
        return outs

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for c in state.children:
            self._child_of.pop(c.core_id, None)

    # -- outputs -------------------------------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput], final_only: bool = False) -> ProcessedOutputs:
        """``final_only``: build a ``RequestOutput`` only for requests that finished (offline
        generation reads nothing else; building one per request per step copies every
        token list and costs a large share of a step's host time at high batch sizes)."""
        now = time.monotonic()
        result = ProcessedOutputs([], [], [], [], IterationStats())
        result.stats.finished, self._aborted = self._aborted, []
        touched: dict[str, RequestState] = {}
        child_of = self._child_of
        log_stats = self.log_stats
        for out in outputs:
            entry = child_of.get(out.req_id)
            if entry is None:
                continue  # aborted by the caller after the step was launched
            state, child = entry
            if (final_only and child.plain and out.finish_reason is None and out.error is None
                    and out.queue_time is None and child.finish_reason is None and not state.pending):
                # _apply's whole effect on a plain child's ordinary step, inlined (hot).
                new_ids = out.new_token_ids
                if new_ids:
                    child.token_ids += new_ids
                    if log_stats:
                        self._note_tokens(state, child, len(new_ids), now, result.stats)
                    if child.index == 0:
                        state.num_cached_tokens = out.num_cached_tokens
            else:
                self._apply(state, child, out, now, result, final_only)
            touched[state.request_id] = state
        updated = result.updated
        for rid, state in touched.items():
            children = state.children
            if (children[0].finish_reason is not None if len(children) == 1  # state.finished, inlined (hot)
                    else state.finished):
                result.request_outputs.append(self._make_output(state))
                self._forget(state)
            elif final_only:
                updated.append(rid)
            else:
                result.request_outputs.append(self._make_output(state))
        return result

    def make_output(self, request_id: str) -> RequestOutput:
        """The current output of a live request."""
        return self._make_output(self.requests[request_id])

    def _apply(self, state: RequestState, child: _Child, out: EngineCoreOutput, now: float,
               result: ProcessedOutputs, lazy: bool = False) -> None:
        """Add one core output to ``child``. ``lazy``: leave detokenization to whoever builds
        an output, unless the child has stop strings (see the module doc)."""
        if child.finish_reason is not None:
            return
        if out.error is not None:
            state.error, state.error_kind = out.error, out.error_kind
        if out.queue_time is not None:
            result.stats.queue_times.append(out.queue_time)
        if out.prompt_logprobs and state.prompt_logprobs is not None and child.index == 0:
            n = child.params.prompt_logprobs or 0
            state.prompt_logprobs.extend(self._convert_logprobs(lp, n) for lp in out.prompt_logprobs)
        new_ids = out.new_token_ids
        if new_ids:
            if self.log_stats:
                self._note_tokens(state, child, len(new_ids), now, result.stats)
            if child.index == 0:
                state.num_cached_tokens = out.num_cached_tokens
                if state.pending:  # the prompt is computed and cached now: release the siblings
                    result.core_adds += state.pending
                    state.pending = []
        detok = child.detok
        if detok is None or not detok.stop:  # no stop strings: nothing to match per token
            child.token_ids += new_ids
            if child.logprobs is not None:
                num = child.params.logprobs or 0
                child.logprobs += [self._convert_logprobs(lp, num) for lp in out.logprobs[:len(new_ids)]]
            if detok is not None and not lazy:
                self._catch_up(child)
            if out.finish_reason is not None:
                self._end(state, child, out, now, result)
            return
        for k, tok in enumerate(new_ids):
            child.token_ids.append(tok)
            if child.logprobs is not None and k < len(out.logprobs):
                child.logprobs.append(self._convert_logprobs(out.logprobs[k], child.params.logprobs or 0))
            if child.detok is not None:
                matched = child.detok.update([tok])
                if matched is not None:
                    # Stop string: finish here and tell the core to stop the request.
                    keep = len(child.detok.output_token_ids)
                    del child.token_ids[keep:]
                    if child.logprobs is not None:
                        del child.logprobs[keep:]
                    if out.finish_reason is None:
                        result.core_aborts.append(child.core_id)
                    self._finish(state, child, "stop", matched, now, result.stats)
                    return
        if out.finish_reason is not None:
            self._end(state, child, out, now, result)

    def _end(self, state: RequestState, child: _Child, out: EngineCoreOutput, now: float,
             result: ProcessedOutputs) -> None:
        """The core finished ``child`` (``out.finish_reason``)."""
        assert out.finish_reason is not None
        self._finish(state, child, out.finish_reason, out.stop_reason, now, result.stats)
        if state.pending and out.finish_reason == "error":
            # The first child failed before computing the prompt: its siblings never started.
            state.pending = []
            for c in state.children[1:]:
                self._finish(state, c, "error", None, now, result.stats)

    @staticmethod
    def _catch_up(child: _Child) -> None:
        """Feed the detokenizer the ids it has not seen (a child without stop strings)."""
        detok = child.detok
        if detok is not None and detok.num_output_tokens < len(child.token_ids):
            detok.update(child.token_ids[detok.num_output_tokens:])

    @staticmethod
    def _note_tokens(state: RequestState, child: _Child, n: int, now: float, stats: IterationStats) -> None:
        stats.num_generation_tokens += n
        if state.first_token_time is None:
            state.first_token_time = now
            stats.time_to_first_tokens.append(now - state.arrival_time)
            stats.num_prompt_tokens += len(state.prompt_token_ids)
        if child.last_token_time is not None:
            stats.inter_token_latencies.append(now - child.last_token_time)
        if child.first_token_time is None:
            child.first_token_time = now
        child.last_token_time = now

    def _finish(self, state: RequestState, child: _Child, reason: str, stop_reason: Optional[int | str], now: float,
                stats: IterationStats) -> None:
        child.finish_reason, child.stop_reason = reason, stop_reason
        if self.log_stats:
            stats.finished.append(child.finished_stats(reason, state, now))

    def _convert_logprobs(self, lp: SampledLogprobs, num: int) -> PositionLogprobs:
        """The chosen token plus this request's own top-``num`` (the batch computed the max)."""
        d: PositionLogprobs = {}
        for j, (tid, val) in enumerate(zip(lp.token_ids[: num + 1], lp.logprobs[: num + 1])):
            rank = lp.rank if j == 0 else j
            if tid not in d:
                d[tid] = Logprob(val, rank, self.tokenizer.decode([tid]))
        return d

    def _make_output(self, state: RequestState) -> RequestOutput:
        outs = []
        for c in state.children:
            self._catch_up(c)
            text = c.detok.get_next_output_text(c.finish_reason is not None, delta=False) if c.detok else ""
            outs.append(CompletionOutput(c.index, text, list(c.token_ids),
                                         None if c.logprobs is None else list(c.logprobs),
                                         c.finish_reason, c.stop_reason))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, state.prompt_logprobs,
                             outs, state.finished, state.num_cached_tokens, state.error, state.error_kind)
