"""Triton paged attention over tandem's KV cache: one launch for a whole mixed batch.

Layout (fixed by the engine)
----------------------------
Per layer one tensor ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]``
(0 = K, 1 = V). The token at position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``. Queries are flattened with
no padding between sequences, ``q [num_tokens, num_heads, head_dim]``; sequence ``b`` owns
rows ``query_start_loc[b]:query_start_loc[b+1]`` and has ``seq_lens[b]`` tokens of context
after this step (cached prefix + this step's tokens, which :func:`write_kv_cache` has already
stored), so every key is read from the paged cache. Query ``i`` of sequence ``b`` sits at
position ``seq_lens[b] - q_len_b + i`` and sees keys ``<=`` its position (and ``>``
position - ``sliding_window``). Fresh prefill, chunked prefill over a cached prefix and
decode are the same case, so one kernel serves them all.

Grid
----
A program owns one *query tile* of one sequence and one KV head. Its ``BLOCK_M`` rows are
``BLOCK_Q`` query tokens x ``GROUP`` query heads of that KV head (GQA packing: row ``r`` is
token ``r // GROUP``, head ``kv_head * GROUP + r % GROUP``), so each K/V tile is loaded once
per group and fed to ``tl.dot`` with ``M = BLOCK_M >= 16`` even for decode. The program
walks its key range in ``BLOCK_N`` tiles, gathering each key's page through the block table
(so a tile may span several pages or part of one: ``BLOCK_N`` and ``block_size`` are
independent), with fp32 accumulation and an online softmax in the exp2 domain (the scale is
pre-multiplied by log2(e)). Causality limits each tile's key range, so a query tile never
reads keys past its last query's position.

Axis 0 enumerates query tiles in one of two ways, chosen in Python from shapes and
``max_query_len``:

* ``seq-grid``: ``B * cdiv(max_query_len, BLOCK_Q)`` programs, program ``i`` is tile
  ``i % n`` of sequence ``i // n``. Exact for decode batches (one program per sequence)
  and single long prefills.
* ``packed``: ``num_tokens // BLOCK_Q + B`` programs (an upper bound on the tiles of any
  batch with these shapes); sequence ``b``'s tiles start at ``query_start_loc[b] // BLOCK_Q
  + b`` and a program finds its sequence by binary search over ``query_start_loc``. Used for
  mixed batches, where the seq-grid would launch ``B x`` the longest prefill.

Programs whose tile is past their sequence's query length exit at once; sequences with
``seq_lens == 0`` or no queries (CUDA-graph padding rows, ``query_start_loc`` repeated)
attend to nothing and write zeros or nothing, never reading the cache.

Split-KV (flash decoding)
-------------------------
With few sequences the grid above leaves most SMs idle during decode. Axis 2 then splits
each program's key tiles into ``num_kv_splits`` contiguous chunks (per sequence, so short
sequences get empty chunks); each writes an unnormalised partial ``(max, sum, acc)`` in fp32
and the last split of each (query tile, KV head) program to finish merges them (an arrival
counter per program; ``FUSED_MERGE``, else a second small kernel merges them per (token,
head)). The split count is a compile-time
constant picked from ``max_seq_len`` (the longest context in the batch), batch size and SM
count by ``tandem.kernels.splits`` (only for ``max_query_len == 1`` by default; any batch is
correct with splits, which the tests use). One split merges nothing.

Graph safety
------------
The wrappers never read tensor values on the host: launch shapes depend only on tensor
shapes and the Python ints passed in (``max_query_len``, ``max_seq_len``,
``num_kv_splits``), outputs are written in place, and the split buffers are allocated from
shapes (inside a graph they come from its private pool). Capture with a fixed
``max_query_len`` and an explicit ``num_kv_splits`` (one graph per split count a batch may
pick) and pad the batch with ``seq_lens == 0`` rows and negative slots.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from tandem.kernels import pdl
from tandem.kernels.splits import choose_num_kv_splits

__all__ = ["write_kv_cache", "paged_attention", "choose_num_kv_splits", "is_interpreting"]

_LOG2E = 1.4426950408889634

# Key tile of a decode launch (one query per sequence), if set; else the default above.
# An experiment knob (``gpu_bench.py --decode-tile-n``): read at launch, so set it before a
# model runner captures its graphs.
DECODE_TILE_N: Optional[int] = None


# ---------------------------------------------------------------------------------------
# KV cache write
# ---------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ckv,
    stride_cslot,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KVH_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    offs_h = tl.arange(0, KVH_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    dst = cache_ptr + slot * stride_cslot + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------
@triton.jit
def _find_seq(qsl_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b in [0, num_seqs) with query_start_loc[b] // BLOCK_Q + b <= tile_idx."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid
        else:
            hi = mid - 1
    return lo


# Integer arguments that change from step to step are not specialized on (Triton would
# otherwise compile a variant per value class: == 1, divisible by 16, other).
@triton.jit(do_not_specialize=["num_seqs", "tiles_per_seq", "window"])
def _paged_attn_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    num_seqs,
    num_heads,
    tiles_per_seq,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_ckv,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SEQ_GRID: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
    counter_ptr=None,
    FUSED_MERGE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # (tandem.kernels.pdl) everything below reads the step's own data
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    # -- which sequence / query tile -------------------------------------------------
    if SEQ_GRID:
        seq = pid // tiles_per_seq
        q_tile = pid % tiles_per_seq
    else:
        seq = _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
        q_tile = pid - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # position of this step's first query token

    # -- query rows: BLOCK_Q tokens x GROUP heads -----------------------------------
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q_pos = ctx_len + q_idx
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # -- key range of this tile, then this split's share of it ---------------------
    last_q = tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    kv_hi = tl.maximum(tl.minimum(ctx_len + last_q + 1, seq_len), 0)  # exclusive
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx_len + q_tile * BLOCK_Q - window + 1, 0)
    else:
        kv_lo = 0
    tile_lo = kv_lo // BLOCK_N
    tile_hi = (kv_hi + BLOCK_N - 1) // BLOCK_N
    n_tiles = tl.maximum(tile_hi - tile_lo, 0)
    per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_begin = tile_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    bt_row = bt_ptr + seq * stride_bt
    k_base = cache_ptr + kv_head * stride_ch
    v_base = k_base + stride_ckv
    for t in range(t_begin, t_end):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_hi
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot_off = page * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs
        k_t = tl.load(
            k_base + slot_off[None, :] + offs_d[:, None] * stride_cd,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        s = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PREC) * qk_scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay at 0
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_t = tl.load(
            v_base + slot_off[:, None] + offs_d[None, :] * stride_cd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v_t.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        ml = (tok * num_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + ml, m_i, mask=row_ok)
        tl.store(part_l_ptr + ml, l_i, mask=row_ok)
        tl.store(part_acc_ptr + ml[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        if FUSED_MERGE:  # the tile's last split to finish merges them all (no merge kernel)
            tl.debug_barrier()  # every thread's partial stored before the count is released
            counter = counter_ptr + pid * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
                tl.atomic_xchg(counter, 0)  # ready for the next launch (and graph replay)
                _merge_rows(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, tok, head, offs_d, row_ok, d_ok,
                            num_heads, stride_ot, stride_oh, stride_od, BLOCK_M, HEAD_DIM_PAD, NUM_SPLITS)


@triton.jit
def _merge_rows(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, tok, head, offs_d, row_ok, d_ok, num_heads,
                stride_ot, stride_oh, stride_od, BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                NUM_SPLITS: tl.constexpr):
    """Merge the ``NUM_SPLITS`` partials of rows (``tok``, ``head``) into ``out``: each split
    weighs ``exp2(m_s - max m)``. The partials are read past L1 (``.cg``): other programs
    wrote them during this launch."""
    base = (tok * num_heads + head) * NUM_SPLITS
    m_max = tl.load(part_m_ptr + base, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
    for s in tl.static_range(1, NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + base + s, mask=row_ok, other=float("-inf"),
                                          cache_modifier=".cg"))
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.zeros_like(m_ref)
    o = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        w = tl.exp2(tl.load(part_m_ptr + base + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m_ref)
        denom += w * tl.load(part_l_ptr + base + s, mask=row_ok, other=0.0, cache_modifier=".cg")
        a = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0, cache_modifier=".cg")
        o += a * w[:, None]
    o = o / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    qsl_ptr,
    num_seqs,
    num_heads,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if PDL:  # (tandem.kernels.pdl)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if tok >= tl.load(qsl_ptr + num_seqs):  # token past the batch (graph padding): untouched
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < NUM_SPLITS
    base = (tok * num_heads + head) * NUM_SPLITS
    m_s = tl.load(part_m_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + offs_s, mask=s_ok, other=0.0)
    m_max = tl.max(m_s, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m_s - m_ref)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * l_s, 0)
    acc = tl.load(
        part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# ---------------------------------------------------------------------------------------
# Python wrappers
# ---------------------------------------------------------------------------------------
# Split-KV partials merged by the last split of each (query tile, KV head) to finish, inside
# the attention kernel, instead of by a second kernel (one launch fewer per layer and step).
# Off until it has run on a GPU (its memory ordering is what the interpreter cannot check):
# ``gpu_bench.py --fused-merge`` and ``tests/kernels/test_paged_attention.py`` on a GPU.
FUSED_MERGE = False

# Per device: one arrival counter per (query tile, KV head) program of a split launch,
# zeroed once and put back to zero by the program that merges, so that it stays valid
# across launches and graph replays without a memset. Grown (never shrunk) as needed.
_COUNTERS: dict[tuple[str, Optional[int]], torch.Tensor] = {}


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, 1 << 16, 2 * (buf.numel() if buf is not None else 0)),
                                           dtype=torch.int32, device=device)
    return buf

def is_interpreting() -> bool:
    """True when the kernels were defined under ``TRITON_INTERPRET=1`` (they run on CPU)."""
    return type(_paged_attn_kernel).__name__ == "InterpretedFunction"


def _check_device(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not is_interpreting():
        raise RuntimeError(
            "Triton kernels need CUDA tensors; to run them on CPU set TRITON_INTERPRET=1 "
            "before tandem.kernels.paged_attention is first imported"
        )


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: Optional[int]) -> int:
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k[t], v[t]`` (``[num_tokens, num_kv_heads, head_dim]``, any strides) at flat slot
    ``slot_mapping[t]`` of ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]``,
    casting to the cache dtype. Negative slots (padding tokens) are skipped. One launch."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    num_tokens, kvh, d = k.shape
    if tuple(v.shape) != (num_tokens, kvh, d) or tuple(kv_cache.shape[3:]) != (kvh, d):
        raise ValueError(f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(kv_cache.shape)}")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError("slot_mapping shorter than the number of tokens")
    if kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache blocks must be laid out so that slot = block * block_size + offset")
    _check_device(k, v, kv_cache, slot_mapping)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        NUM_KV_HEADS=kvh,
        HEAD_DIM=d,
        KVH_PAD=_next_pow2(kvh),
        HEAD_DIM_PAD=_next_pow2(d),
        num_warps=4 if kvh * d >= 1024 else 2,
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
    tile_m: Optional[int] = None,
    tile_n: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of every query token of a flattened batch over its paged context.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` (fp32/fp16/bf16, any strides).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, already holding this
            step's keys/values (:func:`write_kv_cache`).
        out: ``[num_tokens, num_heads, head_dim]``, written in place for every real query row;
            rows past ``query_start_loc[-1]`` are left untouched.
        query_start_loc: ``[B + 1]`` int32 cumulative query lengths (repeat the last value for
            padding sequences).
        seq_lens: ``[B]`` int32, context length of each sequence after this step (0 = padding).
        block_tables: ``[B, max_blocks]`` int32 page ids (entries past a sequence's length are
            never read). int64 metadata works too (one more compiled variant).
        max_query_len: upper bound on any sequence's query length (Python int; picks tiles
            and grid).
        max_seq_len: upper bound on ``seq_lens`` (Python int; only picks the split count).
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: if set, a query at position p sees keys in ``(p - window, p]``.
        num_kv_splits: split-KV count; ``None`` picks one (>1 only for pure decode).
        tile_m, tile_n: override the query-row / key tile sizes (powers of two >= 16).

    With splits, fp32 partials of ``num_tokens x num_heads x num_kv_splits x head_dim`` are
    allocated per call (from the graph's pool under capture); the automatic count keeps that
    small (about ``4 * num_SMs`` rows of programs). Returns ``out``. No host synchronisation;
    capturable in a CUDA graph.
    """
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must both be [num_tokens, num_heads, head_dim], "
                         f"got {tuple(q.shape)}, {tuple(out.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q {head_dim}, cache {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError("query_start_loc must be [B+1] and block_tables [B, max_blocks] for seq_lens [B]")
    if block_tables.stride(1) != 1 or query_start_loc.stride(0) != 1 or seq_lens.stride(0) != 1:
        raise ValueError("metadata tensors must be contiguous along their last dimension")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError("sliding_window must be positive")
    _check_device(q, kv_cache, out, query_start_loc, seq_lens, block_tables)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out

    group = num_heads // num_kv_heads
    head_dim_pad = max(16, _next_pow2(head_dim))
    min_m = max(16, _next_pow2(group))
    if tile_m is None:
        big_m = 128 if head_dim_pad <= 128 else 64
        tile_m = 16 if max_query_len == 1 else min(big_m, _next_pow2(group * max_query_len))
    block_m = max(min_m, tile_m)
    block_q = block_m // group
    if tile_n is None:
        tile_n = 64 if head_dim_pad <= 128 else 32
        if max_query_len == 1 and DECODE_TILE_N:
            tile_n = DECODE_TILE_N
    block_n = max(16, tile_n)

    tiles_per_seq = -(-max_query_len // block_q)
    packed_programs = num_tokens // block_q + num_seqs
    seq_grid = num_seqs * tiles_per_seq <= packed_programs
    grid_q = num_seqs * tiles_per_seq if seq_grid else packed_programs

    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len, _sm_count(q.device))
    num_kv_splits = max(1, int(num_kv_splits))

    counters = None
    if num_kv_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_kv_splits, head_dim_pad), dtype=torch.float32,
                               device=q.device)
        part_m = torch.empty((num_tokens, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        if FUSED_MERGE:
            counters = _merge_counters(q.device, grid_q * num_kv_heads)
    else:
        part_acc = part_m = part_l = out  # unused

    big = block_m * head_dim_pad >= 128 * 128
    _paged_attn_kernel[(grid_q, num_kv_heads, num_kv_splits)](
        q, kv_cache, out, part_acc, part_m, part_l,
        query_start_loc, seq_lens, block_tables,
        num_seqs, num_heads, tiles_per_seq,
        float(scale) * _LOG2E,
        int(sliding_window or 0),
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        NUM_SPLITS=num_kv_splits,
        SEQ_GRID=seq_grid,
        USE_WINDOW=sliding_window is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if big else 4,
        num_stages=2 if big else 3,
        counter_ptr=counters,
        FUSED_MERGE=counters is not None,
        **pdl.launch_options(),
    )
    if num_kv_splits > 1 and counters is None:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_m, part_l, query_start_loc,
            num_seqs, num_heads,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=max(2, _next_pow2(num_kv_splits)),
            num_warps=4 if head_dim_pad >= 128 else 2,
            **pdl.launch_options(),
        )
    return out
