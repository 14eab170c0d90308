"""The plain data that crosses between a front end and the engine core (thread or process).

Both directions are batched: a front end sends one ``CoreInput`` with every request added
or aborted since its last message; the core sends each front end one ``CoreOutputBatch``
per step in which that front end's requests produced outputs (a server may run several
API-server processes, each a front end with its own ``client_index``), carrying those
requests' ``EngineCoreOutput``s and a ``CoreStats`` snapshot for /metrics, plus a heartbeat
every second. Everything here is a msgspec struct of ids, numbers and lists (the sampling
parameters travel as their validated fields), so a front end decodes a step's batch in one
call into typed objects, with no per-field Python code.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from tandem.sampling_params import SamplingParams
from tandem.types.engine_output import EngineCoreOutput
from tandem.types.request import Request


DEFAULT_HEARTBEAT_S = 1.0  # how often the core tells each front end it is alive


class EngineDeadError(RuntimeError):
    """The engine core is gone (crashed, killed or hung); no request can make progress."""


class EngineStartError(RuntimeError):
    """The engine core could not start (its error, with the core's traceback, is the message)."""


class EngineCoreRequest(msgspec.Struct):
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


class CoreInput(msgspec.Struct):
    """Front end -> core: everything to add or abort since the last message.

    ``client_index`` says which front end sent it, so the core sends that front end, and only
    it, its requests' outputs. A front end's first message says ``hello`` (the core starts
    sending it heartbeats) and its last, if it leaves before the core stops, ``goodbye`` (the
    core aborts what it still has running and stops sending to it)."""

    adds: list[EngineCoreRequest] = msgspec.field(default_factory=list)
    aborts: list[str] = msgspec.field(default_factory=list)
    shutdown: bool = False
    client_index: int = 0
    hello: bool = False
    goodbye: bool = False

    def __bool__(self) -> bool:
        return bool(self.adds or self.aborts or self.shutdown or self.hello or self.goodbye)


class CoreStats(msgspec.Struct, array_like=True):
    """A snapshot of the core after a step. Counters are totals since the core started, so
    any front end can report the whole server's numbers from its latest snapshot."""

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
    # Speculative decoding (totals; all 0 without it): proposals verified, draft tokens in
    # them, of which accepted, and accepted by position in the proposal.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)
    # Steps with prompt tokens beyond one token per request (``SchedulerStats.num_prefill_steps``).
    num_prefill_steps: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0


class CoreOutputBatch(msgspec.Struct, array_like=True):
    """Core -> one front end: one step's outputs of its requests and a stats snapshot; or a
    heartbeat (``heartbeat``: no outputs, the newest snapshot, ``busy_s``)."""

    outputs: list[EngineCoreOutput]
    stats: CoreStats
    # Set when the core loop itself failed and is exiting: every pending request is lost.
    fatal_error: Optional[str] = None
    heartbeat: bool = False
    busy_s: float = 0.0  # heartbeats: how long the step now running has run (0: between steps)
