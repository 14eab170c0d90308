"""What a worker sends back up for one step: sampled ids and logprobs (plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import msgspec


class SampledLogprobs(msgspec.Struct, array_like=True):
    """Top-n logprobs at one position: column 0 is the sampled (or prompt) token.

    A msgspec struct (encoded as an array): one per request per step crosses to the front
    end when logprobs are asked for, so it decodes cheaply there."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    step_id: int
    req_ids: list[str]  # requests that sampled this step, in batch order
    sampled_token_ids: list[int]
    logprobs: Optional[list[SampledLogprobs]] = None  # aligned with req_ids, when any request asked
    # req_id -> logprobs of prompt positions covered by this step's chunk (target = next prompt token)
    prompt_logprobs: dict[str, list[SampledLogprobs]] = field(default_factory=dict)
    # A step that verified drafts: every sampling request's emitted tokens (the accepted
    # drafts and one token of the target's own, 1..1+k of them) and their logprobs, aligned
    # with req_ids; ``sampled_token_ids`` then holds each one's first token.
    spec_token_ids: Optional[list[list[int]]] = None
    spec_logprobs: Optional[list[list[SampledLogprobs]]] = None
    # Speculative decoding: the drafts proposed for each constrained request's next step.
    draft_token_ids: Optional[dict[str, list[int]]] = None
