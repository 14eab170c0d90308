"""Attention over the paged KV cache, with two backends chosen by one setting.

The model runner flattens every scheduled token of every request into one batch with no
padding (CUDA-graph decode pads the batch, with padding sequences of length 0). Each
attention layer writes this step's keys/values into the paged cache by slot
(``slot = block_id * block_size + offset``; a negative slot is padding and is skipped) and
then attends over each sequence's cached context through its block table. Per-step
metadata arrives through a forward context set by the model runner, so model code stays
free of scheduling concepts.

Backends (``EngineConfig.attention_backend``):
* ``triton`` — ``tandem.kernels.attention``: one launch per layer for the whole batch
  (prefill, chunked prefill over a cached prefix, and decode with GQA and split-KV),
  graph-capturable; the GPU fast path.
* ``sdpa`` — torch SDPA: decode tokens (one query per sequence) batched into one padded
  call, prefill chunks per sequence. The CPU path and the fallback where Triton is absent.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from tandem.layers.norm import RMSNorm
    from tandem.layers.rotary import RotaryEmbedding

BACKENDS = ("sdpa", "triton")


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
    tokens of context (its cached prefix plus this step's tokens). Device tensors serve the
    kernels; the host arrays serve the SDPA backend's per-sequence loop (and are None when
    a CUDA graph replays, which only the Triton backend does).
    """

    slot_mapping: torch.Tensor  # [T] int64 on the device; < 0 = padding token
    query_start_loc: torch.Tensor  # [B + 1] int32 on the device
    seq_lens: torch.Tensor  # [B] int32 on the device
    block_tables: torch.Tensor  # [B, max_blocks] int32 on the device
    block_size: int
    max_query_len: int
    max_seq_len: int
    backend: str = "sdpa"
    num_kv_splits: int = 1  # Triton decode: split the key range for long contexts
    query_start_loc_host: Optional[np.ndarray] = None
    seq_lens_host: Optional[np.ndarray] = None
    _sdpa_decode: Optional[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default=None, repr=False)

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        backend: str = "sdpa",
    ) -> "AttentionMetadata":
        """Build metadata from per-sequence host lists (tests and tools; the model runner
        builds it from its staged arrays)."""
        dev = torch.device(device)
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        sl = np.asarray(seq_lens, dtype=np.int32)
        width = max((len(b) for b in block_tables), default=1) or 1
        bt = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, b in enumerate(block_tables):
            bt[i, :len(b)] = b
        pos = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq_lens)] or [np.zeros(0, int)])
        seq_of = np.repeat(np.arange(len(query_lens)), query_lens)
        slots = bt[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.from_numpy(sl).to(dev),
            block_tables=torch.from_numpy(bt).to(dev),
            block_size=block_size,
            max_query_len=int(max(query_lens, default=0)),
            max_seq_len=int(max(seq_lens, default=0)),
            backend=backend,
            query_start_loc_host=qsl,
            seq_lens_host=sl,
        )


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


def triton_available() -> bool:
    """Whether the Triton backend can run here (Triton installed, a CUDA device)."""
    if not torch.cuda.is_available():
        return False
    from tandem.kernels import HAS_TRITON

    return HAS_TRITON


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto``: Triton on CUDA when it is installed, else SDPA."""
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; one of auto, {', '.join(BACKENDS)}")
    if name == "triton" and device.type == "cuda" and not triton_available():
        raise ValueError("attention_backend='triton' needs the triton package")
    return name


class Attention(torch.nn.Module):
    """Multi-head / grouped-query attention over the paged cache of one layer.

    Inputs are flattened: ``q [T, num_heads * head_dim]``, ``k, v [T, num_kv_heads * head_dim]``.
    Rotary is applied here when ``rope=(positions, rotary_emb)`` is given (else the caller
    has applied it), after ``qk_norm=(q_norm, k_norm)``, an RMSNorm over each head (Qwen3),
    when given: on the Triton path with fused kernels one launch normalizes and rotates q
    and k and writes the KV cache, instead of up to four kernels. Without a forward
    context (or with no metadata) the whole batch is treated as one causal sequence and
    nothing is cached; that keeps the layer usable for a warm-up/profiling pass.
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: Optional[tuple[torch.Tensor, RotaryEmbedding]] = None,
                qk_norm: Optional[tuple[RMSNorm, RMSNorm]] = None) -> torch.Tensor:
        T = q.shape[0]
        ctx = get_forward_context()
        md = ctx.attn_metadata if ctx is not None else None
        if rope is not None and md is not None and md.backend == "triton" and rope[1].fused:
            assert ctx is not None
            out = self._triton_rope(rope[0], rope[1], qk_norm, q, k, v, ctx.kv_caches[self.layer_idx], md)
            return out.reshape(T, self.num_heads * self.head_dim)
        if qk_norm is not None:
            q, k = self._head_norms(qk_norm, q, k)
        if rope is not None:
            q, k = rope[1](rope[0], q, k)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if md is None:
            out = self._causal(q, k, v)
            return out.reshape(T, self.num_heads * self.head_dim)
        kv = ctx.kv_caches[self.layer_idx]  # type: ignore[union-attr]
        if md.backend == "triton":
            out = self._triton(q, k, v, kv, md)
        else:
            out = self._sdpa_paged(q, k, v, kv, md)
        return out.reshape(T, self.num_heads * self.head_dim)

    # -- the QKV projection's fused epilogue (small batches) ---------------------------
    def rope_write_target(self, rotary: RotaryEmbedding, qk_norm: Optional[tuple[RMSNorm, RMSNorm]]
                          ) -> Optional[tuple[torch.Tensor, AttentionMetadata]]:
        """The step's KV cache and metadata when a QKV projection may rotate q and k and
        write k and v itself (``tandem.kernels.gemv.RopeWrite``): the Triton path with fused
        kernels, full rotary and no per-head q/k norms; else None (``forward`` does it)."""
        ctx = get_forward_context()
        md = ctx.attn_metadata if ctx is not None else None
        if (md is None or md.backend != "triton" or not rotary.fused or qk_norm is not None
                or rotary.rotary_dim != self.head_dim):
            return None
        assert ctx is not None
        return ctx.kv_caches[self.layer_idx], md

    def attend_rotated(self, q: torch.Tensor, kv: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Attention for ``q [T, H * D]`` already rotated, this step's k and v already in ``kv``."""
        T = q.shape[0]
        return self._paged(q.view(T, self.num_heads, self.head_dim), kv, md).reshape(T, self.num_heads * self.head_dim)

    # -- Triton ------------------------------------------------------------------
    def _triton(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        from tandem.kernels.attention import write_kv_cache

        write_kv_cache(k, v, kv, md.slot_mapping)
        return self._paged(q, kv, md)

    def _head_norms(self, qk_norm: tuple[RMSNorm, RMSNorm], q: torch.Tensor,
                    k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over each head of q and of k (flattened ``[T, heads * head_dim]`` in and out)."""
        T = q.shape[0]
        q = qk_norm[0](q.reshape(T, -1, self.head_dim)).reshape(T, -1)
        k = qk_norm[1](k.reshape(T, -1, self.head_dim)).reshape(T, -1)
        return q, k

    def _triton_rope(self, positions: torch.Tensor, rotary: RotaryEmbedding,
                     qk_norm: Optional[tuple[RMSNorm, RMSNorm]], q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, kv: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """(Per-head q/k norms,) rotary and the cache write in one kernel, then attention."""
        from tandem.kernels.fused import rotary_write_kv_cache_

        norm_args = None
        if qk_norm is not None:
            qn, kn = qk_norm
            if rotary.rotary_dim == self.head_dim and qn.eps == kn.eps:
                norm_args = (qn.weight, kn.weight, qn.eps)
            else:  # the kernel norms only fully rotated heads with one eps
                q, k = self._head_norms(qk_norm, q, k)
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        rotary_write_kv_cache_(positions, q, k.view(T, self.num_kv_heads, self.head_dim),
                               v.view(T, self.num_kv_heads, self.head_dim), rotary.cos_cache, rotary.sin_cache,
                               rotary.rotary_dim, kv, md.slot_mapping, qk_norm=norm_args)
        return self._paged(q, kv, md)

    def _paged(self, q: torch.Tensor, kv: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        from tandem.kernels.attention import paged_attention

        out = torch.empty_like(q)
        paged_attention(q, kv, out, query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
                        block_tables=md.block_tables, max_query_len=md.max_query_len,
                        max_seq_len=md.max_seq_len, scale=self.scale, sliding_window=self.sliding_window,
                        num_kv_splits=md.num_kv_splits)
        return out

    # -- SDPA --------------------------------------------------------------------
    def _sdpa_paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                    md: AttentionMetadata) -> torch.Tensor:
        assert md.query_start_loc_host is not None and md.seq_lens_host is not None, \
            "the SDPA backend needs host metadata (it cannot run inside a CUDA graph)"
        k_cache = kv[0].view(-1, self.num_kv_heads, self.head_dim)
        v_cache = kv[1].view(-1, self.num_kv_heads, self.head_dim)
        k_cache.index_copy_(0, md.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, md.slot_mapping, v.to(v_cache.dtype))

        out = torch.empty_like(q)
        qsl, seq_lens = md.query_start_loc_host, md.seq_lens_host
        q_lens = qsl[1:] - qsl[:-1]
        if (q_lens == 1).any():
            self._decode(q, kv, md, out)
        for i in np.flatnonzero(q_lens != 1).tolist():
            start, end = int(qsl[i]), int(qsl[i + 1])
            seq_len = int(seq_lens[i])
            q_len = end - start
            if q_len == seq_len:
                # Nothing cached before this chunk: attend to this step's k/v directly.
                out[start:end] = self._causal(q[start:end], k[start:end], v[start:end])
                continue
            nblk = (seq_len + md.block_size - 1) // md.block_size
            blocks = md.block_tables[i, :nblk].long()
            ks = kv[0][blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            vs = kv[1][blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if self.sliding_window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
            out[start:end] = self._sdpa(q[start:end], ks.to(q.dtype), vs.to(q.dtype), mask)
        return out

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

    @staticmethod
    def _decode_plan(md: AttentionMetadata) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The single-query sequences, computed once per step and shared by every layer."""
        if md._sdpa_decode is None:
            assert md.query_start_loc_host is not None and md.seq_lens_host is not None
            qsl = md.query_start_loc_host
            decode = np.flatnonzero((qsl[1:] - qsl[:-1]) == 1)
            dev = md.block_tables.device
            idx = torch.from_numpy(decode).to(dev)
            lens = torch.from_numpy(md.seq_lens_host[decode].astype(np.int64)).to(dev)
            tok = torch.from_numpy(qsl[decode].astype(np.int64)).to(dev)
            md._sdpa_decode = (decode.tolist(), lens, md.block_tables[idx].long(), tok)
        return md._sdpa_decode

    def _decode(self, q: torch.Tensor, kv: torch.Tensor, md: AttentionMetadata, out: torch.Tensor) -> None:
        """All single-query sequences in one padded SDPA call over their gathered blocks."""
        decode, lens_t, bt, tok_idx = self._decode_plan(md)
        assert md.seq_lens_host is not None
        bd, width = bt.shape
        max_len = int(md.seq_lens_host[decode].max())
        nblk = min(width, (max_len + md.block_size - 1) // md.block_size)
        bt = bt[:, :nblk]
        ks = kv[0][bt].reshape(bd, nblk * md.block_size, self.num_kv_heads, self.head_dim)
        vs = kv[1][bt].reshape(bd, nblk * md.block_size, self.num_kv_heads, self.head_dim)
        k_pos = torch.arange(nblk * md.block_size, device=q.device)
        lens = lens_t[:, None]
        mask = k_pos[None, :] < lens  # [Bd, L]
        if self.sliding_window is not None:
            mask &= k_pos[None, :] >= lens - self.sliding_window
        qd = q[tok_idx]  # [Bd, H, D]
        with _deterministic(q.device):
            o = F.scaled_dot_product_attention(
                qd.unsqueeze(2),  # [Bd, H, 1, D]
                ks.transpose(1, 2).to(q.dtype),  # [Bd, KVH, L, D]
                vs.transpose(1, 2).to(q.dtype),
                attn_mask=mask[:, None, None, :],
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        out[tok_idx] = o.squeeze(2)
