"""Serving overhead: output tokens/s of the server at a concurrency vs ``LLM.generate``, one run.

Both sides get the same token-id prompts, the same output length (greedy, ignore EOS) and
the same engine flags, with ``--max-num-seqs`` equal to the concurrency, so both run the
same batches. The offline ``LLM`` lives in this process; the server is a real ``tandem
serve`` process (HTTP, SSE, the engine core in its own process) driven by ``tandem bench
serve`` (``tandem.bench.serve.run_benchmark``) keeping ``--concurrency`` streams open.
Both stay loaded and the rounds alternate (O S, S O, ...), so drift in the load of a
shared machine hits both alike; the ratio is median server tokens/s / median offline
tokens/s; the goal is >= 0.9.

    python benchmarks/serve_overhead.py                       # embedded SmolLM2, 64 prompts
    python benchmarks/serve_overhead.py --model /path/to/hf --num-prompts 128 --output-len 128
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time

from serve_common import machine, random_prompts, start_server, stop_server


def offline(llm, args: argparse.Namespace, prompts: list[list[int]]) -> float:
    from tandem import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


async def online(url: str, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, int]:
    """The server's output tokens/s under ``tandem bench serve`` (its programmatic API), with
    exactly these prompts, ``--concurrency`` streams at a time."""
    from tandem.bench.datasets import SampleRequest
    from tandem.bench.serve import BenchmarkConfig, run_benchmark

    config = BenchmarkConfig(base_url=url, num_prompts=len(prompts), max_concurrency=args.concurrency,
                             random_output_len=args.output_len, warmup=False, disable_tqdm=True,
                             ignore_eos=True, temperature=0.0)
    samples = [SampleRequest(p, len(p), args.output_len) for p in prompts]
    result = await run_benchmark(config, samples)
    return result.metrics.output_token_throughput, result.metrics.failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from statistics import median

    from tandem import LLM, SamplingParams

    log = tempfile.NamedTemporaryFile(prefix="serve_overhead-", suffix=".log", delete=False).name
    with LLM(args.model, max_num_seqs=args.concurrency) as llm:
        prompts = random_prompts(llm.engine.model_config.vocab_size, args.num_prompts, args.input_len, args.seed)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        proc, url = start_server(args.model, ["--max-num-seqs", str(args.concurrency)], log)
        off: list[float] = []
        srv: list[float] = []
        errors = 0
        try:
            asyncio.run(online(url, args, prompts[:2]))  # warm-up
            for r in range(args.rounds):
                for side in (("offline", "server") if r % 2 == 0 else ("server", "offline")):
                    if side == "offline":
                        off.append(offline(llm, args, prompts))
                    else:
                        tps, errs = asyncio.run(online(url, args, prompts))
                        srv.append(tps)
                        errors += errs
                print(f"round {r + 1}: offline {off[-1]:.1f} tok/s, server {srv[-1]:.1f} tok/s", file=sys.stderr)
        finally:
            code = stop_server(proc)
    print(json.dumps({"offline_tok_s": [round(x, 1) for x in off], "server_tok_s": [round(x, 1) for x in srv],
                      "ratio_of_medians": round(median(srv) / median(off), 3), "errors": errors,
                      "server_exit": code, "num_prompts": args.num_prompts, "input_len": args.input_len,
                      "output_len": args.output_len, "concurrency": args.concurrency,
                      "model": args.model or "embedded SmolLM2-135M-Instruct", **machine()}))
    return 0 if errors == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
