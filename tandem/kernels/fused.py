"""Fused Triton kernels for the small ops of a decoder layer: RMSNorm (with the residual
add), rotary embedding, SiLU-and-multiply.

Why: in eager PyTorch each of these is 3 to 10 elementwise kernels (casts, pow, mean,
rsqrt, multiplies, slices, cat). A decode step of a 24-layer model then launches over a
thousand kernels of a few microseconds each, and that, not memory bandwidth, bounds the
step even inside a CUDA graph. One kernel per op brings a layer down to about ten
launches.

Each kernel reproduces the roundings of the PyTorch code it replaces (``tandem.layers``,
which follows Hugging Face): values are computed in fp32 and rounded to the activation
dtype exactly where the eager code holds an activation-dtype tensor, so bf16 results agree
with the eager path up to fp32 summation order.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


def _pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


# -- RMSNorm -------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                     H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        # residual = x + residual, rounded to the activation dtype as the eager add is.
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / H
    normed = (h * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * norm(x)``; with ``residual``: ``(weight * norm(x + residual), x + residual)``."""
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    T = x2.shape[0]
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res2 = residual.reshape(-1, H) if residual is not None else x2
    if T:
        _rms_norm_kernel[(T,)](x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0),
                               res_out.stride(0), H, eps, HAS_RES=residual is not None, BLOCK=_pow2(H),
                               num_warps=4 if H <= 4096 else 8)
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


# -- rotary --------------------------------------------------------------------------------
@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, stride_qt, stride_kt, stride_cos,
                   NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                   HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    # cos/sin are fp32 in the cache and cast to the activation dtype before use, like HF.
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(q_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(q_ptr.dtype.element_ty).to(tl.float32)
    offs_h = tl.arange(0, HEADS_PAD)
    for which in tl.static_range(2):
        if which == 0:
            base = q_ptr + tok * stride_qt
            n_heads = NUM_Q
        else:
            base = k_ptr + tok * stride_kt
            n_heads = NUM_K
        mask = (offs_h[:, None] < n_heads) & d_ok[None, :]
        p1 = base + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
        dt = q_ptr.dtype.element_ty
        # Each product is rounded before the sum, as x1 * cos - x2 * sin is in the eager dtype.
        o1 = (x1 * cos[None, :]).to(dt).to(tl.float32) - (x2 * sin[None, :]).to(dt).to(tl.float32)
        o2 = (x2 * cos[None, :]).to(dt).to(tl.float32) + (x1 * sin[None, :]).to(dt).to(tl.float32)
        tl.store(p1, o1.to(dt), mask=mask)
        tl.store(p1 + HALF, o2.to(dt), mask=mask)


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                      sin_cache: torch.Tensor, head_dim: int, rotary_dim: int) -> None:
    """Rotate ``q [T, H*D]`` and ``k [T, KVH*D]`` in place (neox layout; the first
    ``rotary_dim`` dims of each head). Rows may be strided views of a fused QKV output."""
    T = positions.shape[0]
    if T == 0:
        return
    assert q.stride(1) == 1 and k.stride(1) == 1, "heads must be contiguous within a token"
    nq, nk = q.shape[1] // head_dim, k.shape[1] // head_dim
    half = rotary_dim // 2
    _rotary_kernel[(T,)](q, k, positions, cos_cache, sin_cache, q.stride(0), k.stride(0), cos_cache.stride(0),
                         NUM_Q=nq, NUM_K=nk, HEAD_DIM=head_dim, HALF=half, HEADS_PAD=_pow2(max(nq, nk)),
                         HALF_PAD=_pow2(half), num_warps=4)


# -- SiLU and multiply ---------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounds its output
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in one kernel."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    T = x2.shape[0]
    out = torch.empty(T, d, dtype=x.dtype, device=x.device)
    if T:
        block = min(1024, _pow2(d))
        _silu_mul_kernel[(T, triton.cdiv(d, block))](x2, out, x2.stride(0), out.stride(0), d, BLOCK=block,
                                                     num_warps=4)
    return out.view(*x.shape[:-1], d)
