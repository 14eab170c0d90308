"""Bad input gets a clear error, never a crash, a hang or a lost request."""
from __future__ import annotations


import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    m = LLM(tiny_llama, block_size=4, num_kv_blocks=64, max_model_len=64)
    yield m
    m.shutdown()


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate([list(range(2, 80))], SamplingParams(max_tokens=4), use_tqdm=False)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([""], SamplingParams(max_tokens=4), use_tqdm=False)


def test_out_of_vocab_token(llm):
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate([[5, 100000]], SamplingParams(max_tokens=4), use_tqdm=False)


@pytest.mark.parametrize("kw, msg", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n must be"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop strings"),
])
def test_bad_sampling_params(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_too_many_logprobs(llm):
    with pytest.raises(ValueError, match="exceeds max_logprobs"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, logprobs=50), use_tqdm=False)


def test_bad_batch_leaves_engine_clean(llm):
    """One bad prompt rejects the call; nothing is left running; the next call works."""
    with pytest.raises(ValueError):
        llm.generate([[5, 6], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_corrupt_safetensors(tiny_llama, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(bad))


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def test_request_larger_than_cache(tiny_llama):
    m = LLM(tiny_llama, block_size=4, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        m.generate([list(range(2, 30))], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    m.shutdown()


@pytest.mark.timeout(120)
def test_logit_bias_steers_generation_and_is_checked_against_the_vocabulary(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={42: 100.0}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [42] * 6
    with pytest.raises(ValueError, match="logit_bias token ids must be in"):
        llm.generate([[5]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    # The same LLM still serves plain requests afterwards.
    assert len(llm.generate([[5]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
