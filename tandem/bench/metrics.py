"""Aggregate benchmark numbers from per-request records.

Pure functions of the records and the wall duration, so each number can be checked
against a hand computation. The definitions follow ``vllm bench serve`` so results from
both tools can be put side by side:

- throughput counts only successful requests, over the whole benchmark wall time;
- TTFT is sending -> first non-empty content chunk; ITL the gaps between later chunks;
- E2E latency runs from sending to the end of the stream (``[DONE]``), the response as a
  client sees it complete; vLLM stops at the last token chunk instead, which differs only
  by the server's gap before its final usage event;
- TPOT is per request ``(e2el - ttft) / (output_tokens - 1)``, left out for requests
  with fewer than two output tokens (undefined there); its statistics are over requests;
- statistics use the population standard deviation and linearly interpolated
  percentiles (numpy's defaults), reported in milliseconds;
- goodput counts successful requests that meet every given SLO; a request whose TPOT is
  undefined meets a TPOT SLO.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from tandem.bench.records import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (99.0,)


@dataclass
class LatencyStats:
    """Summary of one latency metric, in milliseconds (all zero when ``count`` is 0)."""

    count: int = 0
    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    p99: float = 0.0
    percentiles: dict[str, float] = field(default_factory=dict)  # "p90" -> ms


@dataclass
class BenchmarkMetrics:
    """Everything the summary table and the saved JSON report about one run."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_token_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    max_concurrent_requests: int
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    good_requests: Optional[int] = None  # None when no SLO was given
    request_goodput: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)


def percentile_key(p: float) -> str:
    """``99.0 -> "p99"``, ``99.9 -> "p99.9"``."""
    return f"p{p:g}"


def latency_stats(values_s: Sequence[float], percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> LatencyStats:
    """Mean, median, std, p99 and the requested percentiles of ``values_s`` (seconds), in ms."""
    ps = sorted({*(float(p) for p in percentiles), 99.0})
    if len(values_s) == 0:
        return LatencyStats(percentiles={percentile_key(p): 0.0 for p in ps})
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    pct = {percentile_key(p): float(np.percentile(a, p)) for p in ps}
    return LatencyStats(count=int(a.size), mean=float(a.mean()), median=float(np.median(a)),
                        std=float(a.std()), p99=pct["p99"], percentiles=pct)


def max_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Largest number of half-open ``[start, end)`` intervals that overlap at one instant.

    An end and a start at the same instant do not overlap (the ending request is gone).
    """
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        events.append((start, 1))
        events.append((end, -1))
    events.sort()  # at equal times -1 sorts before +1
    cur = peak = 0
    for _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def meets_slos(rec: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO in ``slos_ms`` (keys from ``SLO_METRICS``)."""
    if not rec.success:
        return False
    values = {"ttft": rec.ttft, "tpot": rec.tpot, "e2el": rec.e2el}
    for name, limit_ms in slos_ms.items():
        v = values[name]
        if v is None:
            if name == "tpot":  # undefined for one output token: nothing to violate
                continue
            return False
        if v * 1000.0 > limit_ms:
            return False
    return True


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    percentiles: Iterable[float] = DEFAULT_PERCENTILES,
                    goodput_slos_ms: Optional[dict[str, float]] = None) -> BenchmarkMetrics:
    """Aggregate ``records`` of one run that took ``duration_s`` seconds of wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    percentiles = list(percentiles)
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [g for r in ok for g in r.itl]
    e2els = [r.e2el for r in ok]
    slos = dict(goodput_slos_ms or {})
    good = sum(meets_slos(r, slos) for r in ok) if slos else None
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        input_token_throughput=total_in / duration_s,
        output_token_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        max_concurrent_requests=max_concurrency((r.start_time, r.end_time) for r in records),
        ttft_ms=latency_stats(ttfts, percentiles),
        tpot_ms=latency_stats(tpots, percentiles),
        itl_ms=latency_stats(itls, percentiles),
        e2el_ms=latency_stats(e2els, percentiles),
        goodput_slos_ms=slos,
        good_requests=good,
        request_goodput=None if good is None else good / duration_s,
    )


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``; each in [0, 100]."""
    out: list[float] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            p = float(part)
        except ValueError:
            raise ValueError(f"--metric-percentiles: {part!r} is not a number") from None
        if not (0.0 <= p <= 100.0) or math.isnan(p):
            raise ValueError(f"--metric-percentiles: {part} is outside [0, 100]")
        out.append(p)
    if not out:
        raise ValueError("--metric-percentiles: give at least one percentile, e.g. 50,90,99")
    return out


def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for tok in item.split():
            name, sep, value = tok.partition(":")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"--goodput: {tok!r} is not NAME:MILLISECONDS with NAME one of "
                                 f"{', '.join(SLO_METRICS)}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput: {value!r} in {tok!r} is not a number") from None
            if not ms > 0 or math.isinf(ms):
                raise ValueError(f"--goodput: the SLO in {tok!r} must be a positive number of ms")
            slos[name] = ms
    return slos
