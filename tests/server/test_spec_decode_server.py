"""A server with speculative decoding (issue 20): the same completions as offline plain
decoding, the speculative counters on /metrics, and ``tandem bench serve``'s acceptance."""
from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from server_utils import ServerProcess, idle, wait_for
from tandem import LLM, SamplingParams
from tandem.bench.serve import BenchmarkConfig, format_summary, run_benchmark

pytestmark = pytest.mark.timeout(400)

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
ARGS = ("--max-model-len", "256", "--num-kv-blocks", "256", "--block-size", "16", "--max-num-seqs", "16")


def test_spec_server(tiny_llama, tmp_path):
    prompt = " ".join(["t9 t10 t11 t12"] * 6)
    with LLM(tiny_llama, max_model_len=256, num_kv_blocks=256, block_size=16, max_num_seqs=16) as llm:
        ref = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    server = ServerProcess(tiny_llama, *ARGS, "--speculative-config", json.dumps(SPEC), tmp=tmp_path)
    try:
        before = wait_for(server, idle)
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                             "ignore_eos": True}, timeout=60).json()
        assert r["choices"][0]["text"] == ref
        after = wait_for(server, lambda m: m.get("tandem:spec_decode_num_draft_tokens_total", 0)
                         > before.get("tandem:spec_decode_num_draft_tokens_total", 0))
        drafted = after["tandem:spec_decode_num_draft_tokens_total"]
        accepted = after["tandem:spec_decode_num_accepted_tokens_total"]
        assert after["tandem:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafted
        assert sum(v for k, v in after.items()
                   if k.startswith("tandem:spec_decode_num_accepted_tokens_per_pos_total")) == accepted

        res = asyncio.run(run_benchmark(BenchmarkConfig(base_url=server.url, num_prompts=4, random_input_len=12,
                                                        random_output_len=8, disable_tqdm=True,
                                                        percentiles=[50], ignore_eos=True, temperature=0.0)))
        assert res.metrics.completed == 4
        assert res.spec_decode is not None and res.spec_decode["num_drafts"] > 0
        assert "Acceptance rate (%):" in format_summary(res)
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log.read_text()
