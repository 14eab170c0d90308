"""Attention over the paged KV cache.

The model runner flattens every scheduled token of every request into one batch with no
padding. Each attention layer writes this step's keys/values into the paged cache by slot
(``slot = block_id * block_size + offset``) and then attends over each sequence's cached
context through its block table. Per-step metadata arrives through a forward context set
by the model runner, so model code stays free of scheduling concepts.

The CPU path uses torch SDPA: decode tokens (one query per sequence) are batched into one
padded SDPA call; prefill chunks run per sequence. A Triton paged-attention kernel is the
GPU fast path (``tandem.kernels``, when present).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _deterministic(device: torch.device) -> contextlib.AbstractContextManager:
    """Masked SDPA on CUDA picks the memory-efficient kernel, whose results vary from run to
    run for long key lengths (measured on an H200: two identical sync runs diverged after
    ~130 positions). The math backend is bitwise repeatable, which async == sync needs."""
    if device.type == "cuda":
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to.

    Sequences appear in batch order; sequence ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` and, after this step, has ``seq_lens[i]``
    tokens of context (its cached prefix plus this step's tokens).
    """

    slot_mapping: torch.Tensor  # [T] int64, on device
    block_tables: torch.Tensor  # [B, max_blocks] int64, on device (padded with 0)
    query_start_loc: list[int]  # [B + 1], host
    seq_lens: list[int]  # [B], host
    block_size: int
    # Precomputed split of the batch, so each layer does not recompute it.
    decode_seqs: list[int]  # sequences with exactly one query token
    prefill_seqs: list[int]  # the others
    decode_seq_lens: Optional[torch.Tensor] = None  # [num_decode] int64 on device
    decode_block_tables: Optional[torch.Tensor] = None  # [num_decode, max_blocks]
    decode_token_idx: Optional[torch.Tensor] = None  # [num_decode] token index of each decode query

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> "AttentionMetadata":
        """Build metadata from per-sequence host lists (the model runner and tests use this)."""
        qsl = [0]
        slots: list[int] = []
        for q, s, bt in zip(query_lens, seq_lens, block_tables):
            qsl.append(qsl[-1] + q)
            for pos in range(s - q, s):
                slots.append(bt[pos // block_size] * block_size + pos % block_size)
        width = max((len(b) for b in block_tables), default=1) or 1
        bt_pad = [b + [0] * (width - len(b)) for b in block_tables]
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        prefill = [i for i, q in enumerate(query_lens) if q != 1]
        dev = torch.device(device)
        bt_t = torch.tensor(bt_pad, dtype=torch.int64).to(dev, non_blocking=True)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=bt_t,
            query_start_loc=qsl,
            seq_lens=list(seq_lens),
            block_size=block_size,
            decode_seqs=decode,
            prefill_seqs=prefill,
        )
        if decode:
            md.decode_seq_lens = torch.tensor([seq_lens[i] for i in decode], dtype=torch.int64).to(dev)
            md.decode_block_tables = bt_t[torch.tensor(decode, dtype=torch.int64).to(dev)]
            md.decode_token_idx = torch.tensor([qsl[i] for i in decode], dtype=torch.int64).to(dev)
        return md


@dataclass
class ForwardContext:
    attn_metadata: Optional[AttentionMetadata]
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]


_CONTEXT: Optional[ForwardContext] = None


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: Optional[AttentionMetadata], kv_caches: list[torch.Tensor]
) -> Iterator[None]:
    """Make step metadata visible to every attention layer for one forward pass."""
    global _CONTEXT
    prev = _CONTEXT
    _CONTEXT = ForwardContext(attn_metadata, kv_caches)
    try:
        yield
    finally:
        _CONTEXT = prev


def get_forward_context() -> Optional[ForwardContext]:
    return _CONTEXT


class Attention(torch.nn.Module):
    """Multi-head / grouped-query attention over the paged cache of one layer.

    Inputs are flattened: ``q [T, num_heads * head_dim]``, ``k, v [T, num_kv_heads * head_dim]``
    (rotary already applied). Without a forward context (or with no metadata) the whole
    batch is treated as one causal sequence and nothing is cached; that keeps the layer
    usable for a warm-up/profiling pass.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_idx: int,
        sliding_window: Optional[int] = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        md = ctx.attn_metadata if ctx is not None else None
        if md is None:
            out = self._causal(q, k, v)
            return out.reshape(T, self.num_heads * self.head_dim)

        kv = ctx.kv_caches[self.layer_idx]
        k_cache = kv[0].view(-1, self.num_kv_heads, self.head_dim)
        v_cache = kv[1].view(-1, self.num_kv_heads, self.head_dim)
        k_cache.index_copy_(0, md.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, md.slot_mapping, v.to(v_cache.dtype))

        out = torch.empty_like(q)
        if md.decode_seqs:
            self._decode(q, kv, md, out)
        for i in md.prefill_seqs:
            start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
            seq_len = md.seq_lens[i]
            q_len = end - start
            if q_len == seq_len:
                # Nothing cached before this chunk: attend to this step's k/v directly.
                out[start:end] = self._causal(q[start:end], k[start:end], v[start:end])
                continue
            nblk = (seq_len + md.block_size - 1) // md.block_size
            blocks = md.block_tables[i, :nblk]
            ks = kv[0][blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            vs = kv[1][blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if self.sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
            out[start:end] = self._sdpa(q[start:end], ks.to(q.dtype), vs.to(q.dtype), mask)
        return out.reshape(T, self.num_heads * self.head_dim)

    # -- helpers -----------------------------------------------------------------
    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
              causal: bool = False) -> torch.Tensor:
        """q [Lq, H, D], k/v [Lk, KVH, D] -> [Lq, H, D]."""
        with contextlib.nullcontext() if mask is None else _deterministic(q.device):
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=None if mask is None else mask[None, None],
                is_causal=causal,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        return o.squeeze(0).transpose(0, 1)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.sliding_window is not None and q.shape[0] > self.sliding_window:
            pos = torch.arange(q.shape[0], device=q.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.sliding_window)
            return self._sdpa(q, k, v, mask)
        return self._sdpa(q, k, v, None, causal=True)

    def _decode(self, q: torch.Tensor, kv: torch.Tensor, md: AttentionMetadata, out: torch.Tensor) -> None:
        """All single-query sequences in one padded SDPA call over their gathered blocks."""
        assert md.decode_block_tables is not None and md.decode_seq_lens is not None
        assert md.decode_token_idx is not None
        bt = md.decode_block_tables  # [Bd, W]
        bd, width = bt.shape
        max_len = max(md.seq_lens[i] for i in md.decode_seqs)
        nblk = min(width, (max_len + md.block_size - 1) // md.block_size)
        bt = bt[:, :nblk]
        ks = kv[0][bt].reshape(bd, nblk * md.block_size, self.num_kv_heads, self.head_dim)
        vs = kv[1][bt].reshape(bd, nblk * md.block_size, self.num_kv_heads, self.head_dim)
        k_pos = torch.arange(nblk * md.block_size, device=q.device)
        lens = md.decode_seq_lens[:, None]
        mask = k_pos[None, :] < lens  # [Bd, L]
        if self.sliding_window is not None:
            mask &= k_pos[None, :] >= lens - self.sliding_window
        qd = q[md.decode_token_idx]  # [Bd, H, D]
        with _deterministic(q.device):
            o = F.scaled_dot_product_attention(
                qd.unsqueeze(2),  # [Bd, H, 1, D]
                ks.transpose(1, 2).to(q.dtype),  # [Bd, KVH, L, D]
                vs.transpose(1, 2).to(q.dtype),
                attn_mask=mask[:, None, None, :],
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        out[md.decode_token_idx] = o.squeeze(2)
