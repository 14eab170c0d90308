"""tandem async scheduling on vs off: same model, same prompts, one process, interleaved rounds.

One engine per mode is built side by side (``async_scheduling=True`` / ``False``; everything
else equal) and all run the same workload as ``offline_throughput.py`` (per-prompt
input/output lengths drawn with a fixed seed, greedy, ignore EOS). Rounds alternate the
order (A S, S A, A S, ...) so drift in machine load hits every mode alike, after an untimed
full round of each (``--warmup-rounds``).

Per mode (median over rounds): wall time, generated tokens/s, engine steps (launched
batches, from ``engine.core.stats``), mean wall time per step, process CPU time per step
(``time.process_time`` delta / steps: all threads, i.e. forward + host work) and main-thread
CPU time per step (``time.thread_time`` of the thread that calls ``generate``; with the
uniproc executor the forward runs inline there), and for async the launched-ahead fraction
(``num_launched_ahead / num_launched``: steps scheduled while an earlier one was still in
flight), and the scheduled / dropped token counts (a dropped token was computed for a request
that had already finished: async's cost of scheduling before the previous step's tokens are
known). Also checks that both modes produce identical token ids (they must).

The two modes are the engine defaults with ``async_scheduling`` on / off. On the CPU the
uniproc executor runs each step inline, so ``async`` schedules step N+1 before it applies
step N's tokens but the forward itself is still synchronous; ``--executor multiproc`` runs
the forward in a worker process, which async then overlaps with the engine's host work.

``--isolate`` runs each mode's engine in its own worker process (spawned once, rounds still
interleaved, the other idle while one runs), so neither engine's threads (a multiproc
executor's reader, OpenMP teams) share a process with the other's. Without it, both
engines share this process.

    python benchmarks/async_vs_sync.py --num-prompts 32 --rounds 3 --json-out out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = bc.script_parser(__doc__)
    ap.add_argument("--cpu-kv-cache-gib", type=float, default=0.5, help="KV cache of each engine on the CPU")
    ap.add_argument("--isolate", action="store_true", help="one worker process per mode")
    ap.add_argument("--executor", default="auto", choices=("auto", "uniproc", "multiproc", "ray"),
                    help="tandem executor of every engine (multiproc: the forward runs in a worker process, "
                         "so async overlaps it with the engine's host work even on the CPU)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed full rounds of each mode first")
    return ap


def run_once(llm: Any, prompts: list[list[int]], params: list[Any], device: str) -> tuple[dict[str, float], list]:
    core = llm.engine.core
    ss = core.scheduler.stats
    l0, a0, s0 = core.stats.num_launched, core.stats.num_launched_ahead, ss.num_steps
    t0_sched, d0 = ss.num_scheduled_tokens, ss.num_dropped_tokens
    bc.sync_device(device)
    c0, th0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    bc.sync_device(device)
    wall, cpu, th = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - th0
    steps = core.stats.num_launched - l0
    assert steps == core.scheduler.stats.num_steps - s0
    ahead = core.stats.num_launched_ahead - a0
    toks = [list(o.outputs[0].token_ids) for o in outs]
    return {"wall_s": wall, "cpu_s": cpu, "main_thread_cpu_s": th, "steps": steps, "ahead": ahead,
            "scheduled_tokens": ss.num_scheduled_tokens - t0_sched, "dropped_tokens": ss.num_dropped_tokens - d0}, toks


def build_engine(mode: str, model: Any, common: dict[str, Any]) -> Any:
    from tandem import LLM

    return LLM(model=model, async_scheduling=(mode == "async"), **common)


def make_params(output_lens: list[int], detokenize: bool) -> tuple[list[Any], Any]:
    from tandem import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=detokenize)
              for n in output_lens]
    return params, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class InProcRunner:
    """An engine in this process."""

    def __init__(self, mode: str, model: Any, common: dict[str, Any], wl: Any, detokenize: bool) -> None:
        self.llm = build_engine(mode, model, common)
        self.prompts, self.device = wl.prompts, common["device"]
        self.params, warm = make_params(wl.output_lens, detokenize)
        self.llm.generate(self.prompts[:4], warm, use_tqdm=False)

    def run(self) -> tuple[dict[str, float], list]:
        return run_once(self.llm, self.prompts, self.params, self.device)

    def close(self) -> None:
        self.llm.shutdown()


def _worker_main(conn: Any, mode: str, model: Any, common: dict[str, Any], prompts: list[list[int]],
                 output_lens: list[int], detokenize: bool) -> None:
    try:
        llm = build_engine(mode, model, common)
        params, warm = make_params(output_lens, detokenize)
        llm.generate(prompts[:4], warm, use_tqdm=False)
        conn.send(("ready", None))
        while conn.recv() == "run":
            conn.send(("ok", run_once(llm, prompts, params, common["device"])))
        llm.shutdown()
    except BaseException as e:  # report instead of leaving the parent waiting
        conn.send(("error", repr(e)))
        raise


class SubprocRunner:
    """An engine in its own (spawned) worker process, driven over a pipe."""

    def __init__(self, mode: str, model: Any, common: dict[str, Any], wl: Any, detokenize: bool) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, name=f"bench-{mode}", daemon=True,
                                args=(child, mode, model, common, wl.prompts, wl.output_lens, detokenize))
        self.proc.start()
        self._expect("ready")

    def _expect(self, tag: str) -> Any:
        kind, payload = self.conn.recv()
        if kind != tag:
            raise RuntimeError(f"benchmark worker {self.proc.name} failed: {payload}")
        return payload

    def run(self) -> tuple[dict[str, float], list]:
        self.conn.send("run")
        return self._expect("ok")

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(60)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    device = bc.resolved_device(a.device)
    folder, tok, wl = bc.load_workload(a)
    info = bc.machine_info()
    print(f"# async vs sync  {info['date']}  device={device} dtype={a.dtype} torch={info['torch']} "
          f"threads={info['torch_threads']} cpus={info['cpu_count']} tandem@{info['tandem_commit']}", flush=True)
    print(f"# workload: {len(wl.prompts)} prompts ({wl.source}), input {a.input_len_range}, output "
          f"{a.output_len_range}; {wl.num_prompt_tokens} prompt tokens, {wl.num_output_tokens} output tokens",
          flush=True)
    common = dict(device=device, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
                  max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=a.enable_prefix_caching,
                  cpu_kv_cache_gib=a.cpu_kv_cache_gib, executor=a.executor,
                  tensor_parallel_size=a.tensor_parallel_size)
    isolate = a.isolate
    runner_cls = SubprocRunner if isolate else InProcRunner
    print(f"# engines {'in one worker process each' if isolate else 'in this process'}", flush=True)
    engines = {m: runner_cls(m, a.model, common, wl, not a.no_detokenize) for m in ("async", "sync")}

    # One untimed full round per engine: the first full-size run pays one-off costs (the CPU
    # kernels' first calls at new shapes, allocator growth) that a 4-prompt warm-up does
    # not reach, and without this they land on whichever mode runs first in round 1.
    for _ in range(a.warmup_rounds):
        for runner in engines.values():
            runner.run()
    raw: dict[str, list[dict[str, float]]] = {n: [] for n in engines}
    tokens: dict[str, list] = {}
    stable = True
    for r in range(a.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            m, toks = engines[name].run()
            raw[name].append(m)
            if name not in tokens:
                tokens[name] = toks
            elif tokens[name] != toks:
                stable = False
                print(f"WARNING: {name} output differs between rounds", flush=True)
            print(f"round {r + 1}/{a.rounds} {name:>12}: {m['wall_s']:7.2f} s  "
                  f"{wl.num_output_tokens / m['wall_s']:7.1f} tok/s  {m['steps']} steps  "
                  f"{1e3 * m['wall_s'] / m['steps']:6.1f} ms/step  cpu {1e3 * m['cpu_s'] / m['steps']:6.1f} ms/step  "
                  f"ahead {m['ahead']}", flush=True)
    for runner in engines.values():
        runner.close()

    same = all(tokens[m] == tokens["sync"] for m in engines)
    summary: dict[str, dict[str, float]] = {}
    for name, runs in raw.items():
        med = {k: bc.median([x[k] for x in runs]) for k in runs[0]}
        steps = med["steps"]
        summary[name] = {
            "wall_s": med["wall_s"], "tok_s": wl.num_output_tokens / med["wall_s"],
            "req_s": len(wl.prompts) / med["wall_s"], "steps": steps,
            "wall_ms_per_step": 1e3 * med["wall_s"] / steps, "cpu_ms_per_step": 1e3 * med["cpu_s"] / steps,
            "main_thread_cpu_ms_per_step": 1e3 * med["main_thread_cpu_s"] / steps,
            "launched_ahead_frac": med["ahead"] / steps, "walls": [x["wall_s"] for x in runs],
            "scheduled_tokens": med["scheduled_tokens"], "dropped_tokens": med["dropped_tokens"],
        }
    s_s = summary["sync"]
    rows = []
    for name in engines:
        s = summary[name]
        rows.append([name, s["wall_s"], s["tok_s"], s["req_s"], int(s["steps"]), s["wall_ms_per_step"],
                     s["cpu_ms_per_step"], s["main_thread_cpu_ms_per_step"], f"{s['launched_ahead_frac']:.1%}",
                     f"{int(s['scheduled_tokens'])} / {int(s['dropped_tokens'])}",
                     " / ".join(f"{w:.2f}" for w in s["walls"])])
    for name in [m for m in engines if m != "sync"]:
        s_a = summary[name]
        rows.append([f"{name} / sync", s_a["wall_s"] / s_s["wall_s"], s_a["tok_s"] / s_s["tok_s"],
                     s_a["req_s"] / s_s["req_s"], "", s_a["wall_ms_per_step"] / s_s["wall_ms_per_step"],
                     s_a["cpu_ms_per_step"] / s_s["cpu_ms_per_step"],
                     s_a["main_thread_cpu_ms_per_step"] / s_s["main_thread_cpu_ms_per_step"], "", "", ""])
    print()
    print(bc.markdown_table(["mode", "wall s (median)", "gen tok/s", "req/s", "steps", "wall ms/step",
                             "CPU ms/step (process)", "CPU ms/step (main thread)", "launched ahead",
                             "sched / dropped tokens", "walls per round"], rows))
    print()
    for name in [m for m in engines if m != "sync"]:
        print(f"throughput {name}/sync: {summary[name]['tok_s'] / s_s['tok_s']:.3f}x")
    print(f"token ids {' == '.join(engines)}: {'IDENTICAL' if same else 'DIFFERENT'} "
          f"({len(wl.prompts)} requests, {wl.num_output_tokens} tokens); each mode stable across rounds: {stable}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "machine": info, "isolated": isolate,
                       "workload": {"num_prompts": len(wl.prompts), "prompt_tokens": wl.num_prompt_tokens,
                                    "output_tokens": wl.num_output_tokens, "output_lens": wl.output_lens,
                                    "prompt_lens": [len(p) for p in wl.prompts], "source": wl.source},
                       "raw": raw, "summary": summary, "tokens_identical": same, "stable_across_rounds": stable},
                      f, indent=1, default=str)
        print(f"wrote {a.json_out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
