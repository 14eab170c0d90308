"""Shared fixtures: tiny random models saved as real HF folders (safetensors + tokenizer)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels can only run interpreted here; set it before anything imports Triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from proc_utils import live_children


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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    cache: dict[tuple, str] = {}

    def make(arch: str = "llama", **kw) -> str:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch, **kw)
        return cache[key]

    return make


@pytest.fixture(autouse=True, scope="session")
def _threads():
    # Two cores: keep torch from oversubscribing when tests run beside each other.
    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True, scope="session")
def no_leaked_processes_or_shared_memory():
    """After the whole suite: no worker process, Ray process or shared-memory segment that a
    test started is still around. Fails the run (an error at session teardown) if one is."""
    import multiprocessing.resource_tracker as rt
    import time

    shm = Path("/dev/shm")
    shm_before = set(os.listdir(shm)) if shm.is_dir() else set()
    children_before = set(live_children())
    yield
    tracker = getattr(rt._resource_tracker, "_pid", None)  # lives as long as we do, by design
    deadline = time.monotonic() + 15
    while True:
        leaked = {p: c for p, c in live_children().items() if p not in children_before and p != tracker}
        new_shm = (set(os.listdir(shm)) - shm_before) if shm.is_dir() else set()
        if (not leaked and not new_shm) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not leaked, f"processes outlived the test suite: {leaked}"
    assert not new_shm, f"shared memory left in /dev/shm: {sorted(new_shm)}"
