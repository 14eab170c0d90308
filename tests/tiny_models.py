"""Tiny random models saved as real HF folders (safetensors + a word-level tokenizer), for
tests anywhere in the suite (a module, not conftest: several conftest.py files share that
module name, so ``from conftest import ...`` can find the wrong one)."""
from __future__ import annotations

from pathlib import Path

import torch


def make_word_tokenizer(vocab_size: int):
    """A word-level tokenizer over 't0'..'tN' so any token id decodes to stable text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1", bos_token="t0", unk_token="t0")


def build_tiny_model(path: Path, arch: str = "llama", vocab_size: int = 128, seed: int = 0, **overrides) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              eos_token_id=1, bos_token_id=0, tie_word_embeddings=False)
    if arch == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**kw)).eval()
    # Sharper logits than the default init, so greedy choices are far from ties and tiny
    # batch-shape float differences cannot flip a token.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    make_word_tokenizer(vocab_size).save_pretrained(path)
    return str(path)
