"""``LLM``: what the argument checks accept (the refusals are in test_bad_inputs.py), the
pre-flight checks before the weights load, and seeds at the edges of their range."""
from __future__ import annotations

import numpy as np
import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.config import engine as engine_config
from tandem.entrypoints import llm as llm_module

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, num_kv_blocks=128) as m:
        yield m


def ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_prompt_shapes_accepted(llm):
    """One prompt or a list; token ids as a list, tuple, or numpy ints: the same answer."""
    want = ids(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False))
    for prompts in ([5, 6, 7], (5, 6, 7), [np.int64(5), np.int32(6), 7], [(5, 6, 7)], np.array([5, 6, 7]).tolist()):
        assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == want, prompts
    assert ids(llm.generate("t5 t6 t7", GREEDY, use_tqdm=False)) == want


def test_params_shapes_accepted(llm):
    out = llm.generate(["t5", "t6"], (GREEDY, GREEDY.clone(max_tokens=1)), use_tqdm=False)
    assert [len(t) for t in ids(out)] == [3, 1]
    assert 1 <= len(ids(llm.generate(["t5"], None, use_tqdm=False))[0]) <= 16  # SamplingParams(): 16 at most


def test_from_config_reuses_the_prepared_model(tiny_llama, monkeypatch):
    config = EngineConfig(model=tiny_llama, num_kv_blocks=32)
    model_config = llm_module.prepare_model(config)
    monkeypatch.setattr(llm_module, "prepare_model", lambda c: pytest.fail("resolved the model twice"))
    with LLM.from_config(config, model_config) as m:
        assert m.engine.model_config is model_config
        assert len(ids(m.generate([[5]], GREEDY, use_tqdm=False))[0]) == 3


@pytest.mark.parametrize("kwargs, gib", [(dict(num_kv_blocks=1000), 1000 * 8192 / 2**30),
                                         (dict(cpu_kv_cache_gib=0.5), 0.5)])
def test_kv_memory_is_checked_for_what_will_be_allocated(tiny_llama, monkeypatch, kwargs, gib):
    """num_kv_blocks x the model's block bytes, or cpu_kv_cache_gib, against available memory."""
    config = EngineConfig(model=tiny_llama, **kwargs)
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: int(gib * 2**30) + 1)
    llm_module.prepare_model(config)
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: int(gib * 2**30) - 4096)
    with pytest.raises(ValueError, match="of memory is available"):
        llm_module.prepare_model(config)


def test_seeds_at_the_64_bit_edges(llm):
    for seed in (2**63 - 1, -(2**63), -1, 0):
        sp = SamplingParams(seed=seed, max_tokens=4, ignore_eos=True)
        assert ids(llm.generate([[5]], sp, use_tqdm=False)) == ids(llm.generate([[5]], sp, use_tqdm=False))


def test_seeded_n_gt_1_at_the_64_bit_edge(llm):
    """The children's seeds (seed * 1_000_003 + i) wrap into the 64-bit range instead of overflowing."""
    out = llm.generate([[5]], SamplingParams(n=2, seed=2**62, max_tokens=2), use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [2, 2]
