"""Small-batch decoder-layer projections: the fused GEMV kernels (``tandem.kernels.gemv``)
against the GEMM path they replace (fused RMSNorm kernel, cuBLAS ``F.linear``, fused
SiLU-and-multiply), both inside CUDA graphs, as a decode step replays them.

For each shape and batch size it captures every layer's projections (attention left out:
``o_proj`` reads the first ``hidden`` features of the QKV output) over the model's own
number of layers, each layer with its own weights so nothing stays in L2, and reports
microseconds per replay of the whole stack and of each projection alone, the bytes of
weights read per microsecond against the HBM bound, and the largest difference between the
two paths' outputs. ``--sweep`` also times each projection under other block shapes.

    python benchmarks/gemv_bench.py --shapes qwen2.5-0.5b,qwen2.5-7b --rows 1,2,4,8 --out gemv.json

Exits with a message (status 0) where there is no CUDA device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# hidden, intermediate, q heads, kv heads, head_dim, layers (Qwen2.5 shapes, q/k/v bias)
SHAPES = {"qwen2.5-0.5b": (896, 4864, 14, 2, 64, 24), "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 28),
          "qwen2.5-7b": (3584, 18944, 28, 4, 128, 28)}


def make_layers(shape: str, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    hidden, inter, heads, kv, hd, layers = SHAPES[shape]
    nqkv = (heads + 2 * kv) * hd

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device="cuda") * k ** -0.5).to(dtype)

    return [dict(ln1=torch.rand(hidden, device="cuda").to(dtype) + 0.5, qkv=w(nqkv, hidden),
                 qkv_b=torch.randn(nqkv, device="cuda").to(dtype), o=w(hidden, heads * hd),
                 ln2=torch.rand(hidden, device="cuda").to(dtype) + 0.5, gate_up=w(2 * inter, hidden),
                 down=w(hidden, inter)) for _ in range(layers)]


def stack(layers: list[dict[str, torch.Tensor]], x: torch.Tensor, use_gemv: bool,
          only: str | None = None) -> torch.Tensor:
    """The projections of every layer, in a decode step's order (or one kind alone)."""
    from tandem.kernels.fused import rms_norm, silu_and_mul
    from tandem.kernels.gemv import gemv

    hidden = x.shape[1]
    res = x.clone()
    h = x
    for p in layers:
        if only is None:
            if use_gemv:
                qkv, res = gemv(h, p["qkv"], p["qkv_b"], norm=(p["ln1"], 1e-6), residual=res)
                o = gemv(qkv[:, :hidden], p["o"])
                act, res = gemv(o, p["gate_up"], norm=(p["ln2"], 1e-6), residual=res, silu=True)
                h = gemv(act, p["down"])
            else:
                n, res = rms_norm(h, p["ln1"], 1e-6, res)
                qkv = F.linear(n, p["qkv"], p["qkv_b"])
                o = F.linear(qkv[:, :hidden], p["o"])
                n, res = rms_norm(o, p["ln2"], 1e-6, res)
                h = F.linear(silu_and_mul(F.linear(n, p["gate_up"])), p["down"])
        elif only == "qkv":
            h = gemv(x, p["qkv"], p["qkv_b"], norm=(p["ln1"], 1e-6), residual=res)[0] if use_gemv \
                else F.linear(rms_norm(x, p["ln1"], 1e-6, res)[0], p["qkv"], p["qkv_b"])
        elif only == "o":
            h = gemv(x, p["o"]) if use_gemv else F.linear(x, p["o"])
        elif only == "gate_up":
            h = gemv(x, p["gate_up"], norm=(p["ln2"], 1e-6), residual=res, silu=True)[0] if use_gemv \
                else silu_and_mul(F.linear(rms_norm(x, p["ln2"], 1e-6, res)[0], p["gate_up"]))
        elif only == "down":  # x: [rows, intermediate]
            h = gemv(x, p["down"]) if use_gemv else F.linear(x, p["down"])
    return h


def sweep_config(block_k: int, warps: int, scale: float) -> Callable[[int, int, int, bool], tuple[int, int, int]]:
    """A ``tandem.kernels.gemv._config`` with these features per tile and warps, and its
    rows-per-program rule scaled by ``scale``."""
    import triton

    def config(m_pad: int, n: int, k: int, silu: bool) -> tuple[int, int, int]:
        cap = max(1, 8192 // (m_pad * block_k * (2 if silu else 1)))
        block_n = 1
        while block_n * 2 <= cap and triton.cdiv(n, block_n * 2) >= 512:
            block_n *= 2
        return max(1, int(block_n * scale)), block_k, warps

    return config


def graph_us(fn: Callable[[], Any], reps: int = 20) -> tuple[float, Any]:
    """Microseconds per replay of ``fn`` captured in a CUDA graph (median of ``reps``)."""
    out = fn()  # compile and warm
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2], out


def weight_bytes(layers: list[dict[str, torch.Tensor]], only: str | None) -> int:
    keys = {"qkv": ["qkv"], "o": ["o"], "gate_up": ["gate_up"], "down": ["down"]}.get(only or "",
                                                                                    ["qkv", "o", "gate_up", "down"])
    return sum(p[k].numel() * p[k].element_size() for p in layers for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-0.5b")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--sweep", default="", help="comma list of shapes whose projections are also timed at other "
                    "block shapes (rows 1)")
    ap.add_argument("--unroll", action="store_true",
                    help="also time the GEMVs with tandem.kernels.gemv.UNROLL_K toggled")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    from tandem.config.model import EnvSwitches
    from tandem.kernels import gemv as gemv_mod
    from tandem.kernels import pdl

    # Launched as the engine launches them: with PDL where supported, unless TANDEM_PDL=0.
    pdl.set_enabled(EnvSwitches.from_environ().pdl and pdl.supported(torch.device("cuda")))

    results: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        layers = make_layers(shape, torch.bfloat16)
        hidden = SHAPES[shape][0]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
            x_down = torch.randn(m, SHAPES[shape][1], device="cuda", dtype=torch.bfloat16)
            row: dict[str, Any] = {"shape": shape, "rows": m}
            for only in (None, "qkv", "o", "gate_up", "down"):
                tag = only or "layer_stack"
                xin = x_down if only == "down" else x
                t_gemm, out_gemm = graph_us(lambda: stack(layers, xin, False, only))
                t_gemv, out_gemv = graph_us(lambda: stack(layers, xin, True, only))
                nbytes = weight_bytes(layers, only)
                diff = float((out_gemm.float() - out_gemv.float()).abs().max() / out_gemm.float().abs().max())
                row[tag] = dict(gemm_us=round(t_gemm, 1), gemv_us=round(t_gemv, 1),
                                gemm_tb_s=round(nbytes / t_gemm / 1e6, 2), gemv_tb_s=round(nbytes / t_gemv / 1e6, 2),
                                rel_max_diff=diff)
                unrolled = ""
                if args.unroll:  # the same GEMVs with the feature-tile loop unrolled
                    default, gemv_mod.UNROLL_K = gemv_mod.UNROLL_K, not gemv_mod.UNROLL_K
                    t_unr, out_unr = graph_us(lambda: stack(layers, xin, True, only))
                    gemv_mod.UNROLL_K = default
                    row[tag].update(gemv_unroll_toggled_us=round(t_unr, 1),
                                    unroll_toggled_same_bits=bool(torch.equal(out_unr, out_gemv)))
                    unrolled = f"  unroll {'on' if not default else 'off'} {t_unr:8.1f} us"
                print(f"{shape} rows {m} {tag:12s} gemm {t_gemm:8.1f} us ({nbytes / t_gemm / 1e6:.2f} TB/s)  "
                      f"gemv {t_gemv:8.1f} us ({nbytes / t_gemv / 1e6:.2f} TB/s)  rel diff {diff:.1e}{unrolled}",
                      flush=True)
            if shape in args.sweep.split(",") and m == 1:
                base = gemv_mod._config
                sweep = []
                for block_k, warps, scale in ((256, 4, 1), (256, 4, 2), (256, 4, 4), (512, 4, 1), (512, 4, 2),
                                              (512, 8, 2), (1024, 4, 1), (1024, 4, 2), (1024, 8, 1), (1024, 8, 2),
                                              (2048, 8, 1)):
                    gemv_mod._config = sweep_config(block_k, warps, scale)
                    cell: dict[str, Any] = {"block_k": block_k, "warps": warps, "block_n_scale": scale}
                    for only in ("qkv", "o", "gate_up", "down"):
                        try:
                            xin = x_down if only == "down" else x
                            cell[only] = round(graph_us(lambda: stack(layers, xin, True, only))[0], 1)
                        except Exception as e:  # a shape the compiler refuses
                            cell[only] = f"{type(e).__name__}"
                    sweep.append(cell)
                    print(f"  sweep {cell}", flush=True)
                gemv_mod._config = base
                row["sweep"] = sweep
            results.append(row)
        layers = []  # free this shape's weights before the next
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
