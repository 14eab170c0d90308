"""The engine's front half without a model: the input processor (validation, n > 1 children)
and the output processor (detokenizing, stop strings, sibling release, stats, failures)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tiny_models import make_word_tokenizer
from tandem.config import EngineConfig, ModelConfig
from tandem.engine.input_processor import ContextLengthError, InputProcessor, output_budget
from tandem.engine.output_processor import OutputProcessor
from tandem.sampling_params import SamplingParams
from tandem.types.engine_output import EngineCoreOutput

pytestmark = pytest.mark.timeout(60)

VOCAB = 128
MODEL = ModelConfig(folder="unused", tokenizer="unused",
                    hf_config=SimpleNamespace(vocab_size=VOCAB, num_hidden_layers=1, num_attention_heads=1,
                                              hidden_size=8),
                    dtype="float32", device="cpu", max_model_len=64, eos_token_ids=(1,), max_num_seqs=64,
                    max_num_batched_tokens=2048)


@pytest.fixture(scope="module")
def tok():
    return make_word_tokenizer(VOCAB)


def processors(tok, share: bool = True, num_kv_blocks: int = 100) -> tuple[InputProcessor, OutputProcessor]:
    ip = InputProcessor(EngineConfig(block_size=4, max_logprobs=5), MODEL.info, tok)
    ip.num_kv_blocks = num_kv_blocks
    return ip, OutputProcessor(tok, share_prompt_blocks=share)


def out(rid: str, *tokens: int, finish: str | None = None, error: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(rid, list(tokens), finish_reason=finish, error=error)


def test_input_processor_validates_and_expands_children(tok):
    ip, _ = processors(tok, num_kv_blocks=6)
    req = ip.process("r", "t20 t21 t22", SamplingParams(n=3, seed=7, max_tokens=5))
    assert req.prompt_token_ids == [20, 21, 22]
    assert [r.request_id for r in req.core_requests] == ["r#0", "r#1", "r#2"]
    seeds = [r.sample_seed for r in req.core_requests]
    assert len(set(seeds)) == 3 and seeds == [r.sample_seed for r in ip.process("q", [20], SamplingParams(
        n=3, seed=7)).core_requests]
    assert ip.process("s", [20], SamplingParams(seed=7)).core_requests[0].sample_seed == 7  # n=1: the seed itself
    roomy, _ = processors(tok)
    assert roomy.process("m", [20] * 10, SamplingParams(max_tokens=None)).core_requests[0].max_tokens == 54
    for prompt, params, words, param in [
        ([], SamplingParams(), "empty", "prompt"),
        ([20, VOCAB], SamplingParams(), "token ids must be", "prompt"),
        ([20, True], SamplingParams(), "token ids must be", "prompt"),
        ([20] * 64, SamplingParams(), "max_model_len", "prompt"),
        ([20], SamplingParams(logprobs=6), "max_logprobs", "logprobs"),
        ([20], SamplingParams(prompt_logprobs=6), "max_logprobs", "prompt_logprobs"),
        ([20], SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias token ids", "logit_bias"),
        ([20] * 4, SamplingParams(max_tokens=30), "KV blocks", None),  # 34 tokens: 9 blocks of 4 > 6
    ]:
        with pytest.raises(ValueError, match=words) as ei:
            ip.process("x", prompt, params)
        assert getattr(ei.value, "param", None) == param, (words, ei.value)


def test_output_budget_is_the_one_max_tokens_check():
    """A prompt must leave room; an explicit budget must fit (the server's OpenAI rule); a
    default is cut to the room (the offline engine's max_tokens); neither: all the room."""
    assert output_budget(64, 10) == 54
    assert output_budget(64, 10, default=16) == 16 and output_budget(64, 60, default=16) == 4
    assert output_budget(64, 10, requested=54) == 54
    with pytest.raises(ContextLengthError, match="and max_tokens \\(55\\) exceed max_model_len \\(64\\)") as ei:
        output_budget(64, 10, requested=55)
    e = ei.value
    assert (e.limit, e.num_prompt_tokens, e.requested, e.param) == (64, 10, 55, "max_tokens")
    for n in (64, 65):
        with pytest.raises(ContextLengthError, match=f"the prompt has {n} tokens, but max_model_len is 64") as ei:
            output_budget(64, n, default=16)
        assert ei.value.requested is None and ei.value.param == "prompt"


def test_n_children_share_the_prompt_then_release_siblings(tok):
    ip, op = processors(tok)
    first = op.add_request(ip.process("r", [20, 21], SamplingParams(n=3, max_tokens=4)))
    assert [r.request_id for r in first] == ["r#0"]  # the siblings wait for the prompt's blocks
    p = op.process_outputs([out("r#0", 30)])
    assert [r.request_id for r in p.core_adds] == ["r#1", "r#2"]
    assert op.process_outputs([out("r#0", 31)]).core_adds == []
    _, op2 = processors(tok, share=False)
    assert len(op2.add_request(ip.process("r", [20, 21], SamplingParams(n=3)))) == 3


def test_stop_string_is_held_back_then_cut_and_the_core_told(tok):
    ip, op = processors(tok)
    op.add_request(ip.process("r", [20], SamplingParams(stop=["t40 t41"], max_tokens=10)))
    texts = []
    for t in (30, 40, 41, 50):
        p = op.process_outputs([out("r", t)])
        if p.request_outputs:
            texts.append(p.request_outputs[0].outputs[0].text)
            final = p.request_outputs[0]
    assert p.core_aborts == [] and final.finished
    assert final.outputs[0].text == " t30 " and final.outputs[0].finish_reason == "stop"  # cut where it starts
    assert final.outputs[0].stop_reason == "t40 t41" and final.outputs[0].token_ids == [30, 40, 41]
    assert all(final.outputs[0].text.startswith(t) for t in texts)  # streamed text is never taken back
    assert "r" not in op


def test_stop_string_aborts_the_core_request(tok):
    ip, op = processors(tok)
    op.add_request(ip.process("r", [20], SamplingParams(stop=["t33"], max_tokens=10)))
    p = op.process_outputs([out("r", 32, 33)])
    assert p.core_aborts == ["r"] and p.request_outputs[0].finished
    assert op.process_outputs([out("r", 34)]).request_outputs == []  # a late token is dropped


def test_final_only_reports_updated_ids_and_builds_on_demand(tok):
    ip, op = processors(tok)
    op.add_request(ip.process("a", [20], SamplingParams(max_tokens=2)))
    op.add_request(ip.process("b", [20], SamplingParams(max_tokens=5)))
    p = op.process_outputs([out("a", 30), out("b", 31)], final_only=True)
    assert p.request_outputs == [] and p.updated == ["a", "b"]
    assert op.make_output("b").outputs[0].text == " t31"
    p = op.process_outputs([out("a", 32, finish="length"), out("b", 33)], final_only=True)
    assert [o.request_id for o in p.request_outputs] == ["a"] and p.updated == ["b"]


def test_stats_count_ttft_once_itl_per_child_and_finishes(tok):
    ip, op = processors(tok)
    op.add_request(ip.process("r", [20, 21, 22], SamplingParams(n=2, max_tokens=2)))
    s1 = op.process_outputs([out("r#0", 30)]).stats
    assert (s1.num_prompt_tokens, s1.num_generation_tokens, len(s1.time_to_first_tokens)) == (3, 1, 1)
    assert s1.inter_token_latencies == []
    s2 = op.process_outputs([out("r#0", 31, finish="length"), out("r#1", 40)]).stats
    assert (s2.num_prompt_tokens, s2.num_generation_tokens, len(s2.time_to_first_tokens)) == (0, 2, 0)
    assert len(s2.inter_token_latencies) == 1  # r#0's second token; r#1's first has no gap
    assert [f.finish_reason for f in s2.finished] == ["length"]
    op.abort("r")
    s3 = op.process_outputs([]).stats
    assert [(f.finish_reason, f.num_generation_tokens) for f in s3.finished] == [("abort", 1)]


def test_failures_end_every_child(tok):
    ip, op = processors(tok)
    op.add_request(ip.process("r", [20], SamplingParams(n=3)))
    p = op.process_outputs([out("r#0", finish="error", error="boom")])
    final = p.request_outputs[0]
    assert final.finished and final.error == "boom"
    assert [c.finish_reason for c in final.outputs] == ["error"] * 3  # the held siblings never started
    op.add_request(ip.process("a", [20], SamplingParams()))
    op.add_request(ip.process("b", [20], SamplingParams(n=2)))
    dead = op.fail_all("gone")
    assert {o.request_id for o in dead} == {"a", "b"} and all(o.error == "gone" and o.finished for o in dead)
    assert not op.has_unfinished_requests()
    op.add_request(ip.process("c", [20], SamplingParams()))
    with pytest.raises(ValueError, match="already in use"):
        op.add_request(ip.process("c", [20], SamplingParams()))
