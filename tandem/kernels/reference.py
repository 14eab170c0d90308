"""Pure-torch references for the paged-attention kernels (no Triton needed).

They take exactly the arguments of :func:`tandem.kernels.attention.paged_attention` and
:func:`~tandem.kernels.attention.write_kv_cache`, but read the metadata back to the host
and loop over sequences, so they are slow, simple and obviously right. Tests and the
benchmark compare the kernels against them; ``compute_dtype`` lets a test run the reference
in float64.
"""
from __future__ import annotations

from typing import Optional

import torch


def write_kv_cache_reference(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k[t]``/``v[t]`` at flat slot ``slot_mapping[t]``; negative slots are skipped."""
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kv_cache[0].view(num_blocks * block_size, kvh, d)[slots] = k[keep].to(kv_cache.dtype)
    kv_cache[1].view(num_blocks * block_size, kvh, d)[slots] = v[keep].to(kv_cache.dtype)


def paged_attention_reference(
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
    compute_dtype: torch.dtype = torch.float32,
    **_ignored: object,
) -> torch.Tensor:
    """Causal paged attention, one sequence at a time, written into ``out`` (rows of real
    query tokens only). ``max_query_len``/``max_seq_len``/``num_kv_splits`` are accepted for
    signature compatibility and ignored. Returns ``out``."""
    del max_query_len, max_seq_len, num_kv_splits
    _, _, block_size, kvh, d = kv_cache.shape
    num_heads = q.shape[1]
    group = num_heads // kvh
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    bts = block_tables.long().cpu()
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len <= 0:
            continue
        if seq_len <= 0:
            out[start:end] = 0
            continue
        pos = torch.arange(seq_len)
        slots = bts[b, pos // block_size] * block_size + pos % block_size
        slots = slots.to(kv_cache.device)
        keys = kv_cache[0].reshape(-1, kvh, d)[slots].to(compute_dtype)  # [S, KVH, D]
        vals = kv_cache[1].reshape(-1, kvh, d)[slots].to(compute_dtype)
        keys = keys.repeat_interleave(group, dim=1)  # [S, H, D]
        vals = vals.repeat_interleave(group, dim=1)
        qs = q[start:end].to(compute_dtype)  # [L, H, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = torch.einsum("lhd,shd->hls", qs, keys) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key (seq_len 0 edge)
        o = torch.einsum("hls,shd->lhd", probs, vals)
        out[start:end] = o.to(out.dtype)
    return out
