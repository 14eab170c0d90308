"""Speculative decoding's counters on /metrics, and how ``tandem bench serve`` reads them."""
from __future__ import annotations

import pytest

from tandem.bench.spec_metrics import SpecCounters, parse_spec_counters
from tandem.engine.messages import CoreStats
from tandem.engine.stats import IterationStats
from tandem.entrypoints.openai.metrics import PrometheusStatLogger

pytestmark = pytest.mark.timeout(30)


def test_counters_rendered_and_parsed_back():
    logger = PrometheusStatLogger("m")
    core = CoreStats(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=25,
                     spec_accepted_per_position=[9, 8, 5, 3])
    logger.record(core, IterationStats())
    text = logger.render().decode()
    for name in ("tandem:spec_decode_num_drafts", "tandem:spec_decode_num_draft_tokens",
                 "tandem:spec_decode_num_accepted_tokens", "tandem:spec_decode_num_accepted_tokens_per_pos"):
        assert name in text
    got = parse_spec_counters(text)
    assert got is not None
    assert (got.num_drafts, got.num_draft_tokens, got.num_accepted_tokens) == (10, 40, 25)
    assert got.accepted_per_position == {0: 9, 1: 8, 2: 5, 3: 3}
    d = got.minus(SpecCounters(2, 8, 5, {0: 1, 1: 1, 2: 1, 3: 0})).to_dict()
    assert d["acceptance_rate"] == 20 / 32 and d["mean_acceptance_length"] == 1 + 20 / 8
    assert d["acceptance_rate_per_position"] == [1.0, 7 / 8, 4 / 8, 3 / 8]


def test_no_speculation_no_counters():
    logger = PrometheusStatLogger("m")
    logger.record(CoreStats(), IterationStats())
    text = logger.render().decode()
    assert "spec_decode_num_accepted_tokens_per_pos" not in text
    assert parse_spec_counters("# nothing here\nfoo 1\n") is None


def test_bench_summary_prints_acceptance():
    """``tandem bench serve``'s table gains a speculative-decoding section when the server
    speculated during the run."""
    import dataclasses

    from tandem.bench.metrics import compute_metrics
    from tandem.bench.serve import BenchmarkConfig, BenchmarkResult, format_summary

    metrics = compute_metrics([], 1.0, [99.0], {})
    res = BenchmarkResult(BenchmarkConfig(), "m", [], [], metrics, 1.0, 0.0, "today")
    assert "Speculative" not in format_summary(res)
    spec = SpecCounters(4, 16, 12, {0: 4, 1: 4, 2: 3, 3: 1}).to_dict()
    text = format_summary(dataclasses.replace(res, spec_decode=spec))
    assert "Acceptance rate (%):" in text and "75.00" in text and "Acceptance length:" in text
    assert "Acceptance rate, position 3 (%):" in text
