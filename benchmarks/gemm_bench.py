"""The decode step's projections at batch 256: cuBLAS (torch's default), cuBLASLt
(``torch.backends.cuda.preferred_blas_library("cublaslt")``) and tandem's split-K Triton GEMM
(``tandem.kernels.gemm``) under a sweep of tile shapes and split counts.

Each projection kind is timed as a CUDA graph of the model's own number of layers, each
layer with its own weights (so nothing stays in L2), replayed; microseconds per layer are
reported with the weights' read rate, and the largest difference from ``F.linear``.

    python benchmarks/gemm_bench.py --shape qwen2.5-0.5b --rows 256 --out gemm.json

Exits with a message (status 0) where there is no CUDA device.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# hidden, intermediate, q heads, kv heads, head_dim, layers (Qwen2.5 shapes)
SHAPES = {"qwen2.5-0.5b": (896, 4864, 14, 2, 64, 24), "qwen2.5-7b": (3584, 18944, 28, 4, 128, 28)}


def kinds(shape: str) -> dict[str, tuple[int, int]]:
    """Projection -> (K, N)."""
    hidden, inter, heads, kv, hd, _ = SHAPES[shape]
    return {"qkv": (hidden, (heads + 2 * kv) * hd), "o": (heads * hd, hidden), "gate_up": (hidden, 2 * inter),
            "down": (inter, hidden)}


def time_graph(fn: Callable[[], Any], reps: int = 20) -> float:
    """Microseconds per replay of a graph of ``fn``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def configs() -> list[Any]:
    from tandem.kernels.gemm import GemmConfig

    out = [GemmConfig(bm, bn, bk, s, 4, st) for bm, bn, bk, s, st in
           itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4, 8), (3, 4))]
    out += [GemmConfig(128, 128, 64, s, 8, 3) for s in (1, 2, 4)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="256")
    ap.add_argument("--kinds", default="qkv,o,gate_up,down")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemm_bench: no CUDA device")
        return 0
    from tandem.kernels.gemm import linear

    torch.manual_seed(0)
    layers = SHAPES[args.shape][-1]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shape": args.shape, "rows": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        res_m: dict[str, Any] = {}
        for kind in args.kinds.split(","):
            K, N = kinds(args.shape)[kind]
            ws = [(torch.randn(N, K, device="cuda") * K ** -0.5).to(torch.bfloat16) for _ in range(layers)]
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            outs = [torch.empty(m, N, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            want = F.linear(x.float(), ws[0].float())
            gb = N * K * 2 * layers / 1e9

            def torch_path(lib: str) -> float:
                torch.backends.cuda.preferred_blas_library(lib)
                try:
                    return time_graph(lambda: [torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)]) / layers
                finally:
                    torch.backends.cuda.preferred_blas_library("cublas")

            row: dict[str, Any] = {"cublas_us": torch_path("cublas"), "cublaslt_us": torch_path("cublaslt"),
                                   "triton": []}
            for cfg in configs():
                try:
                    got = linear(x, ws[0], None, cfg)
                    err = (got.float() - want).abs().max().item()
                    us = time_graph(lambda cfg=cfg: [linear(x, w, None, cfg, out=o) for w, o in zip(ws, outs)]) / layers
                except Exception as e:  # a tile shape that does not fit shared memory
                    row["triton"].append({"config": list(cfg), "error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                row["triton"].append({"config": list(cfg), "us": us, "max_abs_err": err})
            ok = [t for t in row["triton"] if "us" in t]
            best = min(ok, key=lambda t: t["us"]) if ok else None
            row["best_triton"] = best
            lib_best = min(row["cublas_us"], row["cublaslt_us"])
            print(f"M={m} {kind:8s} K={K:5d} N={N:5d}: cublas {row['cublas_us']:6.1f} us, cublaslt "
                  f"{row['cublaslt_us']:6.1f} us, triton best {best['us'] if best else float('nan'):6.1f} us "
                  f"{best['config'] if best else ''} err {best['max_abs_err'] if best else float('nan'):.3g} "
                  f"({gb / layers / (lib_best * 1e-6):.0f} -> "
                  f"{gb / layers / ((best['us'] if best else lib_best) * 1e-6):.0f} GB/s of weights)", flush=True)
            res_m[kind] = row
            torch.cuda.empty_cache()
        result["rows"][str(m)] = res_m
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
