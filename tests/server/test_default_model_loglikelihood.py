"""Echo logprobs of the embedded SmolLM2 over HTTP against HF transformers' fp32 ``log_softmax``
on the same weights, with chunked prefill and prefix caching on (a server whose step budget is
16 tokens, asked the same prompts twice) and with both off (the offline engine)."""
from __future__ import annotations

import httpx
import pytest
import torch

from server_utils import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOL = 1e-3
TEXTS = ["The quick brown fox jumps over the lazy dog because it was in a hurry to get home.",
         "The quick brown fox jumps over the lazy dog, and then it sleeps under the old oak tree."]


@pytest.fixture(scope="module")
def reference(default_model_folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32).eval()

    def ref(ids: list[int]) -> list[float]:
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]

    return ref


def test_echo_logprobs_match_hf_with_chunked_prefill_and_prefix_caching(tmp_path, reference):
    srv = ServerProcess("", "--max-model-len", "256", "--max-num-batched-tokens", "16", "--enable-prefix-caching",
                        "--enable-chunked-prefill", tmp=tmp_path, chat_template=False)
    try:
        ids = [httpx.post(f"{srv.url}/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
        assert all(len(i) > 16 for i in ids)  # every prompt is split into several chunks
        for _ in range(2):  # the second round would find every prompt in the prefix cache
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 1,
                                                              "max_tokens": 1, "temperature": 0}, timeout=600)
            assert r.status_code == 200, r.text
            for c, prompt in zip(r.json()["choices"], ids):
                got = c["logprobs"]["token_logprobs"]
                assert got[0] is None and len(got) == len(prompt) + 1
                assert got[1:len(prompt)] == pytest.approx(reference(prompt), abs=TOL)
    finally:
        assert srv.stop() == 0


def test_prompt_logprobs_match_hf_without_chunking_or_caching(default_model_folder, reference):
    from tandem import LLM, SamplingParams

    with LLM(default_model_folder, max_model_len=256, enable_prefix_caching=False, enable_chunked_prefill=False) as llm:
        outs = llm.generate(TEXTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for o in outs:
        ids = o.prompt_token_ids
        got = [o.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        assert got == pytest.approx(reference(ids), abs=TOL)
