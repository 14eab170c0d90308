"""Speculative decoding on the Triton attention path (the CUDA code path, kernels run by the
Triton interpreter on the CPU): verify steps (several query tokens over a cached prefix),
async scheduling's device-side position correction (the Triton backend reads only device
lengths) and the draft model's single-token steps give plain decoding's tokens."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tandem import LLM, SamplingParams  # noqa: E402


@pytest.mark.timeout(900)
def test_triton_spec_decode_matches_plain(tiny_llama):
    from tandem.kernels import fused

    if not torch.cuda.is_available() and type(fused._rms_norm_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 10, 9, 10, 9, 10]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, dtype="float32",
              enforce_eager=True, attention_backend="triton")
    with LLM(tiny_llama, **kw) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 2}):
        with LLM(tiny_llama, speculative_config=spec, **kw) as llm:
            assert llm.engine.core.executor.worker.runner.backend == "triton"
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            st = llm.spec_decode_stats()
        assert got == want, spec["method"]
        assert st["spec_num_accepted_tokens"] > 0
