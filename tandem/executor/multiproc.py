"""One worker process per tensor-parallel rank, started with spawn, driven over ZeroMQ.

The driver (the engine process) sends every call to every rank and gets one reply per rank
per call, in order (protocol in ``worker/worker_process.py``). A reader thread owns the
reply sockets; it matches replies to pending futures by sequence number and checks that
each rank answers its calls in order. The same thread watches the worker processes: when
one exits (killed, OOM, segfault) every pending and later call fails with
``WorkerDiedError`` within a poll interval. A call that gets no answer within
``rpc_timeout_s`` fails with ``WorkerTimeoutError``. Both break the executor for good: the
remaining workers are stopped so none is left blocked in a collective.

With tensor parallelism an error raised on one rank also breaks the executor: its peers
are then waiting in a collective that will never complete, so the error is reported at
once (from the first rank that raised) rather than after a timeout. With one rank the
worker stays usable after an error and later steps run normally.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Optional

from tandem.config import EngineConfig, ModelConfig
from tandem.executor.base import RemoteExecutor
from tandem.types.errors import ExecutorError, WorkerDiedError, WorkerError, WorkerTimeoutError
from tandem.worker.worker_process import READY_SEQ, SHUTDOWN_METHOD, run_worker_process

logger = logging.getLogger(__name__)

_POLL_MS = 50


def get_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _RpcFuture(Future):
    """A call's future whose ``result()`` waits at most the RPC timeout by default."""

    def __init__(self, executor: "MultiprocExecutor", seq: int, method: str) -> None:
        super().__init__()
        self._executor = weakref.ref(executor)
        self.seq = seq
        self.method = method

    def result(self, timeout: Optional[float] = None) -> Any:  # type: ignore[override]
        ex = self._executor()
        limit = timeout if timeout is not None else (ex.rpc_timeout_s if ex is not None else None)
        try:
            return super().result(limit)
        except FutureTimeout:
            if timeout is not None or ex is None:
                raise
            ex._on_timeout(self)
            return super().result(0)


@dataclass
class _Pending:
    future: _RpcFuture
    replies: dict[int, Any] = field(default_factory=dict)  # rank -> result


@dataclass
class _WorkerHandle:
    rank: int
    proc: Any  # multiprocessing.Process
    request_sock: Any
    reply_sock: Any
    death_writer: Any  # our end of the death pipe: closing it (or dying) stops the worker
    pid: Optional[int] = None
    next_reply: int = 0


class MultiprocExecutor(RemoteExecutor):
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        import zmq

        self.config = config
        self.world_size = config.tensor_parallel_size
        self.rpc_timeout_s = config.rpc_timeout_s
        self._zmq = zmq
        self._ctx = zmq.Context()
        # Linux: abstract-namespace sockets (ipc://@name) leave no file behind, even when the
        # driver is SIGKILLed; elsewhere, socket files in a private temp folder.
        tag = f"tandem-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._ipc_dir: Optional[str] = None if sys.platform == "linux" else tempfile.mkdtemp(prefix="tandem-ipc-")
        ipc_prefix = f"ipc://@{tag}" if self._ipc_dir is None else f"ipc://{self._ipc_dir}/{tag}"
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next_seq = 0
        self._failure: Optional[ExecutorError] = None
        self._closed = False
        self._workers: list[_WorkerHandle] = []
        self._reader: Optional[threading.Thread] = None
        init_method = f"tcp://127.0.0.1:{get_free_port()}" if self.world_size > 1 else None
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cpus // self.world_size)
        mp = multiprocessing.get_context("spawn")
        try:
            for rank in range(self.world_size):
                req_addr = f"{ipc_prefix}-req-{rank}"
                rep_addr = f"{ipc_prefix}-rep-{rank}"
                req = self._ctx.socket(zmq.PUSH)
                req.setsockopt(zmq.LINGER, 0)
                req.bind(req_addr)
                rep = self._ctx.socket(zmq.PULL)
                rep.setsockopt(zmq.LINGER, 0)
                rep.bind(rep_addr)
                death_reader, death_writer = mp.Pipe(duplex=False)
                proc = mp.Process(
                    target=run_worker_process, name=f"tandem-worker-{rank}", daemon=True,
                    kwargs=dict(rank=rank, config=config, model_config=model_config,
                                distributed_init_method=init_method, request_addr=req_addr, reply_addr=rep_addr,
                                death_conn=death_reader, num_threads=threads))
                proc.start()
                death_reader.close()
                self._workers.append(_WorkerHandle(rank, proc, req, rep, death_writer))
            self._finalizer = weakref.finalize(self, MultiprocExecutor._cleanup, self._workers, self._ctx,
                                               self._ipc_dir)
            atexit.register(self._finalizer)
            self._wait_ready(config.worker_start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._reader = threading.Thread(target=self._read_loop, name="tandem-rpc-reader", daemon=True)
        self._reader.start()
        logger.info("multiproc executor: %d worker(s), pids %s", self.world_size, [w.pid for w in self._workers])

    # -- start-up ----------------------------------------------------------------------
    def _wait_ready(self, timeout_s: float) -> None:
        """Every rank reports READY (or its construction error) before the first call."""
        deadline = time.monotonic() + timeout_s
        poller = self._zmq.Poller()
        for w in self._workers:
            poller.register(w.reply_sock, self._zmq.POLLIN)
        waiting = {w.rank: w for w in self._workers}
        while waiting:
            for sock, _ in poller.poll(_POLL_MS):
                w = next(x for x in waiting.values() if x.reply_sock is sock)
                seq, rank, ok, payload = pickle.loads(sock.recv())
                if seq != READY_SEQ:
                    raise ExecutorError(f"worker rank {rank} sent reply #{seq} before it was ready")
                if not ok:
                    raise WorkerError(rank, "start-up", payload)
                w.pid = payload
                del waiting[w.rank]
            for w in list(waiting.values()):
                if w.proc.exitcode is not None:
                    raise WorkerDiedError(f"worker rank {w.rank} (pid {w.proc.pid}) {describe_exit(w.proc.exitcode)} "
                                          "while starting")
            if waiting and time.monotonic() > deadline:
                raise WorkerTimeoutError(f"worker rank(s) {sorted(waiting)} not ready after {timeout_s:.0f} s "
                                         "(worker_start_timeout_s)")

    # -- calls -------------------------------------------------------------------------
    def _call(self, method: str, args: tuple, kwargs: dict) -> _RpcFuture:
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise ExecutorError("the executor is shut down")
            seq = self._next_seq
            self._next_seq += 1
            fut = _RpcFuture(self, seq, method)
            self._pending[seq] = _Pending(fut)
            data = pickle.dumps((seq, method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            for w in self._workers:
                w.request_sock.send(data, copy=False)
        return fut

    def check_health(self) -> None:
        with self._lock:
            if self._failure is not None:
                raise self._failure
        for w in self._workers:
            if w.proc.exitcode is not None:
                self._fail(WorkerDiedError(f"worker rank {w.rank} (pid {w.pid}) {describe_exit(w.proc.exitcode)}"))
                raise self._failure  # type: ignore[misc]

    @property
    def worker_pids(self) -> list[Optional[int]]:
        return [w.pid for w in self._workers]

    # -- the reader thread -------------------------------------------------------------
    def _read_loop(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        by_sock = {}
        for w in self._workers:
            poller.register(w.reply_sock, zmq.POLLIN)
            by_sock[w.reply_sock] = w
        while not self._closed:
            try:
                events = poller.poll(_POLL_MS)
            except zmq.ZMQError:
                return  # sockets closed under us at shutdown
            for sock, _ in events:
                w = by_sock[sock]
                while True:
                    try:
                        data = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except zmq.ZMQError:
                        return
                    self._on_reply(w, *pickle.loads(data))
            if self._failure is None and not self._closed:
                for w in self._workers:
                    if w.proc.exitcode is not None:
                        self._fail(WorkerDiedError(
                            f"worker rank {w.rank} (pid {w.pid}) {describe_exit(w.proc.exitcode)}; "
                            "the executor cannot run more steps"))
                        break

    def _on_reply(self, w: _WorkerHandle, seq: int, rank: int, ok: bool, payload: Any) -> None:
        if seq != w.next_reply:
            self._fail(ExecutorError(f"worker rank {rank} answered call #{seq}, expected #{w.next_reply}"))
            return
        w.next_reply += 1
        with self._lock:
            pending = self._pending.get(seq)
        if pending is None:  # already failed (timeout, death) and forgotten
            return
        fut = pending.future
        if not ok:
            err: Exception = WorkerError(rank, fut.method, payload)
            if self.world_size > 1:
                # A peer's death usually surfaces first as a collective error on a survivor
                # ("connection reset"): report the death, which is the cause.
                dead = self._dead_worker(grace_s=1.0)
                if dead is not None:
                    err = WorkerDiedError(f"worker rank {dead.rank} (pid {dead.pid}) {describe_exit(dead.proc.exitcode)}; "
                                          f"rank {rank} then failed in {fut.method}: {payload.exc_type}: {payload.message}")
                    with self._lock:
                        self._pending.pop(seq, None)
                    fut.set_exception(err)
                    self._fail(err)
                    return
            with self._lock:
                self._pending.pop(seq, None)
            if not fut.done():
                fut.set_exception(err)
            if self.world_size > 1:
                self._fail(ExecutorError(f"tensor-parallel rank {rank} failed in {fut.method}; its peers are out "
                                         f"of step, so the executor stops: {payload.exc_type}: {payload.message}"))
            return
        pending.replies[rank] = payload
        if len(pending.replies) == self.world_size:
            with self._lock:
                self._pending.pop(seq, None)
            fut.all_results = [pending.replies[r] for r in range(self.world_size)]  # type: ignore[attr-defined]
            if not fut.done():
                fut.set_result(pending.replies[0])

    # -- failure -----------------------------------------------------------------------
    def _dead_worker(self, grace_s: float) -> Optional[_WorkerHandle]:
        """The first worker found exited within ``grace_s``, or None."""
        deadline = time.monotonic() + grace_s
        while True:
            for w in self._workers:
                if w.proc.exitcode is not None:
                    return w
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _on_timeout(self, fut: _RpcFuture) -> None:
        with self._lock:
            pending = self._pending.get(fut.seq)
        missing = sorted(set(range(self.world_size)) - set(pending.replies)) if pending else []
        self._fail(WorkerTimeoutError(
            f"worker rank(s) {missing} did not answer {fut.method} (call #{fut.seq}) within "
            f"{self.rpc_timeout_s:g} s (rpc_timeout_s); treating them as hung"))

    def _fail(self, err: ExecutorError) -> None:
        """Break the executor: fail every pending call with ``err`` and stop the workers."""
        with self._lock:
            if self._failure is None:
                self._failure = err
                logger.error("%s", err)
            err = self._failure
            pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(err)
        _stop_workers(self._workers, grace_s=0.0)

    # -- shutdown ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask workers to exit (one more call, one more reply), then make sure they did."""
        if self._closed:
            return
        graceful = self._failure is None and self._workers and all(w.pid is not None for w in self._workers)
        if graceful:
            try:
                self._call(SHUTDOWN_METHOD, (), {}).result(timeout=10)
            except Exception as e:  # a worker that cannot say goodbye is stopped below
                logger.warning("workers did not acknowledge shutdown: %s", e)
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(ExecutorError("the executor was shut down"))
        if self._reader is not None:
            self._reader.join(timeout=5)
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
            atexit.unregister(finalizer)
        else:
            MultiprocExecutor._cleanup(self._workers, self._ctx, self._ipc_dir)

    @staticmethod
    def _cleanup(workers: list[_WorkerHandle], ctx: Any, ipc_dir: Optional[str]) -> None:
        _stop_workers(workers, grace_s=5.0)
        for w in workers:
            w.request_sock.close(linger=0)
            w.reply_sock.close(linger=0)
        ctx.term()
        if ipc_dir is not None:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def _stop_workers(workers: list[_WorkerHandle], grace_s: float) -> None:
    """Join each worker for up to ``grace_s``, then SIGTERM, then SIGKILL: none survives."""
    deadline = time.monotonic() + grace_s
    for w in workers:
        w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.proc.exitcode is None:
            w.proc.terminate()
    for w in workers:
        w.proc.join(timeout=2)
        if w.proc.exitcode is None:
            w.proc.kill()
            w.proc.join(timeout=2)
    for w in workers:
        try:
            w.death_writer.close()
        except OSError:
            pass
