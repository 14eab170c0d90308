"""The Ray executor: one actor per rank on a local Ray instance, the RPC contract, and faults.

* equivalence: uniproc == ray TP=1 == ray TP=2 (gloo), sync and async, on random workloads
  with preemption, chunked prefill, aborts and seeded sampling;
* contract: one reply per call in call order, including calls that only prime the pipeline;
* faults: a worker raising at step N, SIGKILLed mid-step or from outside, hanging, a
  cluster too small for the placement group — each fails (never hangs) within a bounded
  time, and no actor process outlives its executor.

Starting actors is the slow part on a small machine, so engines are built once and shared:
every engine runs ``faulty_worker.FaultyWorker`` (identical to ``Worker`` until a fault is
armed), and sync vs async is the engine core's in-flight depth (1 or 2), which is all that
``async_scheduling`` sets (``EngineConfig.max_concurrent_batches``). Tests that break an
executor *take* their engine out of the cache; the others leave it for the next test.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "engine"))
from engine_harness import assert_same, random_workload, run_workload  # noqa: E402

from proc_utils import live_children  # noqa: E402
from executor_test_utils import BASE, FAULTY, SETTINGS, VOCAB, pid_alive, wait_gone  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.models.model_config import resolve_model_config  # noqa: E402
from tandem.types.scheduler_output import SchedulerOutput  # noqa: E402
from tandem.engine.llm_engine import LLMEngine, RequestError  # noqa: E402
from tandem.entrypoints.llm import LLM  # noqa: E402
from tandem.types.errors import ExecutorError, WorkerDiedError, WorkerError, WorkerTimeoutError  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402

RAY_CPUS = 4
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance whose actors can import ``tandem`` and ``faulty_worker``."""
    shm = Path("/dev/shm")
    shm_before = set(os.listdir(shm)) if shm.is_dir() else set()
    children_before = set(live_children())
    ray.init(num_cpus=RAY_CPUS, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}})
    try:
        yield
    finally:
        ray.shutdown()
    deadline = time.monotonic() + 15
    while True:
        leaked = set(live_children()) - children_before
        new_shm = (set(os.listdir(shm)) - shm_before) if shm.is_dir() else set()
        if (not leaked and not new_shm) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not leaked, f"Ray processes outlived ray.shutdown(): {sorted(leaked)}"
    assert not new_shm, f"Ray left shared memory in /dev/shm: {sorted(new_shm)}"


@pytest.fixture(scope="module")
def tp_model(tiny_factory):
    """GQA model whose heads split over two ranks (4 query heads, 2 KV heads)."""
    return tiny_factory("llama", num_attention_heads=4, num_key_value_heads=2)


class _Engines:
    """Ray-backed ``LLM`` objects by (tp, setting, extra config), built on demand, shared
    across tests; the oldest are shut down when the next would not fit in the cluster."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.cache: dict[tuple, LLM] = {}
        self.refs: dict[tuple, LLMEngine] = {}
        self.made: list[LLM] = []

    def ref(self, setting: str) -> LLMEngine:
        if setting not in self.refs:
            self.refs[setting] = LLMEngine(EngineConfig(model=self.model, executor="uniproc", async_scheduling=False,
                                                        **{**BASE, **SETTINGS[setting]}))
        return self.refs[setting]

    def get(self, tp: int, setting: str = "default", **extra) -> LLM:
        key = (tp, setting, tuple(sorted(extra.items())))
        if key not in self.cache:
            while self.cache and sum(k[0] for k in self.cache) + tp > RAY_CPUS:
                self.release(next(iter(self.cache)))
            llm = LLM(self.model, executor="ray", tensor_parallel_size=tp, worker_cls=FAULTY,
                      **{**BASE, **SETTINGS[setting], **extra})
            self.cache[key] = llm
            self.made.append(llm)
        return self.cache[key]

    def take(self, tp: int, setting: str = "default", **extra) -> LLM:
        """An engine this test may break: no later test gets it."""
        llm = self.get(tp, setting, **extra)
        del self.cache[next(k for k, v in self.cache.items() if v is llm)]
        return llm

    def release(self, key: tuple) -> None:
        llm = self.cache.pop(key)
        shutdown_and_check(llm)


def shutdown_and_check(llm: LLM) -> None:
    pids = [p for p in llm.engine.core.executor.worker_pids if p]
    llm.shutdown()
    assert wait_gone(pids) == [], "actor processes outlived shutdown()"


@pytest.fixture(scope="module")
def engines(ray_cluster, tp_model):
    e = _Engines(tp_model)
    yield e
    for key in list(e.cache):
        e.release(key)
    for llm in e.made:  # taken ones: shut down by their tests, or here (idempotent)
        shutdown_and_check(llm)
    for ref in e.refs.values():
        ref.shutdown()


def _set_depth(llm: LLM, async_scheduling: bool) -> LLMEngine:
    engine = llm.engine
    engine.core.depth = 2 if async_scheduling else 1
    return engine


def _check_equivalence(engines: _Engines, tp: int, setting: str) -> None:
    llm = engines.get(tp, setting)
    try:
        for seed in (3, 11):
            items = random_workload(seed, VOCAB)
            ref = run_workload(engines.ref(setting), items)
            for async_scheduling in (False, True):
                got = run_workload(_set_depth(llm, async_scheduling), items)
                assert_same(ref.outputs, got.outputs, items)
    finally:
        _set_depth(llm, True)
    assert llm.engine.core.stats.num_launched_ahead > 0, "async ray executor never overlapped two steps"


# -- TP=1: equivalence, contract, faults -------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_ray_tp1_matches_uniproc_sync_and_async(engines, setting):
    _check_equivalence(engines, 1, setting)


@pytest.mark.timeout(60)
def test_priming_call_is_answered_and_replies_come_in_order(engines):
    """An empty step (one that only primes the pipeline) is answered like any other, in order."""
    ex = engines.get(1).engine.core.executor
    prime = ex.execute_model(SchedulerOutput(step_id=0, requests=[]))
    infos = [ex._call("get_pid", (), {}) for _ in range(3)]
    second = ex.execute_model(SchedulerOutput(step_id=1, requests=[]))
    out = prime.result(timeout=30)
    assert out.step_id == 0 and out.req_ids == [] and out.sampled_token_ids == []
    assert second.result(timeout=30).step_id == 1
    assert all(f.result(timeout=30) == ex.worker_pids[0] for f in infos)
    assert sorted(ex.collective_rpc("get_pid")) == sorted(ex.worker_pids)


@pytest.mark.timeout(60)
def test_many_calls_in_flight_are_answered_once_each_in_call_order(engines):
    ex = engines.get(1).engine.core.executor
    futs = [ex.execute_model(SchedulerOutput(step_id=i, requests=[])) for i in range(50)]
    assert all(isinstance(f, Future) for f in futs)
    assert [f.result(timeout=30).step_id for f in reversed(futs)][::-1] == list(range(50))
    assert [f.result().step_id for f in futs] == list(range(50)), "a future must resolve once and stay resolved"


@pytest.mark.timeout(60)
def test_worker_exception_comes_back_with_its_traceback_and_worker_stays_usable(engines):
    ex = engines.get(1).engine.core.executor
    with pytest.raises(WorkerError) as ei:
        ex.collective_rpc("set_fault", "no-such-fault")
    msg = str(ei.value)
    assert "ValueError" in msg and "no-such-fault" in msg and ei.value.rank == 0
    assert "faulty_worker.py" in ei.value.worker_traceback, "the worker's own traceback must be carried"
    assert ex.collective_rpc("get_pid") == ex.worker_pids  # one rank: still usable


@pytest.mark.timeout(60)
def test_tp1_worker_raising_at_step_n_fails_the_requests_and_engine_stays_usable(engines):
    llm = engines.get(1)
    llm.engine.core.executor.collective_rpc("set_fault", "raise", 4, 0)
    t0 = time.monotonic()
    with pytest.raises(RequestError) as ei:
        llm.generate([[5, 6, 7], [8, 9]], SP, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert "InjectedFault" in str(ei.value) and "rank 0" in str(ei.value)
    assert "faulty_worker.py" in str(ei.value), "the worker traceback must reach the caller"
    assert all(o.outputs[0].finish_reason == "error" for o in ei.value.outputs)
    out = llm.generate([[5, 6, 7]], SP, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12


@pytest.mark.timeout(60)
def test_tp1_worker_killed_mid_step_fails_pending_and_later_calls(engines):
    llm = engines.take(1, "preempt+chunked")
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    try:
        ex.collective_rpc("set_fault", "kill", 3, 0)
        sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            llm.generate([[5, 6, 7], [8, 9, 10, 11]], sp, use_tqdm=False)
        assert time.monotonic() - t0 < 20, "death must be detected within seconds"
        assert "WorkerDiedError" in str(ei.value) and "rank 0" in str(ei.value)
        with pytest.raises(WorkerDiedError):
            ex.check_health()
        t0 = time.monotonic()
        with pytest.raises(RequestError, match="WorkerDiedError"):  # later calls fail fast
            llm.generate([[5, 6]], sp, use_tqdm=False)
        assert time.monotonic() - t0 < 5
        fut = ex.execute_model(SchedulerOutput(step_id=99, requests=[]))
        assert fut.done() and isinstance(fut.exception(), WorkerDiedError), "a broken executor fails at once"
        with pytest.raises(WorkerDiedError):
            ex.collective_rpc("get_pid")
        assert wait_gone(pids) == []
    finally:
        shutdown_and_check(llm)


@pytest.mark.timeout(60)
def test_hung_worker_times_out_instead_of_hanging(engines):
    llm = engines.take(1, rpc_timeout_s=3.0)
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    try:
        ex.collective_rpc("set_fault", "hang", 2)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        elapsed = time.monotonic() - t0
        assert 2.5 < elapsed < 30, elapsed
        assert "WorkerTimeoutError" in str(ei.value) and "rpc_timeout_s" in str(ei.value)
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError):  # broken: later calls fail fast
            ex.collective_rpc("get_pid")
        assert time.monotonic() - t0 < 1
        assert wait_gone(pids) == [], "a hung actor must be killed"
    finally:
        shutdown_and_check(llm)


@pytest.mark.timeout(60)
def test_cluster_too_small_for_the_placement_group_fails_clearly(ray_cluster, tp_model):
    cfg = EngineConfig(model=tp_model, executor="ray", tensor_parallel_size=RAY_CPUS + 4,  # default start timeout: 600 s
                       **BASE)
    from tandem.executor.ray_executor import RayExecutor

    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match="cannot place"):
        RayExecutor(cfg, resolve_model_config(cfg))
    assert time.monotonic() - t0 < 20
    assert ray.is_initialized(), "an executor must not stop a Ray it did not start"


@pytest.mark.timeout(60)
def test_actor_killed_from_outside_is_detected_while_idle(engines):
    llm = engines.take(1, rpc_timeout_s=3.0)
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    try:
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                ex.check_health()
            except WorkerDiedError as e:
                assert "rank 0" in str(e)
                break
            time.sleep(0.05)
        else:
            pytest.fail("a SIGKILLed actor went unnoticed for 10 s")
        fut = ex.execute_model(SchedulerOutput(step_id=0, requests=[]))
        assert fut.done() and isinstance(fut.exception(), WorkerDiedError)
        assert wait_gone(pids) == []
    finally:
        shutdown_and_check(llm)


# -- shutdown ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_shutdown_leaves_no_actor_process_and_later_calls_fail_clearly(engines):
    llm = engines.take(1)
    ex = llm.engine.core.executor
    pids = ex.collective_rpc("get_pid")
    assert pids == ex.worker_pids and all(pid_alive(p) for p in pids)
    llm.shutdown()
    ex.shutdown()  # idempotent
    assert wait_gone(pids, timeout=10) == [], "actor processes outlived shutdown()"
    with pytest.raises(ExecutorError, match="shut down"):
        ex.collective_rpc("get_pid")
    fut = ex.execute_model(SchedulerOutput(step_id=0, requests=[]))
    assert fut.done() and isinstance(fut.exception(), ExecutorError)
    assert ray.is_initialized(), "an executor must not stop a Ray it did not start"


# -- TP=2 --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_ray_tp2_matches_uniproc_sync_and_async(engines, setting):
    _check_equivalence(engines, 2, setting)


@pytest.mark.timeout(60)
def test_tp2_priming_call_is_answered_on_every_rank(engines):
    ex = engines.get(2).engine.core.executor
    futs = [ex.execute_model(SchedulerOutput(step_id=i, requests=[])) for i in range(3)]
    assert [f.result(timeout=30).step_id for f in futs] == [0, 1, 2]
    pids = ex.collective_rpc("get_pid")
    assert len(pids) == 2 and pids == ex.worker_pids and len(set(pids)) == 2


@pytest.mark.timeout(60)
def test_tp2_rank_killed_mid_step_is_reported_as_a_death(engines):
    """Rank 1 dies inside a step while rank 0 waits in a collective: the executor reports
    the death (not rank 0's collective error), at once, and kills rank 0 too."""
    llm = engines.take(2)
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    try:
        ex.collective_rpc("set_fault", "kill", 3, 1)
        sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            llm.generate([[5, 6, 7], [8, 9, 10, 11]], sp, use_tqdm=False)
        assert time.monotonic() - t0 < 20, "death must be detected within seconds"
        assert "WorkerDiedError" in str(ei.value) and "rank 1" in str(ei.value)
        with pytest.raises(WorkerDiedError, match="rank 1"):
            ex.collective_rpc("get_pid")
        assert wait_gone(pids) == [], "the surviving rank must be killed too"
    finally:
        shutdown_and_check(llm)


@pytest.mark.timeout(60)
def test_tp2_worker_raising_breaks_the_executor_at_once(engines):
    llm = engines.take(2, "preempt+chunked")
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    try:
        ex.collective_rpc("set_fault", "raise", 4, 1)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            llm.generate([[5, 6, 7], [8, 9]], SP, use_tqdm=False)
        assert time.monotonic() - t0 < 15, "a TP error must be reported at once, not after a timeout"
        assert "InjectedFault" in str(ei.value) and "rank 1" in str(ei.value)
        assert all(o.outputs[0].finish_reason == "error" for o in ei.value.outputs)
        with pytest.raises(RequestError, match="out of step"):  # TP peers are out of step: stopped
            llm.generate([[5, 6, 7]], SP, use_tqdm=False)
        assert wait_gone(pids) == []
    finally:
        shutdown_and_check(llm)
