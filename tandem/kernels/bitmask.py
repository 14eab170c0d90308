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


@triton.jit
def _apply_host_bitmask_kernel(logits_ptr, gate_ptr, mask_rows_ptr, vocab_size, num_words, stride_logits,
                               BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    src = tl.load(mask_rows_ptr + i)  # the bitmask row of logits row i; -1: unconstrained
    base = tl.load(gate_ptr + 2).to(tl.pointer_type(tl.int32))  # GATE_BITMASK_ADDR (host memory)
    first = tl.program_id(1) * BLOCK
    w = first // 32 + tl.arange(0, BLOCK // 32)
    live = tl.where(src >= 0, num_words, 0)  # words to read: none for an unconstrained row
    # volatile: the rows were written by the host after the previous replay read them.
    words = tl.load(base + src * num_words + w, mask=w < live, other=-1, volatile=True)
    banned = ((words[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    banned = tl.reshape(banned, [BLOCK])
    offs = first + tl.arange(0, BLOCK)
    tl.store(logits_ptr + i * stride_logits + offs, float("-inf"), mask=banned & (offs < vocab_size))


def apply_host_bitmask_triton(logits: torch.Tensor, gate: torch.Tensor, mask_rows: torch.Tensor,
                              num_words: int) -> None:
    """Set ``-inf`` in ``logits`` ([B, V], in place) wherever a row's bitmask row has a 0 bit,
    reading the bitmask where the host filled it: ``gate[2]`` (``host_flag.GATE_BITMASK_ADDR``)
    is the address of its contiguous int32 ``[rows, num_words]`` in pinned host memory (the
    device reads it over the bus, with unified addressing), and ``mask_rows[r]`` (int64,
    ``>= B`` entries) its row for logits row ``r``, or -1 to leave that row alone. Both are
    device tensors read when the kernel runs, so a CUDA graph that captured this call masks
    each replay's rows of each replay's bitmask (gated decode graphs); no copy of the bitmask
    is queued, so none has to be launched either."""
    assert gate.dtype == torch.int64 and mask_rows.dtype == torch.int64 and logits.stride(1) == 1
    rows = logits.shape[0]
    vocab = min(logits.shape[1], num_words * 32)
    if rows == 0 or vocab == 0:
        return
    grid = (rows, triton.cdiv(vocab, _BLOCK))
    _apply_host_bitmask_kernel[grid](logits, gate, mask_rows, vocab, num_words, logits.stride(0), BLOCK=_BLOCK,
                                     num_warps=4)
