"""Embedding and LM head split along the vocabulary across tensor-parallel ranks.

Rank ``r`` holds the rows ``[r * shard, (r + 1) * shard)`` of the (padded) vocabulary, with
``shard = ceil(vocab_size / tp)``; rows past ``vocab_size`` are zero padding and never
selected. The embedding looks up the ids of its shard (others give zero rows) and sums
the ranks' partial results; the LM head computes its shard of the logits and all-gathers
them into the full ``[n, vocab_size]`` on every rank. With one rank both are plain.
A tied LM head shares the embedding's parameter: both use the same shard layout.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import get_tp_rank, get_tp_world_size, tp_all_gather, tp_all_reduce
from tandem.layers.linear import ShardId, default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        # Rows of the real vocabulary this rank holds (the last rank may hold fewer).
        self.num_real_rows = max(0, min(num_embeddings - self.vocab_start, self.shard_size))
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, rows {self.vocab_start}..+{self.shard_size}, dim={self.weight.shape[1]}"

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's rows of the full ``[vocab, dim]`` checkpoint tensor; zero the padding."""
        expected = (self.num_embeddings, param.shape[1])
        if shard_id is not None or tuple(loaded_weight.shape) != expected:
            raise ValueError(f"expected a whole {expected} vocabulary tensor, got {tuple(loaded_weight.shape)}"
                             + (f" with shard_id={shard_id!r}" if shard_id is not None else ""))
        if self.tp_size == 1:
            return default_weight_loader(param, loaded_weight)
        with torch.no_grad():
            param.zero_()
            param[: self.num_real_rows].copy_(loaded_weight.narrow(0, self.vocab_start, self.num_real_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_real_rows)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection; ``forward`` returns full-vocab logits on every rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tie_to: Optional[VocabParallelEmbedding] = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        if tie_to is not None:
            if tie_to.shard_size != self.shard_size:
                raise ValueError("a tied LM head needs the embedding's vocabulary layout")
            self.weight = tie_to.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = F.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        return tp_all_gather(logits, dim=-1)[..., : self.num_embeddings]
