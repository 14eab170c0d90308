"""Per-request generation settings, mirroring vLLM's ``SamplingParams``.

Validation happens here, at construction, so a bad request fails before it reaches the
scheduler with a message that names the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature == 0`` means greedy decoding. ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``seed`` makes the request's sampling reproducible regardless of which
    other requests share its batch (and of async scheduling and preemption): the noise for
    output token ``i`` is derived from ``(seed, i)`` alone.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def clone(self, **changes: object) -> "SamplingParams":
        data = {f: getattr(self, f) for f in self.__dataclass_fields__}
        data.update(changes)
        data["stop"] = list(data["stop"])  # type: ignore[arg-type]
        data["stop_token_ids"] = list(data["stop_token_ids"])  # type: ignore[arg-type]
        return SamplingParams(**data)  # type: ignore[arg-type]
