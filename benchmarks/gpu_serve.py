"""Serving at engine speed, on the GPU: ``tandem serve`` against offline ``LLM.generate`` of
the same engine config, in one run.

The model is random bf16 weights with a real shape (``--shape``), built on the device. Both
sides use the same engine flags (``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192,
prefix caching off), token-id prompts of ``--input-len`` random tokens and
``--output-len`` greedy output tokens with ``ignore_eos``, fresh prompts every round.

* offline: ``LLM.generate`` of 256 requests, an untimed round first, median of
  ``--offline-rounds``; then the same with the engine's default ``max_num_seqs`` /
  ``max_num_batched_tokens`` (the device defaults), one round after a warm-up;
* served: for each ``--api-server-counts`` entry, a real ``tandem serve`` process driven by
  ``--clients`` ``tandem bench serve`` processes side by side (one Python client cannot
  parse tens of thousands of SSE chunks a second), ``--num-prompts`` requests in all at
  ``--concurrency`` streams in all, after a warm-up round; the CPU share of every server
  process (launcher, API servers, engine core) is sampled each second with psutil.

Output tokens/s of a served run is all clients' output tokens over the wall time from the
first client's start to the last client's end. Prints a table; writes JSON (``--out``).

    python benchmarks/gpu_serve.py --shape qwen2.5-0.5b --api-server-counts 1,auto,2,4 --out serve.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_common  # noqa: E402
from gpu_bench import SHAPES, build_model, free_cuda, log  # noqa: E402

ENGINE = dict(max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=False, max_model_len=2048,
              gpu_memory_utilization=0.85)
VOCAB_FOR_PROMPTS = 1000  # the benchmark tokenizer's words t0..t999 (any id below the model's vocabulary works)


def prompts_of(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB_FOR_PROMPTS) for _ in range(length)] for _ in range(n)]


# -- offline -----------------------------------------------------------------------------
def offline(folder: str, args: argparse.Namespace, engine: dict[str, Any], rounds: int) -> dict[str, Any]:
    from tandem import LLM, SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with LLM(folder, **engine) as llm:
        llm.generate(prompts_of(256, args.input_len, 999), sp, use_tqdm=False)  # untimed: compile, warm
        runs = []
        for r in range(rounds):
            prompts = prompts_of(256, args.input_len, 1000 + r)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            log(f"offline {engine.get('max_num_seqs', 'default')}: round {r + 1} {runs[-1]:.0f} tok/s")
        resolved = {k: getattr(llm.engine.model_config, k) for k in ("max_num_seqs", "max_num_batched_tokens")}
    del llm
    free_cuda()
    left = torch_reserved_gib()
    if left > 1.0:  # the served runs that follow would get a smaller KV cache than the offline one
        log(f"warning: {left:.1f} GiB of device memory still reserved after the offline engine shut down")
    return {"tok_per_s": statistics.median(runs), "rounds": runs, "engine": engine, "resolved": resolved}


def torch_reserved_gib() -> float:
    import torch

    return torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0


# -- served ------------------------------------------------------------------------------
def start_server(folder: str, count: str, log_path: str, **engine: Any) -> tuple[subprocess.Popen, int]:
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--no-{k.replace('_', '-')}" if v is False
             else f"--{k.replace('_', '-')}={v}" for k, v in {**ENGINE, **engine}.items()]
    proc, url = serve_common.start_server(folder, ["--api-server-count", count, *flags], log_path)
    return proc, int(url.rsplit(":", 1)[1])


def stop_server(proc: subprocess.Popen) -> Any:
    code = serve_common.stop_server(proc)
    return "killed" if code < 0 else code


def server_processes(launcher: int) -> dict[str, Any]:
    import psutil

    root = psutil.Process(launcher)
    procs: dict[str, Any] = {"launcher": root}
    n = 0
    for p in root.children(recursive=True):
        cmd = " ".join(p.cmdline())
        if "core_process" in cmd:
            procs["engine_core"] = p
        elif "server_process" in cmd:
            n += 1
            procs[f"api_server_{n}"] = p
        elif "worker_process" in cmd:
            procs[f"worker_{p.pid}"] = p
    return procs


class CpuSampler:
    """CPU % of each process, sampled every second while running."""

    def __init__(self, procs: dict[str, Any]) -> None:
        self.procs = procs
        self.samples: dict[str, list[float]] = {k: [] for k in procs}
        self._stop = threading.Event()
        for p in procs.values():
            p.cpu_percent(None)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for k, p in self.procs.items():
                try:
                    self.samples[k].append(p.cpu_percent(None))
                except Exception:
                    pass

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {k: {"mean": statistics.mean(v) if v else None, "max": max(v) if v else None}
                for k, v in self.samples.items()}


def physical_cores(cpus: list[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (hyperthread siblings together), in order."""
    groups: dict[str, list[int]] = {}
    for c in cpus:
        try:
            key = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            key = str(c)
        groups.setdefault(key, []).append(c)
    return list(groups.values())


def pin_server(procs: dict[str, Any], core_cpus: int) -> dict[str, Any]:
    """Give the engine core (every thread) one hyperthread of each of the first ``core_cpus``
    physical cores of this process's affinity, leave those cores' sibling hyperthreads idle,
    and give the rest of ``procs`` (``server_processes``: launcher, API servers) and, through
    this process's own affinity, the bench clients started later the remaining cores: the
    experiment that tells whether sharing cores (with other processes, or the engine thread
    with its own fill thread on sibling hyperthreads) slows the engine thread. Threads
    started later inherit their creator's set."""
    cores = physical_cores(sorted(os.sched_getaffinity(0)))
    if not 0 < core_cpus < len(cores):
        raise ValueError(f"--pin-core-cpus {core_cpus}: this host has {len(cores)} physical cores")
    core = [c[0] for c in cores[:core_cpus]]
    rest = [x for c in cores[core_cpus:] for x in c]
    for name, p in procs.items():
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            os.sched_setaffinity(int(tid), core if name == "engine_core" else rest)
    os.sched_setaffinity(0, rest)
    return {"engine_core": core, "others": rest, "physical_cores": cores}


def isolate_engine_thread(procs: dict[str, Any], cpu: int) -> dict[str, Any]:
    """Give the engine thread (the engine core's main thread) ``cpu`` alone, and keep its
    hidden hyperthread sibling (``cpu_siblings.find_sibling``: a VM may show every vCPU as
    a core) idle: every other thread of the server, the engine core's own fill thread
    included, and the bench clients started later run on the remaining CPUs. Done after
    the warm-up, which starts the engine core's threads (a thread inherits its creator's
    set). Tells whether what shares the engine thread's physical core slows it."""
    from cpu_siblings import find_sibling

    sibling = find_sibling(cpu)
    rest = [c for c in sorted(os.sched_getaffinity(0)) if c not in (cpu, sibling)]
    core_pid = procs["engine_core"].pid
    for p in procs.values():
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            os.sched_setaffinity(int(tid), [cpu] if int(tid) == core_pid else rest)
    os.sched_setaffinity(0, rest)
    return {"engine_thread": cpu, "sibling_left_idle": sibling, "others": rest}


def collect_step_trace(tmp: str, out: Any, tag: str) -> dict[str, Any]:
    """The engine core's step trace of the server just stopped (``--step-trace``): its
    summary, printed, and the file kept beside ``out``."""
    from step_trace_summary import summarize

    files = sorted(Path(tmp).glob("step-trace.*.jsonl"))
    if not files:
        return {}
    events = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    if out:
        shutil.copy(files[-1], f"{os.path.splitext(out)[0]}_steptrace_{tag}.jsonl")
    for f in files:
        f.unlink()
    res = summarize(events)
    for name, ph in res.get("phases", {}).items():
        log(f"step trace {name}: {ph['count']} spans, median {ph['median_ms']:.3f} ms, mean {ph['mean_ms']:.3f} ms "
            f"(CPU {ph['mean_cpu_ms']:.3f} ms, switches {ph['mean_vcsw']:.2f} voluntary / {ph['mean_ivcsw']:.2f} "
            f"involuntary), share {ph['share']:.1%}")
    for name, t in res.get("threads", {}).items():
        log(f"step trace thread {name}: CPU {t['cpu_ms']:.0f} of {t['wall_ms']:.0f} ms, {t['vcsw']} voluntary and "
            f"{t['ivcsw']} involuntary switches")
    if "step_cycle_ms" in res:
        log(f"step trace cycle: median {res['step_cycle_ms']['median']:.3f} ms")
    return res


def core_step_counters(port: int) -> dict[str, float]:
    """The engine core's step counters from /metrics (steps launched, steps with prompt
    tokens beyond one per request); a round's difference tells how many of its steps could
    not run a decode graph."""
    import httpx

    names = ("tandem:engine_steps_launched_total", "tandem:engine_prefill_steps_total")
    out: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        if line.startswith(names):
            labelled, _, value = line.rpartition(" ")
            name = labelled.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def run_clients(port: int, args: argparse.Namespace, num_prompts: int, seed: int, tmp: str,
                structured_ratio: float = 0.0) -> dict[str, Any]:
    """``--clients`` ``tandem bench serve`` processes at once; their results summed."""
    k = args.clients
    procs, files = [], []
    t0 = time.time()
    for i in range(k):
        out = os.path.join(tmp, f"client-{seed}-{i}-{structured_ratio:g}.json")
        files.append(out)
        cmd = [sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve", "--port", str(port),
               "--num-prompts", str(num_prompts // k), "--max-concurrency", str(args.concurrency // k),
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--random-vocab-size", str(VOCAB_FOR_PROMPTS), "--seed", str(seed * 100 + i), "--ignore-eos",
               "--temperature", "0", "--no-warmup", "--disable-tqdm", "--save-result", "--result-dir", tmp,
               "--result-filename", os.path.basename(out)]
        if structured_ratio:
            cmd += ["--structured-output-ratio", str(structured_ratio)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    errs = [p.communicate(timeout=1200)[1].decode(errors="replace") for p in procs]
    wall = time.time() - t0
    results = []
    for f, err in zip(files, errs):
        if not os.path.exists(f):
            raise RuntimeError(f"a bench client wrote no result:\n{err[-2000:]}")
        results.append(json.loads(Path(f).read_text()))
    metrics = [r["metrics"] for r in results]
    out_tokens = sum(m["total_output_tokens"] for m in metrics)
    duration = max(m["duration_s"] for m in metrics)

    def mean_of(key: str) -> float:
        n = sum(m[key]["count"] for m in metrics)
        return sum(m[key]["mean"] * m[key]["count"] for m in metrics) / n if n else 0.0

    return {"output_tok_per_s": out_tokens / duration, "output_tokens": out_tokens, "duration_s": duration,
            "wall_s_with_client_start": wall, "failed": sum(m["failed"] for m in metrics),
            "completed": sum(m["completed"] for m in metrics), "mean_ttft_ms": mean_of("ttft_ms"),
            "mean_tpot_ms": mean_of("tpot_ms"), "p99_ttft_ms": max(m["ttft_ms"]["p99"] for m in metrics)}


def served(folder: str, count: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    log_path = os.path.join(tmp, f"server-{count}.log")
    t0 = time.perf_counter()
    proc, port = start_server(folder, count, log_path)
    res: dict[str, Any] = {"api_server_count": count, "start_s": time.perf_counter() - t0}
    try:
        procs = server_processes(proc.pid)
        res["processes"] = sorted(procs)
        res["rss_mib"] = {k: p.memory_info().rss / 2**20 for k, p in procs.items()}
        run_clients(port, args, max(args.clients * 8, 256), 1, tmp)  # warm-up round
        sampler = CpuSampler(procs)
        res.update(run_clients(port, args, args.num_prompts, 2, tmp))
        res["cpu_percent"] = sampler.stop()
    finally:
        res["exit_code"] = stop_server(proc)
        text = Path(log_path).read_text()
        res["log_tail"] = text[-1500:]
        res["ready_lines"] = [line for line in text.splitlines() if " ready in " in line]
    log(f"serve --api-server-count {count}: {res['output_tok_per_s']:.0f} tok/s, TTFT {res['mean_ttft_ms']:.0f} ms, "
        f"TPOT {res['mean_tpot_ms']:.2f} ms, failed {res['failed']}, cpu {json.dumps(res['cpu_percent'])}")
    return res


def engine_core_pid(server_pid: int) -> int:
    """The engine core among the server's descendants: the one holding the model (largest RSS)."""
    import psutil

    kids = psutil.Process(server_pid).children(recursive=True)
    return max(kids, key=lambda k: k.memory_info().rss).pid


def structured_runs(folder: str, count: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """``structured_run`` for each of ``--structured-sampling`` x ``--fill-threads``, one
    server each, in turn; the first one's result is the top level (the table), every one's
    under ``by_variant`` ("gated/1", "split/1", ...)."""
    variants = [(m, int(n)) for m in args.structured_sampling.split(",") for n in args.fill_threads.split(",")]
    results = {f"{m}/{n}": structured_run(folder, count, args, tmp, n, m) for m, n in variants}
    out = dict(results[f"{variants[0][0]}/{variants[0][1]}"])
    if len(variants) > 1:
        out["by_variant"] = results
    return out


def structured_run(folder: str, count: str, args: argparse.Namespace, tmp: str, fill_threads: int,
                   sampling: str = "auto") -> dict[str, Any]:
    """One server (``--structured-outputs-fill-threads fill_threads``,
    ``--structured-outputs-sampling sampling``); the same served
    workload with a share of JSON-schema requests, for each of ``--structured-ratios`` (bench
    serve's default schema never closes, so every token of a constrained request is under
    the grammar and every request has the same length), ``--structured-rounds`` rounds of
    them interleaved, so that a drift of the host reaches every share alike; a run takes
    seconds, and one server's unconstrained runs varied by 7% on an H100 host."""
    log_path = os.path.join(tmp, f"server-structured-{count}-{sampling}-{fill_threads}.log")
    proc, port = start_server(folder, count, log_path, structured_outputs_fill_threads=fill_threads,
                              structured_outputs_sampling=sampling)
    out: dict[str, Any] = {"api_server_count": count, "fill_threads": fill_threads, "sampling": sampling,
                           "runs": {}}
    try:
        procs = server_processes(proc.pid)
        if args.pin_core_cpus:
            out["pinned"] = pin_server(procs, args.pin_core_cpus)
        ratios = [float(r) for r in args.structured_ratios.split(",")]
        for r in ratios:  # warm-up: compile the grammar kernels and the schema once
            run_clients(port, args, max(args.clients * 8, 256), 3, tmp, structured_ratio=r)
        if args.isolate_engine_thread is not None:
            out["isolated"] = isolate_engine_thread(procs, args.isolate_engine_thread)
            log(f"engine thread isolated: {out['isolated']}")
        rounds: dict[str, list[dict[str, Any]]] = {f"{r:g}": [] for r in ratios}
        for rnd in range(args.structured_rounds):  # the ratios interleaved, round after round
            for r in ratios:
                spy = None
                if rnd == 0 and args.profile_core_ratio is not None and abs(r - args.profile_core_ratio) < 1e-9:
                    from api_server_cpu import start_profile

                    spy_path = os.path.join(tmp, "core.pyspy")
                    spy = start_profile(engine_core_pid(proc.pid), spy_path,
                                        extra=["--threads", "--gil" if args.profile_core_gil else "--idle",
                                               "--nonblocking"])
                sampler = CpuSampler(procs)
                steps0 = core_step_counters(port)
                res = run_clients(port, args, args.num_prompts, 4, tmp, structured_ratio=r)
                res["cpu_percent"] = sampler.stop()
                steps1 = core_step_counters(port)
                res["engine_steps"] = {k.split(":")[1]: v - steps0.get(k, 0.0) for k, v in steps1.items()}
                if spy is not None:
                    from api_server_cpu import stop_profile

                    print(f"--- py-spy of the engine core, constrained share {r:g} ---", file=sys.stderr)
                    stop_profile(spy, spy_path, top=45)
                    if args.out:  # the raw stacks, per thread, for a closer look
                        shutil.copy(spy_path, f"{os.path.splitext(args.out)[0]}_core_r{r:g}.pyspy")
                rounds[f"{r:g}"].append(res)
                cpu = res["cpu_percent"]
                api = [v["mean"] for k, v in cpu.items() if k.startswith("api_server") and v["mean"] is not None]
                log(f"structured share {r:g}, {sampling} sampling, {fill_threads} fill threads, round {rnd}: "
                    f"{res['output_tok_per_s']:.0f} tok/s, TPOT {res['mean_tpot_ms']:.2f} ms, failed {res['failed']}, "
                    f"CPU% engine core {cpu.get('engine_core', {}).get('mean') or 0:.0f}, "
                    f"API servers {statistics.mean(api) if api else 0:.0f} each, steps "
                    f"{res['engine_steps'].get('engine_steps_launched_total', 0):.0f} (with prompt tokens "
                    f"{res['engine_steps'].get('engine_prefill_steps_total', 0):.0f})")
        for key, runs in rounds.items():  # each share's median round (by throughput) stands for it
            ranked = sorted(runs, key=lambda x: x["output_tok_per_s"])
            out["runs"][key] = dict(ranked[(len(ranked) - 1) // 2],
                                    all_tok_per_s=[x["output_tok_per_s"] for x in runs])
    finally:
        out["exit_code"] = stop_server(proc)
        if args.step_trace:
            out["step_trace"] = collect_step_trace(tmp, args.out, f"{count}-{sampling}-{fill_threads}")
        text = Path(log_path).read_text()
        out["log_tail"] = text[-3000:]
        out["ready_lines"] = [line for line in text.splitlines() if " ready in " in line]  # RSS, torch imported?
    base = out["runs"].get("0", {}).get("output_tok_per_s")
    if base:
        out["relative_to_unconstrained"] = {k: v["output_tok_per_s"] / base for k, v in out["runs"].items()}
    return out


def guidellm_run(folder: str, count: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """guidellm (if installed) against ``--api-server-count count``: 64 streams, 512 requests,
    synthetic prompts of ``--input-len`` tokens, ``--output-len`` output tokens; its console report."""
    import importlib.util

    if importlib.util.find_spec("guidellm") is None:
        return {"error": "guidellm is not installed"}
    log_path = os.path.join(tmp, f"server-guidellm-{count}.log")
    proc, port = start_server(folder, count, log_path)
    try:
        cmd = [sys.executable, "-m", "guidellm", "run", "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},request_format=/v1/completions",
               "--profile", "kind=concurrent,streams=64", "--tokenizer", f"kind=huggingface_auto,model={folder}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
               "--constraint", "kind=max_requests,count=512", "--output", "kind=console"]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        res = {"api_server_count": count, "command": " ".join(cmd), "returncode": run.returncode,
               "wall_s": time.perf_counter() - t0, "stdout_tail": run.stdout[-6000:], "stderr_tail": run.stderr[-3000:]}
    finally:
        stop_server(proc)
    log(f"guidellm against --api-server-count {count}: exit {res['returncode']} in {res['wall_s']:.0f} s")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--api-server-counts", default="1,auto,2,4")
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--offline-rounds", type=int, default=3)
    p.add_argument("--skip-default-config", action="store_true")
    p.add_argument("--skip-offline", action="store_true", help="served runs only (ratios are then not computed)")
    p.add_argument("--guidellm-count", default=None, help="also run guidellm against this --api-server-count")
    p.add_argument("--structured-ratios", default=None, metavar="R,R,...",
                   help="also serve with these shares of JSON-schema requests (e.g. 0,0.2,0.8,1)")
    p.add_argument("--structured-rounds", type=int, default=1,
                   help="structured runs: rounds of every share, interleaved; each share's median round is reported")
    p.add_argument("--fill-threads", default="1", metavar="N,N,...",
                   help="structured runs: a server per --structured-outputs-fill-threads value, same host")
    p.add_argument("--structured-sampling", default="auto", metavar="MODE,MODE,...",
                   help="structured runs: a server per --structured-outputs-sampling value (auto, gated, split)")
    p.add_argument("--structured-count", default="auto", help="--api-server-count of the structured runs")
    p.add_argument("--pin-core-cpus", type=int, default=0, metavar="N",
                   help="structured runs: the engine core on N physical cores of its own (one hyperthread each, the "
                        "siblings idle), the API servers and clients on the rest")
    p.add_argument("--isolate-engine-thread", type=int, default=None, metavar="CPU",
                   help="structured runs: the engine thread alone on CPU, its hidden hyperthread sibling (probed) "
                        "idle, everything else on the other CPUs")
    p.add_argument("--step-trace", action="store_true",
                   help="structured runs: the engine core records its step timeline (TANDEM_STEP_TRACE); each "
                        "server's is summarized (step_trace_summary.py) and kept beside --out")
    p.add_argument("--fake-grammar", action="store_true",
                   help="structured runs: the servers' engine cores skip xgrammar's native work (every token "
                        "allowed and accepted; benchmarks/fake_grammar): the constrained path's own cost")
    p.add_argument("--profile-core-ratio", type=float, default=None, metavar="R",
                   help="py-spy the engine core (all threads) during the structured run of share R")
    p.add_argument("--profile-core-gil", action="store_true",
                   help="with --profile-core-ratio: only samples that hold the GIL (py-spy --gil), not idle ones; "
                        "a thread's own Python work, without its waits for the GIL")
    p.add_argument("--tokenizer-from", default=None, metavar="DIR",
                   help="copy this tokenizer into the model folder (a byte-level one, so grammars can spell JSON); "
                        "the model's vocabulary becomes the tokenizer's size")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, few requests: checks this script")
    args = p.parse_args()
    logging_quiet()
    if args.smoke:
        smoke_setup(args)

    result: dict[str, Any] = {"args": vars(args), "shape": SHAPES[args.shape], "engine": ENGINE}
    with tempfile.TemporaryDirectory() as tmp:
        if args.step_trace:  # the servers started below inherit it; their engine cores write there
            os.environ["TANDEM_STEP_TRACE"] = os.path.join(tmp, "step-trace")
        if args.fake_grammar:  # (the servers' processes run benchmarks/fake_grammar/sitecustomize.py)
            inject = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_grammar")
            os.environ["PYTHONPATH"] = os.pathsep.join([inject, *filter(None, [os.environ.get("PYTHONPATH")])])
            os.environ["TANDEM_BENCH_FAKE_GRAMMAR"] = "1"
        shape = dict(SHAPES[args.shape])
        if args.tokenizer_from:
            shape["vocab_size"] = tokenizer_vocab(args.tokenizer_from)
            result["shape"] = shape
        folder = build_model(os.path.join(tmp, "model"), shape)
        if args.tokenizer_from:
            use_tokenizer(folder, args.tokenizer_from)
        result["offline_tuned"] = ({"tok_per_s": float("nan"), "rounds": []} if args.skip_offline
                                   else offline(folder, args, ENGINE, args.offline_rounds))
        if not (args.skip_default_config or args.skip_offline):
            default = {k: v for k, v in ENGINE.items() if k not in ("max_num_seqs", "max_num_batched_tokens")}
            result["offline_default"] = offline(folder, args, default, args.offline_rounds)
        result["served"] = []
        for count in [c for c in args.api_server_counts.split(",") if c]:
            try:
                result["served"].append(served(folder, count, args, tmp))
            except Exception as e:
                result["served"].append({"api_server_count": count, "error": f"{type(e).__name__}: {e}"[:3000]})
                log(f"serve {count}: {result['served'][-1]['error']}")
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2))
        if args.structured_ratios:
            result["structured"] = structured_runs(folder, args.structured_count, args, tmp)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2))
        if args.guidellm_count:
            result["guidellm"] = guidellm_run(folder, args.guidellm_count, args, tmp)
            print(result["guidellm"].get("stdout_tail", result["guidellm"].get("error", ""))[-4000:])
    offline_tps = result["offline_tuned"]["tok_per_s"]
    print_table(result, offline_tps)
    if "structured" in result:
        print("| constrained share | tok/s | / unconstrained | TPOT ms | failed |\n|---|---|---|---|---|")
        for n, st in result["structured"].get("by_variant", {"": result["structured"]}).items():
            rel = st.get("relative_to_unconstrained", {})
            for k, v in st["runs"].items():
                print(f"| {k}{f' ({n}: sampling / fill threads)' if n else ''} | {v['output_tok_per_s']:.0f} | "
                      f"{rel.get(k, float('nan')):.3f} | {v['mean_tpot_ms']:.2f} | {v['failed']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def smoke_setup(args: argparse.Namespace) -> None:
    """Tiny shapes and counts so the whole script runs on a CPU in a minute or two."""
    import gpu_bench

    SHAPES["smoke"] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True)
    args.shape, args.num_prompts, args.concurrency, args.clients = "smoke", 64, 16, 2
    args.input_len, args.output_len, args.offline_rounds = 16, 16, 1
    ENGINE.update(max_num_seqs=16, max_model_len=256, num_kv_blocks=256)
    ENGINE.pop("gpu_memory_utilization")
    globals()["build_model"] = lambda folder, shape: gpu_bench.build_model(folder, shape, device="cpu")
    globals()["free_cuda"] = lambda: None


def tokenizer_vocab(folder: str) -> int:
    from tandem.tokenizer import load_tokenizer

    return len(load_tokenizer(folder))


def use_tokenizer(model_folder: str, tokenizer_folder: str) -> None:
    """Replace the model folder's tokenizer with the one in ``tokenizer_folder``."""
    import glob
    import shutil

    for f in glob.glob(os.path.join(model_folder, "tokenizer*")) + glob.glob(os.path.join(model_folder, "special*")):
        os.remove(f)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        src = os.path.join(tokenizer_folder, name)
        if os.path.exists(src):
            shutil.copy(src, model_folder)


def logging_quiet() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)


def print_table(result: dict[str, Any], offline_tps: float) -> None:
    print(f"\noffline (tuned): {offline_tps:.0f} tok/s {result['offline_tuned']['rounds']}")
    if "offline_default" in result:
        d = result["offline_default"]
        print(f"offline (device defaults {d['resolved']}): {d['tok_per_s']:.0f} tok/s = "
              f"{d['tok_per_s'] / offline_tps:.3f}x tuned")
    print("| api servers | tok/s | / offline | TTFT ms | TPOT ms | failed | CPU% (mean) |")
    print("|---|---|---|---|---|---|---|")
    for r in result["served"]:
        if "error" in r:
            print(f"| {r['api_server_count']} | error: {r['error'][:200]} |")
            continue
        cpu = ", ".join(f"{k} {v['mean']:.0f}" for k, v in r["cpu_percent"].items()
                        if v["mean"] is not None and not k.startswith("worker"))
        print(f"| {r['api_server_count']} | {r['output_tok_per_s']:.0f} | {r['output_tok_per_s'] / offline_tps:.3f} | "
              f"{r['mean_ttft_ms']:.0f} | {r['mean_tpot_ms']:.2f} | {r['failed']} | {cpu} |")


if __name__ == "__main__":
    sys.exit(main())
