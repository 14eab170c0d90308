"""The worker's side of speculative decoding: n-gram proposals, verification, and the
device-side correction of optimistic positions. Everything here is tensor work on the
device (the same code on the CPU and on CUDA); the host only stages index arrays.

**Verification.** A request verifying ``k`` drafts was scheduled ``1 + k`` positions
(``start`` = its last real token, then the drafts ``d_1..d_k``); its ``1 + k`` logits rows
are sampled exactly as plain decoding samples one position: each row has its own sequence
length, so penalties, ``min_tokens``, logit bias, seeds (output index) and logprobs see the
position it stands for, and the drafts before it, which equal the emitted tokens wherever
the row is used. ``t_j`` is the token sampled at row ``j``; the step emits ``t_0..t_a`` where
``a`` is the first ``j`` with ``t_j != d_{j+1}`` (or ``k``).

*Greedy*: ``t_j`` is the target's argmax, so the output is plain greedy decoding's.
*Sampling*: a draft proposed deterministically (n-gram lookup, or a greedy draft model)
has a one-hot draft distribution ``q = e_d``. Rejection sampling then accepts ``d`` with
probability ``min(1, p(d)/q(d)) = p(d)`` and otherwise samples from ``max(0, p - q)``
normalized, which is ``p`` restricted to tokens ``!= d``. Sampling ``t ~ p`` and accepting
iff ``t == d`` has exactly these probabilities (accept: ``p(d)``; else ``t`` is ``p``
conditioned on ``t != d``), so it *is* that rejection sampler: lossless. A seeded request's
noise is a pure function of (seed, output index, token), so it even emits exactly the tokens
it emits without speculation.

**Proposals** are made on the device right after verification, into the token table at
the positions after the request's last token, where the next step's verify positions read
them; so step N+1 can be launched before the host knows step N's tokens (async scheduling).
N-gram: the latest earlier occurrence of the last ``n`` tokens (longest ``n`` first)
proposes what followed it; a continuation that reaches the end of the sequence repeats
with the match's period. With no match the drafts are the last token (rarely accepted).

**Correction.** A step scheduled while the request's previous verify step was in flight
has positions optimistic by that step's rejected count, which this worker recorded on the
device (``last_rejected`` by token-table row): ``correct`` subtracts it from the staged
positions, gather indices, slots, sequence lengths and destinations before the forward.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from tandem.config.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass
class SampleLayout:
    """Host arrays of a step's sampling rows: one per plain sampling request, ``1 + k`` per
    request verifying ``k`` drafts (its last ``1 + k`` positions, in order)."""

    seq: np.ndarray  # int64 [R] index in the batch of each row's request
    seq_lens: np.ndarray  # int32 [R] sequence length the row samples at (its token lands there)
    logits_rows: np.ndarray  # int64 [R] flat index of each row's token in the step
    num_rows: np.ndarray  # int64 [S] rows of each sampling request (1 + k)
    drafts: np.ndarray  # int64 [S] k of each sampling request

    @property
    def num_drafts(self) -> int:
        return int(self.drafts.sum())


def sample_layout(sample_idx: np.ndarray, drafts: Optional[np.ndarray], counts: np.ndarray, qsl: np.ndarray,
                  seq_lens: np.ndarray) -> SampleLayout:
    """Where each sampling row's logits and token are (``drafts``: k by batch index, or None)."""
    k = drafts[sample_idx].astype(np.int64) if drafts is not None else np.zeros(len(sample_idx), np.int64)
    m = k + 1
    seq = np.repeat(sample_idx.astype(np.int64), m)
    first = np.cumsum(m) - m
    j = np.arange(len(seq), dtype=np.int64) - np.repeat(first, m)
    m_rep = np.repeat(m, m)
    logits_rows = qsl[seq].astype(np.int64) + counts[seq] - m_rep + j
    lens = (seq_lens[seq] - m_rep + 1 + j).astype(np.int32)
    return SampleLayout(seq, lens, logits_rows, m, k)


@dataclass
class VerifyInputs:
    """Device tensors the verification and the proposer read (staged per step)."""

    row_seq: torch.Tensor  # int64 [R] sampling request (0..S-1) of each row
    is_draft_row: torch.Tensor  # bool [R] row j < k: its token is compared with draft j + 1
    first_row: torch.Tensor  # int64 [R] first row of the row's request
    rows: torch.Tensor  # int64 [S] token-table row of each sampling request
    drafts: torch.Tensor  # int64 [S] k of each
    base_len: torch.Tensor  # int64 [S] tokens known before this step's tokens (start + 1)
    window: int  # host upper bound of every request's token count after the step


class SpecDecoder:
    """Per-worker state and device logic of speculative decoding (n-gram proposer)."""

    def __init__(self, config: SpeculativeConfig, max_rows: int, width: int, device: torch.device,
                 draft: Optional["DraftProposer"] = None) -> None:
        if config.method == "draft_model" and draft is None:
            raise ValueError("speculative method 'draft_model' needs the draft model")
        self.draft = draft
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.width = width
        self.device = device
        # Rejected drafts of each row's latest step (0 after a plain step or a new request).
        self.last_rejected = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)

    def reset_row(self, row: int) -> None:
        # A one-element view zeroed by a kernel: indexed assignment of a Python number can
        # stage the value through pageable host memory, which synchronizes.
        self.last_rejected[row:row + 1].zero_()

    # -- correction (async scheduling) ------------------------------------------------------
    def corrections(self, rows: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        """[B] int64: how far each sequence's staged positions are ahead of the truth."""
        return self.last_rejected[rows.long()] * flags

    @staticmethod
    def correct_tokens(corr_tok: torch.Tensor, positions: torch.Tensor, gather: torch.Tensor,
                       slots: torch.Tensor, tok_rows: torch.Tensor, block_table: torch.Tensor,
                       block_size: int) -> None:
        """In place: move each token back by its sequence's correction, and recompute its slot."""
        positions.sub_(corr_tok)
        gather.sub_(corr_tok)
        blocks = block_table[tok_rows, torch.div(positions, block_size, rounding_mode="floor")].long()
        slots.copy_(blocks * block_size + positions % block_size)

    # -- verification -------------------------------------------------------------------------
    def verify(self, table: torch.Tensor, dest: torch.Tensor, sampled: torch.Tensor, v: VerifyInputs
               ) -> torch.Tensor:
        """Compare each row's token with the draft after it (read from the token table at
        the row's destination, before the caller scatters ``sampled`` there); return the
        number of tokens each request emits ([S] int64, 1..1+k), and record each row's
        rejected count (for the correction of steps scheduled behind this one)."""
        flat = table.view(-1)
        drafts = flat[dest]
        ok = (sampled == drafts) & v.is_draft_row
        fail = (~ok).to(torch.int64)
        before = torch.cumsum(fail, 0) - fail  # failures before each row (whole batch)
        emitted = before == before[v.first_row]  # no failure before the row within its request
        num_emitted = torch.zeros(v.rows.shape[0], dtype=torch.int64, device=sampled.device)
        num_emitted.index_add_(0, v.row_seq, emitted.to(torch.int64))
        self.last_rejected[v.rows] = v.drafts + 1 - num_emitted
        return num_emitted

    def propose(self, table: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, window: int,
                block_table: Optional[torch.Tensor] = None) -> None:
        """Write ``k`` drafts after each request's ``lengths`` known tokens (n-gram lookup, or
        the draft model's greedy choices)."""
        if self.draft is not None:
            assert block_table is not None
            self.draft.propose(table, block_table, rows, lengths, window)
            return
        window = max(1, min(window, self.width))
        S = rows.shape[0]
        dev = table.device
        toks = table[rows, :window]  # [S, W]
        cont = torch.full((S,), -1, dtype=torch.int64, device=dev)  # where the continuation starts
        lens = lengths[:, None]
        for n in range(self.max_n, self.min_n - 1, -1):
            if n >= window:
                continue
            suffix = toks.gather(1, (lens - n + torch.arange(n, device=dev)).clamp(0, window - 1))
            match = (toks.unfold(1, n, 1) == suffix[:, None, :]).all(-1)  # [S, W - n + 1] by start
            starts = torch.arange(match.shape[1], device=dev)
            ok = match & (starts[None, :] + n < lens)
            best = torch.where(ok, starts[None, :], -1).amax(1)
            take = (cont < 0) & (best >= 0)
            cont = torch.where(take, best + n, cont)
        found = cont >= 0
        period = torch.where(found, lengths - cont, 1).clamp_min(1)
        m = torch.arange(self.k, device=dev)
        src = torch.where(found[:, None], cont[:, None] + m[None, :] % period[:, None], lens - 1)
        drafts = toks.gather(1, src.clamp(0, window - 1))
        pos = lens + m[None, :]
        scratch = (table.shape[0] - 1) * self.width  # the scratch row: positions past the end go there
        idx = torch.where(pos < self.width, rows[:, None] * self.width + pos, scratch)
        table.view(-1).index_copy_(0, idx.reshape(-1), drafts.reshape(-1))


class DraftProposer:
    """Method ``draft_model``: a small model proposes ``k`` tokens greedily (a one-hot draft
    distribution, so verification is exact rejection sampling, see the module doc).

    Its KV cache lives in the target's blocks (the same block table and slots, in caches of
    its own shape). Every target forward is mirrored by a draft forward over the same tokens
    (``mirror``), so the draft's cache holds every position the target computed; after
    verification ``propose`` runs ``k`` single-token steps from each request's last token.
    The scheduler allocates ``k`` lookahead slots beyond every sampling step for them.
    """

    def __init__(self, model: Any, k: int, block_size: int, max_model_len: int, width: int,
                 backend: str) -> None:
        self.model = model
        self.k = k
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.width = width
        self.backend = backend
        self.kv_caches: list[torch.Tensor] = []

    def init_kv_cache(self, num_blocks: int, num_layers: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> None:
        self.kv_caches = [torch.zeros(2, num_blocks, self.block_size, num_kv_heads, head_dim, dtype=dtype,
                                      device=device) for _ in range(num_layers)]

    def propose(self, table: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                window: int) -> None:
        """Greedy drafts after each request's ``lengths`` known tokens, into the token table."""
        from tandem.layers.attention import AttentionMetadata, set_forward_context

        S = rows.shape[0]
        dev = table.device
        bs = self.block_size
        flat = table.view(-1)
        scratch = (table.shape[0] - 1) * self.width
        qsl = torch.arange(S + 1, dtype=torch.int32, device=dev)
        qsl_host = np.arange(S + 1, dtype=np.int32)
        tables = block_table[rows]
        tok = table[rows, (lengths - 1).clamp(0, self.width - 1)]
        for i in range(self.k):
            pos = (lengths - 1 + i).clamp(0, self.max_model_len - 1)
            slots = tables.gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
            lens = (pos + 1).to(torch.int32)
            md = AttentionMetadata(
                slot_mapping=slots, query_start_loc=qsl, seq_lens=lens, block_tables=tables, block_size=bs,
                max_query_len=1, max_seq_len=min(window + i + 1, self.max_model_len), backend=self.backend,
                query_start_loc_host=qsl_host,
                # The SDPA backend loops on the host (a copy that waits on CUDA; Triton does not).
                seq_lens_host=lens.cpu().numpy() if self.backend == "sdpa" else None)
            with set_forward_context(md, self.kv_caches):
                hidden = self.model(tok, pos)
            tok = self.model.compute_logits(hidden).argmax(dim=-1)
            dst = lengths + i
            flat.index_copy_(0, torch.where(dst < self.width, rows * self.width + dst, scratch), tok)
