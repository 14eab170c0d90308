"""Triton paged attention + KV-cache write vs the pure-torch reference.

Without CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set here
before the kernel module is first imported; if another module imported it first without the
flag, it is reloaded), on tiny shapes. With CUDA the same tests also run at real shapes
(bf16, head_dim 64/128, 14 q heads / 2 kv heads, contexts up to 4k, batch 64) and a CUDA
graph capture/replay test runs.

Every call gets ``out`` poisoned with NaN; every real row must be written and match the
reference (computed in float64), and rows past the batch must stay untouched.
"""
from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import pytest  # noqa: E402

from tandem.kernels.reference import paged_attention_reference, write_kv_cache_reference  # noqa: E402

pytestmark = pytest.mark.timeout(600 if HAS_CUDA else 180)

DEVICE = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
if HAS_CUDA:
    TOL[torch.float32] = 2e-4


def _needs_fresh_process() -> bool:
    """True on a CPU machine where triton was imported (by some earlier module) before
    TRITON_INTERPRET=1 was set: triton.language's own @jit helpers are then compiled-mode
    functions and the interpreter cannot run in this process."""
    if HAS_CUDA:
        return False
    try:
        import triton.language as tl
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return isinstance(tl.zeros, JITFunction)


@pytest.fixture(scope="module")
def pa() -> ModuleType:
    """The kernel module, defined in interpreter mode when there is no GPU."""
    pytest.importorskip("triton")
    if _needs_fresh_process():
        pytest.skip("triton was imported without TRITON_INTERPRET=1; covered by test_in_fresh_process")
    name = "tandem.kernels.attention"
    mod = sys.modules.get(name) or importlib.import_module(name)
    if not HAS_CUDA and not mod.is_interpreting():
        mod = importlib.reload(mod)  # imported earlier without TRITON_INTERPRET
    assert HAS_CUDA or mod.is_interpreting()
    return mod


def test_in_fresh_process() -> None:
    """Fallback: when this process cannot interpret the kernels, run this file in a new one."""
    if not _needs_fresh_process():
        pytest.skip("the kernels run in this process")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


# ---------------------------------------------------------------------------------------
# batch construction
# ---------------------------------------------------------------------------------------
@dataclass
class Batch:
    q: torch.Tensor  # [T_total, H, D] (T_total = real tokens + pad_tokens)
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_real_tokens: int
    scale: float

    def kwargs(self, **extra: object) -> dict:
        kw = dict(query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_tables=self.block_tables,
                  max_query_len=self.max_query_len, max_seq_len=self.max_seq_len, scale=self.scale)
        kw.update(extra)
        return kw


def make_batch(
    q_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 8,
    dtype: torch.dtype = torch.float32,
    pad_seqs: int = 0,
    pad_tokens: int = 0,
    seed: int = 0,
    device: str = DEVICE,
) -> Batch:
    """Random q and cache; each sequence gets shuffled, non-contiguous pages; unused block-table
    entries point at random (valid) pages, so reading past a sequence gives wrong numbers."""
    assert len(q_lens) == len(seq_lens)
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // block_size) for s in seq_lens]
    width = max(nblk + [1]) + 1
    num_blocks = sum(nblk) + 4
    perm = torch.randperm(num_blocks, generator=g)
    B = len(q_lens) + pad_seqs
    bt = torch.randint(0, num_blocks, (B, width), generator=g)
    used = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[used:used + n]
        used += n
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    T = sum(q_lens)
    q = torch.randn(T + pad_tokens, heads, head_dim, generator=g)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    qsl += [qsl[-1]] * pad_seqs
    lens = list(seq_lens) + [0] * pad_seqs
    return Batch(
        q=q.to(device=device, dtype=dtype),
        kv_cache=cache.to(device=device, dtype=dtype),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=bt.to(device=device, dtype=torch.int32),
        max_query_len=max(list(q_lens) + [0]),
        max_seq_len=max(list(seq_lens) + [0]),
        num_real_tokens=T,
        scale=head_dim ** -0.5,
    )


def run_and_check(pa: ModuleType, batch: Batch, *, sliding_window: Optional[int] = None,
                  num_kv_splits: Optional[int] = None, tile_m: Optional[int] = None,
                  tile_n: Optional[int] = None) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    pa.paged_attention(batch.q, batch.kv_cache, out, sliding_window=sliding_window,
                       **batch.kwargs(num_kv_splits=num_kv_splits, tile_m=tile_m, tile_n=tile_n))
    ref = torch.zeros(batch.q.shape, dtype=torch.float64, device=batch.q.device)
    paged_attention_reference(batch.q, batch.kv_cache, ref, sliding_window=sliding_window,
                              compute_dtype=torch.float64, **batch.kwargs())
    T = batch.num_real_tokens
    real = out[:T].double()
    assert not torch.isnan(real).any(), f"{int(torch.isnan(real).any(-1).any(-1).sum())} rows not written"
    tol = TOL[batch.q.dtype]
    torch.testing.assert_close(real, ref[:T], atol=tol, rtol=tol)
    assert torch.isnan(out[T:]).all(), "rows past the batch must stay untouched"
    return out


# ---------------------------------------------------------------------------------------
# import / packaging
# ---------------------------------------------------------------------------------------
def test_package_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import tandem.kernels as K\n"
        "assert not K.HAS_TRITON and not K.triton_available()\n"
        "from tandem.kernels.reference import paged_attention_reference\n"
        "assert callable(paged_attention_reference)\n"
        "import tandem.layers.attention, tandem.worker.model_runner  # the engine imports without triton\n"
        "try:\n"
        "    import tandem.kernels.attention\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('expected ImportError')\n"
        "assert 'triton' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr


def test_compiles_for_sm90_without_gpu() -> None:
    """The interpreter never runs Triton's compiler: compile the main variants for sm_90
    ahead of time in a process without TRITON_INTERPRET (no GPU needed)."""
    pytest.importorskip("triton")
    if HAS_CUDA:
        pytest.skip("the GPU tests compile the kernels for real")
    script = Path(__file__).resolve().with_name("sm90_compile_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=170)
    if res.returncode == 3:
        pytest.skip(f"ahead-of-time compile unavailable: {res.stdout.strip()[-300:]}")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]


def test_choose_num_kv_splits(pa: ModuleType) -> None:
    f = pa.choose_num_kv_splits
    assert f(1, 2, 1, 8192, 132) == 32
    assert f(64, 2, 1, 2048, 132) == 4
    assert f(512, 8, 1, 8192, 132) == 1  # the batch alone fills the GPU
    assert f(1, 2, 1, 63, 132) == 1  # too short to split (under two 32-key chunks)
    assert f(1, 2, 1, 100, 132) == 2
    assert f(32, 2, 1, 300, 132) == 1  # a fuller batch splits only in 256-key chunks
    assert f(4, 2, 7, 8192, 132) == 1  # not a pure decode batch
    for b in (1, 3, 17, 64):
        s = f(b, 8, 1, 2048, 132)
        assert s >= 1 and s & (s - 1) == 0


# ---------------------------------------------------------------------------------------
# write_kv_cache
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                   (torch.float32, torch.float16)])
def test_write_kv_cache(pa: ModuleType, src_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    nb, bs, kvh, d, T = 6, 4, 3, 16, 11
    # k, v as strided views of one fused qkv projection, like the model produces.
    qkv = torch.randn(T, 4 + 2 * kvh, d, generator=g).to(DEVICE, src_dtype)
    k, v = qkv[:, 4:4 + kvh], qkv[:, 4 + kvh:]
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(DEVICE)
    cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(DEVICE, cache_dtype)
    expect = cache.clone()
    write_kv_cache_reference(k, v, expect, slots)
    for slot_dtype in (torch.int64, torch.int32):
        got = cache.clone()
        pa.write_kv_cache(k, v, got, slots.to(slot_dtype))
        torch.testing.assert_close(got, expect, atol=0, rtol=0)
    assert not torch.equal(expect, cache)


def test_write_then_attend_matches_plain_causal_attention(pa: ModuleType) -> None:
    """End to end without the reference's paging: write the step's K/V with the kernel (slots
    from the block tables), then attention must equal plain causal SDPA on the logical K/V."""
    H, KVH, D, BS = 4, 2, 16, 4
    q_lens, seq_lens = [3, 1, 6], [9, 5, 6]
    batch = make_batch(q_lens, seq_lens, heads=H, kv_heads=KVH, head_dim=D, block_size=BS, seed=3)
    g = torch.Generator().manual_seed(4)
    bt = batch.block_tables.cpu().long()
    logical_k = [torch.randn(s, KVH, D, generator=g) for s in seq_lens]
    logical_v = [torch.randn(s, KVH, D, generator=g) for s in seq_lens]
    # The cached prefixes: stored with the reference writer.
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s - q_lens[b])
        slots = (bt[b, pos // BS] * BS + pos % BS).to(DEVICE)
        write_kv_cache_reference(logical_k[b][: len(pos)].to(DEVICE), logical_v[b][: len(pos)].to(DEVICE),
                                 batch.kv_cache, slots)
    # This step's tokens: by the kernel.
    pos = [torch.arange(s - ql, s) for ql, s in zip(q_lens, seq_lens, strict=True)]
    slot_mapping = torch.cat([bt[b, p // BS] * BS + p % BS for b, p in enumerate(pos)]).to(DEVICE)
    k_new = torch.cat([logical_k[b][p] for b, p in enumerate(pos)]).to(DEVICE)
    v_new = torch.cat([logical_v[b][p] for b, p in enumerate(pos)]).to(DEVICE)
    pa.write_kv_cache(k_new, v_new, batch.kv_cache, slot_mapping)

    out = torch.full_like(batch.q, float("nan"))
    pa.paged_attention(batch.q, batch.kv_cache, out, **batch.kwargs())
    start = 0
    for b, (ql, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        qb = batch.q[start:start + ql].double().transpose(0, 1)  # [H, L, D]
        kb = logical_k[b].double().to(DEVICE).repeat_interleave(H // KVH, 1).transpose(0, 1)
        vb = logical_v[b].double().to(DEVICE).repeat_interleave(H // KVH, 1).transpose(0, 1)
        mask = torch.arange(s, device=DEVICE)[None, :] <= torch.arange(s - ql, s, device=DEVICE)[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=batch.scale)
        torch.testing.assert_close(out[start:start + ql].double(), ref.transpose(0, 1), atol=1e-4, rtol=1e-4)
        start += ql


# ---------------------------------------------------------------------------------------
# attention: tiny shapes (interpreter-friendly)
# ---------------------------------------------------------------------------------------
DECODE_LENS = [1, 3, 8, 17, 33, 70]  # incl. 1, multiples and non-multiples of the block size


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (7, 1)])
def test_decode_gqa_and_splits(pa: ModuleType, heads: int, kv_heads: int) -> None:
    batch = make_batch([1] * len(DECODE_LENS), DECODE_LENS, heads=heads, kv_heads=kv_heads, seed=heads)
    one = run_and_check(pa, batch, num_kv_splits=1)
    # 4 splits of 16-key tiles: the short sequences leave most splits empty.
    split = run_and_check(pa, batch, num_kv_splits=4, tile_n=16)
    torch.testing.assert_close(split, one, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("splits", [2, 4])
def test_splits_merged_by_their_last_program_equal_the_merge_kernel(pa: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                                    splits: int) -> None:
    """``FUSED_MERGE``: the last split of each program to finish merges the partials (no
    merge kernel). It matches the reference and the merge kernel's output to fp32 rounding,
    and leaves every arrival counter at zero for the next launch (run twice: the counters
    are reused)."""
    batch = make_batch([1] * len(DECODE_LENS), DECODE_LENS, heads=4, kv_heads=2, seed=splits)
    monkeypatch.setattr(pa, "FUSED_MERGE", False)
    kernel = run_and_check(pa, batch, num_kv_splits=splits, tile_n=16)
    monkeypatch.setattr(pa, "FUSED_MERGE", True)
    for _ in range(2):
        fused = run_and_check(pa, batch, num_kv_splits=splits, tile_n=16)
        torch.testing.assert_close(fused, kernel, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert pa._COUNTERS and all(int(c.abs().sum()) == 0 for c in pa._COUNTERS.values())


@pytest.mark.parametrize("max_len", [7, 16, 40, 70])
def test_decode_with_the_split_count_the_runner_picks(pa: ModuleType, max_len: int) -> None:
    """The model runner picks the split count from the batch's longest context (scaled down
    here: 8-key chunks, so the counts change within interpreter-sized contexts). The picked
    count, and every other count a graph of this bucket could bake in, match the reference;
    all counts agree with one another to fp32 rounding."""
    from tandem.kernels.splits import choose_num_kv_splits, decode_split_counts

    lens = [max(1, max_len - d) for d in (0, 5, 13, 29)]
    batch = make_batch([1] * len(lens), lens, heads=4, kv_heads=2, seed=max_len)
    chunk = 8
    picked = choose_num_kv_splits(len(lens), 2, 1, batch.max_seq_len, 64, min_split_tokens=chunk)
    variants = decode_split_counts(len(lens), 2, 70, 64, min_split_tokens=chunk)
    assert picked in variants
    assert picked == (1 if max_len < 2 * chunk else max(s for s in variants if s <= max_len // chunk))
    outs = {s: run_and_check(pa, batch, num_kv_splits=s, tile_n=16) for s in variants}
    for s, out in outs.items():
        torch.testing.assert_close(out, outs[1], atol=1e-5, rtol=1e-5, equal_nan=True, msg=f"{s} splits")


def test_decode_tile_knob_applies_to_decode_only(pa: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DECODE_TILE_N`` (an experiment knob) sets the key tile of decode launches only; a
    decode batch under it matches the reference, and a mixed batch is unaffected by it."""
    decode = make_batch([1] * len(DECODE_LENS), DECODE_LENS, heads=4, kv_heads=2, seed=11)
    mixed = make_batch([1, 5, 12], [40, 21, 12], heads=4, kv_heads=2, seed=12)
    base = run_and_check(pa, mixed)
    monkeypatch.setattr(pa, "DECODE_TILE_N", 16)
    run_and_check(pa, decode, num_kv_splits=2)
    torch.testing.assert_close(run_and_check(pa, mixed), base, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("block_size,tile_n,head_dim,splits", [(4, 16, 32, 1), (16, 16, 16, 2), (32, 16, 16, 1),
                                                               (8, 32, 24, 2)])
def test_block_and_tile_sizes(pa: ModuleType, block_size: int, tile_n: int, head_dim: int, splits: int) -> None:
    """Tiles spanning several pages, exactly one, part of one; a non-power-of-two head_dim."""
    batch = make_batch([1, 1, 5, 12], [5, 40, 21, 12], block_size=block_size, head_dim=head_dim, seed=block_size)
    run_and_check(pa, batch, tile_n=tile_n, tile_m=16, num_kv_splits=splits)


def test_prefill_varlen(pa: ModuleType) -> None:
    """Fresh prefills (q_len == seq_len) of several lengths; several query tiles each."""
    lens = [1, 7, 19, 45]
    batch = make_batch(lens, lens, seed=5)
    run_and_check(pa, batch, tile_m=16)  # 8 query tokens per tile with group 2


def test_chunked_prefill_with_cached_prefix(pa: ModuleType) -> None:
    batch = make_batch([5, 16, 9], [37, 24, 9], seed=6)
    run_and_check(pa, batch, tile_m=16)
    run_and_check(pa, batch, tile_m=16, num_kv_splits=3)  # splits are correct for prefill too


@pytest.mark.parametrize("tile_m,index_dtype", [(16, torch.int32), (64, torch.int64)])
def test_mixed_batch(pa: ModuleType, tile_m: int, index_dtype: torch.dtype) -> None:
    """Decodes, a chunk over a cached prefix, fresh prefills and a sequence with no query this
    step, in one launch, plus graph padding. tile_m 16 gives the packed grid (binary search
    over query_start_loc), 64 the per-sequence grid; metadata as int32 and as int64."""
    q_lens = [1, 13, 1, 0, 30, 2, 1]
    seq_lens = [50, 29, 1, 10, 30, 9, 66]
    batch = make_batch(q_lens, seq_lens, pad_seqs=2, pad_tokens=5, seed=7)
    batch.query_start_loc = batch.query_start_loc.to(index_dtype)
    batch.seq_lens = batch.seq_lens.to(index_dtype)
    batch.block_tables = batch.block_tables.to(index_dtype)
    run_and_check(pa, batch, tile_m=tile_m)


@pytest.mark.parametrize("window,splits", [(1, 1), (5, 2), (24, 4)])
def test_sliding_window(pa: ModuleType, window: int, splits: int) -> None:
    batch = make_batch([1, 1, 20, 7], [3, 60, 45, 7], seed=8 + window)
    run_and_check(pa, batch, sliding_window=window, tile_m=16, tile_n=16, num_kv_splits=splits)


def test_padding_rows(pa: ModuleType) -> None:
    """CUDA-graph padding: extra sequences with no queries and seq_len 0, token rows past the
    batch, and a padded decode slot (one query, seq_len 0): outputs zero, no NaN."""
    batch = make_batch([1, 1, 1, 4], [9, 0, 30, 4], pad_seqs=3, pad_tokens=3, seed=9)
    for splits in (1, 4):
        out = run_and_check(pa, batch, num_kv_splits=splits, tile_m=16)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_all_padding_batch_is_a_no_op(pa: ModuleType) -> None:
    batch = make_batch([], [], pad_seqs=4, pad_tokens=2, seed=10)
    batch.max_query_len = 1  # what a captured decode graph passes
    batch.max_seq_len = 64
    out = torch.full_like(batch.q, float("nan"))
    for splits in (1, 2):
        pa.paged_attention(batch.q, batch.kv_cache, out, **batch.kwargs(num_kv_splits=splits))
        assert torch.isnan(out).all()


def test_fp16(pa: ModuleType) -> None:
    batch = make_batch([1, 6, 1], [27, 6, 14], dtype=torch.float16, seed=11)
    run_and_check(pa, batch, tile_m=16)
    run_and_check(pa, batch, tile_m=16, num_kv_splits=2)


# ---------------------------------------------------------------------------------------
# attention: real shapes (CUDA only)
# ---------------------------------------------------------------------------------------
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="real shapes need a CUDA device")


@cuda_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_decode_batch(pa: ModuleType, head_dim: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(head_dim)
    lens = torch.randint(1, 4097, (64,), generator=g).tolist()
    lens[:4] = [1, 16, 17, 4096]
    batch = make_batch([1] * 64, lens, heads=14, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype)
    auto = run_and_check(pa, batch)
    one = run_and_check(pa, batch, num_kv_splits=1)
    many = run_and_check(pa, batch, num_kv_splits=16)
    tol = TOL[dtype]
    torch.testing.assert_close(auto, one, atol=tol, rtol=tol)
    torch.testing.assert_close(many, one, atol=tol, rtol=tol)


@cuda_only
@pytest.mark.parametrize("batch_size,ctx", [(1, 8192), (4, 2048)])
def test_real_small_batch_long_context_splits(pa: ModuleType, batch_size: int, ctx: int) -> None:
    batch = make_batch([1] * batch_size, [ctx - i for i in range(batch_size)], heads=14, kv_heads=2,
                       head_dim=128, block_size=16, dtype=torch.bfloat16)
    run_and_check(pa, batch)  # auto split count (> 1 here)


@cuda_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 1024])
def test_real_mixed_batch(pa: ModuleType, head_dim: int, window: Optional[int]) -> None:
    g = torch.Generator().manual_seed(head_dim + 1)
    q_lens = [1] * 48 + [2048, 777, 513, 1, 300]
    seq_lens = torch.randint(1, 4097, (48,), generator=g).tolist() + [2048, 3000, 4096, 4096, 301]
    batch = make_batch(q_lens, seq_lens, heads=14, kv_heads=2, head_dim=head_dim, block_size=16,
                       dtype=torch.bfloat16, pad_seqs=5, pad_tokens=7)
    run_and_check(pa, batch, sliding_window=window)


@cuda_only
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(32, 8, 128, 16), (16, 16, 64, 32), (8, 1, 256, 16),
                                                                  (12, 4, 96, 64)])
def test_real_other_shapes(pa: ModuleType, heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    q_lens = [1] * 8 + [600, 33]
    seq_lens = [1, 100, 1000, 3000, 17, 64, 2049, 4000, 1200, 33]
    batch = make_batch(q_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=torch.bfloat16)
    run_and_check(pa, batch)
    decode = make_batch([1] * 8, seq_lens[:8], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        block_size=block_size, dtype=torch.bfloat16)
    run_and_check(pa, decode, num_kv_splits=8)


@cuda_only
def test_real_fp32_cache(pa: ModuleType) -> None:
    batch = make_batch([1] * 16 + [500], list(range(100, 1700, 100)) + [900], heads=14, kv_heads=2,
                       head_dim=64, block_size=16, dtype=torch.float32)
    run_and_check(pa, batch)


@cuda_only
@pytest.mark.parametrize("batch_size,ctx,splits", [(1, 8192, 16), (4, 2048, 8), (64, 4096, 16), (7, 300, 4)])
def test_real_fused_merge_equals_the_merge_kernel_at_every_launch(pa: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                                  batch_size: int, ctx: int, splits: int) -> None:
    """``FUSED_MERGE`` on the GPU, where programs really race: the last split to arrive reads
    partials that other programs wrote. A missing release or acquire shows as stale partials,
    so the output of 200 launches must stay bit-identical (which split merges does not change
    the arithmetic), match the merge kernel to bf16 rounding, and leave the counters at zero."""
    lens = [ctx - 37 * i for i in range(batch_size)]
    batch = make_batch([1] * batch_size, lens, heads=14, kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.bfloat16, seed=ctx)
    monkeypatch.setattr(pa, "FUSED_MERGE", False)
    kernel = run_and_check(pa, batch, num_kv_splits=splits)
    monkeypatch.setattr(pa, "FUSED_MERGE", True)
    first = run_and_check(pa, batch, num_kv_splits=splits)
    T = batch.num_real_tokens
    torch.testing.assert_close(first[:T], kernel[:T], atol=1e-2, rtol=1e-2)
    out = torch.empty_like(batch.q)
    differing = 0
    for _ in range(200):
        out.fill_(float("nan"))
        pa.paged_attention(batch.q, batch.kv_cache, out, **batch.kwargs(num_kv_splits=splits))
        differing += int(not torch.equal(out[:T], first[:T]))
    assert differing == 0, f"{differing} of 200 launches differ"
    assert all(int(c.abs().sum()) == 0 for c in pa._COUNTERS.values())


@cuda_only
@pytest.mark.parametrize("fused_merge", [False, True])
def test_cuda_graph_capture_and_replay(pa: ModuleType, monkeypatch: pytest.MonkeyPatch, fused_merge: bool) -> None:
    """Capture write + attention for a padded decode batch once, then replay with new metadata
    written into the captured tensors (different lengths, tables and slots); with the merge
    kernel and with the fused merge (its counters baked into the graph)."""
    monkeypatch.setattr(pa, "FUSED_MERGE", fused_merge)
    H, KVH, D, BS, B, max_len = 14, 2, 128, 16, 32, 2048
    width = max_len // BS
    num_blocks = B * width + 1
    dt = torch.bfloat16
    cache = torch.randn(2, num_blocks, BS, KVH, D, device="cuda", dtype=dt)
    q = torch.randn(B, H, D, device="cuda", dtype=dt)
    k = torch.randn(B, KVH, D, device="cuda", dtype=dt)
    v = torch.randn(B, KVH, D, device="cuda", dtype=dt)
    out = torch.zeros(B, H, D, device="cuda", dtype=dt)
    qsl = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    bt = torch.zeros(B, width, dtype=torch.int32, device="cuda")
    slots = torch.full((B,), -1, dtype=torch.int64, device="cuda")
    kw = dict(query_start_loc=qsl, seq_lens=seq_lens, block_tables=bt, max_query_len=1, max_seq_len=max_len,
              scale=D ** -0.5, num_kv_splits=8)

    def step() -> None:
        pa.write_kv_cache(k, v, cache, slots)
        pa.paged_attention(q, cache, out, **kw)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    g = torch.Generator().manual_seed(0)
    for real in (B, 5, 19):
        lens = torch.randint(1, max_len + 1, (real,), generator=g)
        perm = torch.randperm(num_blocks, generator=g)[: B * width].view(B, width)
        qsl.copy_(torch.tensor(list(range(real + 1)) + [real] * (B - real), dtype=torch.int32))
        seq_lens.copy_(torch.cat([lens, torch.zeros(B - real, dtype=torch.int64)]).int())
        bt.copy_(perm.int())
        pos = lens - 1
        new_slots = torch.full((B,), -1, dtype=torch.int64)
        new_slots[:real] = perm[torch.arange(real), pos // BS] * BS + pos % BS
        slots.copy_(new_slots)
        q.normal_()
        k.normal_()
        v.normal_()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.zeros(B, H, D, dtype=torch.float64, device="cuda")
        paged_attention_reference(q, cache, ref, compute_dtype=torch.float64, **kw)
        torch.testing.assert_close(out[:real].double(), ref[:real], atol=3e-2, rtol=3e-2)
        assert torch.isnan(out[real:]).all()
