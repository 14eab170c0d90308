"""What the engine hands back to callers: one ``RequestOutput`` per prompt."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# For each generated (or prompt) position: {token_id: Logprob}.
@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: Optional[str] = None


PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sampled continuation of a prompt (``n > 1`` gives several)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[PositionLogprobs]]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[int | str] = None  # the stop token id or stop string that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: Optional[str] = None
    # "invalid_request" when ``error`` is the request's own fault (e.g. a JSON schema that
    # does not compile: a server answers 400); None when it is the engine's (500).
    error_kind: Optional[str] = None
