"""The step loop's guarantees, tested without a model (a fake executor).

The three bugs reviewers found in the vLLM overlap PR, made impossible here:
1. reading a batch that was never scheduled when the in-flight queue is full;
2. a livelock where the loop returns early and never drains its queue;
3. a worker that does not answer the RPC that only primes the pipeline.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import zlib
from types import SimpleNamespace
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from hypothesis import given, settings, strategies as st

from tandem.config import EngineConfig, ModelConfig
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput
from tandem.engine.engine_core import EngineCore, EngineStallError
from tandem.types.request import Request
from tandem.executor.base import Executor
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)

EOS = 1
# The loop never looks inside the model: a config with the fields the engine reads is enough.
FAKE_MODEL = ModelConfig(folder="unused", tokenizer="unused",
                         hf_config=SimpleNamespace(vocab_size=100, num_hidden_layers=1, num_attention_heads=1,
                                                   hidden_size=8),
                         dtype="float32", device="cpu", max_model_len=256, eos_token_ids=(EOS,),
                         max_num_seqs=4, max_num_batched_tokens=16)


def fake_token(req_id: str, position: int) -> int:
    """Deterministic 'model': the token depends only on the request and the position
    (crc32, not the salted ``hash()``, so a failing hypothesis example reproduces)."""
    return (zlib.crc32(f"{req_id}:{position}".encode()) % 50) + 2 if position % 7 else EOS


class FakeExecutor(Executor):
    """Answers every step through a future; optionally from a thread, optionally late."""

    def __init__(self, threaded: bool = False, fail_at: int | None = None) -> None:
        self.calls: list[SchedulerOutput] = []
        self.pool = ThreadPoolExecutor(1) if threaded else None
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.fail_at is not None and so.step_id == self.fail_at:
            raise RuntimeError(f"injected failure at step {so.step_id}")
        ids, toks = [], []
        for r in so.requests:
            if r.samples:
                ids.append(r.req_id)
                toks.append(fake_token(r.req_id, r.num_computed_tokens + r.num_scheduled_tokens))
        return ModelRunnerOutput(so.step_id, ids, toks)

    def execute_model(self, so: SchedulerOutput) -> Future:
        self.calls.append(so)
        if self.pool is not None:
            return self.pool.submit(self._run, so)
        f: Future = Future()
        try:
            f.set_result(self._run(so))
        except Exception as e:
            f.set_exception(e)
        return f

    def sample_tokens(self, grammar) -> Future:
        raise AssertionError("these tests send no constrained request")

    def collective_rpc(self, method, *args, **kwargs):
        if method == "determine_num_kv_blocks":
            return [self.num_blocks]
        return [None]

    num_blocks = 64

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.pool:
            self.pool.shutdown()


def make_core(async_scheduling: bool, executor: FakeExecutor | None = None, **kw) -> EngineCore:
    cfg = EngineConfig(async_scheduling=async_scheduling, block_size=4, max_num_seqs=4,
                       max_num_batched_tokens=16, **kw)
    model = dataclasses.replace(FAKE_MODEL, **cfg.step_limits(FAKE_MODEL.device)._asdict())
    return EngineCore(cfg, model, executor=executor or FakeExecutor())


def req(rid: str, n_prompt: int = 5, max_tokens: int = 8, **sp) -> Request:
    return Request(rid, list(range(2, 2 + n_prompt)), SamplingParams(max_tokens=max_tokens, **sp), [EOS], max_tokens)


def run_to_end(core: EngineCore, max_iters: int = 10_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    it = 0
    while core.has_work():
        for o in core.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
        it += 1
        assert it < max_iters, "loop did not drain"
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_iteration_launches_or_completes(async_scheduling):
    """Never neither; never a step that was not scheduled; the queue never exceeds its depth."""
    ex = FakeExecutor()
    core = make_core(async_scheduling, ex)
    for i in range(6):
        core.add_request(req(f"r{i}", n_prompt=3 + i, max_tokens=5 + i))
    while core.has_work():
        launched, completed = core.stats.num_launched, core.stats.num_completed
        core.step()
        assert len(core.batch_queue) <= core.depth
        assert (core.stats.num_launched - launched) + (core.stats.num_completed - completed) >= 1
    assert core.stats.num_launched == core.stats.num_completed == len(ex.calls)
    assert all(not so.is_empty for so in ex.calls), "an empty (never scheduled) step was launched"


def test_full_queue_with_nothing_schedulable_completes_oldest():
    """Bug 1: with the queue full (or nothing to schedule) the loop completes a real batch."""
    core = make_core(True)
    core.add_request(req("a", max_tokens=2))
    core.step()  # launch step 0 (prefill)
    assert len(core.batch_queue) == 1
    core.step()  # launch step 1 (decode on a placeholder), queue full -> complete step 0
    # 'a' now has 1 real token + 1 placeholder = max_tokens: nothing more can be scheduled.
    assert core.scheduler.schedule().is_empty
    outs = core.step()  # must complete the in-flight step, not read a missing one
    assert outs and outs[0].finish_reason == "length"
    assert not core.has_work()


@pytest.mark.parametrize("depth_async", [False, True])
def test_stall_is_an_error_not_a_spin(depth_async):
    core = make_core(depth_async)
    r = req("x")
    core.add_request(r)
    core.scheduler.waiting.clear()  # a request the scheduler can never see
    with pytest.raises(EngineStallError):
        core.step()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    async_scheduling=st.booleans(),
    threaded=st.booleans(),
    num_blocks=st.sampled_from([12, 24, 64]),
)
def test_liveness_random_arrivals_and_aborts(seed, async_scheduling, threaded, num_blocks):
    """Bug 2: under any mix of arrivals, aborts and cache pressure every request ends."""
    rng = random.Random(seed)
    ex = FakeExecutor(threaded=threaded)
    ex.num_blocks = num_blocks
    core = make_core(async_scheduling, ex)
    todo = [(rng.randint(0, 30), req(f"q{i}", rng.randint(1, 20), rng.randint(1, 12),
                                     ignore_eos=rng.random() < 0.5)) for i in range(12)]
    live: set[str] = set()
    finished: set[str] = set()
    it = 0
    while todo or core.has_work():
        for t, r in [x for x in todo if x[0] <= it]:
            todo.remove((t, r))
            core.add_request(r)
            live.add(r.request_id)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            core.abort_requests([victim])
            live.discard(victim)
            finished.add(victim)
        for o in core.step():
            if o.finish_reason is not None:
                live.discard(o.req_id)
                finished.add(o.req_id)
        it += 1
        assert it < 5000, "livelock"
    assert finished == {f"q{i}" for i in range(12)}
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    core.kv_cache.check_integrity()
    ex.shutdown()


def test_priming_rpc_is_answered_and_replies_in_order():
    """Bug 3: the first execute_model (which only primes the pipeline) gets its reply, and
    replies arrive one per call, in call order, even when several are outstanding."""
    ex = FakeExecutor(threaded=True)
    core = make_core(True, ex)
    core.add_request(req("p", max_tokens=4, ignore_eos=True))
    core.step()  # launches the priming step and returns without completing it
    assert len(core.batch_queue) == 1
    step = core.batch_queue[0]
    assert step.output is not None and step.output.result(timeout=5).step_id == step.so.step_id
    out = run_to_end(core)
    assert len(out["p"]) == 4
    steps = [so.step_id for so in ex.calls]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    ex.shutdown()


@pytest.mark.parametrize("threaded", [False, True])
def test_step_error_reaches_caller_and_engine_stays_usable(threaded):
    ex = FakeExecutor(threaded=threaded, fail_at=2)
    core = make_core(True, ex)
    core.add_request(req("e1", max_tokens=6))
    core.add_request(req("e2", max_tokens=6))
    outs = {}
    while core.has_work():
        for o in core.step():
            outs.setdefault(o.req_id, []).append(o)
    assert all(o[-1].finish_reason == "error" and "injected failure" in o[-1].error for o in outs.values())
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    # Still usable afterwards.
    ex.fail_at = None
    core.add_request(req("e3", max_tokens=3))
    assert len(run_to_end(core)["e3"]) == 3
    ex.shutdown()


def test_async_launches_ahead_nearly_every_decode_step():
    """Case 17: the overlap really happens (counted, not assumed)."""
    core = make_core(True)
    for i in range(3):
        core.add_request(req(f"d{i}", max_tokens=40, ignore_eos=True))
    run_to_end(core)
    s = core.stats
    assert s.num_launched_ahead >= 0.9 * (s.num_launched - 1), s


def test_sync_never_launches_ahead():
    core = make_core(False)
    core.add_request(req("s", max_tokens=10, ignore_eos=True))
    run_to_end(core)
    assert core.stats.num_launched_ahead == 0


@pytest.mark.parametrize("threaded", [False, True])
def test_fake_model_outputs_same_async_and_sync(threaded):
    """The async loop hands every request the tokens the sync loop does, with the executor
    answering inline or from a thread."""
    outs = {}
    for async_scheduling in (False, True):
        ex = FakeExecutor(threaded=threaded)
        core = make_core(async_scheduling, ex)
        for i in range(5):
            core.add_request(req(f"m{i}", n_prompt=2 + 3 * i, max_tokens=12))
        outs[async_scheduling] = run_to_end(core)
        ex.shutdown()
    assert outs[True] == outs[False]
    assert len(outs[True]) == 5 and all(outs[True].values())
