"""Speculative decoding (issue 20) emits exactly what plain decoding emits.

Greedy: token for token. Seeded sampling: also token for token, because a seeded row's
noise is a pure function of (seed, output index, token) and verification samples every
position as plain decoding would (``tandem.worker.speculative``). Both in sync and async
scheduling (where step N+1 is scheduled before step N's accepted count is known), crossed
with preemption (a tiny KV cache) and chunked prefill (a small token budget), on random
workloads (penalties, logprobs, stop strings, min/max tokens, aborts, n > 1) of a tiny
random model and on copy-heavy prompts of the embedded model (real weights: most drafts are
accepted). A chi-square test checks the distribution of unseeded sampling.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from engine_harness import assert_same, random_workload, run_workload
from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams

VOCAB = 128
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SETTINGS = {
    "default": dict(),
    "preempt": dict(num_kv_blocks=40, max_num_seqs=8),
    "preempt+chunked": dict(num_kv_blocks=20, max_num_batched_tokens=12),
}


def make_engine(model: str, async_scheduling: bool, spec: bool, **kw) -> LLMEngine:
    base = dict(model=model, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                async_scheduling=async_scheduling, num_kv_blocks=512,
                speculative_config=NGRAM if spec else None)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


@pytest.fixture(scope="module")
def engines(tiny_llama):
    cache: dict = {}

    def get(setting: str, async_scheduling: bool, spec: bool) -> LLMEngine:
        key = (setting, async_scheduling, spec)
        if key not in cache:
            cache[key] = make_engine(tiny_llama, async_scheduling, spec, **SETTINGS[setting])
        return cache[key]

    yield get
    for e in cache.values():
        e.shutdown()


def spec_stats(engine: LLMEngine):
    spec = engine.core.scheduler.spec
    assert spec is not None
    return spec.stats


@pytest.mark.timeout(240)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("seed", range(3))
def test_random_workload_spec_equals_plain(engines, setting, seed):
    """Greedy and seeded requests with every sampling feature: speculative (sync and async)
    equals plain sync; drafts were verified, some accepted and some rejected."""
    items = random_workload(seed * 7919 + 13, VOCAB, n_reqs=12)
    plain = run_workload(engines(setting, False, False), items)
    for asyn in (False, True):
        e = engines(setting, asyn, True)
        before = spec_stats(e).num_draft_tokens, spec_stats(e).num_accepted_tokens
        spec = run_workload(e, items)
        assert_same(plain.outputs, spec.outputs, items)
        st = spec_stats(e)
        drafted, accepted = st.num_draft_tokens - before[0], st.num_accepted_tokens - before[1]
        assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)


@pytest.mark.timeout(60)
def test_pressure_settings_really_preempt(engines):
    """(Runs after the workloads above, on the same engines.) The small caches preempted
    speculating requests, in sync and async mode."""
    for setting in SETTINGS:
        if setting.startswith("preempt"):
            for asyn in (False, True):
                assert engines(setting, asyn, True).core.scheduler.stats.num_preemptions > 0, (setting, asyn)


@pytest.mark.timeout(120)
def test_async_spec_overlaps_and_corrects(engines):
    """Async speculation really launches ahead (positions of steps scheduled behind an
    in-flight verify step are corrected on the device), and accepts long runs on a
    repetitive prompt while staying identical to plain greedy."""
    prompt = [5, 6, 7, 8, 9] * 6
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    items_out = {}
    for spec in (False, True):
        e = engines("default", True, spec)
        e.add_request("a", prompt, params)
        last = None
        while e.has_unfinished_requests():
            for out in e.step():
                last = out
        items_out[spec] = last.outputs[0].token_ids
    assert items_out[True] == items_out[False]
    e = engines("default", True, True)
    assert e.core.stats.num_launched_ahead > 0
    assert spec_stats(e).num_accepted_tokens > 0


# -- the embedded model (real weights) ---------------------------------------------------------
COPY_PROMPTS = [
    "Repeat this sentence twice: The committee approved the new budget for the city library on Tuesday. "
    "The committee approved",
    "Continue the list:\n1. apples\n2. bananas\n3. cherries\n4. dates\n1. apples\n2.",
    "def area(width, height):\n    return width * height\n\n\ndef volume(width, height, depth):\n    return",
    "Count: one two three four five one two three four five one two",
]


@pytest.fixture(scope="module")
def smol(default_model_folder):
    cache: dict = {}

    def get(async_scheduling: bool, spec: bool, **kw) -> LLMEngine:
        key = (async_scheduling, spec, tuple(sorted(kw.items())))
        if key not in cache:
            cfg = dict(model=default_model_folder, max_model_len=512, num_kv_blocks=256, max_num_seqs=8,
                       async_scheduling=async_scheduling,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4} if spec else None)
            cfg.update(kw)
            cache[key] = LLMEngine(EngineConfig(**cfg))
        return cache[key]

    yield get
    for e in cache.values():
        e.shutdown()


def run_prompts(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> list:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"q{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [(done[f"q{i}"].outputs[0].token_ids, done[f"q{i}"].outputs[0].text,
             done[f"q{i}"].outputs[0].finish_reason) for i in range(len(prompts))]


@pytest.mark.timeout(600)
def test_embedded_model_greedy_identity(smol):
    """Mixed batch on the real model: plain greedy, max_tokens landing inside accepted runs
    (several lengths), a stop string and logprobs; speculative sync and async equal plain."""
    prompts = COPY_PROMPTS + COPY_PROMPTS[:2]
    params = [SamplingParams(max_tokens=24, temperature=0.0),
              SamplingParams(max_tokens=7, temperature=0.0),
              SamplingParams(max_tokens=13, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=30, temperature=0.0, stop=["five one"]),
              SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=21, temperature=0.0, repetition_penalty=1.1)]
    plain = run_prompts(smol(False, False), prompts, params)
    assert plain[3][2] == "stop"
    for asyn in (False, True):
        e = smol(asyn, True)
        got = run_prompts(e, prompts, params)
        assert got == plain, f"async={asyn}"
        st = spec_stats(e)
        assert st.num_accepted_tokens / st.num_draft_tokens > 0.3, st


@pytest.mark.timeout(600)
def test_embedded_model_preemption_identity(smol):
    """A KV cache too small for the batch: requests are preempted (with verify steps in
    flight, in async mode) and resume from their real tokens."""
    prompts = COPY_PROMPTS
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)] * len(prompts)
    plain = run_prompts(smol(False, False), prompts, params)
    for asyn in (False, True):
        e = smol(asyn, True, num_kv_blocks=9, block_size=16)
        got = run_prompts(e, prompts, params)
        assert got == plain, f"async={asyn}"
        assert e.core.scheduler.stats.num_preemptions > 0


# -- the distribution -------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_sampling_keeps_target_distribution(tiny_llama):
    """Chi-square: unseeded temperature sampling with n-gram drafts emits the third token
    with the target's probabilities given the first two. The third token comes from the
    verify step when the second equals the draft (accepted: the bonus row), else from the
    next step (rejected: the target's own sample replaces the draft), so both paths count.
    The context is the model's own greedy loop, so the n-gram draft is often the likely
    token. Fixed context, fixed engine seed."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        context = hf.generate(torch.tensor([[9, 10, 11] * 5]), max_new_tokens=30, do_sample=False)[0].tolist()
    temperature = 0.5
    n = 3000
    engine = make_engine(tiny_llama, True, True, max_num_seqs=64, num_kv_blocks=2048, seed=1234,
                         max_num_batched_tokens=2048)
    try:
        params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
        for i in range(n):
            engine.add_request(f"s{i}", context, params)
        triples = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    triples.append(tuple(out.outputs[0].token_ids))
        st = spec_stats(engine)
    finally:
        engine.shutdown()
    assert len(triples) == n
    assert 0.05 * st.num_draft_tokens < st.num_accepted_tokens < 0.95 * st.num_draft_tokens, st
    pairs = [t[:2] for t in triples]
    top = max(set(pairs), key=pairs.count)
    thirds = np.array([t[2] for t in triples if t[:2] == top])
    assert len(thirds) > 300

    with torch.no_grad():
        logits = hf(torch.tensor([context + list(top)])).logits[0, -1]
    probs = torch.softmax(logits / temperature, dim=-1).double().numpy()
    # Bins: each token expected >= 5 times, the rest pooled.
    expected = probs * len(thirds)
    big = np.flatnonzero(expected >= 5)
    counts = np.bincount(thirds, minlength=VOCAB)
    obs = np.append(counts[big], len(thirds) - counts[big].sum())
    exp = np.append(expected[big], len(thirds) - expected[big].sum())
    if exp[-1] < 5:  # too little mass left to pool: merge it into the last bin
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    assert len(obs) >= 4, "too few tokens to test"
    stat, p = chisquare(obs, exp)
    assert math.isfinite(stat) and p > 0.001, f"chi-square {stat:.1f} over {len(obs)} bins, p={p:.2e}"


# -- the draft_model method --------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting", ["default", "preempt+chunked"])
def test_draft_model_workload_equals_plain(engines, tiny_llama, tiny_factory, setting):
    """Another (random) model as the draft (almost nothing accepted) and the target as its
    own draft (greedy drafts of sampled requests: much accepted): outputs equal plain's."""
    items = random_workload(4242, VOCAB, n_reqs=10)
    plain = run_workload(engines(setting, False, False), items)
    other = tiny_factory("llama", seed=1)
    for draft, asyn in ((other, False), (other, True), (tiny_llama, True)):
        e = make_engine(tiny_llama, asyn, False, **SETTINGS[setting], speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": 3})
        try:
            got = run_workload(e, items)
            st = spec_stats(e)
        finally:
            e.shutdown()
        assert_same(plain.outputs, got.outputs, items)
        assert st.num_draft_tokens > 0
        if draft == tiny_llama:
            assert st.num_accepted_tokens > 0.15 * st.num_draft_tokens, st


@pytest.mark.timeout(120)
def test_self_draft_accepts_every_greedy_draft(tiny_llama):
    """Greedy requests with the target as its own draft: acceptance is 1 (up to float ties
    between the draft's single-token and the target's multi-token forward)."""
    for asyn in (False, True):
        e = make_engine(tiny_llama, asyn, False, speculative_config={
            "method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 4})
        try:
            params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
            for i in range(4):
                e.add_request(f"g{i}", [3 + i, 9, 17, 4 + i], params)
            while e.has_unfinished_requests():
                e.step()
            st = spec_stats(e)
        finally:
            e.shutdown()
        assert st.num_draft_tokens > 50
        assert st.num_accepted_tokens >= 0.98 * st.num_draft_tokens, st


@pytest.mark.timeout(600)
def test_embedded_model_self_draft(smol, default_model_folder):
    """The embedded model as its own draft, sync and async: plain greedy's tokens, and
    acceptance near 1."""
    prompts, params = COPY_PROMPTS[:2], [SamplingParams(max_tokens=16, temperature=0.0)] * 2
    plain = run_prompts(smol(False, False), prompts, params)
    for asyn in (False, True):
        e = LLMEngine(EngineConfig(model=default_model_folder, max_model_len=512, num_kv_blocks=128,
                                   async_scheduling=asyn, speculative_config={
                                       "method": "draft_model", "model": default_model_folder,
                                       "num_speculative_tokens": 3}))
        try:
            assert run_prompts(e, prompts, params) == plain
            st = spec_stats(e)
        finally:
            e.shutdown()
        assert st.num_accepted_tokens >= 0.9 * st.num_draft_tokens, st


@pytest.mark.timeout(120)
def test_llm_counts_and_disable_by_batch_size(tiny_llama):
    """``LLM.spec_decode_stats()`` has /metrics' counts; with ``disable_by_batch_size`` a
    batch that large verifies no drafts (and a small one does), output unchanged."""
    from tandem import LLM

    prompts = [[5 + i, 6, 7, 8, 5 + i, 6, 7, 8, 5 + i, 6] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(tiny_llama, num_kv_blocks=128, block_size=4) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.spec_decode_stats() == {}
    for limit, expect_drafts in ((2, False), (8, True)):
        with LLM(tiny_llama, num_kv_blocks=128, block_size=4,
                 speculative_config={**NGRAM, "disable_by_batch_size": limit}) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            st = llm.spec_decode_stats()
        assert got == plain
        assert set(st) == {"spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
                           "spec_accepted_per_position", "acceptance_rate"}
        assert (st["spec_num_drafts"] > 0) == expect_drafts, (limit, st)
        assert st["spec_num_accepted_tokens"] == sum(st["spec_accepted_per_position"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting", ["default", "preempt+chunked"])
def test_constrained_and_speculating_requests_together(engines, setting):
    """Half the requests under a grammar (their draft positions masked by it), the rest
    unconstrained, in the same steps: speculative sync and async equal plain sync token for
    token, and the constraints hold."""
    from engine_harness import assert_follow_constraints

    items = random_workload(1234567, VOCAB, n_reqs=14, constrained=0.5)
    assert sum(w.pattern is not None for w in items) >= 3
    plain = run_workload(engines(setting, False, False), items)
    for asyn in (False, True):
        e = engines(setting, asyn, True)
        drafted = spec_stats(e).num_draft_tokens
        got = run_workload(e, items)
        assert_same(plain.outputs, got.outputs, items)
        assert_follow_constraints(got.outputs, items)
        assert spec_stats(e).num_draft_tokens > drafted


@pytest.mark.timeout(300)
def test_multiproc_and_tensor_parallel(tiny_llama):
    """Worker processes (outputs cross a process boundary) and two tensor-parallel ranks
    (only rank 0 samples; every rank verifies and proposes from the broadcast ids), for both
    methods: the same tokens as plain decoding in process."""
    from tandem import LLM

    prompts = [[5 + i, 6, 7, 8, 5 + i, 6, 7, 8, 5 + i, 6] for i in range(4)]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, seed=3)] * 2
    with LLM(tiny_llama, num_kv_blocks=128, block_size=4) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    draft = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    for kw in (dict(executor="multiproc", speculative_config=NGRAM),
               dict(tensor_parallel_size=2, speculative_config=NGRAM),
               dict(tensor_parallel_size=2, speculative_config=draft)):
        with LLM(tiny_llama, num_kv_blocks=128, block_size=4, **kw) as llm:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            st = llm.spec_decode_stats()
        assert got == plain, kw
        assert st["spec_num_accepted_tokens"] > 0, kw


@pytest.mark.timeout(300)
def test_constrained_requests_verify_drafts_under_their_grammar(tiny_llama):
    """Constrained requests speculate too: each draft position is masked by the grammar's
    state after the drafts before it, and drafts the grammar refuses are cut. Prompts whose
    n-gram drafts the grammar allows (accepted) and refuses (cut): same tokens as plain
    decoding, sync and async (xgrammar: llguidance cannot read the tiny models' tokenizer;
    ``test_embedded_constrained_speculation`` runs both on the embedded model)."""
    from engine_harness import TINY_CONSTRAINTS, tiny_text

    regex, pattern = TINY_CONSTRAINTS[0]  # (t2[0-9]?|t3[0-9]?)+
    prompts = [[2, 3, 20, 2, 3, 20, 2, 3, 20, 2, 3],  # drafts the grammar allows
               [40, 41, 42, 40, 41, 42, 40, 41]]  # drafts it refuses
    params = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=regex)
    runs = {}
    for spec, asyn in ((False, False), (True, False), (True, True)):
        e = make_engine(tiny_llama, asyn, spec)
        try:
            for i, p in enumerate(prompts):
                e.add_request(f"c{i}", p, params)
            done = {}
            while e.has_unfinished_requests():
                for out in e.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0]
            runs[(spec, asyn)] = [(done[f"c{i}"].token_ids, done[f"c{i}"].finish_reason) for i in range(2)]
            st = spec_stats(e) if spec else None
        finally:
            e.shutdown()
        if st is not None:
            assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, st
    assert runs[(True, False)] == runs[(False, False)] == runs[(True, True)]
    for ids, reason in runs[(False, False)]:
        assert reason != "error" and re.fullmatch(pattern, tiny_text([t for t in ids if t != 1])), ids


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_embedded_constrained_speculation(default_model_folder, backend):
    """A JSON schema on the real model, asked to copy a JSON object: the constrained request
    verifies n-gram drafts under its grammar (many accepted) and emits plain decoding's tokens."""
    import json

    from tandem import LLM
    from tandem.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                               "population": {"type": "integer"}},
              "required": ["city", "country", "population"]}
    messages = [{"role": "user", "content": 'Return this JSON object exactly: {"city": "Paris", "country": "France", '
                                            '"population": 2100000}'}]
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    outs = {}
    for spec in (None, NGRAM):
        with LLM(default_model_folder, max_model_len=512, num_kv_blocks=64, structured_outputs_backend=backend,
                 speculative_config=spec) as llm:
            out = llm.chat([messages], params, use_tqdm=False)[0].outputs[0]
            outs[spec is not None] = (out.token_ids, out.text)
            st = llm.spec_decode_stats()
        if spec is not None:
            assert st["spec_num_accepted_tokens"] > 0, st
    assert outs[True] == outs[False]
    assert set(json.loads(outs[False][1])) == {"city", "country", "population"}
