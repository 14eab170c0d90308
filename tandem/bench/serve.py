"""``tandem bench serve``: measure a running OpenAI-compatible server under load.

The counterpart of ``vllm bench serve``: build a workload (random token prompts or a
dataset file), send it as streamed requests following an arrival process
(:mod:`tandem.bench.arrivals`) with an optional cap on requests in flight, time every
streamed chunk (:mod:`tandem.bench.client`), and report throughput and latency
(:mod:`tandem.bench.metrics`) as a table, and optionally as JSON and PNG charts.
``--concurrency-sweep`` repeats the run at several concurrency caps on the same workload
and charts throughput and latency against concurrency.

For programs and tests there is :func:`run_benchmark` (one run, a :class:`BenchmarkResult`)
and :func:`run_sweep`; for the command line :func:`add_cli_args` and :func:`main`. Exit
codes: 0 success, 1 the benchmark could not run (server unreachable, warm-up failed) or,
with ``--fail-on-error``, some request failed; 2 a usage error (bad flag, bad dataset).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import json
import logging
import math
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from tandem.bench.arrivals import ARRIVALS, arrival_offsets, resolve_arrival
from tandem.bench.datasets import (DatasetError, SampleRequest, load_file_dataset, random_requests,
                                   to_text_prompts)
from tandem.bench.metrics import BenchmarkMetrics, compute_metrics, parse_goodput, parse_percentiles
from tandem.bench.spec_metrics import fetch_spec_counters
from tandem.bench.records import RequestRecord
from tandem.bench.structured import constrain, load_schema
from tandem.bench.tokenizers import BenchTokenizer, TokenizerError

logger = logging.getLogger("tandem.bench")

DESCRIPTION = ("Benchmark a running OpenAI-compatible server (tandem, vLLM, SGLang) with streamed "
               "requests: throughput, TTFT, TPOT, ITL, end-to-end latency and goodput.")
RESULT_SCHEMA = "tandem.bench.serve/1"
WARMUP_MAX_TOKENS = 16


class BenchmarkError(RuntimeError):
    """The benchmark could not run (server unreachable, warm-up failed); one-line message."""


@dataclass
class BenchmarkConfig:
    """Everything that decides what one benchmark run sends and how it is measured."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: Optional[str] = None  # None: the first model that /v1/models lists
    api_key: Optional[str] = None
    # workload
    num_prompts: int = 1000
    dataset_path: Optional[str] = None  # None: random token prompts
    sharegpt_output_len: Optional[int] = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    random_vocab_size: Optional[int] = None
    tokenizer: Optional[str] = None  # local folder; None: the server's /tokenize, /detokenize
    seed: int = 0
    structured_output_ratio: float = 0.0  # share of requests sent with a JSON schema
    structured_output_schema: Optional[str] = None  # a JSON schema file; None: the default
    # load
    request_rate: float = math.inf
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    warmup: bool = True
    # request body
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    # reporting
    percentiles: list[float] = field(default_factory=lambda: [99.0])
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    disable_tqdm: bool = False

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    def validate(self) -> None:
        """Raise ``ValueError`` (one line) for settings that cannot work."""
        if not re.match(r"^https?://[^/]+", self.base_url):
            raise ValueError(f"--base-url must look like http://host:port, got {self.base_url!r}")
        if not self.endpoint.rstrip("/").endswith("completions"):
            raise ValueError(f"--endpoint must be /v1/completions or /v1/chat/completions, got {self.endpoint!r}")
        if self.num_prompts <= 0:
            raise ValueError(f"--num-prompts must be positive, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"--max-concurrency must be positive, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be positive, got {self.request_timeout_s}")
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            raise ValueError(f"--request-rate must be positive or inf, got {self.request_rate}")
        if self.random_vocab_size is not None and self.random_vocab_size <= 0:
            raise ValueError(f"--random-vocab-size must be positive, got {self.random_vocab_size}")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ValueError(f"--tokenizer must be a local folder, not found: {self.tokenizer}")
        if not 0.0 <= self.structured_output_ratio <= 1.0:
            raise ValueError(f"--structured-output-ratio must be in [0, 1], got {self.structured_output_ratio}")
        if self.structured_output_schema is not None and self.structured_output_ratio == 0.0:
            raise ValueError("--structured-output-schema needs a --structured-output-ratio above 0")
        resolve_arrival(self.arrival, self.burstiness)


@dataclass
class BenchmarkResult:
    """One run: its settings, the model it hit, every request and the aggregate metrics."""

    config: BenchmarkConfig
    model: str
    requests: list[SampleRequest]
    records: list[RequestRecord]
    metrics: BenchmarkMetrics
    duration_s: float
    start_time: float  # perf_counter at the first send, for per-request offsets
    date: str
    # The server's speculative decoding during the run (tandem.bench.spec_metrics), if any.
    spec_decode: Optional[dict[str, Any]] = None

    def per_request(self) -> dict[str, list[Any]]:
        """Per-request arrays, index-aligned with the workload."""
        def ms(x: Optional[float]) -> Optional[float]:
            return None if x is None else x * 1000.0

        recs = self.records
        return {
            "success": [r.success for r in recs],
            "error": [r.error for r in recs],
            "prompt_len": [r.prompt_tokens for r in recs],
            "expected_output_len": [s.expected_output_len for s in self.requests],
            "structured": [s.schema is not None for s in self.requests],
            "output_tokens": [r.output_tokens for r in recs],
            "output_tokens_from_usage": [r.output_tokens_from_usage for r in recs],
            "start_offset_s": [r.start_time - self.start_time for r in recs],
            "ttft_ms": [ms(r.ttft) if r.success else None for r in recs],
            "tpot_ms": [ms(r.tpot) if r.success else None for r in recs],
            "e2el_ms": [ms(r.e2el) if r.success else None for r in recs],
            "itl_ms": [[g * 1000.0 for g in r.itl] if r.success else [] for r in recs],
        }

    def to_dict(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config)
        cfg.pop("api_key", None)  # never write a secret into a result file
        return _jsonable({
            "schema": RESULT_SCHEMA,
            "date": self.date,
            "model": self.model,
            "base_url": self.config.base_url,
            "endpoint": self.config.endpoint,
            "num_prompts": len(self.requests),
            "num_structured": sum(s.schema is not None for s in self.requests),
            "request_rate": self.config.request_rate,
            "max_concurrency": self.config.max_concurrency,
            "duration_s": self.duration_s,
            "config": cfg,
            "metrics": self.metrics.to_dict(),
            "spec_decode": self.spec_decode,
            "requests": self.per_request(),
        })


def _jsonable(obj: Any) -> Any:
    """Strict-JSON copy: infinities become the string "inf" (JSON has no Infinity), NaN None."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


# --------------------------------------------------------------------------- the run


def _make_tokenizer(config: BenchmarkConfig, session: Any, model: str) -> BenchTokenizer:
    from tandem.bench.tokenizers import LocalTokenizer, ServerTokenizer

    if config.tokenizer:
        return LocalTokenizer(config.tokenizer)
    return ServerTokenizer(session, config.base_url, model, _headers(config))


def _headers(config: BenchmarkConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def build_workload(config: BenchmarkConfig, session: Any, model: str) -> list[SampleRequest]:
    """The requests of a run: random token prompts or a dataset file (text for chat)."""
    tokenizer: Optional[BenchTokenizer] = None

    def tok() -> BenchTokenizer:
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = _make_tokenizer(config, session, model)
        return tokenizer

    if config.dataset_path:
        samples = await load_file_dataset(config.dataset_path, config.num_prompts, tok(),
                                          seed=config.seed, output_len=config.sharegpt_output_len)
    else:
        vocab = config.random_vocab_size
        if vocab is None and config.tokenizer:
            vocab = tok().vocab_size
        samples = random_requests(config.num_prompts, config.random_input_len, config.random_output_len,
                                  config.random_range_ratio, config.random_prefix_len, vocab, config.seed)
    if config.structured_output_ratio > 0:
        samples = constrain(samples, config.structured_output_ratio, load_schema(config.structured_output_schema),
                            config.seed)
    if config.chat:
        samples = await to_text_prompts(samples, tok() if any(not isinstance(s.prompt, str)
                                                              for s in samples) else None)
    return samples


async def _paced_run(session: Any, config: BenchmarkConfig, client_cfg: Any,
                     samples: Sequence[SampleRequest]) -> tuple[list[RequestRecord], float, float]:
    """Send every sample on its arrival schedule; the records, start time and duration."""
    from tqdm import tqdm

    from tandem.bench.client import send_request

    offsets = arrival_offsets(len(samples), config.request_rate, config.arrival,
                              config.burstiness, config.seed)
    sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    pbar = tqdm(total=len(samples), disable=config.disable_tqdm, desc="requests", unit="req")

    async def one(i: int, s: SampleRequest) -> RequestRecord:
        if sem is None:
            rec = await send_request(session, client_cfg, s.prompt, s.prompt_len, s.expected_output_len, i, s.schema)
        else:
            async with sem:
                rec = await send_request(session, client_cfg, s.prompt, s.prompt_len,
                                         s.expected_output_len, i, s.schema)
        pbar.update(1)
        return rec

    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()
    try:
        for i, (s, off) in enumerate(zip(samples, offsets)):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, s)))
        records = list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        pbar.close()
    return records, t0, time.perf_counter() - t0


async def run_benchmark(config: BenchmarkConfig,
                        samples: Optional[Sequence[SampleRequest]] = None) -> BenchmarkResult:
    """Run one benchmark against ``config.base_url``.

    ``samples`` replaces the workload the config describes (a sweep reuses one workload).
    Raises ``ValueError``/:class:`DatasetError` for bad settings, :class:`TokenizerError`
    when prompts cannot be tokenized and :class:`BenchmarkError` when the server cannot be
    benchmarked; failures of individual requests are in the result, not raised.
    """
    import aiohttp

    from tandem.bench.client import ClientConfig, fetch_models, send_request

    config.validate()
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        model = config.model
        if not model:
            try:
                model = (await fetch_models(session, config.base_url, _headers(config)))[0]
            except RuntimeError as e:
                raise BenchmarkError(str(e)) from None
            logger.info("model: %s (first listed by the server)", model)
        if samples is None:
            samples = await build_workload(config, session, model)
        samples = list(samples)
        client_cfg = ClientConfig(api_url=config.api_url, model=model, chat=config.chat,
                                  api_key=config.api_key, ignore_eos=config.ignore_eos,
                                  temperature=config.temperature, timeout_s=config.request_timeout_s,
                                  extra_body=dict(config.extra_body))
        if config.warmup:
            # One of each kind: a constrained request's first use also compiles its grammar and
            # loads the grammar library, which must not fall into the measured window.
            warm = [next((s for s in samples if s.schema is None), None),
                    next((s for s in samples if s.schema is not None), None)]
            for s in (w for w in warm if w is not None):
                logger.info("warm-up request (not measured)%s", " with a JSON schema" if s.schema else "")
                rec = await send_request(session, client_cfg, s.prompt, s.prompt_len,
                                         min(s.expected_output_len, WARMUP_MAX_TOKENS), schema=s.schema)
                if not rec.success:
                    raise BenchmarkError(f"warm-up request to {config.api_url} failed: {rec.error}")
        pace = ("all at once" if math.isinf(config.request_rate)
                else f"{config.request_rate:g} req/s, {config.arrival} arrivals")
        logger.info("sending %d requests (%s, max concurrency %s)", len(samples), pace,
                    config.max_concurrency or "unlimited")
        date = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        spec_before = await fetch_spec_counters(session, config.base_url, _headers(config))
        records, t0, duration = await _paced_run(session, config, client_cfg, samples)
        spec_after = await fetch_spec_counters(session, config.base_url, _headers(config))
    metrics = compute_metrics(records, duration, config.percentiles, config.goodput_slos_ms)
    _log_failures(records)
    spec = spec_after.minus(spec_before).to_dict() if spec_after is not None and spec_before is not None else None
    return BenchmarkResult(config=config, model=model, requests=samples, records=records,
                           metrics=metrics, duration_s=duration, start_time=t0, date=date, spec_decode=spec)


async def run_sweep(config: BenchmarkConfig, concurrencies: Sequence[int]) -> list[BenchmarkResult]:
    """One run per concurrency cap, all on the same workload (built by the first run)."""
    results: list[BenchmarkResult] = []
    samples: Optional[list[SampleRequest]] = None
    for i, c in enumerate(concurrencies):
        cfg = dataclasses.replace(config, max_concurrency=c, warmup=config.warmup and i == 0,
                                  model=results[0].model if results else config.model)
        logger.info("sweep: max concurrency %d (%d/%d)", c, i + 1, len(concurrencies))
        r = await run_benchmark(cfg, samples)
        samples = r.requests
        results.append(r)
    return results


def _log_failures(records: Sequence[RequestRecord]) -> None:
    errors = Counter(r.error for r in records if not r.success)
    if errors:
        n = sum(errors.values())
        logger.warning("%d of %d requests failed:", n, len(records))
        for err, count in errors.most_common(5):
            logger.warning("  %d x %s", count, err)


# ------------------------------------------------------------------------- reporting


def format_summary(result: BenchmarkResult) -> str:
    """The vLLM-style result table."""
    m, cfg = result.metrics, result.config
    width = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        text = value if isinstance(value, str) else format(value, fmt)
        lines.append(f"{label:<40} {text:<10}")

    def section(title: str) -> None:
        lines.append("{s:{c}^{n}}".format(s=title, n=width, c="-"))

    row("Model:", result.model)
    row("Endpoint:", cfg.endpoint)
    if cfg.structured_output_ratio > 0:
        row("Structured-output requests:", f"{sum(s.schema is not None for s in result.requests)}/"
                                           f"{len(result.requests)}")
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Request rate configured (req/s):", "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:.2f}")
    row("Maximum request concurrency:", str(cfg.max_concurrency) if cfg.max_concurrency else "unlimited")
    row("Peak concurrent requests:", m.max_concurrent_requests)
    row("Benchmark duration (s):", m.duration_s, ".2f")
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput, ".2f")
        row("Requests meeting all SLOs:", f"{m.good_requests}/{m.completed + m.failed}")
    row("Input token throughput (tok/s):", m.input_token_throughput, ".2f")
    row("Output token throughput (tok/s):", m.output_token_throughput, ".2f")
    row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")
    for title, short, stats in (("Time to First Token", "TTFT", m.ttft_ms),
                                ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
                                ("Inter-token Latency", "ITL", m.itl_ms),
                                ("End-to-end Latency", "E2EL", m.e2el_ms)):
        section(title)
        if stats.count == 0:
            row(f"{short}:", "n/a")
            continue
        row(f"Mean {short} (ms):", stats.mean, ".2f")
        row(f"Median {short} (ms):", stats.median, ".2f")
        row(f"Std {short} (ms):", stats.std, ".2f")
        for key, value in stats.percentiles.items():
            row(f"P{key[1:]} {short} (ms):", value, ".2f")
    if result.spec_decode is not None and result.spec_decode["num_drafts"]:
        sd = result.spec_decode
        section("Speculative Decoding")
        row("Acceptance rate (%):", sd["acceptance_rate"] * 100, ".2f")
        row("Acceptance length:", sd["mean_acceptance_length"], ".2f")
        row("Drafts:", sd["num_drafts"])
        row("Draft tokens:", sd["num_draft_tokens"])
        row("Accepted tokens:", sd["num_accepted_tokens"])
        for pos, rate in enumerate(sd["acceptance_rate_per_position"]):
            row(f"Acceptance rate, position {pos} (%):", rate * 100, ".2f")
    lines.append("=" * width)
    return "\n".join(lines)


def default_result_stem(config: BenchmarkConfig, model: str, sweep: bool = False) -> str:
    kind = "chat" if config.chat else "completions"
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    conc = "sweep" if sweep else f"c{config.max_concurrency or 'inf'}"
    short = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/").split("/")[-1]) or "model"
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"tandem-bench-{kind}-{rate}qps-{conc}-{short}-{stamp}"


def write_json(data: dict[str, Any], path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, allow_nan=False)
        f.write("\n")
    return path


def sweep_to_dict(results: Sequence[BenchmarkResult]) -> dict[str, Any]:
    return {
        "schema": RESULT_SCHEMA,
        "sweep": {"max_concurrency": [r.config.max_concurrency for r in results]},
        "runs": [r.to_dict() for r in results],
    }


# ----------------------------------------------------------------------- command line


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tandem bench serve`` (names follow ``vllm bench serve``)."""
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=None,
                   help="server root URL (default http://127.0.0.1:8000; or use --host/--port)")
    g.add_argument("--host", default=None, help="server host (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="server port (default 8000)")
    g.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default; token-id prompts) or /v1/chat/completions")
    g.add_argument("--model", default=None, help="model name to send (default: first from /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default: $OPENAI_API_KEY if set)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take before it counts as failed (default 600)")

    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send (default 1000)")
    g.add_argument("--dataset-path", default=None,
                   help="JSON/JSONL file: ShareGPT conversations or {prompt, output_len} records "
                        "(default: random token prompts)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output length for every dataset request, replacing the dataset's")
    g.add_argument("--random-input-len", type=int, default=1024, help="random prompt length (default 1024)")
    g.add_argument("--random-output-len", type=int, default=128, help="random output length (default 128)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: exact)")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="token ids shared by every random prompt, ahead of its random part (default 0)")
    g.add_argument("--random-vocab-size", type=int, default=None,
                   help="draw random token ids from [0, N) (default: the --tokenizer vocabulary, else 128)")
    g.add_argument("--tokenizer", default=None,
                   help="local tokenizer folder for counting and decoding (default: the server's "
                        "/tokenize and /detokenize)")
    g.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals (default 0)")
    g.add_argument("--structured-output-ratio", type=float, default=0.0,
                   help="share of requests sent with a JSON schema (completions: structured_outputs.json; chat: "
                        "response_format json_schema), as vLLM's structured-output benchmark (default 0)")
    g.add_argument("--structured-output-schema", default=None, metavar="FILE",
                   help="JSON schema file for those requests (default: a list of at least 512 records, which "
                        "no request can finish, so every output token is constrained)")

    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second; inf (default) sends everything at once")
    g.add_argument("--arrival", choices=ARRIVALS, default=None,
                   help="arrival process for a finite rate (default poisson; gamma when --burstiness != 1)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape: <1 burstier, >1 more even than Poisson (default 1)")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--concurrency-sweep", default=None, metavar="N,N,...",
                   help="run once per max concurrency (e.g. 1,4,16,64) and plot against it")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="send one unmeasured request first, and stop if it fails (default on)")

    g = parser.add_argument_group("request body")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens tokens (vLLM extension; default on)")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help="JSON object merged into every request body, e.g. '{\"top_p\": 0.9}'")

    g = parser.add_argument_group("report")
    g.add_argument("--metric-percentiles", default="99",
                   help="percentiles to report, comma separated (default 99)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000 (milliseconds)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--save-result", action="store_true", help="write the result as JSON")
    g.add_argument("--result-dir", default=".", help="folder for JSON and PNG files (default .)")
    g.add_argument("--result-filename", default=None, help="JSON file name (default: generated)")
    g.add_argument("--plot", action="store_true", help="write latency distribution PNGs")
    g.add_argument("--fail-on-error", action="store_true", help="exit 1 if any request failed")


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """A validated config from parsed flags; ``ValueError`` (one line) for bad ones."""
    if args.base_url and (args.host or args.port):
        raise ValueError("give either --base-url or --host/--port, not both")
    base_url = args.base_url or f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    extra: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except ValueError as e:
            raise ValueError(f"--extra-body is not valid JSON ({e})") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    cfg = BenchmarkConfig(
        base_url=base_url, endpoint=args.endpoint, model=args.model, api_key=args.api_key or None,
        num_prompts=args.num_prompts, dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, random_vocab_size=args.random_vocab_size,
        tokenizer=args.tokenizer, seed=args.seed, structured_output_ratio=args.structured_output_ratio,
        structured_output_schema=args.structured_output_schema, request_rate=args.request_rate,
        arrival=resolve_arrival(args.arrival, args.burstiness), burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, warmup=args.warmup, ignore_eos=args.ignore_eos,
        temperature=args.temperature, extra_body=extra, request_timeout_s=args.request_timeout,
        percentiles=parse_percentiles(args.metric_percentiles),
        goodput_slos_ms=parse_goodput(args.goodput), disable_tqdm=args.disable_tqdm,
    )
    cfg.validate()
    return cfg


def parse_sweep(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency-sweep must be comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--concurrency-sweep needs positive integers, got {text!r}")
    return values


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def main(args: argparse.Namespace) -> int:
    """Run ``tandem bench serve`` with parsed flags; returns the exit code."""
    _setup_logging()
    try:
        config = config_from_args(args)
        sweep = parse_sweep(args.concurrency_sweep)
        if args.plot:
            from tandem.bench.plots import require_matplotlib

            require_matplotlib()
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if sweep:
            results = asyncio.run(run_sweep(config, sweep))
        else:
            results = [asyncio.run(run_benchmark(config))]
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TokenizerError as e:
        hint = "" if config.tokenizer else " (or pass --tokenizer FOLDER to count tokens locally)"
        print(f"error: {e}{hint}", file=sys.stderr)
        return 2 if config.tokenizer else 1
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    for r in results:
        print(format_summary(r))
    stem = (os.path.splitext(args.result_filename)[0] if args.result_filename
            else default_result_stem(config, results[0].model, sweep=bool(sweep)))
    if args.save_result:
        name = args.result_filename or stem + ".json"
        data = sweep_to_dict(results) if sweep else results[0].to_dict()
        logger.info("result written to %s", write_json(data, os.path.join(args.result_dir, name)))
    _write_plots(args, results, stem, bool(sweep))
    failed = sum(r.metrics.failed for r in results)
    return 1 if (args.fail_on_error and failed) else 0


def _write_plots(args: argparse.Namespace, results: Sequence[BenchmarkResult], stem: str, sweep: bool) -> None:
    if not (args.plot or sweep):
        return
    try:
        from tandem.bench import plots

        plots.require_matplotlib()
    except ImportError as e:
        logger.warning("no plots: %s", e)
        return
    os.makedirs(args.result_dir, exist_ok=True)
    if args.plot:
        for r in results:
            suffix = f"-c{r.config.max_concurrency}" if sweep else ""
            path = os.path.join(args.result_dir, f"{stem}{suffix}-latency.png")
            title = f"{r.model} {r.config.endpoint}, concurrency {r.config.max_concurrency or 'unlimited'}"
            logger.info("plot written to %s", plots.plot_latency_distributions(r.per_request(), path, title))
    if sweep:
        points = [{"max_concurrency": r.config.max_concurrency, "metrics": r.metrics.to_dict()} for r in results]
        path = os.path.join(args.result_dir, f"{stem}-sweep.png")
        logger.info("plot written to %s", plots.plot_concurrency_sweep(points, path, f"{results[0].model} "
                                                                        f"{results[0].config.endpoint}"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem bench serve", description=DESCRIPTION)
    add_cli_args(parser)
    return parser


if __name__ == "__main__":  # python -m tandem.bench.serve ...
    sys.exit(main(build_parser().parse_args()))
