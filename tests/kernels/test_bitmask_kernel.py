"""tandem's bitmask kernel (``tandem.kernels.bitmask``) against xgrammar's CPU kernel, which
the engine used on every device before: the same logits end up ``-inf`` for whole-batch and
indexed rows, vocabularies that are not a multiple of 32 (or of the kernel's block), a
bitmask wider or narrower than the logits, fp32/fp16 (and bf16 on CUDA). On the CPU the
kernel runs under the Triton interpreter."""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
xgrammar = pytest.importorskip("xgrammar")

from tandem.kernels.bitmask import apply_token_bitmask_triton  # noqa: E402

pytestmark = pytest.mark.timeout(300)
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
CASES = [  # vocab, bitmask words, rows, indices
    (100, 4, 3, None),
    (1100, 35, 4, [3]),
    (1000, 40, 2, None),       # bitmask wider than the logits
    (2100, 60, 3, [2, 0]),     # narrower: columns past 32 * words stay as they were
    (4097, 129, 6, [5, 1, 4]),
]


def _interpreted() -> None:
    if not HAS_CUDA:
        from tandem.kernels import bitmask

        if type(bitmask._apply_bitmask_kernel).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,words,rows,indices", CASES)
def test_bitmask_kernel_matches_xgrammar(dtype, vocab, words, rows, indices):
    _interpreted()
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bitmask[0, 0] = 0  # a word that bans all 32
    want = logits.float().clone()
    xgrammar.apply_token_bitmask_inplace(want, bitmask, vocab_size=min(vocab, words * 32), indices=indices)
    got = logits.to(DEV)
    idx = None if indices is None else torch.tensor(indices, dtype=torch.int64, device=DEV)
    apply_token_bitmask_triton(got, bitmask.to(DEV), idx)
    assert torch.equal(got.float().cpu(), want.to(dtype).float())
    assert torch.isinf(got.float()).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,words,rows,indices", CASES)
def test_host_bitmask_kernel_masks_the_rows_the_gate_names(dtype, vocab, words, rows, indices):
    """The gated decode graphs' mask (``apply_host_bitmask_triton``): the bitmask is read at
    the address the staged gate holds (pinned host memory on CUDA), row ``mask_rows[r]`` for
    logits row ``r``, -1 leaving a row whole: the same logits as xgrammar's kernel given
    those rows. Two calls with the same device tensors and another bitmask follow it (what
    a graph replay sees)."""
    from tandem.kernels.bitmask import apply_host_bitmask_triton
    from tandem.kernels.host_flag import GATE_BITMASK_ADDR, GATE_WORDS

    _interpreted()
    g = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    listed = list(range(rows)) if indices is None else indices
    gate = torch.zeros(GATE_WORDS, dtype=torch.int64, device=DEV)
    mask_rows = torch.full((rows + 2,), -1, dtype=torch.int64, device=DEV)  # (wider than the batch)
    for turn in range(2):
        bitmask = torch.randint(-2**31, 2**31 - 1, (len(listed), words), dtype=torch.int32, generator=g)
        bitmask = bitmask.pin_memory() if HAS_CUDA else bitmask
        bitmask[0, 0] = 0
        gate[GATE_BITMASK_ADDR] = bitmask.data_ptr()
        rows_of = torch.full((rows,), -1, dtype=torch.int64)
        rows_of[listed] = torch.arange(len(listed)) if turn == 0 else torch.arange(len(listed)).flip(0)
        mask_rows[:rows] = rows_of.to(DEV)
        by_row = bitmask[rows_of.clamp(min=0)]  # the bitmask laid out by logits row
        want = logits.float().clone()
        xgrammar.apply_token_bitmask_inplace(want, by_row, vocab_size=min(vocab, words * 32), indices=listed)
        got = logits.to(DEV)
        apply_host_bitmask_triton(got, gate, mask_rows, words)
        assert torch.equal(got.float().cpu(), want.to(dtype).float()), f"turn {turn}"
        assert torch.isinf(got.float()).any()
