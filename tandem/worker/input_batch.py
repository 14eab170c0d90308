"""The worker's persistent per-request state: host arrays, one row per request, and the
device-side token table.

Every request the worker knows owns one *row* for as long as it lives on the worker:

* ``token_table`` (device, ``[rows, max_model_len + 1]``): the request's tokens by
  position. Prompt tokens are written when the request arrives; each sampled token is
  scattered there on the device by the step that sampled it. Step inputs are *gathered*
  from the table by ``(row, position)``. That one mechanism is async scheduling's
  device-side token feed: step N+1's decode input at position ``p`` is whatever step N
  wrote at ``p`` — no host round trip, and correct whatever order the batch is in, because
  rows are stable while batch order is not. The penalties read the same table.
* numpy arrays indexed by row (host): the block table, the prompt length and every
  sampling parameter. A step gathers what it needs with numpy fancy indexing, so building
  its inputs costs a few vectorized operations, not a Python loop per token.
* ``block_table_device`` (device, ``[rows, max_blocks]``): the device mirror of the block
  table, updated incrementally (only new block ids travel), gathered per step on the device.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tandem.sampling_params import SamplingParams
from tandem.types.scheduler_output import NewRequestData


@dataclass
class CachedRequestState:
    req_id: str
    row: int
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    sample_seed: Optional[int]
    num_blocks: int = 0


class InputBatch:
    def __init__(self, max_rows: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.width = max_model_len + 1  # room for the token sampled at the last position
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        # One extra row that no request owns: CUDA-graph padding reads and writes it.
        self.scratch_row = max_rows
        self.token_table = torch.zeros(max_rows + 1, self.width, dtype=torch.int64, device=device)
        self.block_table_device = torch.zeros(max_rows + 1, self.max_blocks, dtype=torch.int32, device=device)
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}

        self.block_table = np.zeros((max_rows + 1, self.max_blocks), dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_rows, dtype=np.int32)
        # Sampling parameters by row (what the sampler needs as tensors).
        self.temperature = np.zeros(max_rows, dtype=np.float32)  # 0 = greedy
        self.top_k = np.zeros(max_rows, dtype=np.int32)  # <= 0: off
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.repetition_penalty = np.ones(max_rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_rows, dtype=np.float32)
        self.presence_penalty = np.zeros(max_rows, dtype=np.float32)
        self.uses_penalties = np.zeros(max_rows, dtype=bool)
        self.seed = np.zeros(max_rows, dtype=np.int64)
        self.seeded = np.zeros(max_rows, dtype=bool)
        self.min_tokens = np.zeros(max_rows, dtype=np.int32)
        self.num_logprobs = np.full(max_rows, -1, dtype=np.int32)  # -1: none wanted
        # Rows with a logit bias: (token ids, values), kept as arrays to stage without a loop.
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        # Work for the next step's single upload: (row, first position, token ids) of new
        # requests' known tokens, and (row, first column, block ids) of new blocks. The
        # latter are applied to the host block table in one vectorized write by
        # ``flush_blocks``, which keeps them as (flat index, block id) arrays in
        # ``block_writes`` until a step uploads them.
        self.pending_tokens: list[tuple[int, list[int]]] = []
        self.pending_blocks: list[tuple[int, int, list[int]]] = []
        self.block_writes: list[tuple[np.ndarray, np.ndarray]] = []
        # Rows whose request wants prompt logprobs (0: a step need not look for any).
        self.num_prompt_logprobs = 0

    # -- lifecycle -----------------------------------------------------------------------
    def add(self, req_id: str, data: NewRequestData, block_ids: list[int]) -> CachedRequestState:
        if req_id in self.requests:  # a resumed request replaces stale state, if any
            self.remove(req_id)
        if not self.free_rows:
            raise RuntimeError(f"input batch is full ({self.max_rows} rows)")
        if len(data.token_ids) > self.width:
            raise ValueError(f"request {req_id} has {len(data.token_ids)} tokens, more than max_model_len")
        row = self.free_rows.pop()
        sp = data.sampling_params
        state = CachedRequestState(req_id, row, data.num_prompt_tokens, sp, data.eos_token_ids, data.sample_seed)
        self.requests[req_id] = state
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.temperature[row] = 0.0 if sp.greedy else sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.repetition_penalty[row] = sp.repetition_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.presence_penalty[row] = sp.presence_penalty
        self.uses_penalties[row] = sp.uses_penalties
        self.seeded[row] = data.sample_seed is not None and not sp.greedy
        self.seed[row] = data.sample_seed or 0
        self.min_tokens[row] = sp.min_tokens
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        if sp.prompt_logprobs is not None:
            self.num_prompt_logprobs += 1
        if sp.logit_bias:
            self.logit_bias[row] = (np.fromiter(sp.logit_bias.keys(), dtype=np.int64),
                                    np.fromiter(sp.logit_bias.values(), dtype=np.float32))
        self.pending_tokens.append((row, list(data.token_ids)))
        self.append_blocks(state, block_ids)
        return state

    def append_blocks(self, state: CachedRequestState, block_ids: list[int]) -> None:
        """Queue new block ids of a request; ``flush_blocks`` writes them into the tables."""
        if not block_ids:
            return
        n0 = state.num_blocks
        state.num_blocks = n0 + len(block_ids)
        self.pending_blocks.append((state.row, n0, block_ids))

    def flush_blocks(self) -> None:
        """Write the queued block ids into the host block table at once (a step's staging
        reads it next) and keep them in ``block_writes`` for the device table.

        At full batch every request crosses a block boundary at the same step: one numpy
        scatter instead of a slice assignment per request."""
        pending = self.pending_blocks
        if not pending:
            return
        n = len(pending)
        width = self.max_blocks
        starts = np.fromiter((row * width + col for row, col, _ in pending), dtype=np.int64, count=n)
        counts = np.fromiter((len(ids) for _, _, ids in pending), dtype=np.int64, count=n)
        total = int(counts.sum())
        vals = np.fromiter(itertools.chain.from_iterable(ids for _, _, ids in pending), dtype=np.int32, count=total)
        if total == n:  # one block each (decode)
            idx = starts
        else:  # start of its run + position inside it
            firsts = np.cumsum(counts) - counts
            idx = np.repeat(starts - firsts, counts) + np.arange(total, dtype=np.int64)
        self.block_table.reshape(-1)[idx] = vals
        pending.clear()
        self.block_writes.append((idx, vals))

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.logit_bias.pop(state.row, None)
            if state.sampling_params.prompt_logprobs is not None:
                self.num_prompt_logprobs -= 1
            self.free_rows.append(state.row)

    def discard_unapplied(self) -> None:
        """After a step stopped part-way: forget its table writes not uploaded yet (they
        belong to requests the engine is about to drop, and a stale write could land on a
        row reused by the next request) and take back any row taken but not registered."""
        self.pending_tokens.clear()
        self.pending_blocks.clear()
        self.block_writes.clear()
        owned = {state.row for state in self.requests.values()}
        self.free_rows = [r for r in range(self.max_rows - 1, -1, -1) if r not in owned]
        self.num_prompt_logprobs = sum(1 for st in self.requests.values()
                                       if st.sampling_params.prompt_logprobs is not None)
