"""One worker process per tensor-parallel rank, started through tandem's own entry point.

Start-up: the driver (the engine process) creates a private endpoint directory (mode
0700) and a random secret, binds one reply socket per rank in it, and starts each worker
as ``python -m tandem.worker.worker_process <dir> <rank>`` — never by re-running the
user's program, so ``tensor_parallel_size > 1`` works from a script on stdin, ``python -c``,
a notebook or a script without a ``__main__`` guard. The secret goes down the worker's
stdin; the start-up message (configs, rendezvous address, the driver's ``sys.path``) is
the first message on the channel. A rank that fails to start is reported at once with its
own error and traceback; one that dies while starting, at once with its exit status.

Calls: every call goes to every rank and gets one reply per rank, in order (protocol in
``worker/worker_process.py``): typed messages (``tandem.ipc``), nothing pickled, every
message authenticated. A reader thread owns the reply sockets; it matches replies to
pending futures by sequence number and checks that each rank answers its calls in order.
The same thread watches the worker processes: when one exits (killed, OOM, segfault)
every pending and later call fails with ``WorkerDiedError`` within a poll interval. A
call with no answer within ``rpc_timeout_s`` fails with ``WorkerTimeoutError``. What
breaks the executor, and how, is ``RemoteExecutor``'s (``executor/base.py``).

Shutdown, orderly or at interpreter exit (an executor nobody shut down is shut down by an
``atexit`` hook, before daemon threads are frozen): one more call asks every worker to
exit, the reader stops, workers that do not exit get SIGTERM then SIGKILL, every socket
is closed with linger 0, the ZeroMQ context is terminated and the directory removed —
logging nothing above DEBUG. A killed driver leaves no orphan: each worker reads EOF on
its stdin, removes the endpoint directory and exits.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Optional, cast

import msgspec

from tandem.config import EngineConfig, ModelConfig
from tandem.executor.base import RemoteExecutor, RemoteFuture
from tandem.ipc import Channel, PrivateDir, WireModelConfig, decode, encode, new_secret, start_child
from tandem.types.errors import ErrorPayload, ExecutorError, WorkerDiedError, WorkerError, WorkerTimeoutError
from tandem.worker.worker import Worker
from tandem.worker.worker_process import (READY_SEQ, SHUTDOWN_METHOD, Call, MethodTable, Reply, WorkerStart,
                                          reply_endpoint, request_endpoint)

logger = logging.getLogger(__name__)

_POLL_MS = 50
_WORKER_MODULE = "tandem.worker.worker_process"
_STDERR = 2  # workers print to the driver's stderr: its stdout may be the user's data

# Executors not shut down yet, shut down at interpreter exit; weak, so that holding one
# here never keeps it alive.
_LIVE: "weakref.WeakSet[MultiprocExecutor]" = weakref.WeakSet()


def _shutdown_live_executors() -> None:
    for ex in list(_LIVE):
        ex.shutdown()


atexit.register(_shutdown_live_executors)


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


class _RpcFuture(RemoteFuture):
    """A call's future whose ``result()`` waits at most the RPC timeout by default, then
    declares the missing ranks hung (which breaks the executor)."""

    def __init__(self, executor: "MultiprocExecutor", seq: int, method: str) -> None:
        super().__init__(seq, method)
        self._executor = weakref.ref(executor)
        self.replies: dict[int, Any] = {}  # rank -> decoded result

    def result(self, timeout: Optional[float] = None) -> Any:  # type: ignore[override]
        ex = self._executor()
        limit = timeout if timeout is not None else (ex.rpc_timeout_s if ex is not None else None)
        try:
            return super().result(limit)
        except FutureTimeout:
            if timeout is not None or ex is None:
                raise
            ex._on_timeout(self, sorted(set(range(ex.world_size)) - set(self.replies)))
            return super().result(0)


@dataclass
class _WorkerHandle:
    rank: int
    channel: Channel
    proc: Optional[subprocess.Popen] = None
    pid: Optional[int] = None  # reported by the worker once ready
    next_reply: int = 0
    said_goodbye: bool = False  # answered the shutdown call: its exit is expected

    @property
    def exitcode(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    @property
    def os_pid(self) -> Optional[int]:
        """The process's pid, known before the worker reports it (``pid``)."""
        return None if self.proc is None else self.proc.pid


class MultiprocExecutor(RemoteExecutor):
    SHUTDOWN_METHOD = SHUTDOWN_METHOD

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        import zmq

        super().__init__(config, pending={})
        self._zmq = zmq
        self._result_types = MethodTable(Worker)  # replies decode into what Worker's methods declare
        self._where = PrivateDir.create()
        self._secret = new_secret()
        self._ctx = zmq.Context()
        self._workers: list[_WorkerHandle] = []
        self._reader: Optional[threading.Thread] = None
        _LIVE.add(self)
        try:
            self._start_workers(config, model_config)
            self._wait_ready(config.worker_start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._reader = threading.Thread(target=self._read_loop, name="tandem-rpc-reader", daemon=True)
        self._reader.start()
        logger.info("multiproc executor: %d worker(s), pids %s", self.world_size, self.worker_pids)

    # -- start-up ----------------------------------------------------------------------------
    def _start_workers(self, config: EngineConfig, model_config: ModelConfig) -> None:
        """Bind each rank's reply socket, start its process, queue its start-up message.
        Each handle is registered before anything can fail, so cleanup closes every socket."""
        init_method = f"tcp://127.0.0.1:{get_free_port()}" if self.world_size > 1 else None
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        wire_model_config = WireModelConfig.from_config(model_config)
        sys_path = [p for p in sys.path if isinstance(p, str)]
        for rank in range(self.world_size):
            channel = Channel(self._ctx, self._secret, local=self._where.address(reply_endpoint(rank)),
                              remote=self._where.address(request_endpoint(rank)))
            w = _WorkerHandle(rank, channel)
            self._workers.append(w)
            w.proc = start_child(_WORKER_MODULE, [self._where.path, str(rank)], self._secret, stdout=_STDERR)
            channel.send(WorkerStart(rank=rank, config=config, model_config=wire_model_config,
                                     distributed_init_method=init_method,
                                     num_threads=max(1, cpus // self.world_size), sys_path=sys_path))

    def _wait_ready(self, timeout_s: float) -> None:
        """Every rank reports READY (or its construction error) before the first call; a
        rank that fails or dies is reported at once, not after the timeout."""
        deadline = time.monotonic() + timeout_s
        poller, by_sock = self._reply_poller()
        waiting = {w.rank: w for w in self._workers}
        while waiting:
            for sock, _ in poller.poll(_POLL_MS):
                self._take_ready(by_sock[sock], waiting)
            for w in list(waiting.values()):
                if w.exitcode is None:
                    continue
                if w.channel.socket.poll(_POLL_MS):  # its last words (its error) may still be in flight
                    self._take_ready(w, waiting)
                if w.rank in waiting:
                    raise WorkerDiedError(f"worker rank {w.rank} (pid {w.os_pid}) {describe_exit(w.exitcode)} "
                                          "while starting (its own output, if any, is on stderr)")
            if waiting and time.monotonic() > deadline:
                raise WorkerTimeoutError(f"worker rank(s) {sorted(waiting)} not ready after {timeout_s:.0f} s "
                                         "(worker_start_timeout_s)")

    @staticmethod
    def _take_ready(w: _WorkerHandle, waiting: dict[int, _WorkerHandle]) -> None:
        """Take rank ``w``'s READY reply if it is there; its start-up error is raised."""
        reply = w.channel.try_recv(Reply)
        if reply is None:
            return
        if reply.seq != READY_SEQ:
            raise ExecutorError(f"worker rank {w.rank} sent reply #{reply.seq} before it was ready")
        if reply.error is not None:
            raise WorkerError(w.rank, "start-up", reply.error)
        w.pid = decode(reply.result, int)
        del waiting[w.rank]

    def _reply_poller(self) -> tuple[Any, dict[Any, _WorkerHandle]]:
        """A poller over every rank's reply socket, and the rank each socket belongs to."""
        poller = self._zmq.Poller()
        by_sock = {}
        for w in self._workers:
            poller.register(w.channel.socket, self._zmq.POLLIN)
            by_sock[w.channel.socket] = w
        return poller, by_sock

    @property
    def worker_pids(self) -> list[Optional[int]]:
        return [w.pid for w in self._workers]

    # -- calls -------------------------------------------------------------------------------
    def _submit(self, seq: int, method: str, args: tuple, kwargs: dict) -> _RpcFuture:
        payload = encode(Call.of(seq, method, args, kwargs))  # an unencodable argument fails here, harmlessly
        try:
            for w in self._workers:
                w.channel.send_encoded(payload)
        except BaseException as e:
            # Some ranks may have call #seq and the others never will: they are out of step
            # for good. (An interrupt cannot cause this: ``_call`` holds it until all are sent.)
            self._failure = ExecutorError(f"call #{seq} ({method}) failed while being sent "
                                          f"({type(e).__name__}: {e}); the workers are out of step")
            raise
        return _RpcFuture(self, seq, method)

    def check_health(self) -> None:
        super().check_health()
        for w in self._workers:
            if w.exitcode is not None:
                self._fail(self._death(w.rank, describe_exit(w.exitcode)))
                super().check_health()

    # -- the reader thread -------------------------------------------------------------------
    def _read_loop(self) -> None:
        """Replies and deaths until shutdown. Never raises: an unexpected error breaks the
        executor (pending calls fail with it) instead of printing a thread traceback."""
        poller, by_sock = self._reply_poller()
        try:
            while not self._closed:
                for sock, _ in poller.poll(_POLL_MS):
                    self._drain(by_sock[sock])
                self._check_deaths()
        except Exception as e:
            if not self._closed:
                self._fail(ExecutorError(f"the multiproc executor's reply reader failed: {type(e).__name__}: {e}"))

    def _drain(self, w: _WorkerHandle) -> None:
        while (reply := w.channel.try_recv(Reply)) is not None:
            self._on_reply(w, reply)

    def _check_deaths(self) -> None:
        if self._failure is not None or self._closed:
            return
        for w in self._workers:
            code = w.exitcode
            if code is None:
                continue
            # Its last replies may still be on their way through ZeroMQ's I/O thread.
            if w.channel.socket.poll(_POLL_MS):
                self._drain(w)
            if not w.said_goodbye:
                self._fail(self._death(w.rank, describe_exit(code)))
                return

    def _on_reply(self, w: _WorkerHandle, reply: Reply) -> None:
        if reply.seq != w.next_reply:
            self._fail(ExecutorError(f"worker rank {w.rank} answered call #{reply.seq}, expected #{w.next_reply}"))
            return
        w.next_reply += 1
        with self._lock:
            fut = cast(Optional[_RpcFuture], self._pending.get(reply.seq))
        if fut is None:  # already failed (timeout, death) and forgotten
            return
        if fut.method == SHUTDOWN_METHOD:
            w.said_goodbye = True
        if reply.error is not None:
            self._on_worker_error(fut, w.rank, reply.error)
            return
        try:
            fut.replies[w.rank] = decode(reply.result, self._result_types.result_type(fut.method))
        except msgspec.DecodeError as e:
            self._on_worker_error(fut, w.rank, ErrorPayload.from_exception(e))
            return
        if len(fut.replies) == self.world_size:
            self._complete(fut, [fut.replies[r] for r in range(self.world_size)])

    # -- failure -----------------------------------------------------------------------------
    def _find_dead_rank(self, fut: RemoteFuture) -> Optional[WorkerDiedError]:
        deadline = time.monotonic() + 1.0
        while True:
            for w in self._workers:
                if w.exitcode is not None and not w.said_goodbye:
                    return self._death(w.rank, describe_exit(w.exitcode))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _stop_workers(self) -> None:
        _terminate(self._workers, grace_s=0.0)

    # -- shutdown ----------------------------------------------------------------------------
    def _release(self, graceful: bool) -> None:
        """Join the reader, let the workers exit (or stop them), then close every socket,
        terminate the context and remove the directory."""
        _LIVE.discard(self)
        if self._reader is not None:
            self._reader.join(timeout=10)
        _terminate(self._workers, grace_s=5.0 if graceful else 0.0)
        for w in self._workers:
            if w.proc is not None and w.proc.stdin is not None:
                try:
                    w.proc.stdin.close()
                except OSError:
                    pass
            w.channel.close()
        self._ctx.term()
        self._where.remove()


def _terminate(workers: list[_WorkerHandle], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the workers to exit, then SIGTERM, then SIGKILL: none survives."""
    procs = [w.proc for w in workers if w.proc is not None]
    deadline = time.monotonic() + grace_s
    for p in procs:
        _wait(p, max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        if not _wait(p, 2.0):
            p.kill()
            _wait(p, 2.0)


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    try:
        proc.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False
