"""Device check + microbenchmark of the Triton paged-attention kernels (tandem.kernels).

1. Correctness at real shapes (bf16/fp16, GQA 14/2 by default) against the pure-torch
   reference: decode with and without split-KV, a mixed decode + prefill-chunk batch with
   CUDA-graph padding rows, a sliding window, and write_kv_cache.
2. Timing with ``triton.testing.do_bench`` (L2 flushed between runs): decode at batch
   1/64/256 x context 256/2k/8k (auto split count, plus the best forced split count when
   ``--sweep-splits``), a mixed batch, write_kv_cache, and a prefill of 8 x 2k tokens
   (next to torch SDPA on contiguous K/V for scale). Decode rows report achieved KV-read
   bandwidth against the H200's ~4.3 TB/s; prefill rows report TFLOP/s.

    python benchmarks/kernel_bench.py                      # 14 q heads / 2 kv heads, head_dim 128
    python benchmarks/kernel_bench.py --heads 32 --kv-heads 8 --head-dim 128 --json out.json

Exits with a message (status 0) where there is no CUDA device or no Triton.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PEAK_BW = 4.3e12  # H200 HBM3e, bytes/s
PEAK_BF16 = 989e12  # H200 dense bf16, FLOP/s


def make_batch(q_lens: list[int], seq_lens: list[int], *, heads: int, kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, pad_seqs: int = 0, seed: int = 0) -> dict:
    """Random q/cache; each sequence's pages are a random, non-contiguous set."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [-(-s // block_size) for s in seq_lens]
    width = max(nblk + [1])
    num_blocks = sum(nblk) + 1
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    bt = torch.zeros(len(q_lens) + pad_seqs, width, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[used:used + n].int()
        used += n
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, device="cuda", dtype=dtype, generator=g)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    qsl += [qsl[-1]] * pad_seqs
    return dict(
        q=q, kv_cache=cache,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(list(seq_lens) + [0] * pad_seqs, dtype=torch.int32, device="cuda"),
        block_tables=bt, max_query_len=max(q_lens), max_seq_len=max(seq_lens), scale=head_dim ** -0.5,
    )


def attn_kwargs(b: dict, **extra: object) -> dict:
    kw = {k: b[k] for k in ("query_start_loc", "seq_lens", "block_tables", "max_query_len", "max_seq_len", "scale")}
    kw.update(extra)
    return kw


# ---------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------
def check(args: argparse.Namespace, K, dtype: torch.dtype) -> list[str]:
    from tandem.kernels.reference import paged_attention_reference, write_kv_cache_reference

    failures: list[str] = []
    shape = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                 dtype=dtype)
    g = torch.Generator().manual_seed(0)
    cases: list[tuple[str, dict, dict]] = []
    lens = torch.randint(1, 4097, (64,), generator=g).tolist()
    lens[:3] = [1, args.block_size + 1, 4096]
    dec = make_batch([1] * 64, lens, **shape, seed=1)
    cases += [("decode b64 auto-split", dec, {}), ("decode b64 1 split", dec, dict(num_kv_splits=1)),
              ("decode b64 16 splits", dec, dict(num_kv_splits=16))]
    cases.append(("decode b1 8k auto-split", make_batch([1], [8192], **shape, seed=2), {}))
    q_lens = [1] * 40 + [2048, 700, 1, 333]
    seq_lens = torch.randint(1, 4097, (40,), generator=g).tolist() + [2048, 3100, 4096, 400]
    mixed = make_batch(q_lens, seq_lens, **shape, pad_seqs=4, seed=3)
    cases += [("mixed + padding rows", mixed, {}), ("mixed, window 512", mixed, dict(sliding_window=512))]
    for name, b, extra in cases:
        out = torch.full_like(b["q"], float("nan"))
        K.paged_attention(b["q"], b["kv_cache"], out, **attn_kwargs(b, **extra))
        ref = torch.zeros_like(b["q"], dtype=torch.float32)
        window = extra.get("sliding_window")
        paged_attention_reference(b["q"], b["kv_cache"], ref, **attn_kwargs(b, sliding_window=window))
        err = (out.float() - ref).abs().max().item()
        nan = torch.isnan(out).any().item()
        ok = err < 3e-2 and not nan
        print(f"  [{'ok' if ok else 'FAIL'}] {name:<26} {str(dtype):<15} max|err| {err:.2e}{'  NaN!' if nan else ''}")
        if not ok:
            failures.append(f"{name} {dtype}")
    # write_kv_cache with padding slots
    b = make_batch([1], [64], **shape)
    cache = b["kv_cache"]
    T = 300
    k = torch.randn(T, args.kv_heads, args.head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(cache.shape[1] * cache.shape[2], device="cuda")[:T]
    slots[::7] = -1
    got, expect = cache.clone(), cache.clone()
    K.write_kv_cache(k, v, got, slots)
    write_kv_cache_reference(k, v, expect, slots)
    ok = torch.equal(got, expect)
    print(f"  [{'ok' if ok else 'FAIL'}] {'write_kv_cache':<26} {str(dtype):<15}")
    if not ok:
        failures.append(f"write_kv_cache {dtype}")
    return failures


# ---------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------
def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def run_bench(args: argparse.Namespace, K) -> list[dict]:
    dtype = torch.bfloat16
    esize = 2
    shape = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                 dtype=dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list[dict] = []
    header = f"{'case':<34}{'splits':>7}{'ms':>10}{'GB/s':>9}{'% 4.3TB/s':>10}{'TFLOP/s':>9}   best forced split"
    print(header)
    print("-" * len(header))

    def emit(case: str, splits: object, ms: float, nbytes: float, flops: float, best: str = "") -> None:
        bw = nbytes / (ms * 1e-3)
        tf = flops / (ms * 1e-3) / 1e12 if flops else 0.0
        print(f"{case:<34}{str(splits):>7}{ms:>10.4f}{bw / 1e9:>9.0f}{100 * bw / PEAK_BW:>9.1f}%"
              f"{tf:>9.1f}   {best}")
        rows.append(dict(case=case, splits=splits, ms=ms, gbps=bw / 1e9, pct_peak_bw=100 * bw / PEAK_BW, tflops=tf,
                         best=best))

    kv_bytes_per_tok = 2 * args.kv_heads * args.head_dim * esize
    for bs in (1, 64, 256):
        for ctx in (256, 2048, 8192):
            b = make_batch([1] * bs, [ctx] * bs, **shape, seed=bs + ctx)
            out = torch.empty_like(b["q"])
            auto = K.choose_num_kv_splits(bs, args.kv_heads, 1, ctx, sms)
            ms = bench(lambda b=b, out=out: K.paged_attention(b["q"], b["kv_cache"], out, **attn_kwargs(b)))
            nbytes = bs * ctx * kv_bytes_per_tok + 2 * b["q"].numel() * esize
            flops = 4.0 * bs * ctx * args.heads * args.head_dim
            best = ""
            if args.sweep_splits:
                timings = {}
                for s in (1, 2, 4, 8, 16, 32):
                    if s > 1 and ctx // s < 64:
                        continue
                    timings[s] = bench(lambda s=s, b=b, out=out: K.paged_attention(
                        b["q"], b["kv_cache"], out, **attn_kwargs(b, num_kv_splits=s)))
                s_best = min(timings, key=timings.get)
                pct = 100 * nbytes / (timings[s_best] * 1e-3) / PEAK_BW
                best = f"{s_best}: {timings[s_best]:.4f} ms ({pct:.0f}%)"
            emit(f"decode b{bs} ctx{ctx}", auto, ms, nbytes, flops, best)
            del b, out
            torch.cuda.empty_cache()

    # mixed: 63 decodes at 2k context + one 2k-token prefill chunk over a 2k prefix
    q_lens = [1] * 63 + [2048]
    seq_lens = [2048] * 63 + [4096]
    b = make_batch(q_lens, seq_lens, **shape, seed=7)
    out = torch.empty_like(b["q"])
    ms = bench(lambda: K.paged_attention(b["q"], b["kv_cache"], out, **attn_kwargs(b)))
    nbytes = (63 * 2048 + 4096) * kv_bytes_per_tok
    flops = 4.0 * args.heads * args.head_dim * (63 * 2048 + 2048 * 2048 + 2048 * 2049 / 2)
    emit("mixed 63 dec@2k + 2k chunk@+2k", 1, ms, nbytes, flops)

    # prefill 8 x 2k
    n, L = 8, 2048
    b = make_batch([L] * n, [L] * n, **shape, seed=8)
    out = torch.empty_like(b["q"])
    ms = bench(lambda: K.paged_attention(b["q"], b["kv_cache"], out, **attn_kwargs(b)))
    flops = 4.0 * n * args.heads * args.head_dim * L * (L + 1) / 2
    emit(f"prefill {n}x{L}", 1, ms, n * L * kv_bytes_per_tok, flops)
    qs = b["q"].view(n, L, args.heads, args.head_dim).transpose(1, 2)
    ks = torch.randn(n, args.kv_heads, L, args.head_dim, device="cuda", dtype=dtype)
    vs = torch.randn_like(ks)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        qs, ks, vs, is_causal=True, enable_gqa=args.heads != args.kv_heads)
    try:
        ms = bench(sdpa)
        emit(f"  (torch SDPA contiguous {n}x{L})", "-", ms, n * L * kv_bytes_per_tok, flops)
    except Exception as e:  # enable_gqa needs torch >= 2.5; backends vary
        print(f"  (torch SDPA baseline unavailable: {e})")

    # write_kv_cache
    for T in (256, 16384):
        b = make_batch([1], [T + 16], **shape, seed=9)
        k = torch.randn(T, args.kv_heads, args.head_dim, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        slots = torch.randperm(b["kv_cache"].shape[1] * args.block_size, device="cuda")[:T]
        ms = bench(lambda k=k, v=v, b=b, slots=slots: K.write_kv_cache(k, v, b["kv_cache"], slots))
        emit(f"write_kv_cache {T} tokens", "-", ms, 2 * T * kv_bytes_per_tok + T * 8, 0.0)
    return rows


def sweep_tiles(args: argparse.Namespace, K) -> list[dict]:
    """Decode at the engine's short contexts: every key-tile size x split count, timed as a
    CUDA graph of 24 launches over as many caches (nothing stays in L2), as the engine's
    decode graph runs them (``gemv_bench.graph_us``: the median replay); microseconds per
    launch. Eager launches are not timed: on a slow host the launch outlasts the kernel."""
    from gemv_bench import graph_us

    layers = 24
    shape = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                 dtype=torch.bfloat16)
    rows: list[dict] = []
    cases = ([(1, 128), (1, 384), (1, 640)] if args.sweep_batch1
             else [(bs, c) for bs in (64, 256) for c in (128, 256, 512)])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    fused_variants = (False, True) if args.sweep_batch1 else (False,)
    fused_default = K.FUSED_MERGE
    for bs, ctx in cases:
        for fused in fused_variants:
            K.FUSED_MERGE = fused
            bs_ = [make_batch([1] * bs, [ctx] * bs, **shape, seed=bs + ctx + i) for i in range(layers)]
            outs = [torch.empty_like(b["q"]) for b in bs_]
            timings = {}
            for tn in ((16, 32, 64, 128) if bs == 1 else (16, 32, 64, 128, 256)):
                for s in ((1, 2, 4, 8, 16, 32) if bs == 1 else (1, 2, 4)):
                    if tn * s > 2 * ctx:
                        continue
                    try:
                        timings[(tn, s)] = graph_us(lambda tn=tn, s=s, pairs=list(zip(bs_, outs)): [
                            K.paged_attention(b["q"], b["kv_cache"], out,
                                              **attn_kwargs(b, num_kv_splits=s, tile_n=tn))
                            for b, out in pairs])[0] / layers
                    except Exception as e:  # a tile that does not fit shared memory
                        print(f"  tile_n {tn}, {s} splits: {type(e).__name__}: {str(e)[:120]}")
            best = min(timings, key=timings.get)
            auto = K.choose_num_kv_splits(bs, args.kv_heads, 1, ctx, sms)
            base = timings.get((64, auto))
            print(f"decode b{bs} ctx{ctx}{' fused merge' if fused else ''}: tile_n 64, {auto} splits (the engine's) "
                  f"{base if base else float('nan'):.1f} us; best "
                  f"tile_n {best[0]}, {best[1]} splits {timings[best]:.1f} us   "
                  + " ".join(f"{k[0]}/{k[1]}:{v:.1f}" for k, v in sorted(timings.items())), flush=True)
            rows.append(dict(case=f"decode b{bs} ctx{ctx}", fused_merge=fused, engine_splits=auto,
                             us={f"{k[0]}/{k[1]}": v for k, v in timings.items()},
                             best=list(best)))
            torch.cuda.empty_cache()
    K.FUSED_MERGE = fused_default
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-sweep-splits", dest="sweep_splits", action="store_false",
                    help="only time the automatic split count for decode")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--sweep-batch1", action="store_true",
                    help="with --sweep-tile-n: batch 1 at contexts 128-640, split counts to 32, fused merge on and off")
    ap.add_argument("--sweep-tile-n", action="store_true",
                    help="only the decode key-tile x split sweep at short contexts (batch 64 and 256)")
    ap.add_argument("--json", help="write the timing rows here")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device here; nothing to check or time (run it on the GPU machine).")
        return 0
    from tandem.kernels import triton_available

    if not triton_available():
        print("kernel_bench: triton is not installed; pip install triton.")
        return 0
    import triton

    import tandem.kernels.attention as K

    print(f"device: {torch.cuda.get_device_name(0)} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"shape: {args.heads} q heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
          f"block {args.block_size}")
    failures: list[str] = []
    if not args.skip_check:
        print("correctness vs reference:")
        for dt in (torch.bfloat16, torch.float16):
            failures += check(args, K, dt)
    print()
    rows = sweep_tiles(args, K) if args.sweep_tile_n else run_bench(args, K)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), args=vars(args), rows=rows, failures=failures), f,
                      indent=1)
    if failures:
        print(f"\nFAILED: {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
