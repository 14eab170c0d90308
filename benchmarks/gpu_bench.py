"""GPU benchmark, side by side in one process: tandem (sync, async, async without CUDA
graphs) against Hugging Face transformers (``generate_batch`` continuous batching, and
``generate`` with a static KV cache under ``torch.compile``, timed after compilation).

Models are random bf16 weights with real shapes (Qwen2.5-0.5B, Qwen2.5-1.5B), built from a
config on the device (nothing can be downloaded there); prompts are random token ids.

Workloads (``--workloads``):
* ``throughput``: 256 requests, 128 prompt + 128 output tokens, greedy, ignore_eos;
* ``batch1``: one request decoding 512 tokens;
* ``prefill``: 8 prompts of 8192 tokens, 1 output token each (prefill MFU).

Reported per run: tokens/s, wall ms per step, host ms per step (the engine's time minus
the time it waited for step outputs), GPU idle share and GPU busy ms per step in steady
decode (from a ``torch.profiler`` trace of ~60 decode steps), the decode step against the
HBM bound (weights + KV read once per step at the measured copy bandwidth), and prefill
MFU against the measured bf16 matmul rate. Writes JSON (``--out``).

    python benchmarks/gpu_bench.py --shapes qwen2.5-0.5b --out gpu_bench.json
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6),
}
MAX_LEN = 8192 + 256


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- setup -------------------------------------------------------------------------------
def build_model(folder: str, shape: dict[str, Any], device: str = "cuda") -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    cfg = Qwen2Config(max_position_embeddings=MAX_LEN, eos_token_id=1, bos_token_id=0, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(1000)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1", bos_token="t0", unk_token="t0").save_pretrained(folder)
    del model
    free_cuda()
    return folder


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured here."""
    from triton.testing import do_bench

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), return_mode="median")
    bw = 2 * x.numel() / (ms * 1e-3)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = do_bench(lambda: a @ b, return_mode="median")
    flops = 2 * 8192 ** 3 / (ms * 1e-3)
    return {"copy_bytes_per_s": bw, "bf16_flops_per_s": flops}


# -- tandem ------------------------------------------------------------------------------
class StepClock:
    """Wraps the engine's executor so each step's wait for its output is timed: host time
    per step = engine time - waiting time."""

    def __init__(self, core: Any) -> None:
        self.wait_s = 0.0
        ex = core.executor
        self._orig = ex.execute_model
        clock = self

        def execute_model(so: Any) -> Any:
            fut = clock._orig(so)
            orig_result = fut.result

            def result(timeout: Optional[float] = None) -> Any:
                t0 = time.perf_counter()
                try:
                    return orig_result(timeout)
                finally:
                    clock.wait_s += time.perf_counter() - t0

            fut.result = result
            return fut

        ex.execute_model = execute_model


def run_engine(llm: Any, prompts: list[list[int]], sp: Any, profile_steps: Optional[tuple[int, int]] = None,
               cprofile: Any = None, trace_path: Optional[str] = None) -> dict[str, Any]:
    """Drive the engine step by step (so a window of steps can be profiled: a torch.profiler
    trace, written to ``trace_path`` (Chrome format) if given, and ``cprofile``, a
    ``cProfile.Profile``, over the same steps if given)."""
    engine = llm.engine
    core = engine.core
    clock = StepClock(core)
    ids = [f"b{i}" for i in range(len(prompts))]
    s0 = (core.stats.num_launched, core.stats.num_launched_ahead)
    prof = None
    profile: Optional[dict[str, float]] = None
    prof_window: Optional[tuple[int, int]] = None
    step_times: list[float] = []
    out_tokens = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)  # one per request, or one for all
    for rid, p, one_sp in zip(ids, prompts, sps):
        engine.add_request(rid, p, one_sp)
    n = 0
    while engine.has_unfinished_requests():
        if profile_steps and n == profile_steps[0]:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            if cprofile is not None:
                cprofile.enable()
        ts = time.perf_counter()
        for o in engine.step(final_only=True):
            if o.finished:
                out_tokens += len(o.outputs[0].token_ids)
        step_times.append(time.perf_counter() - ts)
        n += 1
        if prof is not None and profile_steps and n == profile_steps[1]:
            torch.cuda.synchronize()
            if cprofile is not None:
                cprofile.disable()
            prof.__exit__(None, None, None)
            if trace_path:
                prof.export_chrome_trace(trace_path)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
            prof_window = (profile_steps[0], n)
            profile = summarize_profile(prof)
            prof = None
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = core.stats.num_launched - s0[0]
    res = dict(wall_s=wall, output_tokens=out_tokens, tok_per_s=out_tokens / wall, steps=steps,
               launched_ahead=(core.stats.num_launched_ahead - s0[1]) / max(steps, 1),
               ms_per_step=1e3 * wall / max(steps, 1),
               host_ms_per_step=1e3 * (wall - clock.wait_s) / max(steps, 1))
    if profile is not None and prof_window is not None:
        res["profile"] = profile
        res["profile_window"] = prof_window
        mid = step_times[prof_window[0]:prof_window[1]]
        res["steady_wall_ms_per_loop"] = 1e3 * statistics.median(mid)
    worker = getattr(core.executor, "worker", None)  # None: a multiproc worker, in its own process
    if worker is not None:
        res["graph_steps"] = worker.runner.stats_graph_steps
    return res


def summarize_profile(prof: Any) -> dict[str, float]:
    """GPU busy/idle over the traced window, from kernel and memcpy intervals."""
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start:
            spans.append((ev.time_range.start, ev.time_range.end))
    if not spans:
        return {"gpu_idle_share": float("nan"), "gpu_busy_ms": 0.0, "window_ms": 0.0}
    spans.sort()
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    return {"gpu_idle_share": 1 - busy / window, "gpu_busy_ms": busy / 1e3, "window_ms": window / 1e3,
            "kernels": len(spans), "top_kernels": top_kernels(prof)}


def top_kernels(prof: Any, n: int = 20) -> list[dict[str, Any]]:
    """The device kernels and copies that took the most time in the traced window: name
    (cut to 90 characters), count and total ms, most first (what a step's device time is
    made of, to choose what to fuse or replace)."""
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start:
            t = totals.setdefault(ev.name[:90], [0, 0.0])
            t[0] += 1
            t[1] += (ev.time_range.end - ev.time_range.start) / 1e3
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": name, "count": int(c), "total_ms": round(ms, 3)} for name, (c, ms) in rows]


def tandem_llm(folder: str, **kw: Any) -> Any:
    from tandem import LLM

    base = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=MAX_LEN, gpu_memory_utilization=0.85,
                enable_prefix_caching=False)
    base.update(kw)
    return LLM(folder, **base)


def bench_tandem(folder: str, workloads: list[str], rounds: int, vocab: int,
                 only: Optional[list[str]] = None) -> dict[str, Any]:
    from tandem import SamplingParams

    out: dict[str, Any] = {}
    modes = {"tandem_sync": dict(async_scheduling=False), "tandem_async": dict(async_scheduling=True),
             "tandem_async_eager": dict(async_scheduling=True, enforce_eager=True),
             # The worker in its own process: launches and sampling off the engine core's
             # thread (the profile sees only this process, so it has no GPU figures).
             "tandem_async_multiproc": dict(async_scheduling=True, executor="multiproc")}
    tput = prompts_of(256, 128, vocab, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for name, kw in modes.items():
        if (only and name not in only) or (not only and name == "tandem_async_multiproc"):
            continue
        try:
            out[name] = _bench_tandem_mode(folder, name, kw, workloads, rounds, vocab, tput, sp)
        except Exception as e:  # keep the other modes' numbers
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            log(f"{name}: {out[name]['error']}")
        free_cuda()
    return out


def _bench_tandem_mode(folder: str, name: str, kw: dict[str, Any], workloads: list[str], rounds: int, vocab: int,
                       tput: list[list[int]], sp: Any) -> dict[str, Any]:
    from tandem import SamplingParams

    t_build = time.perf_counter()
    llm = tandem_llm(folder, **kw)
    log(f"{name}: engine ready in {time.perf_counter() - t_build:.1f}s")
    llm.generate(tput[:16], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    res: dict[str, Any] = {}
    if "throughput" in workloads:
        runs = [run_engine(llm, tput, sp, profile_steps=(40, 100) if r == 0 else None) for r in range(rounds)]
        best = max(runs, key=lambda r: r["tok_per_s"])
        for key in ("profile", "profile_window", "steady_wall_ms_per_loop"):  # round 0 is the profiled one
            best[key] = runs[0].get(key)
        best["all_tok_per_s"] = [r["tok_per_s"] for r in runs]
        res["throughput"] = best
        log(f"{name}: throughput {best['tok_per_s']:.0f} tok/s, {best['ms_per_step']:.2f} ms/step, host "
            f"{best['host_ms_per_step']:.2f} ms/step, idle {best['profile'] and best['profile']['gpu_idle_share']}")
    if "batch1" in workloads and name != "tandem_sync":
        one = prompts_of(1, 128, vocab, seed=2)
        sp1 = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
        r = run_engine(llm, one, sp1)
        # Again, profiled: the device's busy share of 100 steady steps (the timed run is not traced).
        traced = run_engine(llm, prompts_of(1, 128, vocab, seed=5), sp1, profile_steps=(200, 300))
        for key in ("profile", "profile_window", "steady_wall_ms_per_loop"):
            r[key] = traced.get(key)
        res["batch1"] = r
        log(f"{name}: batch-1 {r['tok_per_s']:.0f} tok/s, {r['ms_per_step']:.3f} ms/step, host "
            f"{r['host_ms_per_step']:.3f} ms/step, profile {r.get('profile')}")
    if "prefill" in workloads and name == "tandem_async":
        long = prompts_of(8, 8192, vocab, seed=3)
        run_engine(llm, long[:1], SamplingParams(temperature=0, max_tokens=1))  # warm the long shapes
        r = run_engine(llm, long, SamplingParams(temperature=0, max_tokens=1))
        r["prompt_tokens"] = 8 * 8192
        res["prefill"] = r
        log(f"{name}: prefill 8x8192 in {r['wall_s']:.3f}s")
    llm.shutdown()
    return res


# -- Hugging Face ------------------------------------------------------------------------
def hf_model(folder: str, attn: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation=attn).cuda().eval()


def bench_hf_static_compiled(folder: str, prompts: list[list[int]], new_tokens: int, rounds: int) -> dict[str, Any]:
    """``generate`` with a static cache, which transformers compiles itself (torch.compile,
    "reduce-overhead": CUDA graphs) on first use; all prompts one batch (equal lengths, so
    no padding). Timed after two untimed calls that compile and warm up."""
    from transformers import GenerationConfig

    model = hf_model(folder, "sdpa")
    ids = torch.tensor(prompts, device="cuda")
    gc_ = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           cache_implementation="static", eos_token_id=None, pad_token_id=0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, generation_config=gc_)
        model.generate(ids, generation_config=gc_)
    compile_s = time.perf_counter() - t0
    walls = []
    with torch.inference_mode():
        for _ in range(rounds):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(ids, generation_config=gc_)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model
    torch._dynamo.reset()
    free_cuda()
    w = min(walls)
    return dict(wall_s=w, output_tokens=n, tok_per_s=n / w, compile_and_warmup_s=compile_s, all_walls=walls)


def bench_hf_generate_batch(folder: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    errors = []
    for attn in ("paged|sdpa", "sdpa"):
        try:
            model = hf_model(folder, attn)
            gc_ = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
            with torch.no_grad():  # generate_batch works on a thread of its own: no inference_mode tensors
                model.generate_batch(inputs=prompts[:8], generation_config=gc_, progress_bar=False)
                torch.cuda.synchronize()
                t = time.perf_counter()
                res = model.generate_batch(inputs=prompts, generation_config=gc_, progress_bar=False)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            n = sum(len(r.generated_tokens) for r in res.values())
            del model
            free_cuda()
            if n == 0:  # nothing generated: record why and try the next implementation
                errors.append(f"{attn}: no tokens generated; first result {next(iter(res.values()), None)!r}"[:600])
                continue
            return dict(wall_s=wall, output_tokens=n, tok_per_s=n / wall, attn_implementation=attn)
        except Exception as e:  # try the next attention implementation name
            errors.append(f"{attn}: {type(e).__name__}: {e}"[:300])
            free_cuda()
    return dict(error="; ".join(errors))


# -- analysis ------------------------------------------------------------------------------
def decode_bound_ms(shape: dict[str, Any], batch: int, ctx: float, bw: float) -> float:
    """Bytes a decode step must read once: every weight but the embedding (tied: the LM head
    reads it) plus the KV of every sequence, over the measured copy bandwidth."""
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * i
    weights = 2 * (L * per_layer + shape["vocab_size"] * h)
    kv_bytes = 2 * batch * ctx * L * 2 * kv * d
    return 1e3 * (weights + kv_bytes) / bw


def prefill_flops(shape: dict[str, Any], n_seqs: int, seq_len: int) -> float:
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * i
    linear = 2 * n_seqs * seq_len * L * per_layer
    attention = 2 * 2 * n_seqs * L * heads * d * seq_len * seq_len / 2  # causal QK^T and PV
    lm_head = 2 * n_seqs * shape["vocab_size"] * h  # one sampled row per prompt
    return linear + attention + lm_head


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen2.5-0.5b", help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--workloads", default="throughput,batch1,prefill")
    ap.add_argument("--systems", default="tandem,hf_static,hf_batch")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tandem-modes", default="", help="comma list of tandem_sync, tandem_async, tandem_async_eager, "
                    "tandem_async_multiproc (default: the first three)")
    ap.add_argument("--min-split-tokens", type=int, default=None,
                    help="shortest split-KV key chunk of a decode step (tandem's default: "
                         "tandem.kernels.splits.MIN_SPLIT_TOKENS)")
    ap.add_argument("--small-batch-split-tokens", type=int, default=None,
                    help="shortest split-KV key chunk of a decode batch small enough to leave most SMs idle "
                         "(tandem's default: tandem.kernels.splits.SMALL_BATCH_SPLIT_TOKENS)")
    ap.add_argument("--decode-tile-n", type=int, default=None,
                    help="key tile of decode attention launches (tandem.kernels.attention.DECODE_TILE_N)")
    ap.add_argument("--no-gemv-unroll", action="store_true",
                    help="tandem.kernels.gemv.UNROLL_K off (on by default; the in-process engines read it at "
                         "launch)")
    ap.add_argument("--no-gemv-rope", action="store_true",
                    help="tandem.kernels.gemv.FUSE_ROPE off: a separate rotary + KV-write kernel after the QKV "
                         "GEMV (on by default)")
    ap.add_argument("--fused-merge", action="store_true",
                    help="tandem.kernels.attention.FUSED_MERGE on: split-KV partials merged by the last split, "
                         "not by a second kernel")
    ap.add_argument("--out", default="gpu_bench.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA device", file=sys.stderr)
        return 2
    if a.fused_merge:
        from tandem.kernels import attention

        attention.FUSED_MERGE = True
    if a.no_gemv_unroll or a.no_gemv_rope:
        from tandem.kernels import gemv

        gemv.UNROLL_K = gemv.UNROLL_K and not a.no_gemv_unroll
        gemv.FUSE_ROPE = gemv.FUSE_ROPE and not a.no_gemv_rope
    if a.min_split_tokens is not None:  # read by each model runner as it is built
        import tandem.worker.model_runner as model_runner

        model_runner.MIN_SPLIT_TOKENS = a.min_split_tokens
    if a.small_batch_split_tokens is not None:
        import tandem.worker.model_runner as model_runner

        model_runner.SMALL_BATCH_SPLIT_TOKENS = a.small_batch_split_tokens
    if a.decode_tile_n is not None:
        from tandem.kernels import attention

        attention.DECODE_TILE_N = a.decode_tile_n
    logging.basicConfig(level=logging.WARNING)
    workloads = a.workloads.split(",")
    systems = a.systems.split(",")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "min_split_tokens": a.min_split_tokens,
                              "small_batch_split_tokens": a.small_batch_split_tokens, "decode_tile_n": a.decode_tile_n,
                              "fused_merge": a.fused_merge, "ceilings": measure_ceilings(), "shapes": {}}
    log(f"ceilings: {result['ceilings']}")
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        folder = build_model(tempfile.mkdtemp(prefix=f"tandem-{name}-"), shape)
        log(f"built {name}")
        row: dict[str, Any] = {}
        result["shapes"][name] = row

        def save() -> None:
            analyse(row, shape, result["ceilings"])
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1, default=str)

        def attempt(key: str, wl: str, fn: Any) -> None:
            """One system's run; an error is recorded, not fatal, and the JSON is saved."""
            try:
                row.setdefault(key, {})[wl] = fn()
            except Exception as e:  # keep the other systems' numbers
                row.setdefault(key, {})[wl] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            log(f"{key} {wl}: {row[key][wl].get('tok_per_s', row[key][wl].get('error'))}")
            save()

        if "tandem" in systems:
            row.update(bench_tandem(folder, workloads, a.rounds, shape["vocab_size"],
                                   a.tandem_modes.split(",") if a.tandem_modes else None))
            save()
        tput = prompts_of(256, 128, shape["vocab_size"], seed=1)
        if "hf_batch" in systems and "throughput" in workloads:
            attempt("hf_generate_batch", "throughput", lambda: bench_hf_generate_batch(folder, tput, 128))
        if "hf_static" in systems and "throughput" in workloads:
            attempt("hf_static_compiled", "throughput", lambda: bench_hf_static_compiled(folder, tput, 128, a.rounds))
        if "hf_static" in systems and "batch1" in workloads:
            one = prompts_of(1, 128, shape["vocab_size"], seed=2)
            attempt("hf_static_compiled", "batch1", lambda: bench_hf_static_compiled(folder, one, 512, 1))
    print_table(result)
    return 0


def analyse(row: dict[str, Any], shape: dict[str, Any], ceilings: dict[str, float]) -> None:
    bw, peak = ceilings["copy_bytes_per_s"], ceilings["bf16_flops_per_s"]
    for name in ("tandem_sync", "tandem_async", "tandem_async_eager"):
        t = row.get(name, {}).get("throughput")
        if t and t.get("profile") and t.get("profile_window"):
            bound = decode_bound_ms(shape, 256, 128 + 64, bw)  # mean context over the decode phase
            busy_per_step = t["profile"]["gpu_busy_ms"] / max(1, t["profile_window"][1] - t["profile_window"][0])
            t["hbm_bound_ms"] = bound
            t["gpu_busy_ms_per_step"] = busy_per_step
            t["step_over_bound"] = t["steady_wall_ms_per_loop"] / bound
    p = row.get("tandem_async", {}).get("prefill")
    if p:
        p["mfu"] = prefill_flops(shape, 8, 8192) / p["wall_s"] / peak
    a = row.get("tandem_async", {}).get("throughput", {}).get("tok_per_s")
    s = row.get("tandem_sync", {}).get("throughput", {}).get("tok_per_s")
    hs = row.get("hf_static_compiled", {}).get("throughput", {}).get("tok_per_s")
    hb = row.get("hf_generate_batch", {}).get("throughput", {}).get("tok_per_s")
    row["ratios"] = {"async_over_sync": a / s if a and s else None,
                     "async_over_hf_static_compiled": a / hs if a and hs else None,
                     "async_over_hf_generate_batch": a / hb if a and hb else None}


def print_table(result: dict[str, Any]) -> None:
    for name, row in result["shapes"].items():
        print(f"\n== {name}")
        for sys_name, r in row.items():
            if sys_name == "ratios":
                continue
            for wl, v in r.items():
                if isinstance(v, dict) and "tok_per_s" in v:
                    extra = ""
                    if v.get("profile"):
                        extra = (f" idle={v['profile']['gpu_idle_share']:.3f}"
                                 f" steady={v['steady_wall_ms_per_loop']:.2f}ms"
                                 f" bound={v.get('hbm_bound_ms', 0):.2f}ms"
                                 f" busy/step={v.get('gpu_busy_ms_per_step', 0):.2f}ms")
                    if "mfu" in v:
                        extra += f" mfu={v['mfu']:.3f}"
                    host = f" host={v['host_ms_per_step']:.2f}ms/step" if "host_ms_per_step" in v else ""
                    print(f"{sys_name:22s} {wl:10s} {v['tok_per_s']:10.0f} tok/s{host}{extra}")
                    if v.get("profile") and v.get("profile_window"):
                        steps = v["profile_window"][1] - v["profile_window"][0]
                        for k in v["profile"].get("top_kernels", [])[:12]:
                            print(f"    {k['total_ms'] / steps * 1e3:8.1f} us/step {k['count'] / steps:5.1f}/step  "
                                  f"{k['name'][:80]}")
        print("ratios:", row.get("ratios"))


if __name__ == "__main__":
    sys.exit(main())
