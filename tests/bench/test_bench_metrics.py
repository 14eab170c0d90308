"""Benchmark metrics on hand-built records, checked against numbers worked out by hand."""
from __future__ import annotations

import json

import pytest

from tandem.bench.metrics import (compute_metrics, latency_stats, max_concurrency, meets_slos,
                                  parse_goodput, parse_percentiles)
from tandem.bench.records import RequestRecord

pytestmark = pytest.mark.timeout(30)


def rec(start: float, chunks: list[float], end: float, out: int, prompt: int = 10, ok: bool = True) -> RequestRecord:
    return RequestRecord(success=ok, start_time=start, chunk_times=chunks, end_time=end,
                         output_tokens=out, prompt_tokens=prompt, error="" if ok else "boom")


def records() -> list[RequestRecord]:
    # A: ttft 0.1, chunks at 0.1 0.3 0.4, e2e 0.5, 4 tokens -> tpot (0.5-0.1)/3 = 0.1333..
    # B: start 1.0, ttft 0.2, chunks 1.2 1.5, e2e 0.6, 3 tokens -> tpot (0.6-0.2)/2 = 0.2
    # C: start 0.2, ttft 0.3, one token, e2e 0.3 -> tpot undefined
    # D: failed (counted only in failed and in concurrency)
    return [
        rec(0.0, [0.1, 0.3, 0.4], 0.5, 4, prompt=10),
        rec(1.0, [1.2, 1.5], 1.6, 3, prompt=20),
        rec(0.2, [0.5], 0.5, 1, prompt=30),
        rec(0.3, [], 0.45, 0, prompt=40, ok=False),
    ]


def test_record_properties():
    a, b, c, _ = records()
    assert a.ttft == pytest.approx(0.1)
    assert a.itl == pytest.approx([0.2, 0.1])
    assert a.e2el == pytest.approx(0.5)
    assert a.tpot == pytest.approx(0.4 / 3)
    assert b.tpot == pytest.approx(0.2)
    assert c.tpot is None and c.itl == []
    assert RequestRecord().ttft is None


def test_compute_metrics_hand_computed():
    m = compute_metrics(records(), duration_s=2.0, percentiles=[50, 90])
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 60 and m.total_output_tokens == 8
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_token_throughput == pytest.approx(30.0)
    assert m.output_token_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(34.0)
    # TTFT over successes: 100, 200, 300 ms
    assert m.ttft_ms.count == 3
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.median == pytest.approx(200.0)
    assert m.ttft_ms.std == pytest.approx((20000 / 3) ** 0.5)  # population std
    assert m.ttft_ms.percentiles["p90"] == pytest.approx(280.0)  # 200 + 0.8 * 100
    assert m.ttft_ms.p99 == pytest.approx(298.0)
    assert set(m.ttft_ms.percentiles) == {"p50", "p90", "p99"}
    # TPOT over A and B only: 133.33 and 200 ms
    assert m.tpot_ms.count == 2
    assert m.tpot_ms.mean == pytest.approx((400 / 3 + 200) / 2)
    assert m.tpot_ms.median == pytest.approx((400 / 3 + 200) / 2)
    # ITL: A's 200, 100 and B's 300 ms
    assert m.itl_ms.count == 3
    assert m.itl_ms.mean == pytest.approx(200.0)
    assert m.itl_ms.median == pytest.approx(200.0)
    # E2E: 500, 600, 300 ms
    assert m.e2el_ms.mean == pytest.approx(466.6666667)
    assert m.e2el_ms.median == pytest.approx(500.0)
    assert m.e2el_ms.percentiles["p50"] == pytest.approx(500.0)
    # [0,0.5) [1,1.6) [0.2,0.5) [0.3,0.45): three overlap at 0.3..0.45
    assert m.max_concurrent_requests == 3
    assert m.request_goodput is None and m.good_requests is None
    json.dumps(m.to_dict(), allow_nan=False)


def test_goodput():
    recs = records()
    # ttft <= 150 ms: only A
    m = compute_metrics(recs, 2.0, goodput_slos_ms={"ttft": 150})
    assert m.good_requests == 1 and m.request_goodput == pytest.approx(0.5)
    # tpot <= 150 ms: A (133) and C (undefined tpot meets it); B (200) misses
    m = compute_metrics(recs, 2.0, goodput_slos_ms={"tpot": 150})
    assert m.good_requests == 2
    # all of them: ttft <= 250 (A, B), tpot <= 250 (A, B, C), e2el <= 550 (A, C) -> A
    m = compute_metrics(recs, 4.0, goodput_slos_ms={"ttft": 250, "tpot": 250, "e2el": 550})
    assert m.good_requests == 1 and m.request_goodput == pytest.approx(0.25)
    # an SLO exactly met counts
    assert meets_slos(recs[0], {"e2el": 500.0})
    assert not meets_slos(recs[3], {"e2el": 10_000})  # failed requests never count


def test_latency_stats_empty_and_single():
    s = latency_stats([], [50])
    assert s.count == 0 and s.mean == 0.0 and s.percentiles == {"p50": 0.0, "p99": 0.0}
    s = latency_stats([0.25])
    assert (s.mean, s.median, s.std, s.p99) == (250.0, 250.0, 0.0, 250.0)


def test_no_success_and_bad_duration():
    m = compute_metrics([rec(0, [], 1, 0, ok=False)], 1.0)
    assert m.completed == 0 and m.failed == 1 and m.ttft_ms.count == 0
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_max_concurrency_half_open():
    assert max_concurrency([]) == 0
    assert max_concurrency([(0, 1), (1, 2), (2, 3)]) == 1  # back to back never overlap
    assert max_concurrency([(0, 10), (1, 2), (1.5, 3), (2, 4)]) == 3


def test_parse_percentiles_and_goodput():
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "x", "101", "-1"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)
    assert parse_goodput(["ttft:500", "tpot:50 e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:-1"], ["e2el:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
