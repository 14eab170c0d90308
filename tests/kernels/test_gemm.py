"""The split-K GEMM (``tandem.kernels.gemm.linear``) against ``F.linear``: one split and
several, with and without bias, partial tiles in every dimension. On the CPU under the
Triton interpreter (fp32, fp16); on CUDA also bf16 at the 0.5B model's decode shapes and
inside a CUDA graph."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

pytestmark = pytest.mark.timeout(300)
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# (M, K, N): partial tiles of rows, features and outputs; K not a multiple of the split.
SHAPES = [(5, 96, 40), (33, 200, 70)] + ([(256, 4864, 896), (256, 896, 896), (64, 896, 1152)] if HAS_CUDA else [])


def _interpreted() -> None:
    if not HAS_CUDA:
        from tandem.kernels import gemm

        if type(gemm._gemm_kernel).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(dtype: torch.dtype, shape: tuple[int, int, int], split_k: int, bias: bool) -> None:
    from tandem.kernels.gemm import GemmConfig, linear

    _interpreted()
    M, K, N = shape
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype) if bias else None
    cfg = GemmConfig(block_m=16, block_n=32, block_k=32, split_k=split_k, num_warps=4, num_stages=2)
    got = linear(x, w, b, cfg)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (M, N)
    # fp32 to summation order; 16-bit to a rounding step of the output (one per split's sum order)
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    torch.testing.assert_close(got.float(), want, atol=tol * 4, rtol=tol * 2)


def test_out_is_written_in_place_and_strided_rows_work() -> None:
    from tandem.kernels.gemm import GemmConfig, linear

    _interpreted()
    x_full = torch.randn(7, 130, device=DEV)
    x = x_full[:, :96]  # rows strided, last dimension contiguous
    w = torch.randn(48, 96, device=DEV)
    out_full = torch.zeros(7, 64, device=DEV)
    out = out_full[:, 8:56]
    got = linear(x, w, None, GemmConfig(block_m=16, block_n=16, block_k=32, split_k=2, num_stages=2), out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert (out_full[:, :8] == 0).all() and (out_full[:, 56:] == 0).all()


def test_bad_shapes_are_refused() -> None:
    from tandem.kernels.gemm import linear

    with pytest.raises(ValueError, match="x must be"):
        linear(torch.randn(3, 4, device=DEV), torch.randn(5, 6, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        linear(torch.randn(4, 3, device=DEV).t(), torch.randn(5, 4, device=DEV))


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU")
def test_graph_replay_equals_eager() -> None:
    from tandem.kernels.gemm import GemmConfig, linear

    x = torch.randn(256, 4864, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(896, 4864, device="cuda", dtype=torch.bfloat16) * 0.02
    cfg = GemmConfig(block_m=64, block_n=64, block_k=64, split_k=4)
    eager = linear(x, w, None, cfg)
    out = torch.empty_like(eager)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        linear(x, w, None, cfg, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        linear(x, w, None, cfg, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
