"""Fixtures of the GPU tests: random models built from a config (nothing can be
downloaded on the device), the LM head sharpened so greedy choices are rarely near-ties."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 2048


def _build(path: Path, sharpen: float, **over) -> str:
    from tiny_models import make_word_tokenizer
    from transformers import AutoModelForCausalLM, Qwen2Config

    kw = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
              eos_token_id=1, bos_token_id=0, tie_word_embeddings=False)
    kw.update(over)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**kw)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path, safe_serialization=True)
    make_word_tokenizer(VOCAB).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> str:
    return _build(tmp_path_factory.mktemp("gpu_sharp"), sharpen=8.0)


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> str:
    """Default init: many near-ties in bf16, the hard case for exact comparisons."""
    return _build(tmp_path_factory.mktemp("gpu_plain"), sharpen=1.0)
