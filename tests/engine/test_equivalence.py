"""Async scheduling is token-for-token identical to sync, on fixed and random workloads.

Crossed with: a tiny KV cache (forces preemption), a small token budget (forces chunked
prefill) and prefix caching on/off. Greedy and seeded sampling, stop strings/ids, EOS,
max/min tokens, penalties, logprobs, n > 1 and aborts all appear in the random workloads.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_harness import WorkItem, assert_follow_constraints, assert_same, random_workload, run_workload
from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams
from tandem.structured_output.manager import FillThreads

VOCAB = 128
SETTINGS = {
    "default": dict(),
    "preempt": dict(num_kv_blocks=40, max_num_seqs=8),
    "chunked": dict(max_num_batched_tokens=16),
    "preempt+chunked": dict(num_kv_blocks=40, max_num_batched_tokens=12),
    "no-prefix-cache": dict(enable_prefix_caching=False, num_kv_blocks=60),
}


def make_engine(model: str, async_scheduling: bool, **kw) -> LLMEngine:
    base = dict(model=model, block_size=4, max_num_seqs=6, max_num_batched_tokens=64,
                async_scheduling=async_scheduling, num_kv_blocks=512)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


@pytest.fixture(scope="module")
def engines(tiny_llama):
    cache: dict = {}

    def get(setting: str, async_scheduling: bool, **kw) -> LLMEngine:
        key = (setting, async_scheduling, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_engine(tiny_llama, async_scheduling, **SETTINGS[setting], **kw)
        return cache[key]

    yield get
    for e in cache.values():
        e.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_async_equals_sync(engines, setting, seed):
    items = random_workload(seed * 7919 + 13, VOCAB)
    sync = run_workload(engines(setting, False), items)
    asyn = run_workload(engines(setting, True), items)
    assert_same(sync.outputs, asyn.outputs, items)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("seed", range(3))
def test_constrained_workload_async_equals_sync(engines, setting, seed):
    """Half the requests under a regex, choice or grammar (greedy and seeded, mixed with
    unconstrained ones, with preemption and chunked prefill in the crossed settings): async
    equals sync token for token, every finished constrained output matches its constraint.
    The reference is the sync engine with gated sampling run inline (the CPU default); the
    async engine here splits each constrained step and really deferred sampling behind an
    in-flight step, with its bitmasks filled on the manager's fill threads while the engine
    thread went on (every fill of one row or more here, shared among the threads from two
    rows; a served engine hands over fills of ``BACKGROUND_FILL_ROWS`` rows or more, shared
    from ``MIN_ROWS_PER_FILL_THREAD`` a thread). Gated async: the next test."""
    items = random_workload(seed * 104729 + 7, VOCAB, n_reqs=14, constrained=0.5)
    assert sum(w.pattern is not None for w in items) >= 3
    sync = run_workload(engines(setting, False), items)
    e = engines(setting, True, structured_outputs_sampling="split")
    e.core.structured.background_fill_rows = 1
    e.core.structured.min_rows_per_fill_thread = 1
    e.core.structured.set_fill_threads(FillThreads("tandem-fill", 2))  # (the default is 1 on a small host)
    deferred = e.core.stats.num_sampling_deferred
    background = e.core.structured.num_background_fills
    shared = e.core.structured.num_shared_fills
    asyn = run_workload(e, items)
    assert_same(sync.outputs, asyn.outputs, items)
    assert_follow_constraints(sync.outputs, items)
    assert e.core.stats.num_sampling_deferred > deferred
    assert e.core.structured.num_background_fills > background
    assert e.core.structured.num_shared_fills > shared


@pytest.mark.timeout(180)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("a", [False, True])
def test_gated_constrained_workload_on_the_fill_thread_equals_sync(engines, setting, seed, a):
    """Gated sampling with its jobs on the fill thread, as on CUDA (the CPU worker waits for
    each bitmask on the host): the fills and the accepts run on that thread while the engine
    thread goes on, and the tokens equal the sync engine's whose jobs ran inline."""
    items = random_workload(seed * 104729 + 7, VOCAB, n_reqs=14, constrained=0.5)
    sync = run_workload(engines(setting, False), items)
    e = engines(setting, a, structured_outputs_sampling="gated")
    e.core.structured.set_gated_background(True)
    gated = e.core.stats.num_gated
    got = run_workload(e, items)
    assert_same(sync.outputs, got.outputs, items)
    assert_follow_constraints(got.outputs, items)
    assert e.core.stats.num_gated > gated and e.core.stats.num_sampling_deferred == 0
    fills = e.core.structured.gated
    assert fills.background and fills._thread is not None and fills._thread.is_alive()


@pytest.mark.timeout(120)
def test_pressure_settings_really_preempt_and_chunk(engines):
    """The crossed settings must exercise what they claim to."""
    for a in (False, True):
        e = engines("preempt", a)
        before = e.core.scheduler.stats.num_preemptions
        items = [WorkItem(f"p{i}", list(range(2, 30)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                 for i in range(6)]
        run_workload(e, items)
        assert e.core.scheduler.stats.num_preemptions > before, "tiny KV cache did not force preemption"
    e = engines("chunked", True)
    items = [WorkItem("c", list(range(2, 60)), SamplingParams(temperature=0, max_tokens=4))]
    steps = run_workload(e, items).steps
    assert steps >= 58 // 16 + 4


@pytest.mark.timeout(180)
def test_greedy_matches_hf_and_one_by_one(tiny_llama, engines):
    """Batched tandem (sync and async, every pressure setting) == HF generate, one by one."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 29, 7, 45, 18)]
    ref = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for setting in SETTINGS:
        for a in (False, True):
            e = engines(setting, a)
            items = [WorkItem(f"h{i}", p, sp, arrive_step=i) for i, p in enumerate(prompts)]
            res = run_workload(e, items)
            got = [res.outputs[f"h{i}"].outputs[0].token_ids for i in range(len(prompts))]
            assert got == ref, f"{setting} async={a}: differs from HF greedy"


@pytest.mark.timeout(120)
def test_seeded_sampling_independent_of_batch(engines):
    """A seeded request samples the same tokens alone, in a batch, sync or async."""
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    target = WorkItem("s", [5, 6, 7, 8, 9], sp)
    alone = run_workload(engines("default", False), [target]).outputs["s"].outputs[0].token_ids
    noise = [WorkItem(f"n{i}", [10 + i] * (i + 3), SamplingParams(temperature=0.8, max_tokens=15), i)
             for i in range(5)]
    for setting in ("default", "preempt", "chunked"):
        for a in (False, True):
            res = run_workload(engines(setting, a), noise + [WorkItem("s", target.prompt, sp, arrive_step=2)])
            assert res.outputs["s"].outputs[0].token_ids == alone, f"{setting} async={a}"


@pytest.mark.timeout(120)
def test_prefix_cache_on_equals_off(engines):
    items = random_workload(99, VOCAB, n_reqs=16)
    on = run_workload(engines("default", True), items)
    off = run_workload(engines("no-prefix-cache", True), items)
    assert_same(on.outputs, off.outputs, items)
    assert engines("default", True).core.kv_cache.stats_hits > 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("sampling", ["gated", "split"])
def test_three_steps_in_flight_equal_sync(tiny_llama, monkeypatch, setting, sampling):
    """``TANDEM_ASYNC_DEPTH=3``: the core launches step N+2 before it waits for step N, so
    a request runs with two placeholder tokens; the tokens of random workloads, a third of
    the requests constrained (gated with the jobs on the fill thread, or split), equal sync,
    and the queue really holds three steps."""
    items = random_workload(4513 + len(setting), VOCAB, n_reqs=14, constrained=0.35)
    sync = make_engine(tiny_llama, False, **SETTINGS[setting])
    want = run_workload(sync, items).outputs
    sync.shutdown()
    monkeypatch.setenv("TANDEM_ASYNC_DEPTH", "3")
    e = make_engine(tiny_llama, True, structured_outputs_sampling=sampling, **SETTINGS[setting])
    assert e.core.depth == 3
    if sampling == "gated":
        e.core.structured.set_gated_background(True)
    deepest = 0
    launch = e.core._launch_next

    def spy() -> bool:
        nonlocal deepest
        launched = launch()
        deepest = max(deepest, len(e.core.batch_queue))
        return launched

    monkeypatch.setattr(e.core, "_launch_next", spy)
    got = run_workload(e, items).outputs
    e.shutdown()
    assert_same(want, got, items)
    assert_follow_constraints(got, items)
    assert deepest == 3


@pytest.mark.timeout(120)
def test_async_depth_is_checked(tiny_llama, monkeypatch):
    """Fewer than two steps in flight is not async, and speculative decoding keeps two."""
    from tandem.config import EnvSwitches

    assert EnvSwitches.from_environ({}).async_depth == 2
    monkeypatch.setenv("TANDEM_ASYNC_DEPTH", "1")
    with pytest.raises(ValueError, match="at least 2 steps in flight"):
        make_engine(tiny_llama, True)
    make_engine(tiny_llama, False).shutdown()  # sync: one step, whatever the switch
    monkeypatch.setenv("TANDEM_ASYNC_DEPTH", "3")
    with pytest.raises(ValueError, match="speculative decoding"):
        make_engine(tiny_llama, True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
