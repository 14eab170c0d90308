"""How an asyncio front end talks to an engine core that runs beside it.

``EngineCoreClient`` is the interface: ``send`` a ``CoreInput`` (never blocks), ``await
get_output()`` for the next ``CoreOutputBatch`` (raises ``EngineDeadError`` once the core
is gone), ``shutdown``. Implementations:

* ``ProcessEngineCoreClient``: one front end's connection to a core process, over a private
  ``tandem.ipc`` channel. Batches are read and decoded on the event loop itself (ZeroMQ's
  asyncio integration): no reader thread competes with the loop for the GIL. The core's
  process is watched through a pidfd on the same loop, so its death is seen at once, after
  every batch it sent before dying;
* ``InprocEngineCoreClient`` (``inproc_client.py``, imported only when asked for): the core
  loop in a thread of this process, for tests and embedding.

``CoreProcess`` is the parent's handle on the core process: it starts it, learns the model
from it (``ModelInfo``: the core resolves the model, so a front end never imports torch),
hands out connections (``connect``) and stops it. ``tandem serve`` with several API-server
processes keeps it in the launcher and gives each API-server process a ``CoreAddress``.
"""
from __future__ import annotations

import abc
import asyncio
import collections
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tandem import ipc
from tandem.config import EngineConfig, ModelInfo
from tandem.engine.core_protocol import (CONTROL_ENDPOINT, CORE_ENDPOINT, MODULE, CoreReady, CoreStartup,
                                         front_endpoint)
from tandem.engine.messages import (DEFAULT_HEARTBEAT_S, CoreInput, CoreOutputBatch, EngineDeadError,
                                    EngineStartError)

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the core's liveness is checked where no pidfd can be had


class EngineCoreClient(abc.ABC):
    """The front end's handle on a running engine core."""

    num_kv_blocks: int  # the core's cache size, known once it has started
    dead_error: Optional[str] = None

    @abc.abstractmethod
    def send(self, msg: CoreInput) -> None:
        """Queue adds/aborts for the core; returns at once."""

    @abc.abstractmethod
    async def get_output(self) -> CoreOutputBatch:
        """The next batch from the core; raises ``EngineDeadError`` when the core is gone."""

    @abc.abstractmethod
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Leave the core: stop it (finishing in-flight steps) if this client owns it. May
        block, so it may run in a worker thread; call ``detach`` on the loop first."""

    def detach(self) -> None:
        """Release what this client registered with the event loop (call on the loop)."""


def describe_exit(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class CoreAddress:
    """Where a front end finds a running core: its private directory, the channel secret and
    its pid (to watch it). Crosses to API-server processes inside their private startup file."""

    ipc_dir: str
    secret: bytes
    pid: int


class CoreProcess:
    """The engine core's process, from its parent's side."""

    def __init__(self, config: EngineConfig, heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        """Start the core and wait until it is ready; ``ValueError`` for a bad model or
        flags (the core's one-line message), ``EngineStartError`` for any other failure."""
        import zmq

        self._secret, self._dir = ipc.new_secret(), ipc.PrivateDir.create()
        self._ctx = zmq.Context()
        self._control = ipc.Channel(self._ctx, self._secret, local=self._dir.address(CONTROL_ENDPOINT),
                                    remote=self._dir.address(CORE_ENDPOINT))
        self.proc: Optional[subprocess.Popen] = None
        self._closed = False
        try:
            self.proc = ipc.start_child(MODULE, [self._dir.path], self._secret, stdout=2)
            self._control.send(CoreStartup(config, heartbeat_s))
            ready = self._wait_ready(config.worker_start_timeout_s)
        except BaseException:
            self.stop(timeout_s=0.0)
            raise
        assert ready.model is not None
        self.model: ModelInfo = ready.model
        self.num_kv_blocks = ready.num_kv_blocks
        self.pid = self.proc.pid

    @property
    def address(self) -> CoreAddress:
        return CoreAddress(self._dir.path, self._secret, self.pid)

    @property
    def private_dir(self) -> str:
        """The core's 0700 directory: a place for other private files of the same server."""
        return self._dir.path

    def _wait_ready(self, timeout_s: float) -> CoreReady:
        deadline = time.monotonic() + timeout_s
        assert self.proc is not None
        while True:
            try:
                ready = self._control.recv(CoreReady, timeout_s=_POLL_S)
                break
            except TimeoutError:
                pass
            code = self.proc.poll()
            if code is not None:
                raise EngineStartError(f"the engine core process {describe_exit(code)} while starting "
                                       "(its error is in the log above)")
            if time.monotonic() > deadline:
                raise EngineStartError(f"the engine core did not start within {timeout_s:.0f} s")
        if ready.error is not None:
            if ready.bad_input:
                raise ValueError(ready.error)
            raise EngineStartError(f"the engine core failed to start:\n{ready.error.rstrip()}")
        return ready

    def connect(self, client_index: int = 0, owner: bool = True) -> "ProcessEngineCoreClient":
        """A front end's connection; with ``owner`` its ``shutdown`` stops this process."""
        return ProcessEngineCoreClient(self.address, self.num_kv_blocks, client_index,
                                       owner=self if owner else None)

    def exit_reason(self) -> Optional[str]:
        """None while the process runs, else how it ended."""
        code = None if self.proc is None else self.proc.poll()
        return None if code is None else f"the engine core process (pid {self.pid}) {describe_exit(code)}"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop (it finishes in-flight steps), then make sure it has."""
        if not self._closed and self.proc is not None and self.proc.poll() is None:
            self._control.send(CoreInput(shutdown=True))
        self.stop(timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the process, then kill it; close everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        proc = self.proc
        if proc is not None:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("engine core process %d did not stop within %.0f s: killing it", proc.pid, timeout_s)
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()  # EOF: the core (and with it its workers) exits
            if proc.poll() is None:
                try:
                    proc.wait(1.0 if timeout_s > 0 else 0.2)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._control.close()
        self._ctx.term()
        self._dir.remove()


class ProcessEngineCoreClient(EngineCoreClient):
    """Front end ``client_index``'s connection to a core process; use it on one event loop."""

    def __init__(self, address: CoreAddress, num_kv_blocks: int, client_index: int = 0,
                 owner: Optional[CoreProcess] = None) -> None:
        import zmq

        self.num_kv_blocks = num_kv_blocks
        self.client_index = client_index
        self.pid = address.pid
        self._owner = owner
        where = ipc.PrivateDir(address.ipc_dir)
        self._ctx = zmq.Context()
        self._chan = ipc.Channel(self._ctx, address.secret, local=where.address(front_endpoint(client_index)),
                                 remote=where.address(CORE_ENDPOINT))
        self._chan.send(CoreInput(client_index=client_index, hello=True))
        self._backlog: collections.deque[CoreOutputBatch] = collections.deque()
        self._arx: Any = None  # the receiving socket's asyncio twin, made on the loop
        self._recv: Optional[asyncio.Future] = None
        self._woken_by_death = False
        self._watch: Optional[_ProcessWatch] = None
        self._closed = False

    # -- sending -------------------------------------------------------------------------
    def send(self, msg: CoreInput) -> None:
        if self.dead_error is None and not self._closed:
            msg.client_index = self.client_index
            self._chan.send(msg)

    # -- receiving -----------------------------------------------------------------------
    async def get_output(self) -> CoreOutputBatch:
        if self._arx is None:
            self._start_receiving()
        while True:
            if self._backlog:
                return self._backlog.popleft()
            if self.dead_error is not None:
                raise EngineDeadError(self.dead_error)
            self._recv = fut = self._arx.recv_multipart(copy=True)
            try:
                frames = await fut
            except asyncio.CancelledError:
                if self._woken_by_death:  # the core died while we waited: its last batches are queued
                    self._woken_by_death = False
                    continue
                raise
            finally:
                self._recv = None
            batch = self._decode(frames)
            if batch is not None:
                return batch

    def _decode(self, frames: list[bytes]) -> Optional[CoreOutputBatch]:
        payload = self._chan.authentic(frames)
        if payload is None:
            return None
        try:
            return ipc.decode(payload, CoreOutputBatch)
        except Exception as e:  # a batch that does not decode: the channel cannot be trusted
            self._die(f"lost the engine core channel: {type(e).__name__}: {e}")
            return None

    def _start_receiving(self) -> None:
        import zmq.asyncio

        self._arx = zmq.asyncio.Socket.shadow(self._chan.socket.underlying)
        self._watch = _ProcessWatch(self.pid, self._core_exited)

    def _core_exited(self) -> None:
        """The core's process is gone: keep what it sent, then fail."""
        if self._recv is not None and not self._recv.done():
            self._woken_by_death = True
            self._recv.cancel()
        while (batch := self._chan.try_recv(CoreOutputBatch)) is not None:
            self._backlog.append(batch)
        reason = self._owner.exit_reason() if self._owner is not None else None
        self._die(reason or f"the engine core process (pid {self.pid}) exited")

    def _die(self, error: str) -> None:
        if self.dead_error is None:
            self.dead_error = error
            if not self._closed:
                logger.error("engine core is dead: %s", error)

    # -- leaving -------------------------------------------------------------------------
    def detach(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self._arx is not None:  # the receiving socket's asyncio twin: closing it closes the socket
            self._arx.close(linger=0)
            self._arx = None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core if this client owns it, else tell it this front end is leaving."""
        if self._closed:
            return
        if self._owner is None and self.dead_error is None:
            self._chan.send(CoreInput(client_index=self.client_index, goodbye=True))
        self._closed = True
        if self._owner is not None:
            self._owner.shutdown(timeout_s)
        self.dead_error = self.dead_error or "the engine core was shut down"
        self._chan.close(linger_s=0.0 if self._owner is not None else 1.0)
        self._ctx.term()


class _ProcessWatch:
    """Calls ``on_exit`` on the running loop once process ``pid`` has exited: through a pidfd
    where the OS has them (Linux 5.3+; a zombie counts as exited), else by polling."""

    def __init__(self, pid: int, on_exit: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_exit = on_exit
        self._fd: Optional[int] = None
        self._task: Optional[asyncio.Task] = None
        try:
            self._fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._task = self._loop.create_task(self._poll(pid))
        else:
            self._loop.add_reader(self._fd, self._fire)

    def _fire(self) -> None:
        if self._fd is not None or self._task is not None:
            self.stop()
            self._on_exit()

    async def _poll(self, pid: int) -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                self._task = None
                self._on_exit()
                return
            except PermissionError:
                pass
            await asyncio.sleep(_POLL_S)

    def stop(self) -> None:
        """Stop watching (idempotent)."""
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
