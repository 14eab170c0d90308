"""When each benchmark request is sent.

Open-loop load: the send times are drawn up front from the arrival process, independent of
how fast the server answers, so a slow server faces a growing queue just as it would in
production (``--max-concurrency`` then caps how many are in flight at once).

- ``inf`` rate: everything at t=0 (a burst; the usual throughput measurement);
- ``poisson``: exponential gaps with mean ``1/rate``;
- ``gamma``: gamma gaps with shape ``burstiness`` and mean ``1/rate``, like vLLM's
  ``--burstiness``: below 1 burstier than Poisson (coefficient of variation
  ``1/sqrt(burstiness)``), above 1 more even, and ``burstiness=1`` is Poisson;
- ``fixed``: exactly ``1/rate`` apart.

The first request always goes at t=0, so ``n`` requests span ``n-1`` gaps.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

ARRIVALS = ("poisson", "gamma", "fixed")


def resolve_arrival(arrival: Optional[str], burstiness: float) -> str:
    """The arrival process for the flags given: ``--burstiness`` other than 1 implies gamma."""
    if not burstiness > 0 or math.isnan(burstiness):
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if arrival is None:
        return "gamma" if burstiness != 1.0 else "poisson"
    if arrival not in ARRIVALS:
        raise ValueError(f"--arrival must be one of {', '.join(ARRIVALS)}, got {arrival!r}")
    if arrival == "poisson" and burstiness != 1.0:
        raise ValueError("--arrival poisson means burstiness 1; use --arrival gamma with --burstiness")
    return arrival


def arrival_offsets(n: int, rate: float, arrival: str = "poisson", burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send times in seconds after the start for ``n`` requests at ``rate`` requests/s."""
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {rate}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "fixed":
        return [i / rate for i in range(n)]
    if arrival == "poisson":
        burstiness = 1.0
    elif arrival != "gamma":
        raise ValueError(f"unknown arrival process {arrival!r}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + [float(x) for x in np.cumsum(gaps)]
