"""Where the engine core's steps went: a summary of a ``TANDEM_STEP_TRACE`` file.

Per phase (``tandem.step_trace``): how many spans, their median and mean wall time in
milliseconds, their mean CPU time (the thread's own CPU clock), their mean
voluntary and involuntary context switches, and their share of the traced time; then each
thread's CPU time and switches over the whole trace, and the steady step cycle (from one
launch to the next). The engine thread's phases: ``schedule``, ``launch``, ``wait_output``
(waiting for the step's ids), ``wait_accept`` (from the ids to the gated accept's refusals),
``update`` (applying the step), and, served, ``intake`` (decoding and adding new requests,
aborts) and ``publish`` (the stats snapshot and sending outputs); inside ``launch``, the
model runner's ``prepare``, ``forward`` and ``sample`` and a gated step's ``open`` and
``queue_accept``; the gated fill thread's: ``fill`` and ``accept`` (which includes its own
wait for the ids).

Wall time above CPU time in a phase that does not block by design (``schedule``, ``update``,
``launch`` on a GPU) is time the thread waited to run: voluntary switches there are waits
for the GIL (or a lock), involuntary ones a CPU taken by another process.

    python benchmarks/step_trace_summary.py trace.1234.jsonl [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from typing import Any

# One span: wall ms, CPU ms, voluntary and involuntary context switches.
Span = tuple[float, float, int, int]

# The phases marked by their end only (each starts where its thread's previous mark for the
# step ended); an end of any other phase without its beginning (a launch that raised
# part-way) is no span.
END_ONLY = frozenset({"wait_accept", "update"})


def spans(events: list[list[Any]]) -> dict[tuple[str, str], list[Span]]:
    """Spans by (thread, phase). A phase with both edges pairs each "b" with the next "e" on
    its thread; ``wait_accept`` and ``update`` have only ends and start where the engine
    thread's previous mark for the step ended."""
    out: dict[tuple[str, str], list[Span]] = defaultdict(list)
    open_at: dict[tuple[str, str], tuple[int, int, int, int]] = {}
    last_end: dict[tuple[str, int], tuple[int, int, int, int]] = {}
    for ns, cpu_us, vcsw, ivcsw, thread, phase, edge, step in events:
        key = (thread, phase)
        now = (ns, cpu_us, vcsw, ivcsw)
        if edge == "b":
            open_at[key] = now
            continue
        start = open_at.pop(key, None)
        if start is None and phase in END_ONLY:  # since the step's previous mark on this thread
            start = last_end.get((thread, step))
        if start is not None:
            out[key].append(((ns - start[0]) / 1e6, (cpu_us - start[1]) / 1e3, vcsw - start[2], ivcsw - start[3]))
        last_end[(thread, step)] = now
    return out


def threads(events: list[list[Any]]) -> dict[str, dict[str, float]]:
    """Each thread's wall time between its first and last mark, its CPU time and switches."""
    first: dict[str, list[Any]] = {}
    last: dict[str, list[Any]] = {}
    for ev in events:
        first.setdefault(ev[4], ev)
        last[ev[4]] = ev
    return {t: {"wall_ms": (last[t][0] - first[t][0]) / 1e6, "cpu_ms": (last[t][1] - first[t][1]) / 1e3,
                "vcsw": last[t][2] - first[t][2], "ivcsw": last[t][3] - first[t][3]} for t in first}


def summarize(events: list[list[Any]]) -> dict[str, Any]:
    if not events:
        return {}
    total_ms = (events[-1][0] - events[0][0]) / 1e6
    result: dict[str, Any] = {"traced_ms": total_ms, "phases": {}, "threads": threads(events)}
    for (thread, phase), sp in sorted(spans(events).items()):
        wall = [s[0] for s in sp]
        result["phases"][f"{thread}/{phase}"] = {
            "count": len(sp), "median_ms": statistics.median(wall), "mean_ms": statistics.fmean(wall),
            "mean_cpu_ms": statistics.fmean(s[1] for s in sp), "mean_vcsw": statistics.fmean(s[2] for s in sp),
            "mean_ivcsw": statistics.fmean(s[3] for s in sp), "share": sum(wall) / total_ms if total_ms else 0.0}
    launches = [ev[0] for ev in events if ev[5] == "launch" and ev[6] == "b"]
    cycles = [(b - a) / 1e6 for a, b in zip(launches, launches[1:])]
    if cycles:
        result["step_cycle_ms"] = {"count": len(cycles), "median": statistics.median(cycles),
                                   "mean": statistics.fmean(cycles)}
    return result


def print_summary(res: dict[str, Any]) -> None:
    print("| thread/phase | spans | median ms | mean ms | mean CPU ms | voluntary / involuntary switches "
          "a span | share of the traced time |")
    print("|---|---|---|---|---|---|---|")
    for name, p in res.get("phases", {}).items():
        print(f"| {name} | {p['count']} | {p['median_ms']:.3f} | {p['mean_ms']:.3f} | {p['mean_cpu_ms']:.3f} | "
              f"{p['mean_vcsw']:.2f} / {p['mean_ivcsw']:.2f} | {p['share']:.1%} |")
    for name, t in res.get("threads", {}).items():
        busy = t["cpu_ms"] / t["wall_ms"] if t["wall_ms"] else 0.0
        print(f"thread {name}: CPU {t['cpu_ms']:.0f} of {t['wall_ms']:.0f} ms ({busy:.0%}), "
              f"{t['vcsw']} voluntary and {t['ivcsw']} involuntary switches")
    if "step_cycle_ms" in res:
        c = res["step_cycle_ms"]
        print(f"step cycle (launch to launch): median {c['median']:.3f} ms, mean {c['mean']:.3f} ms over {c['count']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = [json.loads(line) for line in f]
    res = summarize(events)
    print(f"{len(events)} events over {res.get('traced_ms', 0):.0f} ms")
    print_summary(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
