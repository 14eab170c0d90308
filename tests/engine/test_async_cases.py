"""One test per failure mode in shared/design/async-scheduling.md (cases 4-18), on a real
tiny model. Cases 1-3 and 17 are in test_engine_loop.py (model-free)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_harness import WorkItem, assert_same, run_workload
from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine, RequestError
from tandem.entrypoints.llm import LLM
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.timeout(120)
VOCAB = 128


def engine(model: str, a: bool, **kw) -> LLMEngine:
    base = dict(model=model, block_size=4, max_num_seqs=6, max_num_batched_tokens=64, async_scheduling=a,
                num_kv_blocks=256)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def both(model: str, items: list[WorkItem], **kw):
    res = []
    for a in (False, True):
        e = engine(model, a, **kw)
        res.append((e, run_workload(e, items)))
    return res


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def reference_tokens(model: str, prompt: list[int], n: int) -> list[int]:
    e = engine(model, False)
    return run_workload(e, [WorkItem("ref", prompt, greedy(n, ignore_eos=True))]).outputs["ref"].outputs[0].token_ids


def count_scheduled(e: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Wrap the engine's executor to count scheduled tokens per request."""
    counts: dict[str, int] = {}
    orig = e.core.executor.execute_model

    def wrapped(so):
        for r in so.requests:
            counts[r.req_id] = counts.get(r.req_id, 0) + r.num_scheduled_tokens
        return orig(so)

    monkeypatch.setattr(e.core.executor, "execute_model", wrapped)
    return counts


# -- 4. one token too many --------------------------------------------------------------
def test_case04_never_scheduled_past_max_tokens_or_max_model_len(tiny_llama, monkeypatch):
    e = engine(tiny_llama, True)
    counts = count_scheduled(e, monkeypatch)
    prompt = list(range(2, 12))
    res = run_workload(e, [WorkItem("m", prompt, greedy(7, ignore_eos=True))])
    assert len(res.outputs["m"].outputs[0].token_ids) == 7
    # prompt + 6 inputs for tokens 2..7: the 7th token is never fed back.
    assert counts["m"] == len(prompt) + 7 - 1
    e2 = engine(tiny_llama, True, max_model_len=16)
    counts2 = count_scheduled(e2, monkeypatch)
    out = run_workload(e2, [WorkItem("l", prompt, greedy(100, ignore_eos=True))]).outputs["l"].outputs[0]
    assert len(prompt) + len(out.token_ids) == 16 and out.finish_reason == "length"
    assert counts2["l"] == 15
    assert e.core.scheduler.stats.num_dropped_tokens == 0


# -- 5. token after the end -------------------------------------------------------------
def test_case05_token_after_stop_is_dropped_and_blocks_freed_once(tiny_llama):
    prompt = [9, 8, 7, 6, 5]
    ref = reference_tokens(tiny_llama, prompt, 12)
    stop_tok = ref[4]
    first = ref.index(stop_tok)
    sp = greedy(12, stop_token_ids=[stop_tok])
    (es, rs), (ea, ra) = both(tiny_llama, [WorkItem("s", prompt, sp)])
    for r in (rs, ra):
        c = r.outputs["s"].outputs[0]
        assert c.token_ids == ref[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    assert ea.core.scheduler.stats.num_dropped_tokens >= 1  # the in-flight step's token
    assert es.core.scheduler.stats.num_dropped_tokens == 0
    for e in (es, ea):
        assert e.core.kv_cache.num_free_blocks == e.core.kv_cache.num_blocks


# -- 6. min_tokens and ignore_eos ----------------------------------------------------------
def test_case06_min_tokens_and_ignore_eos_hold_with_placeholders(tiny_llama):
    prompt = [3, 4, 5]
    ref = reference_tokens(tiny_llama, prompt, 10)
    eos_like = ref[1]  # a token the model emits early: use it as a stop id
    items = [WorkItem("min", prompt, greedy(10, stop_token_ids=[eos_like], min_tokens=6)),
             WorkItem("ign", prompt, greedy(10, ignore_eos=True))]
    (_, rs), (_, ra) = both(tiny_llama, items)
    assert_same(rs.outputs, ra.outputs, items)
    out = ra.outputs["min"].outputs[0].token_ids
    assert len(out) >= 6 and eos_like not in out[:6]
    assert len(ra.outputs["ign"].outputs[0].token_ids) == 10


# -- 7. abort while in flight -------------------------------------------------------------
def test_case07_abort_in_flight_no_output_no_double_free(tiny_llama):
    e = engine(tiny_llama, True)
    e.add_request("a", [5, 6, 7], greedy(50, ignore_eos=True))
    e.add_request("b", [5, 6, 8], greedy(8, ignore_eos=True))
    seen_after_abort = []
    aborted = False
    while e.has_unfinished_requests():
        for out in e.step():
            if out.request_id == "a" and aborted:
                seen_after_abort.append(out)
            if out.request_id == "a" and len(out.outputs[0].token_ids) == 3 and not aborted:
                assert e.core.batch_queue, "expected a step in flight"
                e.abort_request("a")
                aborted = True
                e.abort_request("a")  # twice: no-op
    e.abort_request("a")  # finished: no-op
    e.abort_request("nope")  # unknown: no-op
    assert aborted and not seen_after_abort
    assert e.core.scheduler.stats.num_dropped_tokens >= 1
    e.core.kv_cache.check_integrity()
    assert e.core.kv_cache.num_free_blocks == e.core.kv_cache.num_blocks


# -- 8. preemption with a step in flight ------------------------------------------------------
def test_case08_preemption_in_flight_no_repeat_no_loss(tiny_llama):
    prompts = [[2 + i] * (10 + i) for i in range(6)]
    items = [WorkItem(f"p{i}", p, greedy(30, ignore_eos=True)) for i, p in enumerate(prompts)]
    (es, rs), (ea, ra) = both(tiny_llama, items, num_kv_blocks=30)
    assert ea.core.scheduler.stats.num_preemptions > 0
    assert_same(rs.outputs, ra.outputs, items)
    for i, p in enumerate(prompts):
        assert ra.outputs[f"p{i}"].outputs[0].token_ids == reference_tokens(tiny_llama, p, 30)


# -- 9. prefix cache only over real tokens ---------------------------------------------------
def test_case09_blocks_hashed_only_when_all_tokens_real(tiny_llama, monkeypatch):
    e = engine(tiny_llama, True)
    kv = e.core.kv_cache
    orig = kv.cache_full_blocks
    checked = []

    def guarded(request, num_real_computed):
        assert num_real_computed <= request.num_tokens, "asked to hash a placeholder position"
        orig(request, num_real_computed)
        for j, b in enumerate(kv.req_blocks.get(id(request), [])):
            if b.block_hash is not None and j < len(request.block_hashes):
                assert (j + 1) * kv.block_size <= request.num_tokens
                checked.append(j)

    monkeypatch.setattr(kv, "cache_full_blocks", guarded)
    items = [WorkItem("x", list(range(2, 9)), greedy(20, ignore_eos=True)),
             WorkItem("y", list(range(2, 9)), greedy(20, ignore_eos=True), arrive_step=12)]
    res = run_workload(e, items)
    assert checked
    # The second request reuses blocks that include *generated* tokens only if identical.
    assert res.outputs["x"].outputs[0].token_ids == res.outputs["y"].outputs[0].token_ids


# -- 10. chunked prefill -------------------------------------------------------------------------
def test_case10_non_final_chunks_sample_nothing_and_seeded_same(tiny_llama, monkeypatch):
    e = engine(tiny_llama, True, max_num_batched_tokens=8)
    sampled_on_chunk = []
    orig = e.core.executor.execute_model

    def spy(so):
        for r in so.requests:
            if r.new is not None or r.num_computed_tokens < 30:
                final = r.num_computed_tokens + r.num_scheduled_tokens >= 30
                sampled_on_chunk.append((final, r.samples))
        return orig(so)

    monkeypatch.setattr(e.core.executor, "execute_model", spy)
    sp = SamplingParams(temperature=1.0, seed=77, max_tokens=10, ignore_eos=True)
    prompt = list(range(2, 32))
    chunked = run_workload(e, [WorkItem("c", prompt, sp)]).outputs["c"].outputs[0].token_ids
    assert any(not f for f, _ in sampled_on_chunk), "prompt was not chunked"
    assert all(s == f for f, s in sampled_on_chunk), "a non-final chunk sampled"
    whole = run_workload(engine(tiny_llama, False), [WorkItem("c", prompt, sp)]).outputs["c"].outputs[0].token_ids
    assert chunked == whole


# -- 11. penalties see exactly the sync tokens -----------------------------------------------------
def test_case11_penalties_match_hf_reference(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = [4, 4, 5, 6, 4, 7]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.5,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    items = [WorkItem("r", prompt, greedy(16, ignore_eos=True, repetition_penalty=1.5)),
             WorkItem("f", prompt, greedy(16, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5))]
    (_, rs), (_, ra) = both(tiny_llama, items)
    assert ra.outputs["r"].outputs[0].token_ids == ref
    assert_same(rs.outputs, ra.outputs, items)


# -- 12. batch reordering ------------------------------------------------------------------------
def test_case12_each_decode_reads_its_own_previous_token(tiny_llama):
    """Requests leave at different times and others join: every output equals its solo run."""
    prompts = [[2 + (7 * i) % 100] * (3 + i) for i in range(8)]
    lens = [3, 17, 5, 11, 2, 20, 8, 13]
    items = [WorkItem(f"o{i}", p, greedy(lens[i], ignore_eos=True), arrive_step=(i * 3) % 7)
             for i, p in enumerate(prompts)]
    (_, rs), (_, ra) = both(tiny_llama, items, max_num_seqs=4)
    for i, p in enumerate(prompts):
        solo = reference_tokens(tiny_llama, p, lens[i])
        assert ra.outputs[f"o{i}"].outputs[0].token_ids == solo
        assert rs.outputs[f"o{i}"].outputs[0].token_ids == solo


# -- 13. errors surface ----------------------------------------------------------------------------
@pytest.mark.parametrize("constrained,fill_thread", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("where", ["model", "sampler"])
@pytest.mark.parametrize("a", [False, True])
def test_case13_injected_error_reaches_caller_engine_stays_usable(tiny_llama, monkeypatch, where, a, constrained,
                                                                  fill_thread):
    """(constrained: the failing step is a gated constrained step; with ``fill_thread`` its
    fills and accepts run on their thread, as on CUDA, where the failed step's accept fails
    and the fills after it still run.)"""
    llm = LLM(tiny_llama, async_scheduling=a, block_size=4, num_kv_blocks=128)
    if fill_thread:
        llm.engine.core.structured.set_gated_background(True)
    runner = llm.engine.core.executor.worker.runner
    target = runner.model if where == "model" else runner.sampler
    orig = target.forward
    calls = {"n": 0}

    def failing(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError(f"injected {where} failure")
        return orig(*args, **kw)

    sp = greedy(8, ignore_eos=True)
    bad = greedy(8, structured_outputs=StructuredOutputsParams(regex="(t2[0-9]?)+")) if constrained else sp
    with monkeypatch.context() as mp:
        mp.setattr(target, "forward", failing)
        with pytest.raises(RequestError) as info:
            llm.generate([[5, 6, 7], [8, 9]], [sp, bad], use_tqdm=False)
    assert f"injected {where} failure" in str(info.value)
    assert all(o.outputs[0].finish_reason == "error" for o in info.value.outputs)
    again = llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    assert again[0].outputs[0].token_ids == reference_tokens(tiny_llama, [5, 6, 7], 8)
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    llm.shutdown()


# -- 14. request ids -----------------------------------------------------------------------------
def test_case14_request_id_reuse(tiny_llama):
    e = engine(tiny_llama, True)
    e.add_request("same", [5, 6], greedy(3))
    with pytest.raises(ValueError, match="already in use"):
        e.add_request("same", [5, 6], greedy(3))
    run_workload(e, [])
    res = run_workload(e, [WorkItem("same", [5, 6], greedy(3))])
    assert len(res.outputs["same"].outputs[0].token_ids) == 3


# -- 15. scheduler ahead of the worker -----------------------------------------------------------
def test_case15_resumed_request_sends_confirmed_tokens(tiny_llama, monkeypatch):
    """A request resumed after preemption is re-sent to the worker with exactly the tokens
    the worker confirmed: it resumes only once none of its earlier steps is in flight, so
    it has no look-ahead placeholder left, and the step that resumes it is its only step
    in flight (holding one new placeholder if, and only if, that step samples)."""
    e = engine(tiny_llama, True, num_kv_blocks=24, max_num_seqs=4)
    sched = e.core.scheduler
    resumed = []
    orig = e.core.executor.execute_model

    def spy(so):
        for r in so.requests:
            if r.new is not None and len(r.new.token_ids) > r.new.num_prompt_tokens:
                req = sched.requests[r.req_id]
                assert req.num_inflight_steps == 1, f"resumed with an earlier step still in flight: {req}"
                assert req.num_output_placeholders == int(r.samples), f"stale placeholders on resume: {req}"
                assert r.new.token_ids == req.prompt_token_ids + req.output_token_ids
                resumed.append(r.req_id)
        return orig(so)

    monkeypatch.setattr(e.core.executor, "execute_model", spy)
    prompts = [[3 + i] * 12 for i in range(4)]
    items = [WorkItem(f"w{i}", p, greedy(24, ignore_eos=True)) for i, p in enumerate(prompts)]
    res = run_workload(e, items)
    assert resumed, "no request was resumed after preemption"
    for i, p in enumerate(prompts):
        assert res.outputs[f"w{i}"].outputs[0].token_ids == reference_tokens(tiny_llama, p, 24)


# -- 16. silent duplication is caught by the exact comparison --------------------------------------
def test_case16_exact_comparison_catches_misrouted_tokens(tiny_llama, monkeypatch):
    """Break the device token feed (write sampled ids one row off) and check the sync==async
    comparison fails, while the same async run without the fault passes it: the guard
    against silent duplication has teeth."""
    items = [WorkItem(f"d{i}", [10 + i] * 4, greedy(10, ignore_eos=True)) for i in range(3)]
    good = run_workload(engine(tiny_llama, False), items).outputs
    assert_same(good, run_workload(engine(tiny_llama, True), items).outputs, items)
    bad_engine = engine(tiny_llama, True)
    flat = bad_engine.core.executor.worker.runner.batch.token_table.view(-1)
    orig_index_copy = torch.Tensor.index_copy_
    misrouted = []

    def misroute(self, dim, index, source):
        if self.data_ptr() == flat.data_ptr() and index.numel() > 1:
            index = torch.roll(index, 1)  # each sampled id lands in another request's row
            misrouted.append(index.numel())
        return orig_index_copy(self, dim, index, source)

    with monkeypatch.context() as mp:
        mp.setattr(torch.Tensor, "index_copy_", misroute)
        bad = run_workload(bad_engine, items).outputs
    assert misrouted, "the fault was never injected: the token table is no longer written with index_copy_"
    with pytest.raises(AssertionError):
        assert_same(good, bad, items)


# -- 18. no needless re-scheduling ---------------------------------------------------------------
def test_case18_request_near_max_tokens_stays_running(tiny_llama, monkeypatch):
    e = engine(tiny_llama, True)
    news: dict[str, int] = {}
    orig = e.core.executor.execute_model

    def spy(so):
        for r in so.requests:
            if r.new is not None:
                news[r.req_id] = news.get(r.req_id, 0) + 1
        assert not so.preempted_req_ids
        return orig(so)

    monkeypatch.setattr(e.core.executor, "execute_model", spy)
    items = [WorkItem(f"n{i}", [5 + i] * 5, greedy(2 + i, ignore_eos=True)) for i in range(5)]
    res = run_workload(e, items)
    assert news == {f"n{i}": 1 for i in range(5)}, "a request was dropped and re-added"
    steps = e.core.stats.num_launched
    # 5 prompts in one step, then decode steps up to the longest (6 tokens): no extra steps.
    assert steps <= 6, steps
    assert all(len(res.outputs[f"n{i}"].outputs[0].token_ids) == 2 + i for i in range(5))
