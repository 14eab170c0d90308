"""Split-KV count selection (pure functions; no Triton, no device).

The count follows the longest context in the batch, so short-context decode takes one
split (no merge kernel) and the decode graphs per bucket cover every count a batch can
pick."""
from __future__ import annotations

import pytest

from tandem.kernels.splits import (MIN_SPLIT_TOKENS, SMALL_BATCH_SPLIT_TOKENS, choose_num_kv_splits,
                                   decode_split_counts, split_chunk_tokens)

pytestmark = pytest.mark.timeout(60)

H200_SMS = 132


def test_short_context_takes_one_split() -> None:
    # A batch that fills the GPU with (sequence, KV head) programs does not split short
    # contexts (no merge kernel): chunks are MIN_SPLIT_TOKENS long.
    for ctx in (1, 17, 256, 2 * MIN_SPLIT_TOKENS - 1):
        assert choose_num_kv_splits(32, 2, 1, ctx, H200_SMS) == 1
    assert choose_num_kv_splits(32, 2, 1, 2 * MIN_SPLIT_TOKENS, H200_SMS) == 2
    # Batch 1 of a 0.5B Qwen2 shape (2 KV heads) leaves the GPU nearly empty: chunks of
    # SMALL_BATCH_SPLIT_TOKENS, so a context under two of them still takes one split.
    assert split_chunk_tokens(1, 2, H200_SMS) == SMALL_BATCH_SPLIT_TOKENS
    for ctx in (1, 17, 2 * SMALL_BATCH_SPLIT_TOKENS - 1):
        assert choose_num_kv_splits(1, 2, 1, ctx, H200_SMS) == 1
    assert choose_num_kv_splits(1, 2, 1, 2 * SMALL_BATCH_SPLIT_TOKENS, H200_SMS) == 2
    assert choose_num_kv_splits(1, 2, 1, 300, H200_SMS) == 8  # 300 // 32 = 9 chunks -> 8


def test_long_context_splits_by_context_then_by_occupancy() -> None:
    assert choose_num_kv_splits(32, 2, 1, 4096, H200_SMS) == 8  # occupancy: ceil(528 / 64) = 9 -> 8
    assert choose_num_kv_splits(1, 2, 1, 512, H200_SMS) == 16  # 512 // 32 keys per chunk
    assert choose_num_kv_splits(1, 2, 1, 8192, H200_SMS) == 32  # the cap
    assert choose_num_kv_splits(1, 2, 1, 1 << 20, H200_SMS) == 32
    # A big batch fills the GPU on its own: no split whatever the context.
    assert choose_num_kv_splits(512, 8, 1, 32768, H200_SMS) == 1
    assert choose_num_kv_splits(256, 2, 1, 32768, H200_SMS) == 1  # 512 programs >= 132 SMs
    # Occupancy bounds it: 64 x 2 programs want ceil(528 / 128) = 5 -> 4.
    assert choose_num_kv_splits(64, 2, 1, 32768, H200_SMS) == 4


def test_only_pure_decode_splits() -> None:
    assert choose_num_kv_splits(4, 2, 7, 8192, H200_SMS) == 1
    assert choose_num_kv_splits(0, 2, 1, 8192, H200_SMS) == 1


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 8, 17, 64, 100, 256, 1024])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_counts_are_powers_of_two_monotone_in_context(num_seqs: int, kv_heads: int) -> None:
    prev = 1
    for ctx in range(1, 9000, 7):
        s = choose_num_kv_splits(num_seqs, kv_heads, 1, ctx, H200_SMS)
        assert s >= prev and s & (s - 1) == 0
        prev = s


@pytest.mark.parametrize("max_model_len", [1, 100, 511, 512, 2048, 4097, 8192, 40000])
@pytest.mark.parametrize("num_seqs,kv_heads,sms", [(1, 2, 132), (16, 2, 132), (48, 4, 132), (256, 2, 132),
                                                   (3, 1, 8), (1, 8, 1)])
def test_decode_split_counts_are_exactly_the_reachable_counts(max_model_len: int, num_seqs: int, kv_heads: int,
                                                              sms: int) -> None:
    """Brute force over every context: the graph variants cover every count a batch of this
    bucket can pick, and nothing else (no graph captured in vain)."""
    want = sorted({choose_num_kv_splits(num_seqs, kv_heads, 1, n, sms) for n in range(1, max_model_len + 1)})
    assert decode_split_counts(num_seqs, kv_heads, max_model_len, sms) == want


def test_decode_split_counts_honour_min_split_tokens() -> None:
    got = decode_split_counts(1, 2, 64, H200_SMS, min_split_tokens=4)
    want = sorted({choose_num_kv_splits(1, 2, 1, n, H200_SMS, min_split_tokens=4) for n in range(1, 65)})
    assert got == want == [1, 2, 4, 8, 16]


def test_variant_counts_per_bucket_on_an_h200() -> None:
    """What capture costs for a 0.5B Qwen2 (2 KV heads) at max_model_len 4096: small buckets
    get a graph per context range, mid-size ones a few, buckets whose programs fill the
    SMs one graph."""
    assert decode_split_counts(1, 2, 4096, H200_SMS) == [1, 2, 4, 8, 16, 32]
    assert decode_split_counts(64, 2, 4096, H200_SMS) == [1, 2, 4]
    assert decode_split_counts(256, 2, 4096, H200_SMS) == [1]
    assert decode_split_counts(512, 2, 4096, H200_SMS) == [1]
