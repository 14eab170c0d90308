"""Which CPUs of this host share a physical core: a pure-Python loop's slowdown beside a spinner.

A VM may present its vCPUs as cores of one thread each (``lscpu``: "Thread(s) per core: 1")
while the hypervisor runs two of them as hyperthreads of one physical core. Then a thread
that spins (a CUDA event wait spins by default) slows whatever Python runs on its sibling,
every line of it alike. This probe pins a Python loop to ``--cpu`` and times it beside a
spinning process pinned to each other CPU in turn, and reports each rate against the
median: a sibling shows as a large slowdown (tens of percent), any other CPU as noise.

    python benchmarks/cpu_siblings.py --cpu 0 [--cpu 1 ...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Optional


def _spin(cpu: int, stop: "mp.synchronize.Event") -> None:
    os.sched_setaffinity(0, {cpu})
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1


def _loop_rate(seconds: float) -> float:
    """Iterations per second of a small pure-Python loop (attribute reads, a dict, a list)."""
    class R:
        __slots__ = ("a", "b")

        def __init__(self, i: int) -> None:
            self.a, self.b = i, {"k": i}

    objs = [R(i) for i in range(256)]
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s = 0
        for o in objs:
            s += o.a + o.b["k"]
        n += 1
    return n / (time.perf_counter() - t0)


def probe(cpu: int, others: list[int], seconds: float, repeats: int) -> dict[str, float]:
    """Slowdown of the loop on ``cpu`` beside a spinner on each of ``others``, against its
    median rate over all of them (a sibling stands out above 1; the others sit near 1).
    Relative to each other, not to the loop alone: alone, the core may clock differently."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        _loop_rate(seconds)  # warm-up
        rates: dict[str, float] = {}
        for other in others:
            stop = mp.Event()
            p = mp.Process(target=_spin, args=(other, stop), daemon=True)
            p.start()
            time.sleep(0.05)
            rates[str(other)] = statistics.median(_loop_rate(seconds) for _ in range(repeats))
            stop.set()
            p.join()
    finally:
        os.sched_setaffinity(0, before)
    typical = statistics.median(rates.values())
    return {k: typical / v for k, v in rates.items()}


def find_sibling(cpu: int, seconds: float = 0.12, repeats: int = 3, threshold: float = 1.25) -> Optional[int]:
    """The CPU whose spinner slows a loop on ``cpu`` by ``threshold`` or more against the
    others (its hidden hyperthread sibling), else None."""
    row = probe(cpu, [c for c in sorted(os.sched_getaffinity(0)) if c != cpu], seconds, repeats)
    worst = max(row, key=row.__getitem__)
    return int(worst) if row[worst] >= threshold else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", type=int, action="append", help="CPU to probe (repeatable; default 0)")
    ap.add_argument("--seconds", type=float, default=0.15, help="per timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    result = {}
    for cpu in args.cpu or [0]:
        row = probe(cpu, [c for c in cpus if c != cpu], args.seconds, args.repeats)
        result[str(cpu)] = row
        worst = max(row, key=row.get)  # type: ignore[arg-type]
        print(f"cpu {cpu}: slowdown beside a spinner on " + ", ".join(f"{k}: {v:.2f}" for k, v in row.items())
              + f"  (worst: cpu {worst}, {row[worst]:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
