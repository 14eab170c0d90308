"""Speculative decoding on a CUDA device (skipped elsewhere; written without a GPU at hand,
issue 20): the verify steps (CUDA graphs of the uniform ``1 + k`` batch, eager otherwise),
the pure-decode steps between them (CUDA graphs, whose static inputs the async correction
rewrites in place), the device-side proposers and the
correction give the CPU path's tokens in fp32, and launch without a hidden synchronization.
"""
from __future__ import annotations

import pytest
import torch

from test_gpu_engine import _llm, _prompts, _sync_checked, _tokens

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(900),
]


def _copy_prompts(n: int) -> list[list[int]]:
    """Periodic prompts: the n-gram proposer's drafts are often right."""
    return [(p * 8)[:64] for p in _prompts(n, 3, 9, seed=5)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fp32_spec_equals_cpu_plain(sharp_model, method, async_scheduling):
    from tandem import SamplingParams

    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        spec["model"] = sharp_model
    prompts = _copy_prompts(8) + _prompts(8, 3, 100)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with _llm(sharp_model, device="cpu", dtype="float32") as cpu:
        want = _tokens(cpu, prompts, sp)
    with _llm(sharp_model, device="cuda", dtype="float32", attention_backend="triton",
              async_scheduling=async_scheduling, speculative_config=spec) as gpu:
        runner = gpu.engine.core.executor.worker.runner
        graph_steps = runner.stats_graph_steps
        got = _tokens(gpu, prompts, sp)
        stats = gpu.spec_decode_stats()
        assert runner.verify_graphs, "no verify step graph was captured"
        assert runner.stats_graph_steps > graph_steps
    assert got == want
    assert stats["spec_num_accepted_tokens"] > 0


def test_spec_launches_have_no_hidden_synchronization(sharp_model):
    from tandem import SamplingParams

    with _llm(sharp_model, dtype="bfloat16",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        runner = llm.engine.core.executor.worker.runner
        llm.generate(_copy_prompts(2), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm
        errors: list[str] = []
        runner.execute_model = _sync_checked(runner.execute_model, errors)
        params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=1.0, repetition_penalty=1.2, max_tokens=32, ignore_eos=True)]
        prompts = _copy_prompts(12)
        try:
            outs = llm.generate(prompts, [params[i % 3] for i in range(len(prompts))], use_tqdm=False)
        finally:
            assert not errors, errors[0]
        assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
        assert llm.spec_decode_stats()["spec_num_accepted_tokens"] > 0
