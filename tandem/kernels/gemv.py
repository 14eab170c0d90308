"""Small-batch linear layers as one Triton GEMV each, with the neighbouring ops fused in.

Why: at batch 1 a decode step of a 0.5B model moves 1 GB of weights, which the HBM bound
puts near 0.25 ms, yet the step took 1.1 ms of GPU time in ~250 kernels. Each kernel costs a
few microseconds whatever its size, and cuBLAS answers the skinny shapes of a small batch
with split-K GEMMs plus a reduce kernel. Reading the weight once per row block, with the
batch's few rows riding along, and folding the small ops into the same launch, a decoder
layer becomes five launches instead of about ten:

* ``[residual add +] RMSNorm + QKV projection (+ bias) [+ rotary + KV write]``: the norm is
  the GEMV's prologue; with ``rope``, each program owns the two halves of head features
  that rotary pairs, rotates them and stores q, and k and v to their cache slots;
* [rotary + KV write (``tandem.kernels.fused``), where the QKV launch does not,] attention
  (``tandem.kernels.attention``);
* ``o_proj``;
* ``residual add + RMSNorm + gate_up projection + SiLU-and-multiply``: the norm is the
  prologue and SiLU(gate) * up the epilogue (each program owns the same rows of both halves);
* ``down_proj``.

Every program reads the whole (tiny) input and, for the norm, computes its statistics
itself; program 0 alone writes the new residual stream. Roundings follow the eager code the
kernels replace (``tandem.layers``, after Hugging Face): the residual sum, the normalized
value, the weight product, the projection output and SiLU are each rounded to the activation
dtype where the eager code holds an activation-dtype tensor, so results agree with it up to
fp32 summation order. No atomics: a row's sum is accumulated in a fixed order, so equal
inputs give equal outputs run after run (async == sync needs that).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from tandem.kernels import pdl

# Batches of at most this many rows may take the GEMV path; larger ones are GEMMs (cuBLAS).
MAX_ROWS = 8
# Models whose merged gate_up weight has at most this many elements take it at batch 1 by
# default. Measured on an H100 in CUDA graphs (benchmarks/gemv_bench.py, results in
# RESULTS.md): a 0.5B layer stack (gate_up of 8.7M elements) ran 694 -> 551 us a step at one
# row, a 7B one (136M) 3% slower than cuBLAS, and two or more rows were slower at both sizes.
AUTO_MAX_GATE_UP_NUMEL = 32 << 20
# Unroll the feature-tile loop of inputs wider than one tile (a variant per input width), so
# that all of a program's weight loads may be in flight together instead of one tile's at a
# time. Measured on an H100 (0.5B shapes, one row, ``gemv_bench.py --unroll``): down 133 ->
# 97 us, gate_up 236 -> 218 us, the layer stack 470 -> 428 us; the engine at batch 1, 1,238
# -> 1,320 tok/s (``benchmarks/RESULTS.md``).
UNROLL_K = True
# The QKV launch also rotates q and k and writes k and v to the KV cache (``RopeWrite``),
# where the attention allows it: one launch fewer per layer (the separate rotary + KV write
# kernel took ~1.8 us of a 0.5B batch-1 layer on an H100).
FUSE_ROPE = True


def auto_max_rows(hidden_size: int, intermediate_size: int) -> int:
    """The rows the GEMV path takes by default for a model of this size (1 or 0)."""
    return 1 if 2 * hidden_size * intermediate_size <= AUTO_MAX_GATE_UP_NUMEL else 0


@triton.jit
def _gemv_chunk(acc, acc_up, w, wu, x_ptrs, r_ptrs, nw_ptrs, x_mask, k_ok, rstd3, dt: tl.constexpr,
                NORM: tl.constexpr, HAS_RES: tl.constexpr, PAIRED: tl.constexpr):
    """Accumulate one feature chunk of the multi-tile path: load the input chunk, normalize
    it with the rows' ``rstd3`` (after adding the residual), multiply by the loaded weights
    (``PAIRED``: also by the paired rows' ``wu``, into ``acc_up``)."""
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    if NORM:
        if HAS_RES:
            r = tl.load(r_ptrs, mask=x_mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        normed = (x.to(tl.float32) * rstd3).to(dt)
        nw = tl.load(nw_ptrs, mask=k_ok, other=0.0)
        x = (nw.to(tl.float32) * normed.to(tl.float32)).to(dt)
    xf = x.to(tl.float32)
    acc += xf * w.to(tl.float32)
    if PAIRED:
        acc_up += xf * wu.to(tl.float32)
    return acc, acc_up


@triton.jit
def _gemv_tile(acc, acc_up, k0, w3, x3, r3, nw_ptr, k3, n_ok3, m_ok3, K, up_offset, stride_wn, rstd3,
               dt: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, PAIRED: tl.constexpr):
    """Load the weights of the feature tile at ``k0`` and accumulate it (``_gemv_chunk``)."""
    kk = k0 + k3
    k_ok3 = kk < K
    w = tl.load(w3 + kk, mask=n_ok3 & k_ok3, other=0.0)
    wu = w
    if PAIRED:
        wu = tl.load(w3 + up_offset * stride_wn + kk, mask=n_ok3 & k_ok3, other=0.0)
    return _gemv_chunk(acc, acc_up, w, wu, x3 + kk, r3 + kk, nw_ptr + kk, m_ok3 & k_ok3, k_ok3, rstd3, dt, NORM,
                       HAS_RES, PAIRED)


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
                 pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                 M, N, K, stride_xm, stride_rm, stride_wn, stride_om, stride_rom, up_offset, eps,
                 stride_cos, stride_ckv, stride_cslot, stride_ch, stride_cd,
                 NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                 ROPE: tl.constexpr, PAIRED: tl.constexpr, NUM_Q: tl.constexpr, NUM_K: tl.constexpr,
                 HEAD_DIM: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NORM_BLOCK: tl.constexpr,
                 ONE_TILE: tl.constexpr, K_UNROLL: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, M_PAD)
    if ROPE:  # programs own (first half, second half) output pairs of heads: N counts pairs
        offs_p = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_p < N
        offs_n = (offs_p // (HEAD_DIM // 2)) * HEAD_DIM + offs_p % (HEAD_DIM // 2)
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
    # Tiles are [rows, outputs, features], loaded as such, so an input chunk broadcasts over
    # the outputs with no layout conversion.
    m3 = offs_m[:, None, None]
    n3 = offs_n[None, :, None]
    k3 = tl.arange(0, BLOCK_K)[None, None, :]
    x3 = x_ptr + m3.to(tl.int64) * stride_xm
    r3 = res_ptr + m3.to(tl.int64) * stride_rm
    w3 = w_ptr + n3.to(tl.int64) * stride_wn
    m_ok3 = m3 < M
    n_ok3 = n_ok[None, :, None]

    # The first (or only) tile's weights are loaded first: with PDL, while the kernel before
    # this one still runs (weights are never written during a step; the input and every
    # store wait for it).
    k_ok3 = k3 < K
    w = tl.load(w3 + k3, mask=n_ok3 & k_ok3, other=0.0)
    wu = w
    if PAIRED:
        wu = tl.load(w3 + up_offset * stride_wn + k3, mask=n_ok3 & k_ok3, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if ONE_TILE:  # K <= BLOCK_K: the norm's statistics come from the input load the projection uses
        x = tl.load(x3 + k3, mask=m_ok3 & k_ok3, other=0.0)
        if NORM:
            if HAS_RES:
                r = tl.load(r3 + k3, mask=m_ok3 & k_ok3, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
                if pid == 0:
                    tl.store(res_out_ptr + m3.to(tl.int64) * stride_rom + k3, x, mask=m_ok3 & k_ok3)
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=2) / K + eps)[:, :, None]
            normed = (xf * rstd).to(dt)
            nw = tl.load(nw_ptr + k3, mask=k_ok3, other=0.0)
            x = (nw.to(tl.float32) * normed.to(tl.float32)).to(dt)
        xf = x.to(tl.float32)
        acc = xf * w.to(tl.float32)
        acc_up = acc
        if PAIRED:
            acc_up = xf * wu.to(tl.float32)
    else:
        rstd3 = tl.full([M_PAD, 1, 1], 1.0, dtype=tl.float32)
        if NORM:  # pass 1: each row's mean square (and, from program 0, the new residual stream)
            ss = tl.zeros([M_PAD], dtype=tl.float32)
            m_ok = offs_m < M
            x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
            r_rows = res_ptr + offs_m[:, None].to(tl.int64) * stride_rm
            for k0 in range(0, K, NORM_BLOCK):  # one iteration for a model's usual widths
                offs_k = k0 + tl.arange(0, NORM_BLOCK)
                mk = m_ok[:, None] & (offs_k < K)[None, :]
                h = tl.load(x_rows + offs_k[None, :], mask=mk, other=0.0)
                if HAS_RES:
                    r = tl.load(r_rows + offs_k[None, :], mask=mk, other=0.0)
                    h = (h.to(tl.float32) + r.to(tl.float32)).to(dt)
                    if pid == 0:
                        tl.store(res_out_ptr + offs_m[:, None].to(tl.int64) * stride_rom + offs_k[None, :], h,
                                 mask=mk)
                hf = h.to(tl.float32)
                ss += tl.sum(hf * hf, axis=1)
            rstd3 = tl.rsqrt(ss / K + eps)[:, None, None]
        zero = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc, acc_up = _gemv_chunk(zero, zero, w, wu, x3 + k3, r3 + k3, nw_ptr + k3, m_ok3 & k_ok3, k_ok3, rstd3,
                                  dt, NORM, HAS_RES, PAIRED)
        if K_UNROLL > 0:  # the remaining tiles unrolled: every tile's loads can be in flight at once
            for k0 in tl.static_range(BLOCK_K, K_UNROLL, BLOCK_K):
                acc, acc_up = _gemv_tile(acc, acc_up, k0, w3, x3, r3, nw_ptr, k3, n_ok3, m_ok3, K, up_offset,
                                         stride_wn, rstd3, dt, NORM, HAS_RES, PAIRED)
        else:
            for k0 in range(BLOCK_K, K, BLOCK_K):
                acc, acc_up = _gemv_tile(acc, acc_up, k0, w3, x3, r3, nw_ptr, k3, n_ok3, m_ok3, K, up_offset,
                                         stride_wn, rstd3, dt, NORM, HAS_RES, PAIRED)

    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    u = y
    if PAIRED:
        u = tl.sum(acc_up, axis=2)
        if HAS_BIAS:
            u += tl.load(b_ptr + up_offset + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        g = y.to(dt).to(tl.float32)  # the projection's output, rounded as the GEMM's is
        s = (g * tl.sigmoid(g)).to(dt).to(tl.float32)  # F.silu rounds its output
        y = s * u.to(dt).to(tl.float32)
    om = (offs_m < M)[:, None] & n_ok[None, :]
    if ROPE:
        _rope_epilogue(y, u, offs_m, offs_p, offs_n, om, M, out_ptr, stride_om, pos_ptr, cos_ptr, sin_ptr,
                       stride_cos, cache_ptr, slot_ptr, stride_ckv, stride_cslot, stride_ch, stride_cd, dt,
                       NUM_Q, NUM_K, HEAD_DIM)
    else:
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], y.to(dt), mask=om)


@triton.jit
def _rope_epilogue(y, u, offs_m, offs_p, offs_n, om, M, out_ptr, stride_om, pos_ptr, cos_ptr, sin_ptr, stride_cos,
                   cache_ptr, slot_ptr, stride_ckv, stride_cslot, stride_ch, stride_cd, dt: tl.constexpr,
                   NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The QKV projection's pairs ``(y, u)`` (feature ``j`` and ``j + HEAD_DIM / 2`` of a
    head, fp32 sums): rotary on q and k heads, q stored to ``out`` (``[M, NUM_Q * HEAD_DIM]``),
    k and v to their cache slots, with the roundings of ``fused._rotary_write_kv_kernel``
    (projection output, cos/sin and each product in the activation dtype)."""
    HALF = HEAD_DIM // 2
    cdt = cache_ptr.dtype.element_ty
    m_ok = offs_m < M
    x1 = y.to(dt).to(tl.float32)
    x2 = u.to(dt).to(tl.float32)
    head = offs_p // HALF
    j = offs_p % HALF
    pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    cs = pos[:, None] * stride_cos + j[None, :]
    cos = tl.load(cos_ptr + cs, mask=om, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(sin_ptr + cs, mask=om, other=0.0).to(dt).to(tl.float32)
    is_v = (head >= NUM_Q + NUM_K)[None, :]
    o1 = tl.where(is_v, x1, (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)).to(dt)
    o2 = tl.where(is_v, x2, (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)).to(dt)
    # q: attention reads it next.
    is_q = (head < NUM_Q)[None, :]
    q_dst = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(q_dst, o1, mask=om & is_q)
    tl.store(q_dst + HALF, o2, mask=om & is_q)
    # k and v: into their cache slots (a negative slot is a padding token: nothing cached).
    slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)
    kv_mask = om & (head >= NUM_Q)[None, :] & (slot >= 0)[:, None]
    kv_head = tl.where(head >= NUM_Q + NUM_K, head - NUM_Q - NUM_K, head - NUM_Q)
    kv_head = tl.where(head >= NUM_Q, kv_head, 0)
    which = (head >= NUM_Q + NUM_K).to(tl.int64)
    dst = (cache_ptr + which[None, :] * stride_ckv + tl.where(slot >= 0, slot, 0)[:, None] * stride_cslot
           + kv_head[None, :].to(tl.int64) * stride_ch + j[None, :] * stride_cd)
    tl.store(dst, o1.to(cdt), mask=kv_mask)
    tl.store(dst + HALF * stride_cd, o2.to(cdt), mask=kv_mask)


def _pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _config(m_pad: int, n: int, k: int, silu: bool, paired: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)``, after an H100 sweep of the 0.5B shapes at one row
    (gemv_bench.py --sweep): a feature width of up to 1024 in one tile (QKV 113 -> 91 us a
    step); wider inputs (down) in 1024-feature tiles over 8 warps (153 -> 136 us); the
    gate_up + SiLU launch, with two accumulators, in 16 x 256 tiles (261 -> 235 us). Output
    rows per program: enough programs to cover the SMs a few times over, within a register
    budget for the ``[rows, outputs, features]`` accumulators (~8k fp32 values; ``paired``
    QKV + rotary, like SILU, holds two)."""
    if silu:
        block_k, warps = 256, 4
    elif k <= 1024:
        block_k, warps = _pow2(k), 4
    else:
        block_k, warps = 1024, 8
    cap = max(1, 8192 // (m_pad * block_k * (2 if silu or paired else 1)))
    block_n = 1
    while block_n * 2 <= cap and (silu or triton.cdiv(n, block_n * 2) >= 512):
        block_n *= 2
    return block_n, block_k, warps


@dataclass(frozen=True)
class RopeWrite:
    """What ``gemv(rope=...)`` needs to finish a QKV projection as
    ``fused.rotary_write_kv_cache_`` would: the tokens' positions, the full-rotary ``cos``/
    ``sin`` caches (``[max_position, head_dim / 2]``), the KV cache
    (``[2, num_blocks, block_size, num_kv_heads, head_dim]``), the tokens' slots (negative:
    padding) and the head counts of the fused weight (``[(num_q + 2 num_kv) head_dim, K]``)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         norm: Optional[tuple[torch.Tensor, float]] = None, residual: Optional[torch.Tensor] = None,
         silu: bool = False, rope: Optional[RopeWrite] = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x @ weight.T (+ bias)`` for ``x [M, K]`` with ``M <= MAX_ROWS``.

    ``norm=(norm_weight, eps)`` first applies ``RMSNorm`` to ``x``; with ``residual`` too,
    to ``x + residual``, and the call returns ``(out, x + residual)`` as
    ``RMSNorm.forward(x, residual)`` would. ``silu=True`` treats ``weight [2D, K]`` as the
    merged ``[gate | up]`` projection and returns ``silu(gate) * up`` of shape ``[M, D]``.
    ``rope`` treats ``weight`` as the fused QKV projection and does the rotary embedding and
    the KV-cache write in the same launch (one kernel fewer per layer): it returns the
    rotated q, ``[M, num_q_heads * head_dim]``, with k and v written to their slots.
    """
    M, K = x.shape
    if not 0 < M <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, got {M}")
    if weight.shape[1] != K or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"shape mismatch or non-contiguous rows: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if residual is not None and (norm is None or residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError("a residual is added only before a norm, and must be shaped like x")
    n_total = weight.shape[0]
    if silu and n_total % 2:
        raise ValueError("silu needs an even number of output rows (gate | up)")
    N = n_total // 2 if silu else n_total
    cache_args: tuple = (x, x, x, x, x, 0, 0, 0, 0, 0)  # unused without rope
    nq = nk = d = 1
    up_offset = N
    if rope is not None:
        nq, nk, d = rope.num_q_heads, rope.num_kv_heads, rope.head_dim
        kv = rope.kv_cache
        if silu or n_total != (nq + 2 * nk) * d or d % 2:
            raise ValueError(f"rope needs a QKV weight of ({nq} + 2 x {nk}) x {d} rows, got {n_total}")
        if rope.cos.shape[1] != d // 2 or rope.cos.stride() != rope.sin.stride():
            raise ValueError("rope needs full-rotary cos/sin caches of head_dim / 2 columns")
        if kv.dim() != 5 or kv.shape[0] != 2 or tuple(kv.shape[3:]) != (nk, d) or \
                kv.stride(1) != kv.shape[2] * kv.stride(2):
            raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {nk}, {d}], got {tuple(kv.shape)}")
        if rope.positions.shape[0] < M or rope.slot_mapping.shape[0] < M:
            raise ValueError("positions and slot_mapping need a value per row")
        cache_args = (rope.positions, rope.cos, rope.sin, kv, rope.slot_mapping, rope.cos.stride(0),
                      kv.stride(0), kv.stride(2), kv.stride(3), kv.stride(4))
        N = n_total // 2  # (first half, second half) pairs of every head
        up_offset = d // 2
    m_pad = _pow2(M)
    block_n, block_k, warps = _config(m_pad, N, K, silu, paired=rope is not None)
    # Pass 1 of a multi-tile norm reads whole rows at once where they fit (one round trip to
    # L2 instead of one per tile).
    norm_block = min(_pow2(K), max(block_k, 8192 // m_pad))
    out = torch.empty(M, nq * d if rope is not None else N, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    norm_w, eps = norm if norm is not None else (weight, 0.0)
    res = residual if residual is not None else x
    pos, cos, sin, cache, slots, *strides = cache_args
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, res, norm_w, weight, bias if bias is not None else weight, out, res_out, pos, cos, sin, cache, slots,
        M, N, K, x.stride(0), res.stride(0), weight.stride(0), out.stride(0), res_out.stride(0), up_offset,
        float(eps), *strides,
        NORM=norm is not None, HAS_RES=residual is not None, HAS_BIAS=bias is not None, SILU=silu,
        ROPE=rope is not None, PAIRED=silu or rope is not None, NUM_Q=nq, NUM_K=nk, HEAD_DIM=d, M_PAD=m_pad,
        BLOCK_N=block_n, BLOCK_K=block_k, NORM_BLOCK=norm_block, ONE_TILE=K <= block_k,
        K_UNROLL=K if UNROLL_K and K > block_k else 0, num_warps=warps, **pdl.launch_options())
    if residual is not None:
        return out, res_out
    return out
