"""Prometheus metrics for /metrics, in a registry of the server's own.

A registry per server (not prometheus_client's global one) lets several servers live in
one process, as the tests do. The engine core sends totals (steps launched, launched
ahead, preemptions, prefix-cache lookups, idle seconds) with every batch; counters here
advance by the difference, so nothing is counted twice. Per-request timings come from the
front end (``IterationStats``).
"""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tandem.engine.messages import CoreStats
from tandem.engine.stats import IterationStats

__all__ = ["PrometheusStatLogger", "CONTENT_TYPE_LATEST"]

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


class PrometheusStatLogger:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("tandem:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("tandem:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("tandem:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)")
        self.kv_used = gauge("tandem:kv_cache_used_blocks", "KV cache blocks held by requests")
        self.kv_total = gauge("tandem:kv_cache_total_blocks", "KV cache blocks in all")
        self.prefix_queries = counter("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prefix_hit_rate = gauge("tandem:prefix_cache_hit_rate",
                                     "Share of looked-up prompt tokens found in the prefix cache, since start")
        self.preemptions = counter("tandem:num_preemptions", "Requests preempted (blocks freed, to recompute)")
        self.steps = counter("tandem:engine_steps_launched", "Engine steps launched")
        self.steps_ahead = counter("tandem:engine_steps_launched_ahead",
                                   "Steps launched before the previous step's output was read (the overlap)")
        self.overlap = gauge("tandem:engine_step_overlap_ratio",
                             "Share of steps launched before the previous step's output was read, since start")
        self.idle = counter("tandem:engine_idle_seconds", "Seconds the engine loop waited with no work")
        self.step_errors = counter("tandem:engine_step_errors", "Engine steps that failed")
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
        self.model_name = model_name
        self._last = CoreStats()

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
        self.running.set(core.num_running)
        self.waiting.set(core.num_waiting)
        self.kv_usage.set(core.kv_cache_usage)
        self.kv_used.set(core.num_kv_blocks - core.num_free_kv_blocks)
        self.kv_total.set(core.num_kv_blocks)
        last = self._last
        self.prefix_queries.inc(core.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_hits.inc(core.prefix_cache_hits - last.prefix_cache_hits)
        if core.prefix_cache_queries:
            self.prefix_hit_rate.set(core.prefix_cache_hits / core.prefix_cache_queries)
        self.preemptions.inc(core.num_preemptions - last.num_preemptions)
        self.steps.inc(core.num_steps_launched - last.num_steps_launched)
        self.steps_ahead.inc(core.num_steps_launched_ahead - last.num_steps_launched_ahead)
        if core.num_steps_launched:
            self.overlap.set(core.num_steps_launched_ahead / core.num_steps_launched)
        self.idle.inc(max(0.0, core.idle_seconds - last.idle_seconds))
        self.step_errors.inc(core.num_step_errors - last.num_step_errors)
        self._last = core
        for t in core.queue_times:
            self.queue_time.observe(t)

        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for t in it.inter_token_latencies:
            self.itl.observe(t)
        for f in it.finished:
            self.finished.labels(self.model_name, f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)
            self.tpot.observe(f.time_per_output_token)
            if self.request_prompt_tokens is not None and self.request_generation_tokens is not None:
                self.request_prompt_tokens.observe(f.num_prompt_tokens)
                self.request_generation_tokens.observe(f.num_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
