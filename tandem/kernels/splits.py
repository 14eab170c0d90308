"""Split-KV (flash-decoding) split counts: pure functions of shapes, no Triton needed.

Why a split count from the batch's real context: with few sequences a decode step leaves
most SMs idle, so the key range of each sequence is cut into ``num_kv_splits`` chunks and a
second kernel merges the partial results. Splitting pays only when there are keys to
split. Picking the count from ``max_model_len`` (a bound, not the context) made batch 1 at a
short context pay the merge kernel in every layer of every step; picking it from the
longest context *in the batch* gives those steps one split and no merge kernel.

A CUDA graph bakes the split count in (it is a compile-time constant of the kernel, and it
sizes the grid and the partial buffers), so the model runner captures one decode graph per
(batch-size bucket, split count) that :func:`choose_num_kv_splits` can return for that
bucket (:func:`decode_split_counts`), and an eager step of the same batch picks the same
count: graphs and eager runs stay numerically identical.
"""
from __future__ import annotations

__all__ = ["choose_num_kv_splits", "decode_split_counts", "MIN_SPLIT_TOKENS", "SMALL_BATCH_SPLIT_TOKENS"]

# No split chunk shorter than this many keys: below it the merge costs more than it hides.
MIN_SPLIT_TOKENS = 256
# ...except in a batch so small that its (sequence, KV head) programs fill at most an
# eighth of the SMs (batch 1 to 8 of a 2-KV-head model on an H100): there the GPU is idle
# but for a handful of programs, each walking its keys alone, and chunks this short pay.
# Measured on an H100 (0.5B Qwen2 shape, batch 1, contexts 128-640): the attention kernels
# of a step took 262 us with 256-key chunks (one split), 110 us with 64, 81 us with 32.
SMALL_BATCH_SPLIT_TOKENS = 32


def split_chunk_tokens(num_seqs: int, num_kv_heads: int, num_sms: int, min_split_tokens: int = MIN_SPLIT_TOKENS,
                       small_batch_split_tokens: int = SMALL_BATCH_SPLIT_TOKENS) -> int:
    """The shortest key chunk a decode batch of this size may split into."""
    programs = max(1, num_seqs) * max(1, num_kv_heads)
    if 8 * programs <= max(1, num_sms):
        return min(min_split_tokens, small_batch_split_tokens)
    return min_split_tokens


def choose_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int,
    *, waves: int = 4, min_split_tokens: int = MIN_SPLIT_TOKENS,
    small_batch_split_tokens: int = SMALL_BATCH_SPLIT_TOKENS, max_splits: int = 32,
) -> int:
    """Split-KV count for a batch (a power of two, so few variants get compiled).

    Prefill/mixed batches have enough query tiles, so only pure-decode batches split, and
    only when their (sequence, kv head) programs leave SMs idle: a batch with a program
    per SM already gains nothing but the merge kernel (an H100 ran batch 256 at 2k context
    in 0.112 ms unsplit, 0.120 ms in two). Then: enough programs for about ``waves`` per
    SM, but no chunk shorter than ``split_chunk_tokens`` keys (``min_split_tokens``, or
    ``small_batch_split_tokens`` for a batch that fills an eighth of the SMs or less; the
    merge costs more than shorter chunks hide), so a batch whose longest context
    ``max_seq_len`` is under two chunks does not split at all. The partial results are tiny
    next to the KV reads, so erring high is cheap.

    The result is non-decreasing in ``max_seq_len`` and changes only where
    ``max_seq_len // chunk`` reaches a power of two (the context buckets).
    """
    if max_query_len != 1 or num_seqs <= 0:
        return 1
    programs = num_seqs * max(1, num_kv_heads)
    if programs >= max(1, num_sms):
        return 1
    want = -(-waves * max(1, num_sms) // programs)
    chunk = split_chunk_tokens(num_seqs, num_kv_heads, num_sms, min_split_tokens, small_batch_split_tokens)
    cap = max(1, max_seq_len // chunk)
    splits = max(1, min(want, cap, max_splits))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def decode_split_counts(num_seqs: int, num_kv_heads: int, max_model_len: int, num_sms: int,
                        **kwargs: int) -> list[int]:
    """Every split count :func:`choose_num_kv_splits` returns for a decode batch of
    ``num_seqs`` sequences whose longest context is anywhere in ``1..max_model_len``,
    ascending: the decode graphs to capture for that batch-size bucket.

    The count is a non-decreasing step function of the context that can change only at
    ``chunk * 2**i`` (``split_chunk_tokens``), so evaluating it at those lengths (and at both ends) finds
    every value without walking all lengths.
    """
    min_split = split_chunk_tokens(num_seqs, num_kv_heads, num_sms, kwargs.get("min_split_tokens", MIN_SPLIT_TOKENS),
                                   kwargs.get("small_batch_split_tokens", SMALL_BATCH_SPLIT_TOKENS))
    lengths = {1, max(1, max_model_len)}
    k = 1
    while k * min_split <= max_model_len:
        lengths.add(k * min_split)
        k *= 2
    return sorted({choose_num_kv_splits(num_seqs, num_kv_heads, 1, n, num_sms, **kwargs) for n in lengths})
