"""Structured outputs: forbid the tokens a grammar's bitmask disallows, in one Triton kernel.

Why not xgrammar's own kernel: its launcher asks for the device's properties twice and casts
the row indices to int32 (one more kernel) at every call, and on a GPU host's slow cores the
launch of a constrained step's mask then cost 0.17 ms or more, on the engine thread, for a
kernel of a few microseconds. This one is launched with what the caller already has: the
logits, the device bitmask laid out by sampled row, and the rows to mask (int64, as the
stager keeps them) or None for every row.

Layout (xgrammar's and llguidance's): bit ``t % 32`` of word ``t // 32`` of a row is 1 when
token ``t`` is allowed. Logit columns past ``32 * words`` are left alone, as xgrammar does.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Tokens per program: 32 words of the bitmask.
_BLOCK = 1024


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, indices_ptr, vocab_size, num_words, stride_logits,
                          stride_bitmask, HAS_INDICES: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if HAS_INDICES:
        row = tl.load(indices_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    first = tl.program_id(1) * BLOCK
    w = first // 32 + tl.arange(0, BLOCK // 32)
    words = tl.load(bitmask_ptr + row * stride_bitmask + w, mask=w < num_words, other=-1)
    banned = ((words[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    banned = tl.reshape(banned, [BLOCK])
    offs = first + tl.arange(0, BLOCK)
    tl.store(logits_ptr + row * stride_logits + offs, float("-inf"), mask=banned & (offs < vocab_size))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                               indices: Optional[torch.Tensor] = None) -> None:
    """Set ``-inf`` in ``logits`` ([B, V], in place) wherever row ``r``'s bitmask
    (``bitmask[r]``, int32 ``[>= B, words]``, contiguous rows) has a 0 bit, for the rows
    ``indices`` (a 1-D integer tensor on the logits' device; None: rows ``0..B-1``)."""
    assert bitmask.dtype == torch.int32 and bitmask.stride(1) == 1 and logits.stride(1) == 1
    rows = logits.shape[0] if indices is None else indices.shape[0]
    words = bitmask.shape[1]
    vocab = min(logits.shape[1], words * 32)
    if rows == 0 or vocab == 0:
        return
    grid = (rows, triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, indices if indices is not None else bitmask, vocab, words,
                                logits.stride(0), bitmask.stride(0), HAS_INDICES=indices is not None,
                                BLOCK=_BLOCK, num_warps=4)
