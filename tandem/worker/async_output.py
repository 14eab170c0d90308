"""One step's results, still on their way from the device: the async host copy.

The model runner launches a step and returns an ``AsyncModelOutput`` at once. On CUDA it
has already queued the device-to-host copy of the sampled ids (and logprobs) on a side
stream into pinned memory, with an event; ``get()`` waits on that event only when the
engine needs the tokens. The sampled ids land in a ring of pinned buffers allocated once
(allocating pinned memory per step costs milliseconds); a buffer is reused only after its
last reader called ``get()``. On the CPU there is no stream: the object holds finished
tensors.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from tandem.layers.sampler import LogprobsTensors
from tandem.types.runner_output import ModelRunnerOutput, SampledLogprobs

logger = logging.getLogger(__name__)


class HostBufferRing:
    """Pinned int64 buffers for sampled ids, handed out round robin."""

    def __init__(self, size: int, pinned: bool, depth: int = 4) -> None:
        self.size = size
        self.pinned = pinned
        self._bufs = [torch.empty(size, dtype=torch.int64, pin_memory=pinned) for _ in range(depth)] if pinned else []
        self._busy = [False] * len(self._bufs)
        self._next = 0

    def acquire(self, n: int) -> tuple[torch.Tensor, Optional[int]]:
        """A pinned buffer of at least ``n`` ids and its slot (None: a one-off buffer)."""
        if self._bufs and n <= self.size:
            slot = self._next
            if not self._busy[slot]:
                self._next = (slot + 1) % len(self._bufs)
                self._busy[slot] = True
                return self._bufs[slot], slot
        logger.debug("host buffer ring exhausted; allocating a one-off pinned buffer")
        return torch.empty(max(n, 1), dtype=torch.int64, pin_memory=self.pinned), None

    def release(self, slot: Optional[int]) -> None:
        if slot is not None:
            self._busy[slot] = False


class AsyncModelOutput:
    """Handle to one step's results; ``get()`` blocks only on that step's host copy."""

    def __init__(
        self,
        step_id: int,
        req_ids: list[str],
        sampled: torch.Tensor,
        logprobs: Optional[LogprobsTensors],
        prompt_logprobs: dict[str, LogprobsTensors],
        copy_stream: Optional[torch.cuda.Stream],
        ring: Optional[HostBufferRing] = None,
        spec: Optional[tuple[torch.Tensor, np.ndarray]] = None,
        drafts: Optional[tuple[torch.Tensor, list[tuple[str, int]]]] = None,
    ) -> None:
        """``spec``: a step that verified drafts: the number of tokens each request emits
        (device) and its number of sampled rows (host); ``sampled`` then has one id per row."""
        self.step_id = step_id
        self.req_ids = req_ids
        self._event: Optional[torch.cuda.Event] = None
        self._ring = ring
        self._slot: Optional[int] = None
        tensors = []
        self._spec_rows = spec[1] if spec is not None else None
        if spec is not None:
            tensors.append(spec[0])
        # Constrained requests' next drafts ([S, k] for every sampling request; (id, index) of those wanted).
        self._draft_of = drafts[1] if drafts is not None else None
        if drafts is not None:
            tensors.append(drafts[0])
        if logprobs is not None:
            tensors += [logprobs.token_ids, logprobs.logprobs, logprobs.ranks]
        for lp in prompt_logprobs.values():
            tensors += [lp.token_ids, lp.logprobs, lp.ranks]
        n = sampled.shape[0]
        if copy_stream is not None:
            # The copy reads device tensors produced on the compute stream: order it after
            # them, and keep the sources alive (self._src) until the event has fired.
            copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(copy_stream):
                if ring is not None:
                    buf, self._slot = ring.acquire(n)
                    sampled_host = buf[:n]
                else:
                    sampled_host = torch.empty(n, dtype=torch.int64, pin_memory=True)
                sampled_host.copy_(sampled, non_blocking=True)
                host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
                for h, t in zip(host, tensors):
                    h.copy_(t, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(copy_stream)
            self._src = [sampled] + tensors
        else:
            sampled_host, host = sampled, tensors
        self._sampled = sampled_host
        self._host = host
        self._has_logprobs = logprobs is not None
        self._prompt_keys = list(prompt_logprobs.keys())
        self._result: Optional[ModelRunnerOutput] = None

    @property
    def copy_event(self) -> Optional[torch.cuda.Event]:
        """Recorded on the side stream after the host copies (None on the CPU)."""
        return self._event

    def get(self) -> ModelRunnerOutput:
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
            self._src = []
        out = ModelRunnerOutput(self.step_id, self.req_ids, self._sampled.tolist())
        host = self._host
        k = 0
        if self._spec_rows is not None:
            emitted = host[0].tolist()
            k = 1
        if self._draft_of is not None:
            proposed = host[k].tolist()
            out.draft_token_ids = {rid: proposed[i] for rid, i in self._draft_of}
            k += 1
        if self._has_logprobs:
            out.logprobs = _to_lists(host[k], host[k + 1], host[k + 2])
            k += 3
        if self._spec_rows is not None:
            _split_spec(out, emitted, self._spec_rows)
        for rid in self._prompt_keys:
            out.prompt_logprobs[rid] = _to_lists(host[k], host[k + 1], host[k + 2])
            k += 3
        # Released only once everything is read: a get() interrupted by Ctrl-C runs again
        # later and must find its pinned buffer untouched by a newer step.
        self._result = out
        if self._ring is not None:
            self._ring.release(self._slot)
            self._ring = None
        return out


def _split_spec(out: ModelRunnerOutput, emitted: list[int], num_rows: np.ndarray) -> None:
    """One list of emitted tokens (and logprobs) per request, from one id per sampled row."""
    flat, lps = out.sampled_token_ids, out.logprobs
    starts = (np.cumsum(num_rows) - num_rows).tolist()
    out.spec_token_ids = [flat[s:s + e] for s, e in zip(starts, emitted)]
    out.sampled_token_ids = [t[0] for t in out.spec_token_ids]
    if lps is not None:
        out.spec_logprobs = [lps[s:s + e] for s, e in zip(starts, emitted)]
        out.logprobs = [x[0] for x in out.spec_logprobs]


def _to_lists(ids: torch.Tensor, lps: torch.Tensor, ranks: torch.Tensor) -> list[SampledLogprobs]:
    return [SampledLogprobs(i, lp, r) for i, lp, r in zip(ids.tolist(), lps.tolist(), ranks.tolist())]
