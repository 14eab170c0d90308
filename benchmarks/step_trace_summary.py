"""Where the engine core's steps went: a summary of a ``TANDEM_STEP_TRACE`` file.

Per phase (``tandem.step_trace``): how many spans, their median and mean in milliseconds,
and their share of the traced time on their thread; then the steady step cycle (from one
launch to the next). The engine thread's phases: ``schedule``, ``launch``, ``wait_output``
(waiting for the step's ids), ``wait_accept`` (from the ids to the gated accept's refusals),
``update`` (applying the step), ``publish`` (sending outputs, served); the gated fill
thread's: ``fill`` and ``accept`` (which includes its own wait for the ids).

    python benchmarks/step_trace_summary.py trace.1234.jsonl [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from typing import Any


def spans(events: list[list[Any]]) -> dict[tuple[str, str], list[float]]:
    """Durations (ms) by (thread, phase). A phase with both edges pairs each "b" with the
    next "e" on its thread; ``wait_accept`` and ``update`` have only ends and start where
    the engine thread's previous mark for the step ended."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    open_at: dict[tuple[str, str], int] = {}
    last_end: dict[tuple[str, int], int] = {}
    for ns, thread, phase, edge, step in events:
        key = (thread, phase)
        if edge == "b":
            open_at[key] = ns
            continue
        start = open_at.pop(key, None)
        if start is None:  # an end-only phase: since the step's previous mark on this thread
            start = last_end.get((thread, step))
        if start is not None:
            out[key].append((ns - start) / 1e6)
        last_end[(thread, step)] = ns
    return out


def summarize(events: list[list[Any]]) -> dict[str, Any]:
    if not events:
        return {}
    total_ms = (events[-1][0] - events[0][0]) / 1e6
    result: dict[str, Any] = {"traced_ms": total_ms, "phases": {}}
    for (thread, phase), ms in sorted(spans(events).items()):
        result["phases"][f"{thread}/{phase}"] = {
            "count": len(ms), "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "share": sum(ms) / total_ms if total_ms else 0.0}
    launches = [ns for ns, thread, phase, edge, _ in events if phase == "launch" and edge == "b"]
    cycles = [(b - a) / 1e6 for a, b in zip(launches, launches[1:])]
    if cycles:
        result["step_cycle_ms"] = {"count": len(cycles), "median": statistics.median(cycles),
                                   "mean": statistics.fmean(cycles)}
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = [json.loads(line) for line in f]
    res = summarize(events)
    print(f"{len(events)} events over {res.get('traced_ms', 0):.0f} ms")
    print("| thread/phase | spans | median ms | mean ms | share of the traced time |")
    print("|---|---|---|---|---|")
    for name, p in res.get("phases", {}).items():
        print(f"| {name} | {p['count']} | {p['median_ms']:.3f} | {p['mean_ms']:.3f} | {p['share']:.1%} |")
    if "step_cycle_ms" in res:
        c = res["step_cycle_ms"]
        print(f"step cycle (launch to launch): median {c['median']:.3f} ms, mean {c['mean']:.3f} ms over {c['count']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
