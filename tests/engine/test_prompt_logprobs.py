"""Prompt logprobs (what log-likelihood evaluation reads) against HF transformers' fp32
``log_softmax``, whatever the scheduler does to the prompt: chunked prefill, a prefix-cache
hit that would skip the forward over the prefix, preemption that recomputes the prompt."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)

TOL = 1e-3
PROMPTS = [[5 + (i * 7 + j * 3) % 100 for j in range(n)] for i, n in enumerate((37, 21, 50, 9, 44, 30))]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)

    return ref


def check(outs, hf_logprobs, k: int) -> None:
    for o in outs:
        ids = o.prompt_token_ids
        ref = hf_logprobs(ids)
        plp = o.prompt_logprobs
        assert plp is not None and len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            pos = plp[i]
            assert abs(pos[ids[i]].logprob - ref[i - 1, ids[i]].item()) < TOL, (o.request_id, i)
            row, target = ref[i - 1], ref[i - 1, ids[i]]
            assert 1 + int((row > target + TOL).sum()) <= pos[ids[i]].rank <= 1 + int((row > target - TOL).sum())
            top = torch.topk(ref[i - 1], k).indices.tolist()
            assert set(top) <= set(pos) and len(pos) <= k + 1


@pytest.mark.parametrize("name,kw", [
    ("plain", dict(enable_prefix_caching=False)),
    ("chunked", dict(max_num_batched_tokens=16, enable_prefix_caching=False)),
    ("chunked+prefix-cache", dict(max_num_batched_tokens=16)),
    ("preempting", dict(num_kv_blocks=20, max_num_batched_tokens=32)),
])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_hf(tiny_llama, hf_logprobs, name, kw, async_scheduling):
    cfg = dict(max_model_len=128, block_size=4, max_num_seqs=8, num_kv_blocks=256, async_scheduling=async_scheduling)
    with LLM(tiny_llama, **{**cfg, **kw}) as llm:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
        # Twice: with prefix caching on, the second round finds every prompt cached.
        for _ in range(2):
            check(llm.generate(PROMPTS, sp, use_tqdm=False), hf_logprobs, 2)
        if name == "preempting":
            assert llm.engine.core.scheduler.stats.num_preemptions > 0
        if name == "chunked+prefix-cache":
            # A request without prompt logprobs does hit the blocks the others published.
            hits = llm.engine.core.kv_cache.stats_hits
            llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            assert llm.engine.core.kv_cache.stats_hits > hits
