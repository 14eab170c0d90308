"""The small-batch GEMV kernels against the eager layers they replace (RMSNorm with the
residual add, the projection, SiLU-and-multiply). On the CPU they run under the Triton
interpreter (fp32, fp16); on CUDA also in bf16 at the 0.5B model's sizes. The kernel sums
each row in its own order, so a projection may differ from the GEMM's by a rounding step
of its output; everything before the sum is rounded where the eager code rounds."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tandem.layers.activation import SiluAndMul  # noqa: E402
from tandem.layers.norm import RMSNorm  # noqa: E402

pytestmark = pytest.mark.timeout(300)
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# (K, N): input and output features, in one tile and in several (K > 1024), with partial
# blocks of outputs and features.
SHAPES = [(96, 72), (300, 37), (1100, 20)] + ([(896, 1152), (896, 2 * 4864), (4864, 896)] if HAS_CUDA else [])


def _interpreted() -> None:
    if not HAS_CUDA:
        from tandem.kernels import gemv

        if type(gemv._gemv_kernel).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")


def _close(got: torch.Tensor, want: torch.Tensor, exact: bool = False) -> None:
    """fp32: to fp32 summation order; 16-bit: a rounding step of the output's scale (or
    exactly, for values the eager code computes without a sum over features)."""
    if exact or got.dtype == torch.float32:
        tol = 0.0 if exact else 1e-5
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))
        return
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=2 * eps * float(want.abs().max()))


def _layers(dtype: torch.dtype, K: int, N: int, bias: bool) -> tuple[RMSNorm, torch.Tensor, torch.Tensor | None]:
    norm = RMSNorm(K, eps=1e-6).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(K) * 0.5 + 1)
    norm.weight.requires_grad_(False)
    w = (torch.randn(N, K, device=DEV) * K ** -0.5).to(dtype)
    b = torch.randn(N, device=DEV).to(dtype) if bias else None
    return norm, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("M", [1, 3, 8])
def test_norm_and_projection(dtype, K, N, M):
    """``[residual add +] RMSNorm + x W^T + b`` (the QKV projection's launch)."""
    from tandem.kernels.gemv import gemv

    _interpreted()
    torch.manual_seed(M)
    norm, w, b = _layers(dtype, K, N, bias=True)
    x = torch.randn(M, K, device=DEV, dtype=dtype)
    r = torch.randn(M, K, device=DEV, dtype=dtype)
    h, want_res = norm(x, r)
    got, got_res = gemv(x, w, b, norm=(norm.weight, norm.eps), residual=r)
    _close(got_res, want_res, exact=True)
    _close(got, F.linear(h, w, b))
    _close(gemv(x, w, b, norm=(norm.weight, norm.eps)), F.linear(norm(x), w, b))  # the first layer's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("M", [1, 5])
def test_norm_projection_and_silu(dtype, K, N, M):
    """``residual add + RMSNorm + [gate | up] projection + silu(gate) * up`` (the MLP's
    first launch), with and without bias."""
    from tandem.kernels.gemv import gemv

    _interpreted()
    torch.manual_seed(10 + M)
    N += N % 2
    for bias in (False, True):
        norm, w, b = _layers(dtype, K, N, bias)
        x = torch.randn(M, K, device=DEV, dtype=dtype)
        r = torch.randn(M, K, device=DEV, dtype=dtype)
        h, want_res = norm(x, r)
        gate_up = F.linear(h, w, b)
        got, got_res = gemv(x, w, b, norm=(norm.weight, norm.eps), residual=r, silu=True)
        _close(got_res, want_res, exact=True)
        assert got.shape == (M, N // 2)
        # silu(gate) * up amplifies a rounding step of gate or up by up to ~2x its value:
        # compare with SiLU-and-multiply of the kernel's own inputs as rounded by the GEMM.
        _close(got, SiluAndMul()(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,N", SHAPES)
def test_plain_projection_on_strided_rows(dtype, K, N):
    """``o_proj`` / ``down_proj``: no norm; input rows may be a view with a row stride."""
    from tandem.kernels.gemv import gemv

    _interpreted()
    torch.manual_seed(7)
    _, w, b = _layers(dtype, K, N, bias=False)
    x = torch.randn(4, 2 * K, device=DEV, dtype=dtype)[:, :K]
    _close(gemv(x, w), F.linear(x, w))
    _, w, b = _layers(dtype, K, N, bias=True)
    _close(gemv(x[:1], w, b), F.linear(x[:1], w, b))


def test_refuses_what_it_cannot_compute():
    from tandem.kernels.gemv import MAX_ROWS, gemv

    w = torch.randn(6, 8, device=DEV)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(MAX_ROWS + 1, 8, device=DEV), w)
    with pytest.raises(ValueError, match="shape"):
        gemv(torch.randn(2, 7, device=DEV), w)
    with pytest.raises(ValueError, match="residual"):
        gemv(torch.randn(2, 8, device=DEV), w, residual=torch.randn(2, 8, device=DEV))
    with pytest.raises(ValueError, match="even"):
        gemv(torch.randn(2, 8, device=DEV), torch.randn(5, 8, device=DEV), silu=True)


def test_which_batches_take_it():
    """By default only batch 1 of a small model (where it measured faster); the environment
    switch overrides, within the kernels' limit."""
    from types import SimpleNamespace

    from tandem.config.model import EnvSwitches
    from tandem.kernels.gemv import MAX_ROWS, auto_max_rows
    from tandem.worker.worker import _gemv_rows

    assert auto_max_rows(896, 4864) == 1  # Qwen2.5-0.5B
    assert auto_max_rows(3584, 18944) == 0  # Qwen2.5-7B
    qwen_05b = SimpleNamespace(hidden_size=896, intermediate_size=4864)
    assert EnvSwitches.from_environ({}).gemv_max_rows is None
    assert _gemv_rows(EnvSwitches.from_environ({}).gemv_max_rows, qwen_05b) == 1
    assert _gemv_rows(EnvSwitches.from_environ({"TANDEM_GEMV_MAX_ROWS": "0"}).gemv_max_rows, qwen_05b) == 0
    assert _gemv_rows(EnvSwitches.from_environ({"TANDEM_GEMV_MAX_ROWS": "99"}).gemv_max_rows, qwen_05b) == MAX_ROWS


@pytest.mark.parametrize("silu", [False, True])
def test_unrolled_feature_loop_gives_the_same_bits(monkeypatch, silu):
    """``UNROLL_K`` (the multi-tile loop unrolled) sums the tiles in the same order."""
    from tandem.kernels import gemv as mod

    _interpreted()
    torch.manual_seed(3)
    K, N = 1100, 20
    norm, w, _ = _layers(torch.float32, K, 2 * N if silu else N, bias=False)
    x = torch.randn(2, K, device=DEV)
    r = torch.randn(2, K, device=DEV)
    monkeypatch.setattr(mod, "UNROLL_K", False)
    want = mod.gemv(x, w, norm=(norm.weight, norm.eps), residual=r, silu=silu)
    monkeypatch.setattr(mod, "UNROLL_K", True)
    got = mod.gemv(x, w, norm=(norm.weight, norm.eps), residual=r, silu=silu)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


ROPE_SHAPES = [(96, 4, 2, 16), (1100, 3, 1, 8)] + ([(896, 14, 2, 64), (3584, 28, 4, 128)] if HAS_CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,nq,nk,d", ROPE_SHAPES)
@pytest.mark.parametrize("M", [1, 3])
def test_qkv_projection_with_rotary_and_cache_write(dtype, K, nq, nk, d, M):
    """``gemv(rope=...)``: the QKV launch also rotates q and k and writes k and v to their
    cache slots, as the projection followed by ``fused.rotary_write_kv_cache_`` does. A
    padding row (negative slot) writes nothing to the cache; other slots stay untouched."""
    from tandem.kernels.fused import rotary_write_kv_cache_
    from tandem.kernels.gemv import RopeWrite, gemv
    from tandem.layers.rotary import RotaryEmbedding

    _interpreted()
    torch.manual_seed(K + M)
    N = (nq + 2 * nk) * d
    norm, w, b = _layers(dtype, K, N, bias=True)
    rot = RotaryEmbedding(d, d, 256, 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)).to(DEV)
    x = torch.randn(M, K, device=DEV, dtype=dtype)
    r = torch.randn(M, K, device=DEV, dtype=dtype)
    positions = torch.randint(0, 256, (M,), device=DEV)
    slots = torch.randperm(40, device=DEV)[:M]
    if M > 1:
        slots[1] = -1
    cache_dtype = torch.float32 if dtype == torch.float32 else dtype
    want_cache = torch.randn(2, 5, 8, nk, d, device=DEV).to(cache_dtype)
    got_cache = want_cache.clone()

    qkv, want_res = gemv(x, w, b, norm=(norm.weight, norm.eps), residual=r)
    q = qkv[:, :nq * d].reshape(M, nq, d).clone()
    k = qkv[:, nq * d:(nq + nk) * d].reshape(M, nk, d)
    v = qkv[:, (nq + nk) * d:].reshape(M, nk, d)
    rotary_write_kv_cache_(positions, q, k, v, rot.cos_cache, rot.sin_cache, d, want_cache, slots)

    rope = RopeWrite(positions, rot.cos_cache, rot.sin_cache, got_cache, slots, nq, nk, d)
    got_q, got_res = gemv(x, w, b, norm=(norm.weight, norm.eps), residual=r, rope=rope)
    assert got_q.shape == (M, nq * d)
    _close(got_res, want_res, exact=True)
    exact = not HAS_CUDA  # the interpreter sums each row in one order; a GPU tile layout may not
    _close(got_q, q.reshape(M, -1), exact=exact)
    _close(got_cache, want_cache, exact=exact)
    with pytest.raises(ValueError, match="QKV"):
        gemv(x, w[:-1], rope=rope)
