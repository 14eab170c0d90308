"""A busy neighbour: how much slower the CPU server gets beside a process that keeps a core busy.

For each OpenMP wait policy (``old``: GNU OpenMP's default, which spins about 300,000
iterations before an idle thread sleeps; ``new``: tandem's default, see
``tandem/cpu_threads.py``), one real ``tandem serve`` process is started and timed on the same
job (``--concurrency`` concurrent greedy completions of ``--max-tokens`` tokens, EOS
ignored) in three cases:

- ``alone``: nothing else running (besides whatever else the machine runs);
- ``busy``: beside one ``while True: pass`` Python process;
- ``nice19``: beside the same loop at ``nice 19``.

Each case runs ``--rounds`` times; the table shows the median seconds and the ratio to
``alone`` for the same policy. The goal (issue 21): ``busy`` at most 2x ``alone``. The
numbers only mean something on an otherwise quiet machine (check the load average printed).

    python benchmarks/busy_neighbour.py                                  # both policies, 3 rounds
    python benchmarks/busy_neighbour.py --rounds 1 --max-tokens 8        # a quick sanity run
    python benchmarks/busy_neighbour.py --json benchmarks/results/cpu_busy_neighbour.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from serve_common import machine, start_server, stop_server

# GNU OpenMP's own defaults, set explicitly so that tandem leaves them alone.
OLD_POLICY = {"GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}
_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
CASES = ("alone", "busy", "nice19")
BUSY_LOOP = "while True: pass"


def policy_env(policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _POLICY_VARS}
    if policy == "old":
        env.update(OLD_POLICY)
    return env


def start_neighbour(case: str) -> Optional[subprocess.Popen]:
    if case == "alone":
        return None
    nice = (lambda: os.nice(19)) if case == "nice19" else None
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP], preexec_fn=nice)


def stop_neighbour(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None:
        proc.kill()
        proc.wait()


async def one_job(url: str, concurrency: int, max_tokens: int) -> float:
    """Seconds for ``concurrency`` concurrent completions of ``max_tokens`` tokens each."""
    import httpx

    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        responses = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body)
                                           for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    for r in responses:
        r.raise_for_status()
        if r.json()["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"expected {max_tokens} tokens, got {r.json()['usage']}")
    return elapsed


def measure_policy(policy: str, args: argparse.Namespace, log_dir: str) -> dict[str, list[float]]:
    proc, url = start_server(args.model, args.engine_args, os.path.join(log_dir, f"server_{policy}.log"),
                             env=policy_env(policy))
    times: dict[str, list[float]] = {case: [] for case in CASES}
    try:
        asyncio.run(one_job(url, args.concurrency, args.max_tokens))  # warm-up
        for _ in range(args.rounds):
            for case in CASES:
                neighbour = start_neighbour(case)
                try:
                    time.sleep(0.5)  # let the loop get going
                    times[case].append(asyncio.run(one_job(url, args.concurrency, args.max_tokens)))
                finally:
                    stop_neighbour(neighbour)
                print(f"{policy:>4} {case:>7}: {times[case][-1]:.2f} s", file=sys.stderr, flush=True)
    finally:
        stop_server(proc)
    return times


def table(results: dict[str, dict[str, list[float]]]) -> str:
    rows = ["| policy | " + " | ".join(f"{c} (s)" for c in CASES) + " | busy / alone | nice19 / alone |",
            "|---|" + "---|" * (len(CASES) + 2)]
    for policy, times in results.items():
        med = {c: statistics.median(times[c]) for c in CASES}
        rows.append(f"| {policy} | " + " | ".join(f"{med[c]:.2f}" for c in CASES)
                    + f" | {med['busy'] / med['alone']:.2f}x | {med['nice19'] / med['alone']:.2f}x |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--policies", default="old,new", help="comma-separated: old, new (default both)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the raw times and machine info here")
    ap.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: flags for tandem serve")
    args = ap.parse_args(argv)
    args.engine_args = [a for a in args.engine_args if a != "--"]
    policies = [p for p in args.policies.split(",") if p]
    if any(p not in ("old", "new") for p in policies):
        ap.error("--policies takes old and/or new")
    info: dict[str, Any] = {"machine_before": machine()}
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as log_dir:
        for policy in policies:
            results[policy] = measure_policy(policy, args, log_dir)
    info["machine_after"] = machine()
    print(f"{args.concurrency} concurrent requests x {args.max_tokens} tokens, median of {args.rounds} round(s); "
          f"load average before {info['machine_before']['load_avg_1m']:.2f}, "
          f"after {info['machine_after']['load_avg_1m']:.2f}")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "args": {k: v for k, v in vars(args).items()}, "times_s": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
