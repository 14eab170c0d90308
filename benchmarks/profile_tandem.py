"""Where does one tandem run spend its time? cProfile (Python) + torch.profiler (ops).

Runs the ``offline_throughput.py`` workload once through tandem after a warm-up and prints
the top functions by own time and by cumulative time, then (``--torch-ops``) the top torch
operators by self CPU time. cProfile only sees the thread it runs in; with the uniproc
executor every step runs inline in the profiled main thread, so one profile covers
scheduling, input preparation, the model, sampling and detokenization. The default is
``--no-async-scheduling`` (the synchronous loop, the simpler one to read);
``--async-scheduling`` profiles the same work in the async loop's order.

    python benchmarks/profile_tandem.py --top 25 --torch-ops
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = bc.script_parser(__doc__)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--torch-ops", action="store_true", help="also run once under torch.profiler")
    ap.add_argument("--pstats-out", default=None, help="save the raw cProfile stats here")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    from tandem import LLM, SamplingParams

    device = bc.resolved_device(a.device)
    _, tok, wl = bc.load_workload(a)
    llm = LLM(model=a.model, device=device, dtype=a.dtype, async_scheduling=a.async_scheduling,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              enable_prefix_caching=a.enable_prefix_caching)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=not a.no_detokenize)
              for n in wl.output_lens]
    llm.generate(wl.prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    steps0 = llm.engine.core.stats.num_launched

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(wl.prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    steps = llm.engine.core.stats.num_launched - steps0
    print(f"# one tandem run (async_scheduling={a.async_scheduling}): {len(wl.prompts)} prompts, "
          f"{wl.num_output_tokens} output tokens, {steps} steps, {wall:.2f} s under cProfile "
          f"({1e3 * wall / steps:.1f} ms/step)")
    if a.pstats_out:
        prof.dump_stats(a.pstats_out)
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
        text = s.getvalue()
        print(f"\n## top {a.top} by {key}\n")
        print(text[text.find("   ncalls"):] if "   ncalls" in text else text)

    if a.torch_ops:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as p:
            t0 = time.perf_counter()
            llm.generate(wl.prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        print(f"\n## torch ops by self CPU time (run took {wall:.2f} s under torch.profiler)\n")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))
        del torch
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
