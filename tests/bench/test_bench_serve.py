"""The benchmark runner end to end against the local protocol test double: results, JSON,
PNG charts, the sweep, and the command line's exit codes."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import pytest

from openai_stub import FakeOpenAIServer, unused_port
from tandem.bench.serve import (BenchmarkConfig, add_cli_args, format_summary, main, run_benchmark,
                                run_sweep)

pytestmark = pytest.mark.timeout(60)


def cfg(base_url: str, **kw) -> BenchmarkConfig:
    base = dict(base_url=base_url, num_prompts=8, random_input_len=12, random_output_len=5,
                disable_tqdm=True, percentiles=[50, 90, 99])
    return BenchmarkConfig(**(base | kw))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(argv)


def assert_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 200 and im.size[1] > 200


def test_run_benchmark_completions():
    with FakeOpenAIServer() as srv:
        res = asyncio.run(run_benchmark(cfg(srv.base_url, max_concurrency=2, random_range_ratio=0.5,
                                            goodput_slos_ms={"e2el": 60_000})))
        sent = srv.requests
    m = res.metrics
    assert res.model == "stub-model"  # the first of /v1/models
    assert (m.completed, m.failed) == (8, 0)
    assert len(sent) == 9  # warm-up + 8
    assert sent[0]["max_tokens"] <= 16
    assert [len(b["prompt"]) for b in sent[1:]] == [s.prompt_len for s in res.requests]
    assert m.total_output_tokens == sum(s.expected_output_len for s in res.requests)
    assert m.total_input_tokens == sum(s.prompt_len for s in res.requests)
    assert 1 <= m.max_concurrent_requests <= 2
    assert m.good_requests == 8 and m.request_goodput == pytest.approx(8 / res.duration_s)
    assert m.ttft_ms.count == 8 and m.e2el_ms.mean >= m.ttft_ms.mean > 0
    text = format_summary(res)
    for needle in ("Serving Benchmark Result", "Successful requests:", "Output token throughput (tok/s):",
                   "P90 TTFT (ms):", "Median TPOT (ms):", "P99 E2EL (ms):", "Request goodput (req/s):"):
        assert needle in text


def test_run_benchmark_chat_uses_server_detokenize():
    with FakeOpenAIServer() as srv:
        res = asyncio.run(run_benchmark(cfg(srv.base_url, endpoint="/v1/chat/completions", model="stub-model",
                                            random_vocab_size=50, warmup=False, num_prompts=4)))
        sent = srv.requests
    assert res.metrics.completed == 4 and len(sent) == 4
    for body, s in zip(sent, res.requests):
        content = body["messages"][0]["content"]
        assert content == s.prompt and len(content.split()) == 12 and content.startswith("t")


def test_fixed_rate_paces_requests():
    with FakeOpenAIServer() as srv:
        res = asyncio.run(run_benchmark(cfg(srv.base_url, num_prompts=5, request_rate=20.0, arrival="fixed",
                                            warmup=False, random_output_len=2)))
    starts = res.per_request()["start_offset_s"]
    assert res.duration_s >= 0.2
    assert all(abs(s - i * 0.05) < 0.04 for i, s in enumerate(starts))


def test_failures_are_counted_not_raised():
    with FakeOpenAIServer(fail_every=3) as srv:
        res = asyncio.run(run_benchmark(cfg(srv.base_url, num_prompts=9, warmup=False)))
    assert (res.metrics.completed, res.metrics.failed) == (6, 3)
    errors = res.per_request()["error"]
    assert errors.count("HTTP 500: injected failure") == 3


def test_sweep_reuses_workload():
    with FakeOpenAIServer() as srv:
        results = asyncio.run(run_sweep(cfg(srv.base_url, num_prompts=6), [1, 3]))
        n_sent = len(srv.requests)
    assert [r.config.max_concurrency for r in results] == [1, 3]
    assert results[0].requests == results[1].requests
    assert results[0].metrics.max_concurrent_requests == 1
    assert n_sent == 1 + 6 + 6  # one warm-up only


def test_main_writes_json_and_pngs(tmp_path: Path, capsys):
    with FakeOpenAIServer() as srv:
        rc = main(parse(["--base-url", srv.base_url, "--num-prompts", "6", "--random-input-len", "8",
                         "--random-output-len", "4", "--max-concurrency", "3", "--disable-tqdm",
                         "--metric-percentiles", "50,90", "--goodput", "ttft:10000", "tpot:10000",
                         "--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json",
                         "--plot", "--api-key", "k"]))
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P90 ITL (ms):" in out
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["schema"] == "tandem.bench.serve/1"
    assert data["model"] == "stub-model" and data["num_prompts"] == 6 and data["max_concurrency"] == 3
    assert data["request_rate"] == "inf" and data["config"]["request_rate"] == "inf"
    assert "api_key" not in data["config"]
    m = data["metrics"]
    for key in ("completed", "failed", "request_throughput", "output_token_throughput", "total_token_throughput",
                "input_token_throughput", "max_concurrent_requests", "request_goodput", "good_requests"):
        assert key in m
    assert m["completed"] == 6 and m["goodput_slos_ms"] == {"ttft": 10000.0, "tpot": 10000.0}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(m[key]) == {"count", "mean", "median", "std", "p99", "percentiles"}
        assert set(m[key]["percentiles"]) == {"p50", "p90", "p99"}
    req = data["requests"]
    for key in ("success", "error", "prompt_len", "expected_output_len", "output_tokens", "start_offset_s",
                "ttft_ms", "tpot_ms", "e2el_ms", "itl_ms"):
        assert len(req[key]) == 6, key
    assert req["output_tokens"] == [4] * 6 and all(len(x) == 3 for x in req["itl_ms"])
    assert_png(tmp_path / "run-latency.png")


def test_main_concurrency_sweep_plot(tmp_path: Path, capsys):
    with FakeOpenAIServer() as srv:
        rc = main(parse(["--port", str(srv.port), "--num-prompts", "4", "--random-input-len", "4",
                         "--random-output-len", "3", "--disable-tqdm", "--concurrency-sweep", "1,2,4",
                         "--save-result", "--result-dir", str(tmp_path), "--no-warmup"]))
    assert rc == 0
    assert capsys.readouterr().out.count("Serving Benchmark Result") == 3
    (json_path,) = tmp_path.glob("*.json")
    assert json_path.name.startswith("tandem-bench-completions-infqps-sweep-stub-model-")
    data = json.loads(json_path.read_text())
    assert data["sweep"]["max_concurrency"] == [1, 2, 4] and len(data["runs"]) == 3
    (png,) = tmp_path.glob("*-sweep.png")
    assert png.name == json_path.stem + "-sweep.png"
    assert_png(png)


def test_main_exit_codes(tmp_path: Path, capsys):
    down = f"http://127.0.0.1:{unused_port()}"
    usage = [
        ["--base-url", down, "--host", "h"],
        ["--base-url", down, "--goodput", "ttft"],
        ["--base-url", down, "--metric-percentiles", "x"],
        ["--base-url", down, "--num-prompts", "0"],
        ["--base-url", down, "--endpoint", "/v1/embeddings"],
        ["--base-url", down, "--concurrency-sweep", "1,0"],
        ["--base-url", down, "--arrival", "poisson", "--burstiness", "2"],
        ["--base-url", down, "--extra-body", "[1]"],
        ["--base-url", down, "--tokenizer", str(tmp_path / "nope")],
        ["--base-url", down, "--structured-output-ratio", "1.5"],
        ["--base-url", down, "--structured-output-schema", str(tmp_path / "s.json")],  # without a ratio
    ]
    for argv in usage:
        assert main(parse(argv + ["--disable-tqdm"])) == 2, argv
    # server down: cannot list models
    assert main(parse(["--base-url", down, "--disable-tqdm"])) == 1
    assert "cannot reach" in capsys.readouterr().err
    with FakeOpenAIServer(fail_every=2) as srv:
        base = ["--base-url", srv.base_url, "--model", "stub-model", "--num-prompts", "4", "--random-input-len",
                "4", "--random-output-len", "2", "--disable-tqdm", "--no-warmup"]
        missing = main(parse(base + ["--dataset-path", str(tmp_path / "missing.jsonl")]))
        assert missing == 2 and "dataset file not found" in capsys.readouterr().err
        (tmp_path / "bad.json").write_text("[1, 2]")
        for schema in ("bad.json", "none.json"):
            rc = main(parse(base + ["--structured-output-ratio", "0.5", "--structured-output-schema",
                                    str(tmp_path / schema)]))
            assert rc == 2 and "--structured-output-schema" in capsys.readouterr().err
        assert main(parse(base)) == 0  # failures reported, not an error by default
        assert main(parse(base + ["--fail-on-error"])) == 1


def test_structured_output_share_completions():
    """A quarter of the requests carry vLLM's ``structured_outputs.json`` with the default
    schema (which no request can finish); the rest are unchanged; the result says which."""
    from tandem.bench.structured import DEFAULT_SCHEMA

    with FakeOpenAIServer() as srv:
        res = asyncio.run(run_benchmark(cfg(srv.base_url, structured_output_ratio=0.25)))
        sent = srv.requests
    warm, sent = sent[:2], sent[2:]  # one warm-up of each kind: the grammar compiles before the measurement
    assert ["structured_outputs" in b for b in warm] == [False, True]
    flags = res.per_request()["structured"]
    assert sum(flags) == 2 and res.to_dict()["num_structured"] == 2
    by_prompt = {tuple(b["prompt"]): b for b in sent}
    for s, flag in zip(res.requests, flags):
        body = by_prompt[tuple(s.prompt)]
        assert ("structured_outputs" in body) == flag and "response_format" not in body
        if flag:
            assert body["structured_outputs"] == {"json": DEFAULT_SCHEMA}
        assert body["max_tokens"] == s.expected_output_len and body["ignore_eos"] is True
    assert "Structured-output requests:" in format_summary(res) and res.metrics.completed == 8


def test_structured_output_chat_response_format(tmp_path: Path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    with FakeOpenAIServer() as srv:
        res = asyncio.run(run_benchmark(cfg(srv.base_url, endpoint="/v1/chat/completions", model="stub-model",
                                            structured_output_ratio=1.0,
                                            structured_output_schema=str(tmp_path / "schema.json"))))
        sent = srv.requests
    chat = [b for b in sent if "messages" in b]
    assert len(chat) == 9 and all(res.per_request()["structured"])  # one warm-up: no unconstrained request
    for b in chat:
        assert b["response_format"] == {"type": "json_schema", "json_schema": {"name": "bench_records",
                                                                               "schema": schema}}
        assert "structured_outputs" not in b


def test_warmup_failure_stops_the_run(capsys):
    with FakeOpenAIServer(fail_every=1) as srv:
        rc = main(parse(["--base-url", srv.base_url, "--num-prompts", "3", "--random-input-len", "4",
                         "--random-output-len", "2", "--disable-tqdm"]))
        assert len(srv.requests) == 1
    assert rc == 1
    assert "warm-up request" in capsys.readouterr().err


def test_dataset_file_through_server_tokenizer(tmp_path: Path):
    path = tmp_path / "sharegpt.json"
    conv = {"conversations": [{"from": "human", "value": "t1 t2 t3 t4 t5"},
                              {"from": "gpt", "value": "t6 t7 t8 t9"}]}
    path.write_text(json.dumps([conv] * 3))
    with FakeOpenAIServer() as srv:
        res = asyncio.run(run_benchmark(cfg(srv.base_url, dataset_path=str(path), num_prompts=3, warmup=False)))
    assert [(s.prompt_len, s.expected_output_len) for s in res.requests] == [(5, 4)] * 3
    assert res.metrics.completed == 3 and res.metrics.total_output_tokens == 12


def test_config_defaults_match_vllm():
    c = BenchmarkConfig()
    assert (c.num_prompts, c.random_input_len, c.random_output_len) == (1000, 1024, 128)
    assert math.isinf(c.request_rate) and c.ignore_eos and c.temperature == 0.0
    assert c.api_url == "http://127.0.0.1:8000/v1/completions" and not c.chat
    assert BenchmarkConfig(endpoint="/v1/chat/completions").chat
