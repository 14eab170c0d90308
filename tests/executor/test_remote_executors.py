"""The remote executors' contract, one suite run on both: multiproc (worker processes) and
Ray (one actor per rank on a local Ray instance; skipped when ray is not installed).

* equivalence: uniproc == remote TP=1 == remote TP=2 (gloo), sync and async, on random
  workloads with preemption, chunked prefill, aborts and seeded sampling;
* contract: one reply per call in call order, including calls that only prime the pipeline;
* faults: a worker raising at step N, SIGKILLed or exiting mid-step, dying inside a call
  that is not a step, SIGKILLed from outside while idle, hanging — each fails (never
  hangs) within a bounded time, with the same messages on both executors (they share one
  failure path, ``RemoteExecutor``), and no worker process outlives its executor;
* Ray only: a cluster too small for the placement group fails at once.

Starting workers is the slow part on a small machine, so engines are built once and
shared: every engine runs ``faulty_worker.FaultyWorker`` (identical to ``Worker`` until a
fault is armed), and sync vs async is the engine core's in-flight depth (1 or 2), which is
all that ``async_scheduling`` sets (``EngineConfig.max_concurrent_batches``). Tests that
break an executor *take* their engine out of the cache; the others leave it for the next.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "engine"))
from engine_harness import assert_same, random_workload, run_workload  # noqa: E402

from executor_test_utils import BASE, FAULTY, SETTINGS, VOCAB, pid_alive, wait_gone  # noqa: E402
from proc_utils import live_children  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine, RequestError  # noqa: E402
from tandem.entrypoints.llm import LLM  # noqa: E402
from tandem.models.model_config import resolve_model_config  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402
from tandem.types.errors import ExecutorError, WorkerDiedError, WorkerError, WorkerTimeoutError  # noqa: E402
from tandem.types.scheduler_output import SchedulerOutput  # noqa: E402

CAPACITY = 4  # ranks alive at once (Ray: the CPUs of the local instance)
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance whose actors can import ``tandem`` and ``faulty_worker``."""
    ray = pytest.importorskip("ray")
    shm = Path("/dev/shm")
    shm_before = set(os.listdir(shm)) if shm.is_dir() else set()
    children_before = set(live_children())
    ray.init(num_cpus=CAPACITY, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}})
    try:
        yield ray
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


@pytest.fixture(scope="module", params=["multiproc", "ray"])
def kind(request) -> str:
    """The executor under test; Ray's tests start (and check) a local Ray instance."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


@pytest.fixture(scope="module")
def tp_model(tiny_factory):
    """GQA model whose heads split over two ranks (4 query heads, 2 KV heads)."""
    return tiny_factory("llama", num_attention_heads=4, num_key_value_heads=2)


class Engines:
    """``LLM`` objects of one executor kind by (tp, setting, extra config), built on demand
    and shared across tests; the oldest are shut down when the next would exceed CAPACITY."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        self.model = model
        self.cache: dict[tuple, LLM] = {}
        self.refs: dict[str, LLMEngine] = {}
        self.made: list[LLM] = []

    def ref(self, setting: str) -> LLMEngine:
        if setting not in self.refs:
            self.refs[setting] = LLMEngine(EngineConfig(model=self.model, executor="uniproc", async_scheduling=False,
                                                        **{**BASE, **SETTINGS[setting]}))
        return self.refs[setting]

    def get(self, tp: int, setting: str = "default", **extra) -> LLM:
        key = (tp, setting, tuple(sorted(extra.items())))
        if key not in self.cache:
            while self.cache and sum(k[0] for k in self.cache) + tp > CAPACITY:
                self.release(next(iter(self.cache)))
            llm = LLM(self.model, executor=self.kind, tensor_parallel_size=tp, worker_cls=FAULTY,
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
        shutdown_and_check(self.cache.pop(key))


def shutdown_and_check(llm: LLM) -> None:
    pids = [p for p in llm.engine.core.executor.worker_pids if p]
    llm.shutdown()
    assert wait_gone(pids) == [], "worker processes outlived shutdown()"


@pytest.fixture(scope="module")
def engines(kind, tp_model):
    e = Engines(kind, tp_model)
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


# -- equivalence ---------------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("tp", [1, 2])
def test_matches_uniproc_sync_and_async(engines, tp, setting):
    """(The third workload has constrained requests: their steps take two calls, and under
    tensor parallelism every rank takes part in both.)"""
    llm = engines.get(tp, setting)
    try:
        for seed, constrained in ((3, 0.0), (11, 0.0), (5, 0.5)):
            items = random_workload(seed, VOCAB, constrained=constrained)
            ref = run_workload(engines.ref(setting), items)
            for async_scheduling in (False, True):
                got = run_workload(_set_depth(llm, async_scheduling), items)
                assert_same(ref.outputs, got.outputs, items)
    finally:
        _set_depth(llm, True)
    assert llm.engine.core.stats.num_launched_ahead > 0, f"async {engines.kind} executor never overlapped two steps"
    assert llm.engine.core.stats.num_sampling_deferred > 0, "no constrained step deferred its sampling"


# -- the RPC contract ----------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [1, 2])
def test_priming_call_is_answered_and_replies_come_in_order(engines, tp):
    """The seed's deadlock: a worker that never answered the call that only primes the
    pipeline. Here an empty step is answered like any other, in order, on every rank."""
    ex = engines.get(tp).engine.core.executor
    prime = ex.execute_model(SchedulerOutput(step_id=0, requests=[]))
    infos = [ex._call("get_pid", (), {}) for _ in range(3)]
    second = ex.execute_model(SchedulerOutput(step_id=1, requests=[]))
    third = ex.execute_model(SchedulerOutput(step_id=2, requests=[]))
    out = prime.result(timeout=30)
    assert out.step_id == 0 and out.req_ids == [] and out.sampled_token_ids == []
    assert [second.result(timeout=30).step_id, third.result(timeout=30).step_id] == [1, 2]
    assert all(f.result(timeout=30) == ex.worker_pids[0] for f in infos)
    assert [f.all_results is not None for f in infos] == [True] * 3
    pids = ex.collective_rpc("get_pid")
    assert len(pids) == tp and pids == ex.worker_pids and len(set(pids)) == tp


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
def test_only_the_workers_public_methods_can_be_called(engines):
    ex = engines.get(1).engine.core.executor
    for method in ("__init__", "_fire", "__class__"):
        with pytest.raises(WorkerError, match="not a method FaultyWorker exposes"):
            ex.collective_rpc(method)
    assert ex.collective_rpc("get_pid") == ex.worker_pids


# -- faults --------------------------------------------------------------------------------
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
    out = llm.generate([[5, 6, 7]], SP, use_tqdm=False)  # the worker survives its own exception
    assert len(out[0].outputs[0].token_ids) == 12


@pytest.mark.timeout(60)
def test_tp1_worker_raising_in_sample_tokens_fails_the_requests_and_engine_stays_usable(engines):
    llm = engines.get(1)
    constrained = SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "(t2[0-9]?)+"})
    llm.engine.core.executor.collective_rpc("set_fault", "raise_in_sampling", 3, 0)
    with pytest.raises(RequestError) as ei:
        llm.generate([[5, 6, 7], [8, 9]], [SP, constrained], use_tqdm=False)
    assert "InjectedFault" in str(ei.value) and "sample_tokens" in str(ei.value)
    assert all(o.outputs[0].finish_reason == "error" for o in ei.value.outputs)
    out = llm.generate([[5, 6, 7], [8, 9]], [SP, constrained], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12 and out[1].error is None


@pytest.mark.timeout(90)
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


def _death_text(kind: str, fault: str) -> str:
    """What the death message says about how the process ended (Ray reports its own words)."""
    if kind != "multiproc":
        return "WorkerDiedError"
    return "SIGKILL" if fault == "kill" else "exited with code 3"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault,tp", [("kill", 1), ("exit", 1), ("kill", 2)])
def test_worker_dying_mid_step_fails_pending_and_later_calls(engines, fault, tp):
    """Rank ``tp - 1`` dies inside a step (with TP=2 while rank 0 waits in a collective):
    the executor reports the death (not rank 0's collective error), at once, and stops
    the surviving rank too."""
    llm = engines.take(tp, "preempt+chunked")
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    try:
        ex.collective_rpc("set_fault", fault, 3, tp - 1)
        sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            llm.generate([[5, 6, 7], [8, 9, 10, 11]], sp, use_tqdm=False)
        assert time.monotonic() - t0 < 20, "death must be detected within seconds"
        msg = str(ei.value)
        assert "WorkerDiedError" in msg and f"rank {tp - 1}" in msg and _death_text(engines.kind, fault) in msg
        with pytest.raises(WorkerDiedError):
            ex.check_health()
        t0 = time.monotonic()
        with pytest.raises(RequestError, match="WorkerDiedError"):  # later calls fail fast
            llm.generate([[5, 6]], sp, use_tqdm=False)
        assert time.monotonic() - t0 < 5
        fut = ex.execute_model(SchedulerOutput(step_id=99, requests=[]))
        assert fut.done() and isinstance(fut.exception(), WorkerDiedError), "a broken executor fails at once"
        with pytest.raises(WorkerDiedError, match=f"rank {tp - 1}"):
            ex.collective_rpc("get_pid")
        assert wait_gone(pids) == [], "the surviving ranks must be stopped too"
    finally:
        shutdown_and_check(llm)


@pytest.mark.timeout(60)
def test_worker_dying_inside_a_call_that_is_not_a_step_fails_it(engines):
    llm = engines.take(1)
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 0"):
            ex.collective_rpc("crash_now")
        assert time.monotonic() - t0 < 20
        assert wait_gone(pids) == []
    finally:
        shutdown_and_check(llm)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [1, 2])
def test_worker_killed_from_outside_is_detected_while_idle(engines, tp):
    llm = engines.take(tp)
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    victim = tp - 1
    try:
        os.kill(pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                ex.check_health()
            except WorkerDiedError as e:
                assert f"rank {victim}" in str(e)
                if engines.kind == "multiproc":
                    assert "SIGKILL" in str(e)
                break
            time.sleep(0.05)
        else:
            pytest.fail("a SIGKILLed worker went unnoticed for 10 s")
        fut = ex.execute_model(SchedulerOutput(step_id=0, requests=[]))
        assert fut.done() and isinstance(fut.exception(), WorkerDiedError)
        assert wait_gone(pids) == []
    finally:
        shutdown_and_check(llm)


@pytest.mark.timeout(90)
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
        assert wait_gone(pids) == [], "a hung worker must be stopped"
    finally:
        shutdown_and_check(llm)


# -- shutdown ------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_shutdown_leaves_no_worker_process_and_later_calls_fail_clearly(engines):
    llm = engines.take(1)
    ex = llm.engine.core.executor
    pids = ex.collective_rpc("get_pid")
    assert pids == ex.worker_pids and all(pid_alive(p) for p in pids)
    llm.shutdown()
    ex.shutdown()  # idempotent
    assert wait_gone(pids, timeout=10) == [], "worker processes outlived shutdown()"
    with pytest.raises(ExecutorError, match="shut down"):
        ex.collective_rpc("get_pid")
    fut = ex.execute_model(SchedulerOutput(step_id=0, requests=[]))
    assert fut.done() and isinstance(fut.exception(), ExecutorError)
    if engines.kind == "ray":
        assert ray_is_initialized(), "an executor must not stop a Ray it did not start"


def ray_is_initialized() -> bool:
    import ray

    return ray.is_initialized()


# -- Ray only --------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["ray"], indirect=True)
def test_cluster_too_small_for_the_placement_group_fails_clearly(kind, tiny_factory):
    from tandem.executor.ray_executor import RayExecutor

    tp = 2 * CAPACITY
    model = tiny_factory("llama", num_attention_heads=tp, num_key_value_heads=tp)  # splits over tp ranks
    cfg = EngineConfig(model=model, executor="ray", tensor_parallel_size=tp, **BASE)  # default start timeout: 600 s
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match="cannot place"):
        RayExecutor(cfg, resolve_model_config(cfg))
    assert time.monotonic() - t0 < 20
    assert ray_is_initialized(), "an executor must not stop a Ray it did not start"


@pytest.mark.timeout(30)
def test_ray_is_reached_through_its_public_api_only():
    source = (ROOT / "tandem" / "executor" / "ray_executor.py").read_text()
    assert "ray._private" not in source and "_actor_id" not in source
