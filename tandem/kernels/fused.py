"""Fused Triton kernels for the small ops of a decoder layer: RMSNorm (with the residual
add), rotary embedding (alone, or fused into the KV-cache write), SiLU-and-multiply.

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

from tandem.kernels import pdl


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


# -- rotary fused into the KV-cache write ------------------------------------------------
@triton.jit
def _head_rms_norm(x1, x2, w_ptr, eps, dt: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, offs_d, d_ok):
    """Per-head RMSNorm of ``[heads, HALF]`` halves (fp32 in), rounded as _rms_norm_kernel
    rounds: the normalized value to the activation dtype, then the weight product."""
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
    w1 = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    n1 = (x1 * inv[:, None]).to(dt).to(tl.float32)
    n2 = (x2 * inv[:, None]).to(dt).to(tl.float32)
    return (w1[None, :] * n1).to(dt).to(tl.float32), (w2[None, :] * n2).to(dt).to(tl.float32)


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, qn_ptr, kn_ptr,
                            eps, stride_qt, stride_kt, stride_vt, stride_vh, stride_vd, stride_cos,
                            stride_ckv, stride_cslot, stride_ch, stride_cd, QK_NORM: tl.constexpr,
                            NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                            ROT_DIM: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
                            HALF_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TAIL_PAD: tl.constexpr,
                            PDL: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    if PDL:  # (tandem.kernels.pdl) everything below reads the step's own data
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dt = q_ptr.dtype.element_ty
    cdt = cache_ptr.dtype.element_ty
    offs_d = tl.arange(0, HALF_PAD)
    d_ok = offs_d < HALF
    # The roundings of _rotary_kernel (and of the eager RotaryEmbedding): cos/sin cast to
    # the activation dtype, each product rounded before the sum.
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(dt).to(tl.float32)

    # q: rotated in place (attention reads it next).
    offs_q = tl.arange(0, Q_HEADS_PAD)
    q_mask = (offs_q[:, None] < NUM_Q) & d_ok[None, :]
    pq = q_ptr + tok * stride_qt + offs_q[:, None] * HEAD_DIM + offs_d[None, :]
    x1 = tl.load(pq, mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(pq + HALF, mask=q_mask, other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3: RMSNorm over each head (full rotary only), then rotary
        x1, x2 = _head_rms_norm(x1, x2, qn_ptr, eps, dt, HEAD_DIM, HALF, offs_d, d_ok)
    o1 = (x1 * cos[None, :]).to(dt).to(tl.float32) - (x2 * sin[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * cos[None, :]).to(dt).to(tl.float32) + (x1 * sin[None, :]).to(dt).to(tl.float32)
    tl.store(pq, o1.to(dt), mask=q_mask)
    tl.store(pq + HALF, o2.to(dt), mask=q_mask)

    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:  # a negative slot is a padding token: nothing cached
        # k: rotated straight into its cache slot (attention reads keys from the cache only).
        offs_k = tl.arange(0, K_HEADS_PAD)
        k_mask = (offs_k[:, None] < NUM_K) & d_ok[None, :]
        k_row = k_ptr + tok * stride_kt + offs_k[:, None] * HEAD_DIM
        pk = k_row + offs_d[None, :]
        y1 = tl.load(pk, mask=k_mask, other=0.0).to(tl.float32)
        y2 = tl.load(pk + HALF, mask=k_mask, other=0.0).to(tl.float32)
        if QK_NORM:
            y1, y2 = _head_rms_norm(y1, y2, kn_ptr, eps, dt, HEAD_DIM, HALF, offs_d, d_ok)
        r1 = (y1 * cos[None, :]).to(dt).to(tl.float32) - (y2 * sin[None, :]).to(dt).to(tl.float32)
        r2 = (y2 * cos[None, :]).to(dt).to(tl.float32) + (y1 * sin[None, :]).to(dt).to(tl.float32)
        dst = cache_ptr + slot * stride_cslot + offs_k[:, None] * stride_ch
        tl.store(dst + offs_d[None, :] * stride_cd, r1.to(dt).to(cdt), mask=k_mask)
        tl.store(dst + (HALF + offs_d[None, :]) * stride_cd, r2.to(dt).to(cdt), mask=k_mask)
        if ROT_DIM < HEAD_DIM:  # partial rotary: the rest of each head is copied as is
            offs_t = tl.arange(0, TAIL_PAD)
            t_mask = (offs_k[:, None] < NUM_K) & (offs_t[None, :] < HEAD_DIM - ROT_DIM)
            tail = tl.load(k_row + ROT_DIM + offs_t[None, :], mask=t_mask, other=0.0)
            tl.store(dst + (ROT_DIM + offs_t[None, :]) * stride_cd, tail.to(cdt), mask=t_mask)
        # v: copied into its slot.
        offs_v = tl.arange(0, HEAD_DIM_PAD)
        v_mask = (offs_k[:, None] < NUM_K) & (offs_v[None, :] < HEAD_DIM)
        v = tl.load(v_ptr + tok * stride_vt + offs_k[:, None] * stride_vh + offs_v[None, :] * stride_vd,
                    mask=v_mask, other=0.0)
        tl.store(dst + stride_ckv + offs_v[None, :] * stride_cd, v.to(cdt), mask=v_mask)


def rotary_write_kv_cache_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos_cache: torch.Tensor, sin_cache: torch.Tensor, rotary_dim: int,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> None:
    """Rotary embedding and the KV-cache write in one launch (one kernel fewer per layer).

    ``q [T, H, D]`` is rotated in place; ``k [T, KVH, D]`` is rotated into its cache slot
    (``k`` itself is left as it was: attention reads keys from the cache only) and ``v`` is
    copied into its slot of ``kv_cache [2, num_blocks, block_size, KVH, D]``. Negative slots
    (padding tokens) write nothing. The values equal ``rotary_embedding_`` followed by
    ``tandem.kernels.attention.write_kv_cache``. Heads must be contiguous within a token
    (views of a fused QKV output are); ``v`` may have any strides.

    ``qk_norm=(q_weight, k_weight, eps)`` first applies an RMSNorm over each head of q and
    of k (Qwen3's ``q_norm``/``k_norm``, two more kernels saved), as ``rms_norm`` would;
    it needs ``rotary_dim == head_dim``.
    """
    T, nq, d = q.shape
    _, nk, _ = k.shape
    if tuple(v.shape) != (T, nk, d) or k.shape[0] != T or k.shape[2] != d:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (nk, d):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {nk}, {d}], got {tuple(kv_cache.shape)}")
    if kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache blocks must be laid out so that slot = block * block_size + offset")
    for name, t in (("q", q), ("k", k)):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(f"{name}'s heads must be contiguous within a token, got strides {t.stride()}")
    if slot_mapping.shape[0] < T or positions.shape[0] < T:
        raise ValueError("slot_mapping and positions need a value per token")
    if qk_norm is not None and rotary_dim != d:
        raise ValueError(f"qk_norm needs full rotary (rotary_dim {rotary_dim} != head_dim {d})")
    if T == 0:
        return
    half = rotary_dim // 2
    q_w, k_w, eps = qk_norm if qk_norm is not None else (q, k, 0.0)
    _rotary_write_kv_kernel[(T,)](
        q, k, v, positions, cos_cache, sin_cache, kv_cache, slot_mapping, q_w, k_w, float(eps),
        q.stride(0), k.stride(0), v.stride(0), v.stride(1), v.stride(2), cos_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4), QK_NORM=qk_norm is not None,
        NUM_Q=nq, NUM_K=nk, HEAD_DIM=d, HALF=half, ROT_DIM=rotary_dim, Q_HEADS_PAD=_pow2(nq),
        K_HEADS_PAD=_pow2(nk), HALF_PAD=_pow2(half), HEAD_DIM_PAD=_pow2(d), TAIL_PAD=_pow2(max(1, d - rotary_dim)),
        num_warps=4, **pdl.launch_options())


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
