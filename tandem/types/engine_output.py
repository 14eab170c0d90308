"""What the engine core reports per request after each step (plain data).

The scheduler produces these from a step's ``ModelRunnerOutput``; the engine front end
turns them into user-facing ``RequestOutput``s (text, stop strings, logprobs). In a server
they cross from the engine-core process to the front end, in batches, once per step.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from tandem.types.runner_output import SampledLogprobs

# ``EngineCoreOutput.error_kind`` of an error that is the request's own fault (a JSON schema,
# regex or grammar that does not compile, ...): a server answers it with HTTP 400 and the
# message, the offline API raises ``ValueError``. Without a kind, an error is the engine's (500).
INVALID_REQUEST = "invalid_request"


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """What one step produced for one request.

    A msgspec struct encoded as an array (no field names on the wire): a serving front end
    decodes one per running request per step, which is the bulk of what it reads."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    logprobs: list[SampledLogprobs] = msgspec.field(default_factory=list)
    prompt_logprobs: list[SampledLogprobs] = msgspec.field(default_factory=list)
    num_cached_tokens: int = 0
    error: Optional[str] = None
    # Seconds the request waited before it was first scheduled: set on its first output,
    # when the engine tracks queue times (a server does, for /metrics).
    queue_time: Optional[float] = None
    error_kind: Optional[str] = None  # INVALID_REQUEST, or None: the engine's fault
