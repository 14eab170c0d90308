"""Prometheus metrics for /metrics: the whole server's numbers, from any API-server process.

Two sources, each counted once however many API-server processes there are:

* **the engine core's** numbers (running/waiting requests, KV blocks, steps launched and
  launched ahead, preemptions, prefix-cache lookups, idle seconds) are totals kept by the
  core and sent to every front end with each batch and heartbeat; a collector reports the
  newest snapshot as it is, so they are never summed over processes;
* **the front end's** per-request numbers (tokens, TTFT, inter-token latency, queue time,
  end-to-end latency, finished requests) are observed by the process that served the
  request. With several processes, prometheus_client's multiprocess mode keeps them in
  files under ``PROMETHEUS_MULTIPROC_DIR`` (set by the launcher before any child starts)
  and /metrics sums them over all processes; with one, they live in a registry of the
  server's own, so several servers can share a process, as the tests do.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from tandem.engine.messages import CoreStats
from tandem.engine.stats import IterationStats

__all__ = ["PrometheusStatLogger", "CONTENT_TYPE_LATEST", "MULTIPROC_ENV"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0)
# vLLM's buckets for vllm:request_time_per_output_token_seconds.
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets, ``limit`` = max_model_len)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10

# The core's numbers: (name, help, CoreStats attribute); gauges are "now", counters "since start".
_CORE_GAUGES = (
    ("tandem:num_requests_running", "Requests in the running batch", "num_running"),
    ("tandem:num_requests_waiting", "Requests waiting to be scheduled", "num_waiting"),
    ("tandem:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)", "kv_cache_usage"),
    ("tandem:kv_cache_used_blocks", "KV cache blocks held by requests", "kv_used_blocks"),
    ("tandem:kv_cache_total_blocks", "KV cache blocks in all", "num_kv_blocks"),
    ("tandem:prefix_cache_hit_rate", "Share of looked-up prompt tokens found in the prefix cache, since start",
     "prefix_hit_rate"),
    ("tandem:engine_step_overlap_ratio",
     "Share of steps launched before the previous step's output was read, since start", "overlap_ratio"),
)
_CORE_COUNTERS = (
    ("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    ("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hits"),
    ("tandem:num_preemptions", "Requests preempted (blocks freed, to recompute)", "num_preemptions"),
    ("tandem:engine_steps_launched", "Engine steps launched", "num_steps_launched"),
    ("tandem:engine_steps_launched_ahead", "Steps launched before the previous step's output was read (the overlap)",
     "num_steps_launched_ahead"),
    ("tandem:engine_idle_seconds", "Seconds the engine loop waited with no work", "idle_seconds"),
    ("tandem:engine_step_errors", "Engine steps that failed", "num_step_errors"),
    ("tandem:engine_prefill_steps", "Engine steps with prompt tokens beyond one token per request (prefill or "
     "chunked prefill, alone or beside decodes)", "num_prefill_steps"),
    ("tandem:spec_decode_num_drafts", "Speculative decoding: proposals verified (one per request per step)",
     "spec_num_drafts"),
    ("tandem:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified", "spec_num_draft_tokens"),
    ("tandem:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted",
     "spec_num_accepted_tokens"),
)


def _core_value(core: CoreStats, attr: str) -> float:
    if attr == "kv_used_blocks":
        return core.num_kv_blocks - core.num_free_kv_blocks
    if attr == "prefix_hit_rate":
        return core.prefix_cache_hits / core.prefix_cache_queries if core.prefix_cache_queries else 0.0
    if attr == "overlap_ratio":
        return core.num_steps_launched_ahead / core.num_steps_launched if core.num_steps_launched else 0.0
    return float(getattr(core, attr))


class _CoreCollector:
    """Reports the newest core snapshot a logger has seen."""

    def __init__(self, logger: "PrometheusStatLogger") -> None:
        self._logger = logger

    def collect(self) -> Iterator[Metric]:
        core, name = self._logger.core, self._logger.model_name
        for metric, doc, attr in _CORE_GAUGES:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], _core_value(core, attr))
            yield g
        for metric, doc, attr in _CORE_COUNTERS:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], _core_value(core, attr))
            yield c
        if core.spec_accepted_per_position:
            c = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens_per_pos",
                                    "Speculative decoding: draft tokens accepted at each position of the proposal",
                                    labels=["model_name", "position"])
            for pos, n in enumerate(core.spec_accepted_per_position):
                c.add_metric([name, str(pos)], float(n))
            yield c


class PrometheusStatLogger:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.core = CoreStats()
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        # Multiprocess mode: the values live in files (prometheus_client chose that at import,
        # from the environment); /metrics reads all processes' files, not a registry.
        r: Any = None if self.multiprocess else CollectorRegistry()
        self.registry = r
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = counter("tandem:prompt_tokens", "Prompt tokens of requests that started generating")
        self.generation_tokens = counter("tandem:generation_tokens", "Generated tokens")
        self.finished = Counter("tandem:request_success", "Finished requests by finish reason",
                                labels + ["finished_reason"], registry=r)
        self.ttft = histogram("tandem:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("tandem:inter_token_latency_seconds", "Time between tokens of a request", _ITL_BUCKETS)
        self.e2e = histogram("tandem:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("tandem:request_queue_time_seconds",
                                    "Time a request waited before it was first scheduled", _LATENCY_BUCKETS)
        self.tpot = histogram("tandem:request_time_per_output_token_seconds",
                              "Per request: seconds from its first to its last token over its tokens after the first "
                              "(0 for one token)", _TPOT_BUCKETS)
        # Token-count histograms: buckets up to max_model_len, known once the model is (set_max_model_len).
        self.request_prompt_tokens: Optional[Histogram] = None
        self.request_generation_tokens: Optional[Histogram] = None
        if r is not None:
            r.register(_CoreCollector(self))

    def set_max_model_len(self, max_model_len: int) -> None:
        """Create the per-request token-count histograms (once), with buckets up to ``max_model_len``."""
        if self.request_prompt_tokens is not None:
            return
        buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram(
            "tandem:request_prompt_tokens", "Prompt tokens per finished request", ["model_name"], buckets=buckets,
            registry=self.registry).labels(self.model_name)
        self.request_generation_tokens = Histogram(
            "tandem:request_generation_tokens", "Generated tokens per finished request", ["model_name"],
            buckets=buckets, registry=self.registry).labels(self.model_name)

    def record(self, core: CoreStats, it: IterationStats) -> None:
        self.core = core
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for t in it.inter_token_latencies:
            self.itl.observe(t)
        for t in it.queue_times:
            self.queue_time.observe(t)
        for f in it.finished:
            self.finished.labels(self.model_name, f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)
            self.tpot.observe(f.time_per_output_token)
            if self.request_prompt_tokens is not None and self.request_generation_tokens is not None:
                self.request_prompt_tokens.observe(f.num_prompt_tokens)
                self.request_generation_tokens.observe(f.num_generation_tokens)

    def render(self) -> bytes:
        if self.registry is not None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        registry.register(_CoreCollector(self))
        return generate_latest(registry)
