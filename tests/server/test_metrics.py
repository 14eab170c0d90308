"""/metrics, parsed with prometheus_client's own parser: every counter moves by exactly the work done."""
from __future__ import annotations

import httpx
import pytest

from server_utils import idle, wait_for

pytestmark = pytest.mark.timeout(300)


def test_counters_move(server):
    before = wait_for(server, idle)
    prompt = " ".join(f"t{20 + i}" for i in range(40))  # 40 tokens: two full 16-token blocks to reuse
    r1 = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                          "ignore_eos": True}, timeout=60).json()
    r2 = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 6, "n": 2, "seed": 1,
                                                          "ignore_eos": True}, timeout=60).json()
    chunks = 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "t5"}], "max_tokens": 5, "stream": True,
                            "ignore_eos": True}, timeout=60) as s:
        chunks = sum(1 for line in s.iter_lines() if line.startswith("data: {"))
    assert chunks >= 5
    after = wait_for(server, lambda m: idle(m) and m["tandem:e2e_request_latency_seconds_count"]
                     >= before["tandem:e2e_request_latency_seconds_count"] + 4)

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    generated = r1["usage"]["completion_tokens"] + r2["usage"]["completion_tokens"] + 5
    assert moved("tandem:generation_tokens_total") == generated == 6 + 12 + 5
    # Prompt tokens count once per request (n=2 too), when its first token arrives; the chat
    # prompt is "user : t5 t2 t3" through the test template.
    assert moved("tandem:prompt_tokens_total") == 40 + 40 + 5
    assert moved("tandem:request_success_total{finished_reason=length}") == 4  # n=2 is two
    assert moved("tandem:time_to_first_token_seconds_count") == 3
    assert moved("tandem:inter_token_latency_seconds_count") == 5 + 2 * 5 + 4
    assert moved("tandem:e2e_request_latency_seconds_count") == 4
    # vLLM's per-request histograms: one observation per finished choice
    assert moved("tandem:request_time_per_output_token_seconds_count") == 4
    assert 0 < moved("tandem:request_time_per_output_token_seconds_sum") < moved(
        "tandem:e2e_request_latency_seconds_sum")
    assert moved("tandem:request_prompt_tokens_count") == moved("tandem:request_generation_tokens_count") == 4
    assert moved("tandem:request_prompt_tokens_sum") == 40 + 2 * 40 + 5  # n=2: each choice counts its prompt
    assert moved("tandem:request_generation_tokens_sum") == generated
    assert moved('tandem:request_prompt_tokens_bucket{le=50.0}') == 4  # 1-2-5 buckets, as vLLM's
    assert moved('tandem:request_generation_tokens_bucket{le=5.0}') == 1  # the 5-token chat
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # r1 computed those two blocks
    assert moved("tandem:request_queue_time_seconds_count") >= 3
    assert moved("tandem:engine_steps_launched_total") >= 6
    assert moved("tandem:engine_steps_launched_ahead_total") >= 1  # async scheduling overlaps steps
    # r1's 40-token prompt, r2's 8 uncached ones, the chat's 5: each in a step of its own
    assert 3 <= moved("tandem:engine_prefill_steps_total") < moved("tandem:engine_steps_launched_total")
    assert 0 < after["tandem:engine_step_overlap_ratio"] <= 1
    # The engine waited between the requests (each one is sent after the last answer came).
    assert "tandem:engine_idle_seconds_total" in after and moved("tandem:engine_idle_seconds_total") > 0
    assert moved("tandem:prefix_cache_queries_total") >= 80
    assert moved("tandem:prefix_cache_hits_total") >= 32  # the second request reuses the first one's blocks
    assert 0 < after["tandem:prefix_cache_hit_rate"] <= 1
    assert after["tandem:kv_cache_total_blocks"] == 512 and after["tandem:kv_cache_usage_perc"] == 0
    assert after["tandem:num_requests_waiting"] == 0
