"""What only the multiproc executor has: processes it starts itself, over a channel it owns.

* start-up: workers never re-run the user's program — ``tensor_parallel_size=2`` works from
  a script on stdin, ``python -c``, a script without a ``__main__`` guard and a notebook,
  and the driver's ``sys.path`` reaches the workers (``worker_cls`` from a test folder);
  a worker that fails or dies while starting is reported at once, with its own error;
* the boundary: the endpoints live in a 0700 directory, and a process of the same user
  that connects to them cannot inject a call or a reply, nor get a pickle unpickled;
* exit: a driver killed with SIGKILL leaves no worker and no endpoint directory; an ``LLM``
  dropped at interpreter exit without ``shutdown()`` prints nothing; Ctrl-C (SIGINT to the
  whole process group) ends driver and workers with no traceback, in a script and in
  ``tandem generate``.

The contract shared with Ray (ordering, faults, timeouts) is in ``test_remote_executors.py``.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")

from executor_test_utils import BASE, FAULTY, pid_alive, wait_gone  # noqa: E402
from outsider import send_as_outsider  # noqa: E402
from proc_utils import children_of, live_children  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.entrypoints.llm import LLM  # noqa: E402
from tandem.executor.multiproc import MultiprocExecutor  # noqa: E402
from tandem.ipc import PrivateDir, encode  # noqa: E402
from tandem.models.model_config import resolve_model_config  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402
from tandem.types.errors import WorkerDiedError, WorkerError  # noqa: E402
from tandem.worker.worker_process import Call, Reply  # noqa: E402

HERE = Path(__file__).resolve().parent
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


@pytest.fixture(scope="module")
def tp_model(tiny_factory):
    """GQA model whose heads split over two ranks (4 query heads, 2 KV heads)."""
    return tiny_factory("llama", num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def reference_tokens(tp_model) -> list[list[int]]:
    with LLM(tp_model, executor="uniproc", **BASE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]


@pytest.fixture
def endpoint_dirs(monkeypatch) -> list[str]:
    """The endpoint directories executors create during the test (other engines on this
    machine have their own, so a glob of the temp dir would race with them)."""
    made: list[str] = []
    create = PrivateDir.create

    def recording_create(*args, **kwargs) -> PrivateDir:
        where = create(*args, **kwargs)
        made.append(where.path)
        return where

    monkeypatch.setattr(PrivateDir, "create", recording_create)
    return made


def _no_new_children(before: set[int]) -> list[int]:
    deadline = time.monotonic() + 10
    while (extra := sorted(set(live_children()) - before)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return extra


# -- start-up ------------------------------------------------------------------------------
_USER_PROGRAM = """\
import sys
sys.path.insert(0, {tests!r})  # worker_cls lives here: the driver's sys.path must reach the workers
print("PROGRAM STARTS", flush=True)
from tandem import LLM, SamplingParams
llm = LLM({model!r}, tensor_parallel_size=2, worker_cls="faulty_worker.FaultyWorker", **{base!r})
outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print("TOKENS", [o.outputs[0].token_ids for o in outs], flush=True)
llm.shutdown()
"""
# A notebook runs cells through IPython's InteractiveShell (ipykernel does exactly this):
# ``__main__`` is IPython's namespace module, with no ``__file__``.
_NOTEBOOK = ("import sys\nfrom IPython.core.interactiveshell import InteractiveShell\n"
             "ok = InteractiveShell.instance().run_cell(sys.stdin.read()).success\nsys.exit(0 if ok else 1)\n")


def _start_context(context: str, program: str, tmp_path: Path) -> tuple[list[str], str | None]:
    """argv and stdin for running ``program`` the way a user would in ``context``."""
    if context == "stdin":
        return [sys.executable, "-"], program
    if context == "dash-c":
        return [sys.executable, "-c", program], None
    if context == "unguarded-script":
        script = tmp_path / "user_script.py"
        script.write_text(program)
        return [sys.executable, str(script)], None
    pytest.importorskip("IPython")
    return [sys.executable, "-c", _NOTEBOOK], program


@pytest.mark.timeout(180)
@pytest.mark.parametrize("context", ["stdin", "dash-c", "unguarded-script", "notebook"])
def test_workers_never_rerun_the_users_program(tp_model, reference_tokens, tmp_path, context):
    """With spawn, a script on stdin failed (FileNotFoundError '<stdin>') and an unguarded
    script started workers recursively: each worker re-ran the user's program."""
    program = _USER_PROGRAM.format(tests=str(HERE), model=tp_model, base=BASE, prompts=PROMPTS)
    argv, stdin = _start_context(context, program, tmp_path)
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PROGRAM STARTS") == 1, proc.stdout
    assert f"TOKENS {reference_tokens}" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(60)
def test_worker_that_fails_to_start_reports_its_own_error_at_once_and_leaves_nothing(tp_model, endpoint_dirs):
    """The failing rank's own exception and traceback, at once (not after
    worker_start_timeout_s), with every process, socket and directory cleaned up."""
    children = set(live_children())
    cfg = EngineConfig(model=tp_model, executor="multiproc", tensor_parallel_size=2,
                       worker_cls="tandem.config.EngineConfig", **BASE)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="not a subclass of tandem.worker.worker.Worker") as ei:
        MultiprocExecutor(cfg, resolve_model_config(cfg))
    assert time.monotonic() - t0 < 45, "a failed start must be reported at once"
    assert "resolve_worker_class" in ei.value.worker_traceback
    assert len(endpoint_dirs) == 1 and not os.path.exists(endpoint_dirs[0]), "endpoint directory left behind"
    assert _no_new_children(children) == [], "worker processes left behind"


@pytest.mark.timeout(60)
def test_worker_that_dies_while_starting_is_reported_at_once(tp_model, endpoint_dirs):
    children = set(live_children())
    cfg = EngineConfig(model=tp_model, executor="multiproc", tensor_parallel_size=2,
                       worker_cls="faulty_worker.ExitsWhileStarting", **BASE)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="exited with code 5 while starting"):
        MultiprocExecutor(cfg, resolve_model_config(cfg))
    assert time.monotonic() - t0 < 45
    assert len(endpoint_dirs) == 1 and not os.path.exists(endpoint_dirs[0])
    assert _no_new_children(children) == []


# -- the process boundary ------------------------------------------------------------------
class _Pwn:
    """A pickle that creates a file when unpickled: proof that someone ran it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.timeout(120)
def test_an_outsider_cannot_inject_calls_or_replies(tp_model, reference_tokens, tmp_path):
    """A process of the same user (other users cannot even reach the directory) connects to
    the worker's and the driver's endpoints and sends a forged call that would kill the
    worker, a forged reply, and pickles that would create a file: all are dropped, nothing
    is unpickled, and the engine keeps producing the same tokens."""
    llm = LLM(tp_model, executor="multiproc", worker_cls=FAULTY, **BASE)
    ex = llm.engine.core.executor
    pids = list(ex.worker_pids)
    try:
        where = Path(ex._where.path)
        assert stat.S_IMODE(where.stat().st_mode) == 0o700 and where.stat().st_uid == os.getuid()
        assert sorted(p.name for p in where.iterdir()) == ["rep-0", "req-0"]
        flag = tmp_path / "pwned"
        evil = pickle.dumps(_Pwn(flag))
        seq = ex._next_seq  # the next call number: the strongest guess an attacker could make
        crash = encode(Call.of(seq, "crash_now", (), {}))
        fake_reply = encode(Reply(seq, 0))
        reader = zmq.Context().socket(zmq.PULL)  # and one that tries to read what is not for it
        reader.setsockopt(zmq.LINGER, 0)
        for name in ("req-0", "rep-0"):
            address = f"ipc://{where / name}"
            reader.connect(address)
            for frames in ([evil], [b"\0" * 32 + evil], [b"\0" * 32 + crash], [os.urandom(32) + fake_reply],
                           [crash], [b"\0" * 32, crash]):
                send_as_outsider(address, frames)
        time.sleep(0.5)
        out = llm.generate(PROMPTS, SP, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == reference_tokens
        assert not flag.exists(), "a pickle was unpickled"
        assert ex._workers[0].channel.rejected == 6, "every forged reply must be dropped by the driver"
        assert reader.poll(200) == 0, "an outsider must not receive the engine's messages"
        reader.close()
        ex.check_health()
        assert all(pid_alive(p) for p in pids), "the forged crash_now call must not have run"
    finally:
        llm.shutdown()
    assert wait_gone(pids) == []
    assert not where.exists()


# -- exit ----------------------------------------------------------------------------------
_KILLED_DRIVER = textwrap.dedent("""
    import json, sys, time
    from tandem.config import EngineConfig
    from tandem.executor.multiproc import MultiprocExecutor
    from tandem.models.model_config import resolve_model_config
    cfg = EngineConfig(model=sys.argv[1], executor="multiproc", tensor_parallel_size=2, num_kv_blocks=16)
    ex = MultiprocExecutor(cfg, resolve_model_config(cfg))
    print(json.dumps({"pids": ex.worker_pids, "dir": ex._where.path}), flush=True)
    time.sleep(600)
""")


@pytest.mark.timeout(90)
def test_no_orphans_and_no_endpoint_dir_when_the_driver_is_killed(tp_model):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_DRIVER, tp_model], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert all(pid_alive(p) for p in info["pids"]) and os.path.isdir(info["dir"])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_gone(info["pids"], timeout=15) == [], "workers outlived their killed driver"
        deadline = time.monotonic() + 5
        while os.path.exists(info["dir"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(info["dir"]), "the endpoint directory outlived the killed driver"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


_DROPPED = textwrap.dedent("""
    import json, sys
    from tandem import LLM, SamplingParams
    llm = LLM(sys.argv[1], executor="multiproc", tensor_parallel_size=2, block_size=4, num_kv_blocks=64)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ex = llm.engine.core.executor
    print(json.dumps({"pids": ex.worker_pids, "dir": ex._where.path}), flush=True)
    # no shutdown(): the interpreter exits with the LLM alive
""")


@pytest.mark.timeout(120)
def test_an_llm_dropped_at_interpreter_exit_exits_quietly(tp_model):
    proc = subprocess.run([sys.executable, "-c", _DROPPED, tp_model], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", f"interpreter-exit cleanup printed:\n{proc.stderr}"
    info = json.loads(proc.stdout)
    assert wait_gone(info["pids"]) == []
    assert not os.path.exists(info["dir"])


_INTERRUPTED = textwrap.dedent("""
    import json, sys
    from tandem import LLM, SamplingParams
    llm = LLM(sys.argv[1], executor="multiproc", tensor_parallel_size=2, block_size=4, num_kv_blocks=256)
    ex = llm.engine.core.executor
    print(json.dumps({"pids": ex.worker_pids, "dir": ex._where.path}), flush=True)
    try:
        while True:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                         use_tqdm=False)
    except KeyboardInterrupt:
        llm.shutdown()
        sys.exit(130)
""")


@pytest.mark.timeout(120)
def test_ctrl_c_stops_driver_and_workers_without_a_traceback(tp_model):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the workers
    ignore it (the driver stops them), the driver's handler shuts down, nothing is printed."""
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, tp_model], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(proc.stdout.readline())
        time.sleep(1.0)  # let it get busy generating
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert err == "", f"Ctrl-C printed:\n{err}"
    assert wait_gone(info["pids"]) == [], "workers outlived the interrupted driver"
    assert not os.path.exists(info["dir"])


@pytest.mark.timeout(150)
def test_ctrl_c_during_tandem_generate_leaves_no_process_and_no_traceback(tp_model):
    """The same through the CLI, whose own handler reports the interrupt in one line."""
    argv = [sys.executable, "-m", "tandem.entrypoints.cli", "generate", "--model", tp_model, "--executor", "multiproc",
            "--tensor-parallel-size", "2", "--prompt", "t5 t6 t7", "--prompt", "t8 t9", "--max-tokens", "400",
            "--ignore-eos", "--block-size", "4", "--num-kv-blocks", "512"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 100
        while len(workers := children_of(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert len(workers) == 2, "the CLI never started its workers"
        time.sleep(2.0)  # starting up or generating: either way Ctrl-C must be quiet
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert len(err.splitlines()) == 1 and "interrupted" in err, f"Ctrl-C printed:\n{err}"
    assert wait_gone(workers) == [], "workers outlived the interrupted CLI"
