"""One step's results, still on their way from the device: the async host copy.

The model runner launches a step and returns an ``AsyncModelOutput`` at once. On CUDA it
has already queued the device-to-host copy of the sampled ids (and logprobs) on a side
stream into pinned memory, with an event; ``get()`` waits on that event only when the
engine needs the tokens. On the CPU there is no stream: the object holds finished tensors.
"""
from __future__ import annotations

from typing import Optional

import torch

from tandem.layers.sampler import LogprobsTensors
from tandem.types.runner_output import ModelRunnerOutput, SampledLogprobs


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
    ) -> None:
        self.step_id = step_id
        self.req_ids = req_ids
        self._event: Optional[torch.cuda.Event] = None
        tensors = [sampled]
        if logprobs is not None:
            tensors += [logprobs.token_ids, logprobs.logprobs, logprobs.ranks]
        for lp in prompt_logprobs.values():
            tensors += [lp.token_ids, lp.logprobs, lp.ranks]
        if copy_stream is not None:
            # The copy reads device tensors produced on the compute stream: order it after
            # them, and keep the sources alive (self._src) until the event has fired.
            copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(copy_stream):
                host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
                for h, t in zip(host, tensors):
                    h.copy_(t, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(copy_stream)
            self._src = tensors
        else:
            host = tensors
        self._host = host
        self._has_logprobs = logprobs is not None
        self._prompt_keys = list(prompt_logprobs.keys())

    def get(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
            self._src = []
        host = self._host
        out = ModelRunnerOutput(self.step_id, self.req_ids, host[0].tolist())
        k = 1
        if self._has_logprobs:
            out.logprobs = _to_lists(host[1], host[2], host[3])
            k = 4
        for rid in self._prompt_keys:
            out.prompt_logprobs[rid] = _to_lists(host[k], host[k + 1], host[k + 2])
            k += 3
        return out


def _to_lists(ids: torch.Tensor, lps: torch.Tensor, ranks: torch.Tensor) -> list[SampledLogprobs]:
    return [SampledLogprobs(i, l, r) for i, l, r in zip(ids.tolist(), lps.tolist(), ranks.tolist())]
