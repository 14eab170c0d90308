"""Front-end request statistics, gathered per output batch for a ``StatLogger`` (e.g. Prometheus).

The core's own numbers (running/waiting, KV blocks, steps launched ahead, idle time) come
in ``CoreStats`` with each batch; these are the ones only the front end can see: when a
request arrived, when its tokens reached the caller, how it ended.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tandem.engine.messages import CoreStats


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # Seconds from the first to the last token over the tokens after the first (vLLM's
    # mean_time_per_output_token); 0 with fewer than two tokens.
    time_per_output_token: float = 0.0


@dataclass
class IterationStats:
    """What one output batch did, front-end side."""

    num_prompt_tokens: int = 0  # prompts whose first token arrived in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)  # seconds each newly scheduled request waited
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, core: CoreStats, iteration: IterationStats) -> None: ...
