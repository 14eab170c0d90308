"""The worker's persistent per-request state and the device-side token table.

Every request the worker knows owns one *row* of ``token_table`` (``[rows, max_model_len+1]``
on the device) for as long as it lives on the worker. Prompt tokens are written there when
the request arrives; each sampled token is scattered there on the device by the step that
sampled it. Step inputs are then *gathered* from the table by ``(row, position)``.

That one mechanism gives async scheduling its device-side token feed: step N+1's decode
input at position ``p`` is whatever step N wrote at ``p`` — no host round trip, and correct
whatever order the batch is in, because rows are stable while batch order is not. The
penalties read the same table, so they see exactly the tokens the sync engine would.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tandem.types.scheduler_output import NewRequestData
from tandem.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    row: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    sample_seed: Optional[int]
    block_ids: list[int] = field(default_factory=list)


class InputBatch:
    def __init__(self, max_rows: int, max_model_len: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.width = max_model_len + 1  # room for the token sampled at the last position
        self.device = device
        self.token_table = torch.zeros(max_rows, self.width, dtype=torch.int64, device=device)
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}

    def add(self, req_id: str, data: NewRequestData, block_ids: list[int]) -> CachedRequestState:
        if req_id in self.requests:  # a resumed request replaces stale state, if any
            self.remove(req_id)
        if not self.free_rows:
            raise RuntimeError(f"input batch is full ({self.max_rows} rows)")
        row = self.free_rows.pop()
        n = len(data.token_ids)
        if n > self.width:
            raise ValueError(f"request {req_id} has {n} tokens, more than max_model_len")
        tokens = torch.tensor(data.token_ids, dtype=torch.int64)
        if self.device.type == "cuda":
            tokens = tokens.pin_memory()
        self.token_table[row, :n].copy_(tokens, non_blocking=True)
        state = CachedRequestState(req_id, row, data.num_prompt_tokens, data.sampling_params,
                                   data.eos_token_ids, data.sample_seed, list(block_ids))
        self.requests[req_id] = state
        return state

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.free_rows.append(state.row)
