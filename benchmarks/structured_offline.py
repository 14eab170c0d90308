"""Constrained decoding offline, on the GPU (issue 18): the engine alone, no server.

``LLM.generate``-style runs (``gpu_bench.run_engine``: the engine stepped directly) of 256
requests, 128 random prompt tokens and 128 greedy output tokens with ``ignore_eos``,
where a share (``--ratios``) is under ``tandem bench serve``'s JSON schema (which no
request can close within 128 tokens, so every output token is generated under the
grammar). The model is random bf16 weights of ``--shape`` with a real byte-level tokenizer
(``--tokenizer-from``; the vocabulary becomes the tokenizer's), fresh prompts each round,
prefix caching off. Reported per share: output tok/s (best of ``--rounds``), the ratio to
the unconstrained run of the same process, the GPU idle share of ~60 steady steps (a
``torch.profiler`` trace of round 0), and with ``--cprofile`` where the host time of those
steps goes.

    python benchmarks/structured_offline.py --tokenizer-from TOKENIZER_DIR --ratios 0,0.2,0.8,1 --out so.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import SHAPES, build_model, log, prompts_of, run_engine, tandem_llm  # noqa: E402
from gpu_serve import tokenizer_vocab, use_tokenizer  # noqa: E402


def set_fill_threads(llm: Any, threads: str) -> None:
    """xgrammar's bitmask fill on ``threads`` threads of its own pool, per native call
    (tandem's default: 1)."""
    backend = llm.engine.core.structured._backend
    backend.native_fill_threads = int(threads)
    backend._local = threading.local()  # new BatchGrammarMatcher objects with that count


class _PoolFill:
    """``FillThreads``' interface on a ``ThreadPoolExecutor``: a job waits for the GIL."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tandem-fill-pool")

    def submit(self, fns: list[Callable[[], None]]) -> list[Any]:
        return [self._pool.submit(fn) for fn in fns]

    def shutdown(self) -> None:
        self._pool.shutdown()


def set_fill_handover(llm: Any, handover: str, lanes: int) -> None:
    """How a background bitmask fill is handed to its threads: ``handshake`` (tandem's
    ``FillThreads``: the submitter waits until each thread has its job) or ``pool`` (a
    ``ThreadPoolExecutor``: the job waits for the GIL), to measure the difference; on
    ``lanes`` threads, each a share of the rows (tandem's default: ``FILL_THREADS``)."""
    from tandem.structured_output.manager import FillThreads

    threads = FillThreads("tandem-fill", lanes) if handover == "handshake" else _PoolFill(lanes)
    llm.engine.core.structured.set_fill_threads(threads)  # type: ignore[arg-type]


class SectionTimers:
    """Wall time of the engine's step sections (wrapped methods of the live objects), per
    constrained share: where a step's host time goes, at perf_counter cost, no profiler."""

    def __init__(self, llm: Any) -> None:
        engine = llm.engine
        core = engine.core
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.samples: dict[str, list[float]] = {}  # each call's seconds, for the spread
        self.wrap(engine, "step", "engine.step (all)")
        self.wrap(engine.output_processor, "process_outputs", "output_processor.process_outputs")
        self.wrap(core.scheduler, "schedule", "scheduler.schedule")
        self.wrap(core.scheduler, "update_from_output", "scheduler.update_from_output (incl. accept)")
        self.wrap(core.scheduler, "accept_grammar_tokens", "grammar accept_tokens")
        self.wrap(core.structured, "grammar_output", "structured.grammar_output (incl. fill)")
        self.wrap(core.structured, "start_grammar_output", "structured.start_grammar_output (rows, hand-over)")
        self.wrap(core, "_send_sampling", "core._send_sampling (wait for the fill, sample_tokens)")
        self.wrap(core.executor, "prepare_model", "executor.prepare_model (inputs built ahead)")
        self.wrap(core.executor, "execute_model", "executor.execute_model")
        self.wrap(core.executor, "sample_tokens", "executor.sample_tokens")
        if core.structured._backend is not None:  # one call per fill thread's share of a step
            self.wrap(core.structured._backend, "fill_bitmasks", "backend.fill_bitmasks (a share, on a fill thread)")
        from tandem.structured_output.manager import PendingGrammarOutput

        self.wrap(PendingGrammarOutput, "result", "PendingGrammarOutput.result (wait for the fill)")
        # Inside sample_tokens (the uniproc executor's runner, in this process; a multiproc
        # worker's runner is in its own process, out of reach).
        import tandem.worker.model_runner as mr

        worker = getattr(core.executor, "worker", None)
        if worker is None:
            return
        runner = worker.runner
        self.wrap(runner.bitmasks, "stage_rows", "runner: bitmask stage_rows (copy, upload, scatter)")
        self.wrap(runner.bitmasks, "stage", "runner: bitmask stage")
        self.wrap(mr, "apply_token_bitmask", "runner: apply_token_bitmask (launch)")
        self.wrap(runner, "sampler", "runner: sampler (launch)")

    def wrap(self, obj: Any, name: str, label: str) -> None:
        import time

        inner = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                dt = time.perf_counter() - t
                self.totals[label] = self.totals.get(label, 0.0) + dt
                self.calls[label] = self.calls.get(label, 0) + 1
                self.samples.setdefault(label, []).append(dt)

        setattr(obj, name, timed)

    def report(self, steps: int) -> dict[str, float]:
        """ms per launched step by section, and each section's median and 90th-percentile
        call (``<section> p50`` / ``p90``, ms a call)."""
        import statistics

        out = {k: 1e3 * v / max(steps, 1) for k, v in self.totals.items()}
        for k, xs in self.samples.items():
            xs.sort()
            out[f"{k} p50"] = 1e3 * statistics.median(xs)
            out[f"{k} p90"] = 1e3 * xs[int(0.9 * (len(xs) - 1))]
        self.totals.clear()
        self.calls.clear()
        self.samples.clear()
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--tokenizer-from", required=True, metavar="DIR")
    ap.add_argument("--ratios", default="0,0.2,0.8,1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--cprofile", action="store_true", help="cProfile steady steps of the constrained runs")
    ap.add_argument("--fill-threads", default="", help="comma list of xgrammar's own thread counts per native "
                    "fill call to compare")
    ap.add_argument("--fill-lanes", default="", help="comma list of background fill thread counts to compare "
                    "(tandem's FILL_THREADS: each fills a share of the rows in a native call of its own)")
    ap.add_argument("--timers", action="store_true", help="time the step's sections (wrapped methods)")
    ap.add_argument("--trace-dir", default=None, help="write each share's torch.profiler trace (Chrome JSON) here")
    ap.add_argument("--prepare-ahead", default="on", help="comma list of on/off: build the next step's inputs "
                    "before a constrained step's sampling call (EngineCore.prepare_ahead; tandem's default: on)")
    ap.add_argument("--fill-handover", default="handshake", help="comma list of handshake/pool: how a "
                    "background bitmask fill reaches its thread (set_fill_handover; tandem's default: handshake)")
    ap.add_argument("--executor", default="uniproc", choices=["uniproc", "multiproc"],
                    help="multiproc: the worker (launches, sampling) in its own process")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from tandem import SamplingParams
    from tandem.bench.structured import DEFAULT_SCHEMA
    from tandem.sampling_params import StructuredOutputsParams

    shape = dict(SHAPES[args.shape], vocab_size=tokenizer_vocab(args.tokenizer_from))
    result: dict[str, Any] = {"shape": args.shape, "vocab_size": shape["vocab_size"], "backend": args.backend,
                              "executor": args.executor, "runs": []}
    plain = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=DEFAULT_SCHEMA))
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(os.path.join(tmp, "model"), shape)
        use_tokenizer(folder, args.tokenizer_from)
        llm = tandem_llm(folder, structured_outputs_backend=args.backend, executor=args.executor)
        vocab = shape["vocab_size"]
        run_engine(llm, prompts_of(16, 128, vocab, seed=7), [constrained] * 8 + [plain] * 8)  # compile, warm
        timers = SectionTimers(llm) if args.timers else None
        base = None
        from tandem.structured_output.manager import FILL_THREADS

        configs = [(t, int(lanes), ahead, hand, float(r))
                   for t in (args.fill_threads.split(",") if args.fill_threads else [""])
                   for lanes in (args.fill_lanes.split(",") if args.fill_lanes else [FILL_THREADS])
                   for ahead in args.prepare_ahead.split(",") for hand in args.fill_handover.split(",")
                   for r in args.ratios.split(",")]
        for k, (threads, lanes, ahead, handover, ratio) in enumerate(configs):
            if threads:  # xgrammar's fill threads (the backend's default: 1)
                set_fill_threads(llm, threads)
            set_fill_handover(llm, handover, lanes)
            llm.engine.core.prepare_ahead = ahead == "on"
            n = round(ratio * 256)
            sps = [constrained] * n + [plain] * (256 - n)
            runs = []
            for r in range(args.rounds):
                prompts = prompts_of(256, 128, vocab, seed=100 * k + r)
                prof = cProfile.Profile() if args.cprofile and n and r == 0 else None
                trace = os.path.join(args.trace_dir, f"trace_{ratio}.json") if args.trace_dir and r == 0 else None
                window = (40, 100) if r == 0 and not args.timers else None
                runs.append(run_engine(llm, prompts, sps, profile_steps=window, cprofile=prof, trace_path=trace))
                if prof is not None:
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
                    print(f"--- cProfile, ratio {ratio}, steps 40..100 ---\n{s.getvalue()}", flush=True)
            best = max(runs, key=lambda x: x["tok_per_s"])
            label = (f"fill threads {threads or 'default'}, {lanes} fill lanes, prepare ahead {ahead}, {handover} "
                     f"hand-over, ratio {ratio}")
            row = {"ratio": ratio, "fill_threads": threads or "default", "fill_lanes": lanes, "prepare_ahead": ahead,
                   "fill_handover": handover,
                   "tok_per_s": best["tok_per_s"],
                   "all_tok_per_s": [x["tok_per_s"] for x in runs], "ms_per_step": best["ms_per_step"],
                   "profile": runs[0].get("profile"), "steady_wall_ms_per_loop": runs[0].get("steady_wall_ms_per_loop")}
            if timers is not None:  # ms per launched step, over all rounds of this share
                row["sections_ms_per_step"] = sections = timers.report(sum(x["steps"] for x in runs))
                parts = ", ".join(f"{name} {ms:.3f}" for name, ms in sections.items())
                print(f"{label} sections, ms per step: {parts}", flush=True)
            if n == 0:
                base = row["tok_per_s"]
            row["vs_unconstrained"] = row["tok_per_s"] / base if base else None
            result["runs"].append(row)
            log(f"{label}: {row['tok_per_s']:.0f} tok/s ({row['vs_unconstrained']}), idle "
                f"{row['profile'] and row['profile']['gpu_idle_share']}, loop {row['steady_wall_ms_per_loop']} ms")
        llm.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
