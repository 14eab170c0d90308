"""The multiproc executor: real worker processes, the RPC contract, and what happens when a worker fails.

* equivalence: uniproc == multiproc TP=1 == multiproc TP=2 (gloo), sync and async, on random
  workloads with preemption, chunked prefill, aborts and seeded sampling;
* contract: one reply per call in call order, including calls that only prime the pipeline;
* faults: a worker raising at step N, SIGKILLed mid-step, exiting, hanging, failing to start,
  and the driver itself dying — each fails (never hangs) within a bounded time, and no
  worker process or IPC file outlives its executor.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("zmq")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_harness import assert_same, random_workload, run_workload  # noqa: E402

from executor_test_utils import BASE, FAULTY, SETTINGS, VOCAB, pid_alive, wait_gone  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.types.scheduler_output import SchedulerOutput  # noqa: E402
from tandem.engine.llm_engine import LLMEngine, RequestError  # noqa: E402
from tandem.entrypoints.llm import LLM  # noqa: E402
from tandem.types.errors import ExecutorError, WorkerDiedError, WorkerError, WorkerTimeoutError  # noqa: E402
from tandem.executor.multiproc import MultiprocExecutor  # noqa: E402
from tandem.models.model_config import resolve_model_config  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402



@pytest.fixture(scope="module")
def tp_model(tiny_factory):
    """GQA model whose heads split over two ranks (4 query heads, 2 KV heads)."""
    return tiny_factory("llama", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def engines(tp_model):
    cache: dict = {}

    def get(executor: str, tp: int, async_scheduling: bool, setting: str) -> LLMEngine:
        key = (executor, tp, async_scheduling, setting)
        if key not in cache:
            cfg = EngineConfig(model=tp_model, executor=executor, tensor_parallel_size=tp,
                               async_scheduling=async_scheduling, **{**BASE, **SETTINGS[setting]})
            cache[key] = LLMEngine(cfg)
        return cache[key]

    yield get
    for e in cache.values():
        e.shutdown()


# -- equivalence -----------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("tp", [1, 2])
def test_multiproc_matches_uniproc_sync_and_async(engines, setting, tp):
    for seed in (3, 11):
        items = random_workload(seed, VOCAB)
        ref = run_workload(engines("uniproc", 1, False, setting), items)
        for async_scheduling in (False, True):
            got = run_workload(engines("multiproc", tp, async_scheduling, setting), items)
            assert_same(ref.outputs, got.outputs, items)
    e = engines("multiproc", tp, True, setting)
    assert e.core.stats.num_launched_ahead > 0, "async multiproc never overlapped two steps"


# -- the RPC contract -------------------------------------------------------------------
@pytest.fixture
def executor_factory(tp_model):
    made = []

    def make(tp: int = 1, **kw) -> MultiprocExecutor:
        cfg = EngineConfig(model=tp_model, executor="multiproc", tensor_parallel_size=tp, **{**BASE, **kw})
        ex = MultiprocExecutor(cfg, resolve_model_config(cfg))
        made.append(ex)
        return ex

    yield make
    for ex in made:
        pids = [p for p in ex.worker_pids if p]
        ex.shutdown()
        assert wait_gone(pids) == [], "worker processes outlived shutdown()"


def _ready(ex: MultiprocExecutor) -> None:
    ex.collective_rpc("determine_num_kv_blocks")
    ex.collective_rpc("init_kv_cache", 64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tp", [1, 2])
def test_priming_call_is_answered_and_replies_come_in_order(executor_factory, tp):
    """The seed's deadlock: a worker that never answered the call that only primes the
    pipeline. Here an empty step is answered like any other, in order, on every rank."""
    ex = executor_factory(tp)
    _ready(ex)
    prime = ex.execute_model(SchedulerOutput(step_id=0, requests=[]))
    infos = [ex._call("get_pid", (), {}) for _ in range(3)]
    second = ex.execute_model(SchedulerOutput(step_id=1, requests=[]))
    out = prime.result(timeout=30)
    assert out.step_id == 0 and out.req_ids == [] and out.sampled_token_ids == []
    assert second.result(timeout=30).step_id == 1
    assert all(f.result(timeout=30) == ex.worker_pids[0] for f in infos)
    assert [f.all_results is not None for f in infos] == [True] * 3
    assert len(ex.collective_rpc("get_pid")) == tp
    assert sorted(ex.collective_rpc("get_pid")) == sorted(ex.worker_pids)


@pytest.mark.timeout(60)
def test_worker_exception_comes_back_with_its_traceback_and_worker_stays_usable(executor_factory):
    ex = executor_factory(1, worker_cls=FAULTY)
    with pytest.raises(WorkerError) as ei:
        ex.collective_rpc("set_fault", "no-such-fault")
    msg = str(ei.value)
    assert "ValueError" in msg and "no-such-fault" in msg
    assert "faulty_worker.py" in ei.value.worker_traceback, "the worker's own traceback must be carried"
    assert ex.collective_rpc("get_pid") == ex.worker_pids  # one rank: still usable


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tp", [1, 2])
def test_worker_raising_at_step_n_fails_the_requests_not_the_caller(tp_model, tp):
    llm = LLM(tp_model, executor="multiproc", tensor_parallel_size=tp, worker_cls=FAULTY, **BASE)
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        llm.engine.core.executor.collective_rpc("set_fault", "raise", 4, tp - 1)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            llm.generate([[5, 6, 7], [8, 9]], sp, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        assert "InjectedFault" in str(ei.value) and f"rank {tp - 1}" in str(ei.value)
        assert all(o.outputs[0].finish_reason == "error" for o in ei.value.outputs)
        if tp == 1:  # the worker survives its own exception: the engine keeps serving
            out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 12
        else:  # TP peers are out of step: the executor stops and says so, fast
            with pytest.raises(RequestError, match="out of step"):
                llm.generate([[5, 6, 7]], sp, use_tqdm=False)
    finally:
        pids = llm.engine.core.executor.worker_pids
        llm.shutdown()
        assert wait_gone(pids) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind,tp", [("kill", 1), ("exit", 1), ("kill", 2)])
def test_worker_dying_mid_step_fails_pending_and_later_calls(tp_model, kind, tp):
    llm = LLM(tp_model, executor="multiproc", tensor_parallel_size=tp, worker_cls=FAULTY, **BASE)
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    try:
        ex.collective_rpc("set_fault", kind, 3, tp - 1)
        sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as ei:
            llm.generate([[5, 6, 7], [8, 9, 10, 11]], sp, use_tqdm=False)
        assert time.monotonic() - t0 < 20, "death must be detected within seconds"
        expected = "SIGKILL" if kind == "kill" else "exited with code 3"
        assert "WorkerDiedError" in str(ei.value) and expected in str(ei.value)
        with pytest.raises(WorkerDiedError):
            ex.check_health()
        t0 = time.monotonic()
        with pytest.raises(RequestError, match="WorkerDiedError"):  # later calls fail fast
            llm.generate([[5, 6]], sp, use_tqdm=False)
        assert time.monotonic() - t0 < 5
        with pytest.raises(WorkerDiedError):
            ex.collective_rpc("get_pid")
        assert wait_gone(pids) == [], "the surviving ranks must be stopped too"
    finally:
        llm.shutdown()


@pytest.mark.timeout(60)
def test_worker_killed_from_outside_is_detected_while_idle(executor_factory):
    ex = executor_factory(2)
    victim = ex.worker_pids[1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            ex.check_health()
        except WorkerDiedError as e:
            assert "rank 1" in str(e) and "SIGKILL" in str(e)
            break
        time.sleep(0.05)
    else:
        pytest.fail("a SIGKILLed worker went unnoticed for 10 s")
    with pytest.raises(WorkerDiedError):
        ex.execute_model(SchedulerOutput(step_id=0, requests=[])).result(timeout=5)
    assert wait_gone(ex.worker_pids) == []


@pytest.mark.timeout(90)
def test_hung_worker_times_out_instead_of_hanging(tp_model):
    llm = LLM(tp_model, executor="multiproc", worker_cls=FAULTY, rpc_timeout_s=3.0, **BASE)
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
        with pytest.raises(WorkerTimeoutError):
            ex.collective_rpc("get_pid")
        assert wait_gone(pids) == [], "a hung worker must be stopped"
    finally:
        llm.shutdown()


@pytest.mark.timeout(60)
def test_worker_that_fails_to_start_reports_why_and_leaves_nothing(tp_model):
    before = set(Path("/tmp").glob("tandem-ipc-*"))
    cfg = EngineConfig(model=tp_model, executor="multiproc", tensor_parallel_size=2,
                       worker_cls="tandem.config.EngineConfig", **BASE)
    with pytest.raises(WorkerError, match="not a subclass of tandem.worker.worker.Worker"):
        MultiprocExecutor(cfg, resolve_model_config(cfg))
    assert set(Path("/tmp").glob("tandem-ipc-*")) <= before, "IPC folder left behind"


@pytest.mark.timeout(60)
def test_calls_after_shutdown_fail_clearly(executor_factory):
    ex = executor_factory(1)
    pids = list(ex.worker_pids)
    ex.shutdown()
    ex.shutdown()  # idempotent
    assert wait_gone(pids) == []
    with pytest.raises(ExecutorError, match="shut down"):
        ex.collective_rpc("get_pid")


_DRIVER = textwrap.dedent("""
    import json, sys, time
    from tandem.config import EngineConfig
    from tandem.executor.multiproc import MultiprocExecutor
    from tandem.models.model_config import resolve_model_config
    if __name__ == "__main__":
        cfg = EngineConfig(model=sys.argv[1], executor="multiproc", tensor_parallel_size=2, num_kv_blocks=16)
        ex = MultiprocExecutor(cfg, resolve_model_config(cfg))
        print(json.dumps({"pids": ex.worker_pids}), flush=True)
        time.sleep(600)
""")


@pytest.mark.timeout(90)
def test_no_orphans_when_the_driver_is_killed(tp_model, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), tp_model], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        assert all(pid_alive(p) for p in info["pids"])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_gone(info["pids"], timeout=15) == [], "workers outlived their killed driver"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
