"""Compile the paged-attention kernels (and rotary fused into the KV write) for sm_90 (H100/H200) without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler, so it cannot catch what
only compilation rejects (loop-carried types, early returns, dot shapes, layouts). This
script compiles the main variants ahead of time for an sm_90 target with the specialisation
a real launch gets (unit strides as constants, 16-divisible pointers/strides), which needs
no driver. Run in a process WITHOUT ``TRITON_INTERPRET``.

Exit status: 0 compiled; 1 a kernel failed to compile; 3 this Triton's ahead-of-time API is
not the one used here (the caller skips).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    print("run without TRITON_INTERPRET")
    sys.exit(3)

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception as e:  # noqa: BLE001
    print(f"ahead-of-time compile API unavailable: {e!r}")
    sys.exit(3)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import importlib  # noqa: E402

importlib.import_module("tandem.kernels.attention")
pa = sys.modules["tandem.kernels.attention"]

TARGET = GPUTarget("cuda", 90, 32)
UNIT_STRIDES = ("stride_qd", "stride_od", "stride_cd", "stride_kd", "stride_vd")
DIV16 = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_ckv", "stride_cb", "stride_cs", "stride_ch",
         "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cslot"}


def compile_one(fn: Any, types: dict[str, str], consts: dict[str, Any], **options: Any) -> None:
    consts = dict(consts)
    for name in UNIT_STRIDES:
        if name in fn.arg_names:
            consts[name] = 1
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (n.endswith("_ptr") or n in DIV16)}
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    except TypeError as e:
        print(f"ASTSource API mismatch: {e!r}")
        sys.exit(3)
    t0 = time.time()
    try:
        kernel = triton.compile(src, target=TARGET, options=options)
    except Exception as e:  # noqa: BLE001
        if "ptxas" in repr(e) and "not found" in repr(e).lower():
            print(f"no ptxas: {e!r}")
            sys.exit(3)
        print(f"FAILED {fn.__name__} {consts}: {e}")
        sys.exit(1)
    print(f"ok {fn.__name__} shared={kernel.metadata.shared} ({time.time() - t0:.1f}s) {consts}")


def attention(dtype: str, head_dim: int, group: int, block_m: int, block_n: int, splits: int, seq_grid: bool,
              window: bool, fused_merge: bool = False, **options: Any) -> None:
    types = {"q_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "cache_ptr": f"*{dtype}", "part_acc_ptr": "*fp32",
             "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
             "bt_ptr": "*i32", "qk_scale": "fp32", "stride_ckv": "i64", "counter_ptr": "*i32"}
    consts = dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=16,
                  BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=block_n, NUM_SPLITS=splits, SEQ_GRID=seq_grid,
                  USE_WINDOW=window, DOT_PREC="ieee" if dtype == "fp32" else "tf32", FUSED_MERGE=fused_merge,
                  PDL=True)
    if not fused_merge:
        consts["counter_ptr"] = None
    compile_one(pa._paged_attn_kernel, types, consts, **options)


def main() -> None:
    # decode with split-KV (seq grid), GQA 7: merged by the last split, and by the merge kernel
    attention("bf16", 128, 7, 16, 64, 8, True, False, True, num_warps=4, num_stages=3)
    attention("bf16", 128, 7, 16, 64, 8, True, False, num_warps=4, num_stages=3)
    # mixed/prefill: packed grid (binary search), sliding window, wgmma-sized tile
    attention("fp16", 64, 2, 128, 64, 1, False, True, num_warps=8, num_stages=2)
    compile_one(pa._merge_splits_kernel,
                {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                 "qsl_ptr": "*i32"},
                dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=8, SPLITS_PAD=8, PDL=True), num_warps=4)
    compile_one(pa._write_kv_kernel,
                {"k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": "*bf16", "slot_ptr": "*i64", "stride_ckv": "i64"},
                dict(NUM_KV_HEADS=2, HEAD_DIM=128, KVH_PAD=2, HEAD_DIM_PAD=128), num_warps=2)
    fused = importlib.import_module("tandem.kernels.fused")
    rope_types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
                  "sin_ptr": "*fp32", "cache_ptr": "*bf16", "slot_ptr": "*i64", "qn_ptr": "*bf16", "kn_ptr": "*bf16",
                  "eps": "fp32", "stride_ckv": "i64"}
    # rotary fused into the KV write: Qwen2-7B-like heads; Qwen3 (per-head q/k norm); partial rotary
    for nq, nk, d, rot, qk_norm in ((28, 4, 128, 128, False), (16, 8, 128, 128, True), (14, 2, 64, 32, False)):
        compile_one(fused._rotary_write_kv_kernel, rope_types,
                    dict(QK_NORM=qk_norm, NUM_Q=nq, NUM_K=nk, HEAD_DIM=d, HALF=rot // 2, ROT_DIM=rot,
                         Q_HEADS_PAD=triton.next_power_of_2(nq), K_HEADS_PAD=triton.next_power_of_2(nk),
                         HALF_PAD=triton.next_power_of_2(rot // 2), HEAD_DIM_PAD=triton.next_power_of_2(d),
                         TAIL_PAD=triton.next_power_of_2(max(1, d - rot))), num_warps=4)
    # gated sampling's wait on a host flag (a 64-bit address read with volatile loads)
    compile_one(importlib.import_module("tandem.kernels.host_flag")._wait_flag_kernel,
                {"flag_addr": "i64", "target": "i32", "max_polls": "i32"}, {}, num_warps=1)
    print("all compiled")


if __name__ == "__main__":
    main()
