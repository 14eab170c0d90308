"""Soak: many streamed requests at a high concurrency, a share of clients leaving mid-stream.

Sends ``--num-requests`` completions (token-id prompts, fixed output length, ignore EOS) to a
real ``tandem serve`` process with ``--concurrency`` streams open at a time. A random
``--disconnect-share`` of the clients close their connection after a random number of
chunks. Every request has a deadline (``--request-timeout-s``): one that passes it is a
hang. At the end the server must hold no KV block and run no request (read from /metrics),
answer /health and a fresh request, and every client that stayed must have received its
full output with no error.

    python benchmarks/serve_soak.py                     # embedded SmolLM2, 1000 requests at 64
    python benchmarks/serve_soak.py --model /path/to/hf --num-requests 2000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time

from serve_common import machine, random_prompts, read_metrics, start_server, stop_server, stream_completion


async def soak(url: str, args: argparse.Namespace, vocab: int) -> dict:
    import httpx

    rng = random.Random(args.seed)
    prompts = random_prompts(vocab, args.num_requests, args.input_len, args.seed)
    leave_after = [rng.randint(1, args.output_len - 1) if rng.random() < args.disconnect_share else None
                   for _ in prompts]
    sem = asyncio.Semaphore(args.concurrency)
    counts = {"completed": 0, "disconnected": 0, "errors": 0, "hangs": 0, "short": 0}
    first_errors: list[str] = []
    body = {"max_tokens": args.output_len, "temperature": 0.8, "ignore_eos": True}
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as client:
        async def one(i: int) -> None:
            async with sem:
                err = ""
                try:
                    r = await asyncio.wait_for(
                        stream_completion(client, url, {**body, "prompt": prompts[i], "seed": i}, leave_after[i]),
                        args.request_timeout_s)
                except asyncio.TimeoutError:
                    counts["hangs"] += 1
                    return
                except httpx.HTTPError as e:
                    r = None
                    err = f"{type(e).__name__}: {e}"
                if r is not None and r.disconnected:
                    counts["disconnected"] += 1
                    return
                if r is None or r.error is not None:
                    counts["errors"] += 1
                    if len(first_errors) < 5:
                        first_errors.append(err if r is None else str(r.error))
                elif r.completion_tokens != args.output_len or r.finish_reason != "length":
                    counts["short"] += 1
                else:
                    counts["completed"] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    return {**counts, "first_errors": first_errors, "wall_s": round(wall, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect-share", type=float, default=0.2)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import httpx

    from tandem.config import EngineConfig
    from tandem.models.model_config import resolve_model_config

    vocab = resolve_model_config(EngineConfig(model=args.model)).vocab_size
    log = tempfile.NamedTemporaryFile(prefix="serve_soak-", suffix=".log", delete=False).name
    proc, url = start_server(args.model, ["--max-num-seqs", str(args.concurrency)], log)
    try:
        result = asyncio.run(soak(url, args, vocab))
        deadline = time.monotonic() + 30
        while True:  # the last blocks are freed a step after the last output
            m = read_metrics(url)
            idle = m["tandem:kv_cache_used_blocks"] == 0 and m["tandem:num_requests_running"] == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        health = httpx.get(f"{url}/health", timeout=30).status_code
        fresh_prompt = random_prompts(vocab, 1, 4, seed=-1)[0]
        fresh = httpx.post(f"{url}/v1/completions", json={"prompt": fresh_prompt, "max_tokens": 4},
                           timeout=120).status_code
    finally:
        code = stop_server(proc)
    result.update({
        "kv_blocks_held_at_end": m["tandem:kv_cache_used_blocks"], "running_at_end": m["tandem:num_requests_running"],
        "waiting_at_end": m["tandem:num_requests_waiting"],
        "aborted_after_disconnect": m.get("tandem:request_success_total{finished_reason=abort}", 0),
        "health_after": health, "fresh_request_status": fresh, "server_exit": code,
        "num_requests": args.num_requests, "concurrency": args.concurrency,
        "disconnect_share": args.disconnect_share, "input_len": args.input_len, "output_len": args.output_len,
        "model": args.model or "embedded SmolLM2-135M-Instruct", **machine(),
    })
    print(json.dumps(result))
    ok = (result["hangs"] == result["errors"] == result["short"] == 0 and m["tandem:kv_cache_used_blocks"] == 0
          and health == 200 and fresh == 200 and code == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
