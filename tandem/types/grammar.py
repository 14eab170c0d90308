"""Structured outputs as plain data: what the engine core tells the workers for a step whose
requests are constrained, and what the scheduler may ask of a request's grammar.

The grammar work itself (compiling, matching, filling bitmasks) lives in
``tandem.structured_output``, in the engine core; the workers only apply a bitmask to the
logits. A step with constrained requests is run either in two calls, the forward pass
(``execute_model``) and then ``sample_tokens(GrammarOutput)`` once the bitmask is known
(split), or in one call whose sampling waits for the bitmask behind a gate (gated sampling,
a worker in the engine's process: ``SchedulerOutput.grammar``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol


@dataclass
class GrammarOutput:
    """The token bitmask of one step's constrained requests, for ``sample_tokens``.

    Row ``i`` of ``bitmask`` belongs to ``req_ids[i]``; bit ``t % 32`` of word ``t // 32`` is
    1 when token ``t`` is allowed (xgrammar's and llguidance's layout). Requests of the step
    that sample but are not listed are unconstrained.
    """

    step_id: int
    req_ids: list[str]
    # torch.Tensor int32 [len(req_ids), ceil(vocab_size / 32)], on the host. Typed Any so this
    # module imports no torch (the codec sends tensors as raw buffers).
    bitmask: Any
    # Speculative decoding: request ``i`` owns ``num_rows[i]`` consecutive rows (its last
    # position and each draft position, in order), of which the first ``num_valid_drafts[i]``
    # drafts are allowed by its grammar; later drafts are cut (never accepted). None: one row each.
    num_rows: Optional[list[int]] = None
    num_valid_drafts: Optional[list[int]] = None
    # Gated sampling (``SchedulerOutput.grammar``): the bitmask is still being filled when the
    # worker gets it; ``gate`` says when it is done (a ``BitmaskGate``; typed Any for the
    # codec, though a gated output never leaves the process). None: filled.
    gate: Any = None


class BitmaskGate(Protocol):
    """When a gated step's bitmask is filled: once ``flag[0] >= seq``. ``flag`` is a
    one-element int32 torch tensor in host memory (pinned for a CUDA worker, which waits on
    the device: ``tandem.kernels.host_flag``)."""

    flag: Any
    seq: int
    pinned: bool  # the flag and the bitmask are in pinned memory (the device can read them)

    def wait(self) -> None:
        """Block the calling thread until the bitmask is filled (a CPU worker)."""


class RequestGrammar(Protocol):
    """What the scheduler needs of one request's grammar (``Request.grammar``)."""

    @property
    def is_ready(self) -> bool:
        """Compilation has ended, successfully or not (``error`` says which)."""

    @property
    def error(self) -> Optional[str]:
        """The compiler's one-line message when the constraint did not compile."""

    # Whether ``error`` is the request's fault (a bad schema: HTTP 400), not the engine's
    # (the backend could not be built: 500).
    error_is_request_fault: bool

    def accept_token(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""

    def explain_refusal(self, token: int) -> tuple[str, bool]:
        """After ``accept_token(token)`` was False: a one-line reason, and whether it is the
        request's fault (no token of the vocabulary can continue its constraint)."""
