"""API-server CPU per streamed token: what one ``tandem serve`` front-end process spends to
deliver each token, with a model so small that the engine is never the bound.

A tiny random Llama (hidden 64, 2 layers) with a real byte-level BPE tokenizer (the
embedded SmolLM2's, vocabulary 49,152, so detokenization costs what it costs in use; the
word-level test tokenizer with ``--word-tokenizer``) is served by a real ``tandem serve``
process and driven by ``tandem bench serve`` (its programmatic API) with token-id prompts,
greedy, ``ignore_eos``. The CPU seconds of the API-server process(es) (user + system, from
/proc, over the timed run only) divided by the streamed output tokens is the figure; wall
tokens/s is context. Run it against another checkout with ``PYTHONPATH=<that checkout>``
to compare versions (the server is started as ``python -m tandem.entrypoints.openai``).

    python benchmarks/api_server_cpu.py --out benchmarks/results/cpu_api_server_cpu.json
    PYTHONPATH=/path/to/old/checkout python benchmarks/api_server_cpu.py
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from serve_common import machine, random_prompts, start_server, stop_server

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_model(path: Path, word_tokenizer: bool) -> int:
    """A tiny random Llama in ``path``; returns its vocabulary size."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_word_tokenizer

    source = None
    if not word_tokenizer:
        from tandem.models.loader import default_model_path, resolve_model

        try:
            source = resolve_model(default_model_path(), os.path.expanduser("~/.cache/tandem"))
        except FileNotFoundError:
            print("no embedded model: using the word tokenizer", file=sys.stderr)
    vocab = 49152 if source else 1024
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    if source:
        for name in _TOKENIZER_FILES:
            for f in glob.glob(os.path.join(source, name)):
                shutil.copy(f, path)
    else:
        make_word_tokenizer(vocab).save_pretrained(path)
    return vocab


def api_server_pids(launcher: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher and b"tandem.entrypoints.openai.server_process" in cmd:
            kids.append(int(d))
    return kids or [launcher]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from tandem.bench.datasets import SampleRequest
    from tandem.bench.serve import BenchmarkConfig, run_benchmark

    config = BenchmarkConfig(base_url=url, num_prompts=len(prompts), max_concurrency=args.concurrency,
                             random_output_len=args.output_len, warmup=False, disable_tqdm=True,
                             ignore_eos=True, temperature=0.0)
    result = await run_benchmark(config, [SampleRequest(p, len(p), args.output_len) for p in prompts])
    m = result.metrics
    return {"output_tokens": m.total_output_tokens, "failed": m.failed, "output_tok_s": m.output_token_throughput,
            "duration_s": m.duration_s, "mean_ttft_ms": m.ttft_ms.mean, "mean_tpot_ms": m.tpot_ms.mean}


def start_profile(pid: int, path: str, extra: Optional[list[str]] = None):
    import subprocess

    return subprocess.Popen(["py-spy", "record", "-p", str(pid), "-r", "250", "--format", "raw", "-o", path]
                            + (extra or []),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profile(spy, path: str, top: int = 30) -> None:
    """Stop py-spy and print where the samples fell (own = the innermost frame)."""
    import collections
    import signal

    spy.send_signal(signal.SIGINT)
    spy.wait(60)
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    print(f"py-spy: {total} samples", file=sys.stderr)
    for title, counter in (("own", own), ("inclusive", inclusive)):
        print(f"-- top by {title} samples", file=sys.stderr)
        for f, n in counter.most_common(top):
            print(f"{100 * n / total:5.1f}%  {f}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--api-server-count", type=int, default=1)
    p.add_argument("--word-tokenizer", action="store_true")
    p.add_argument("--out", default=None, help="write the JSON here too")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="py-spy the (first) API-server process during round 1: raw stacks to FILE, and the top "
                        "functions by own and by inclusive samples printed")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        vocab = build_model(Path(tmp) / "model", args.word_tokenizer)
        engine_args = ["--max-num-seqs", str(args.concurrency), "--max-model-len", "512",
                       "--num-kv-blocks", str(args.concurrency * 8 + 64), "--no-enable-prefix-caching"]
        if args.api_server_count != 1:
            engine_args += ["--api-server-count", str(args.api_server_count)]
        proc, url = start_server(str(Path(tmp) / "model"), engine_args, os.path.join(tmp, "server.log"))
        try:
            time.sleep(2.0)  # every API-server process up
            pids = api_server_pids(proc.pid)
            asyncio.run(drive(url, random_prompts(vocab, 64, args.input_len, seed=99), args))  # warm-up
            rounds = []
            for r in range(args.rounds):
                prompts = random_prompts(vocab, args.num_prompts, args.input_len, seed=r)
                before = sum(cpu_seconds(pid) for pid in pids)
                spy = start_profile(pids[0], args.profile) if args.profile and r == 0 else None
                res = asyncio.run(drive(url, prompts, args))
                if spy is not None:
                    stop_profile(spy, args.profile)
                res["api_server_cpu_s"] = sum(cpu_seconds(pid) for pid in pids) - before
                res["api_server_cpu_us_per_token"] = res["api_server_cpu_s"] / max(1, res["output_tokens"]) * 1e6
                rounds.append(res)
                print(f"round {r + 1}: {res['output_tok_s']:.0f} tok/s, API server "
                      f"{res['api_server_cpu_us_per_token']:.1f} us CPU per streamed token, {res['failed']} failed",
                      file=sys.stderr)
        finally:
            code = stop_server(proc)
            if code != 0:
                print(Path(tmp, "server.log").read_text(), file=sys.stderr)
    per_token = sorted(r["api_server_cpu_us_per_token"] for r in rounds)
    out = {"args": vars(args), "machine": machine(), "api_server_pids": len(pids), "rounds": rounds,
           "median_api_server_cpu_us_per_token": per_token[len(per_token) // 2],
           "server_exit_code": code}
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    print(f"API-server CPU per streamed token: {out['median_api_server_cpu_us_per_token']:.1f} us (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
