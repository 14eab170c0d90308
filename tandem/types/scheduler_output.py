"""What the scheduler sends down to the workers for one step (plain data).

It crosses process boundaries unchanged, so it holds only ids, ints and lists (a gated
step's ``grammar``, which holds tensors, never leaves the engine's process). During decode
only the delta travels: a cached request sends its new block ids, never its tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import msgspec

from tandem.sampling_params import SamplingParams
from tandem.types.grammar import GrammarOutput


@dataclass
class NewRequestData:
    """Everything a worker needs to (re)build a request's state.

    For a request resumed after preemption, ``token_ids`` holds the prompt and every output
    token the scheduler has *received* (never placeholders): the scheduler only resumes a
    request once no step of it is in flight, so this is exactly what the worker confirmed.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    sample_seed: Optional[int]


class ScheduledRequest(msgspec.Struct):
    """One request's share of a step. A msgspec struct: the scheduler builds one per running
    request per step (256 a step at full batch), and a struct is built in C, a dataclass
    in Python (several times slower)."""

    req_id: str
    num_computed_tokens: int  # tokens with KV before this step (= first position computed now)
    num_scheduled_tokens: int
    new_block_ids: list[int]  # appended to the request's block table (all of it when ``new``)
    samples: bool  # this step reaches the end of the request's tokens, so it samples one
    new: Optional[NewRequestData] = None
    # Speculative decoding: the last ``num_draft_tokens`` scheduled positions hold the
    # proposer's drafts (the worker put them in its token table), and the step samples at
    # each of the ``1 + num_draft_tokens`` positions. ``correct_drafts``: the request's
    # previous step (still in flight when this one was scheduled) verified drafts, so every
    # position here is optimistic by that step's rejected count, which the worker subtracts
    # on the device (async scheduling).
    num_draft_tokens: int = 0
    correct_drafts: bool = False


@dataclass
class SchedulerOutput:
    step_id: int
    requests: list[ScheduledRequest]
    finished_req_ids: list[str] = field(default_factory=list)  # worker drops their state first
    preempted_req_ids: list[str] = field(default_factory=list)
    # Constrained requests that sample in this step. When there are any, the worker runs only
    # the forward pass in ``execute_model`` and samples in ``sample_tokens(GrammarOutput)``,
    # once the engine core has filled their bitmask; when empty, one call does both.
    grammar_req_ids: list[str] = field(default_factory=list)
    num_draft_tokens: int = 0  # over all requests: > 0 makes the worker verify drafts
    # Gated sampling (a worker in the engine's process): the bitmask of ``grammar_req_ids``,
    # being filled while the forward runs; ``execute_model`` then samples too, behind its
    # gate, and no ``sample_tokens`` follows.
    grammar: Optional[GrammarOutput] = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests
