"""The plain data that crosses between the front end and the engine core (thread or process).

Both directions are batched: the front end sends one ``CoreInput`` with every request added
or aborted since its last message; the core sends one ``CoreOutputBatch`` per step that
produced outputs, carrying every request's ``EngineCoreOutput`` plus a ``CoreStats``
snapshot for /metrics, and a heartbeat batch every second. Everything here is ids, numbers,
lists and dataclasses, so it can be encoded for a typed channel unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tandem.sampling_params import SamplingParams
from tandem.types.engine_output import EngineCoreOutput
from tandem.types.request import Request


class EngineDeadError(RuntimeError):
    """The engine core is gone (crashed, killed or hung); no request can make progress."""


class EngineStartError(RuntimeError):
    """The engine core could not start (its error, with the core's traceback, is the message)."""


@dataclass
class EngineCoreRequest:
    """One core request, as the input processor built it (a child of an ``n > 1`` request is one too)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int
    sample_seed: Optional[int] = None

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params, self.eos_token_ids,
                       self.max_tokens, self.sample_seed)


@dataclass
class CoreInput:
    """Front end -> core: everything to add or abort since the last message."""

    adds: list[EngineCoreRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    shutdown: bool = False

    def __bool__(self) -> bool:
        return bool(self.adds or self.aborts or self.shutdown)


@dataclass
class CoreStats:
    """A snapshot of the core after a step. Counters are totals since the core started."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    num_steps_launched: int = 0
    # Steps launched while an earlier step's output was still unread: the overlap.
    num_steps_launched_ahead: int = 0
    num_step_errors: int = 0
    idle_seconds: float = 0.0  # time the loop waited for input with no work to do
    # Seconds each request spent waiting before it was first scheduled, since the last batch.
    queue_times: list[float] = field(default_factory=list)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


@dataclass
class CoreOutputBatch:
    """Core -> front end: one step's outputs and a stats snapshot, or (``stats`` None) a heartbeat."""

    outputs: list[EngineCoreOutput]
    stats: Optional[CoreStats]
    # Set when the core loop itself failed and is exiting: every pending request is lost.
    fatal_error: Optional[str] = None
    busy_s: float = 0.0  # heartbeats: how long the step now running has run (0: between steps)
