"""Split-K GEMM for the decode step's narrow projections: ``y = x W^T (+ b)``.

Why: at batch 256 the 0.5B model's ``down`` (4864 -> 896) and ``o_proj`` (896 -> 896)
projections have only ``256 x 896`` outputs. In cuBLAS's 128 x 128 (or larger) output tiles
that is 14 tiles for 132 SMs, each walking the whole ``K``: the device step's profile showed
``down`` at ~10 us a layer where its weights take ~2 us to read. Splitting ``K`` over more
programs fills the SMs; each split writes an fp32 partial and a second small kernel sums
them (with the bias) into the output dtype.

``linear(x, w, bias, config)`` takes torch's ``F.linear`` layout (``w`` is ``[N, K]``). The
tile shape and split count come from ``config`` (see :data:`GemmConfig`), chosen per shape by
the caller (``benchmarks/gemm_bench.py`` sweeps them); nothing here reads tensor values on
the host, so it can be captured in a CUDA graph (the partials come from the graph's pool).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from tandem.kernels import pdl

__all__ = ["GemmConfig", "linear"]


class GemmConfig(NamedTuple):
    """One launch shape: output tile ``block_m x block_n``, ``block_k`` per loop step,
    ``split_k`` programs along ``K`` per tile, and the launch's warps and pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _gemm_kernel(a_ptr, w_ptr, c_ptr, part_ptr, bias_ptr, M, N, K, stride_am, stride_wn, stride_cm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    num_n = tl.cdiv(N, BLOCK_N)
    pm = pid // num_n
    pn = pid % num_n
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = split * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_row = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    w_col = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        a = tl.load(a_row + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_col + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(part_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :], acc,
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, c_ptr, bias_ptr, M, N, stride_cm, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + (offs // N) * stride_cm + n, acc.to(c_ptr.dtype.element_ty), mask=ok)


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
           config: GemmConfig = GemmConfig(), out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K]^T (+ bias[N])`` in ``x``'s dtype, fp32 accumulation.

    ``x`` and ``w`` need a contiguous last dimension; ``out`` (``[M, N]``, contiguous last
    dimension) is written in place when given.
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need a contiguous last dimension")
    M, K = x.shape
    N = w.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    c = config
    split = max(1, min(c.split_k, triton.cdiv(K, c.block_k)))
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device) if split > 1 else out
    has_bias = bias is not None
    b = bias if has_bias else out
    grid = (triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n), split)
    _gemm_kernel[grid](x, w, out, part, b, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                       BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=split, HAS_BIAS=has_bias,
                       num_warps=c.num_warps, num_stages=c.num_stages, **pdl.launch_options())
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](part, out, b, M, N, out.stride(0), SPLIT_K=split,
                                                         HAS_BIAS=has_bias, BLOCK=block, num_warps=4,
                                                         **pdl.launch_options())
    return out
