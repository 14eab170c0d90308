"""Compare two py-spy raw profiles (``py-spy record --format raw [--threads]``) below one frame.

Which functions took more samples in run A than in run B, counting only stacks that pass
through ``--root`` (e.g. ``EngineCoreLoop._run``: the engine thread of a served engine
core), by own samples (the innermost frame) and by inclusive samples. Used on the served
engine core's profiles from ``gpu_serve.py --profile-core-ratio R [--profile-core-gil]``,
which keeps the raw stacks next to its ``--out`` file (``..._core_r<R>.pyspy``):

    python benchmarks/pyspy_diff.py A.pyspy[.gz] B.pyspy[.gz] --root EngineCoreLoop._run
"""
from __future__ import annotations

import argparse
import collections
import gzip
from typing import Counter, Iterator


def _lines(path: str) -> Iterator[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        yield from f


def _frame(raw: str) -> str:
    """``func (path/file.py:line)`` -> ``func (file.py)``: lines would split a function."""
    name, _, loc = raw.partition(" (")
    return f"{name} ({loc.rstrip(')').split(':')[0].rsplit('/', 1)[-1]})"


def load(path: str, root: str) -> tuple[Counter[str], Counter[str], int]:
    """Own and inclusive samples of the frames at and below ``root``, and their total."""
    own: Counter[str] = collections.Counter()
    inclusive: Counter[str] = collections.Counter()
    total = 0
    for line in _lines(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = [_frame(f) for f in stack.split(";")]
        at = next((k for k, f in enumerate(frames) if f.startswith(root + " ")), None)
        if at is None:
            continue
        n = int(count)
        total += n
        frames = frames[at:]
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    return own, inclusive, total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--root", default="EngineCoreLoop._run", help="count only stacks through this function")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    a_own, a_inc, a_total = load(args.a, args.root)
    b_own, b_inc, b_total = load(args.b, args.root)
    print(f"samples through {args.root}: A {a_total}, B {b_total} ({a_total - b_total:+d})")
    for title, a, b in (("own", a_own, b_own), ("inclusive", a_inc, b_inc)):
        print(f"-- {title}: A, B, A - B")
        for name in sorted(set(a) | set(b), key=lambda k: b[k] - a[k])[:args.top]:
            print(f"{a[name]:7d} {b[name]:7d} {a[name] - b[name]:+7d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
