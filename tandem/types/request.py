"""The engine core's view of one request: its tokens, progress and lifecycle.

Invariants (checked in tests):
- ``num_output_placeholders >= 0``: tokens scheduled to be sampled but not yet seen by the CPU.
- ``num_computed_tokens <= num_tokens + num_output_placeholders``.
- A finished request never receives another token; its blocks are released once, after its
  last in-flight step (``Scheduler._finish``).
"""
from __future__ import annotations

import enum
from typing import Optional

from tandem.sampling_params import SamplingParams
from tandem.types.grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Waiting too, but not schedulable before its grammar has compiled (structured outputs).
    WAITING_FOR_GRAMMAR = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        max_tokens: int,
        sample_seed: Optional[int] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = list(eos_token_ids)
        self.max_tokens = max_tokens
        self.sample_seed = sample_seed
        # Token ids that may stop the request (stop ids, and EOS unless ignored): a received
        # token outside them, short of the length limits, needs no stop check.
        self.stop_check_ids = frozenset(sampling_params.stop_token_ids or ()).union(
            () if sampling_params.ignore_eos else self.eos_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_inflight_steps = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first scheduling
        self.num_preemptions = 0
        # Prompt positions whose logprobs were reported: a request resumed after preemption
        # recomputes its prompt, and those positions must not be reported twice.
        self.num_prompt_logprobs_sent = 0
        self.block_hashes: list[int] = []
        # The prefix cache's: no block of the request can be published before this many of
        # its tokens are real and computed (0: unknown; see KVCacheManager.cache_full_blocks).
        self.kv_publish_at = 0
        # Token slots of the blocks the request owns (the KV cache manager keeps it current),
        # so the scheduler sees without a lookup that a decode step needs no new block.
        self.kv_num_slots = 0
        # Structured outputs: the compiled constraint and its matcher state, advanced by every
        # received token (never by placeholders). Set by the engine core when the request
        # arrives; None for an unconstrained request.
        self.grammar: Optional[RequestGrammar] = None
        # Speculative decoding: steps in flight that verify drafts of this request (each
        # counted ``1 + k`` placeholders, the most it can emit; the rest are taken back, and
        # ``num_computed_tokens`` corrected, when its tokens arrive).
        self.spec_steps_in_flight = 0
        # The drafts the worker proposed after this request's latest step, when its grammar
        # must see them (a constrained request's masks cover its draft positions).
        self.spec_drafts: Optional[list[int]] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the CPU knows (prompt + received outputs)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}, "
                f"tokens={self.num_tokens}, placeholders={self.num_output_placeholders})")
