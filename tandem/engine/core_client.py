"""How the asyncio front end talks to an engine core that runs beside it.

``EngineCoreClient`` is the interface: ``send`` a ``CoreInput`` (never blocks), ``await
get_output()`` for the next ``CoreOutputBatch`` (raises ``EngineDeadError`` once the core
is gone), ``shutdown``. Two implementations share the hand-over from the core's side to
the event loop:

* ``InprocEngineCoreClient`` runs the core loop in a thread of this process (tests and
  embedding; the GIL is shared with the front end);
* ``ProcessEngineCoreClient`` runs it in its own process (``core_process.py``), over a
  private ``tandem.ipc`` channel. A reader thread receives the core's batches and watches
  the process: when it exits (crash, SIGKILL, OOM) the front end hears of it within
  ``_POLL_S``, after every batch the core sent before dying.
"""
from __future__ import annotations

import abc
import asyncio
import logging
import queue
import signal
import subprocess
import threading
import time
from typing import Optional

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.core_loop import DEFAULT_HEARTBEAT_S, EngineCoreLoop
from tandem.engine.core_process import CORE_ENDPOINT, FRONT_ENDPOINT, MODULE, CoreReady, CoreStartup
from tandem.engine.engine_core import EngineCore
from tandem.engine.messages import CoreInput, CoreOutputBatch, EngineDeadError, EngineStartError

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the reader thread checks that the core process is alive


class EngineCoreClient(abc.ABC):
    """The front end's handle on a running engine core."""

    num_kv_blocks: int  # the core's cache size, known once it has started

    @abc.abstractmethod
    def send(self, msg: CoreInput) -> None:
        """Queue adds/aborts for the core; returns at once."""

    @abc.abstractmethod
    async def get_output(self) -> CoreOutputBatch:
        """The next batch from the core; raises ``EngineDeadError`` when the core is gone."""

    @abc.abstractmethod
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (finishing in-flight steps) and release everything it holds."""


class _HandoverClient(EngineCoreClient):
    """Batches produced on another thread, awaited on the event loop.

    The producing thread puts batches on a thread-safe queue and wakes the loop; the loop
    side checks the queue again after clearing the wake-up event, so no wake-up is lost.
    Once ``_die`` is called, ``get_output`` raises after the batches already queued.
    """

    def __init__(self) -> None:
        self._outputs: queue.SimpleQueue[CoreOutputBatch] = queue.SimpleQueue()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wakeup: Optional[asyncio.Event] = None
        self.dead_error: Optional[str] = None

    def _deliver(self, batch: CoreOutputBatch) -> None:
        self._outputs.put(batch)
        self._wake()

    def _die(self, error: str, expected: bool = False) -> None:
        """From now on ``get_output`` raises (after the queued batches); ``expected`` at shutdown."""
        if self.dead_error is None:
            self.dead_error = error
            if not expected:
                logger.error("engine core is dead: %s", error)
        self._wake()

    def _wake(self) -> None:
        loop, event = self._loop, self._wakeup
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    async def get_output(self) -> CoreOutputBatch:
        if self._wakeup is None:
            self._loop, self._wakeup = asyncio.get_running_loop(), asyncio.Event()
        while True:
            try:
                return self._outputs.get_nowait()
            except queue.Empty:
                pass
            if self.dead_error is not None:
                raise EngineDeadError(self.dead_error)
            self._wakeup.clear()
            if not self._outputs.empty() or self.dead_error is not None:
                continue
            await self._wakeup.wait()


class InprocEngineCoreClient(_HandoverClient):
    """The core loop in a thread of this process."""

    def __init__(self, core: EngineCore, heartbeat_s: Optional[float] = None) -> None:
        super().__init__()
        self.core = core
        self.num_kv_blocks = core.kv_cache.num_blocks
        self._inputs: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        kw = {} if heartbeat_s is None else {"heartbeat_s": heartbeat_s}
        self._loop_runner = EngineCoreLoop(core, self._recv, self._deliver, **kw)
        self._thread = threading.Thread(target=self._run, name="tandem-engine-core", daemon=True)
        self._thread.start()

    def _recv(self, timeout_s: float) -> Optional[CoreInput]:
        try:
            return self._inputs.get(timeout=timeout_s) if timeout_s > 0 else self._inputs.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        try:
            self._loop_runner.run()
        except BaseException as e:
            self._die(f"engine core thread failed: {type(e).__name__}: {e}")
        else:
            self._die("the engine core was shut down", expected=True)

    def send(self, msg: CoreInput) -> None:
        self._inputs.put(msg)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._inputs.put(CoreInput(shutdown=True))
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("engine core thread did not stop within %.0f s", timeout_s)
            return
        self.core.shutdown()


def describe_exit(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessEngineCoreClient(_HandoverClient):
    """The core loop in its own process, started through tandem's entry point (``core_process``)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        import zmq

        from tandem import ipc

        super().__init__()
        secret, self._dir = ipc.new_secret(), ipc.PrivateDir.create()
        self._ctx = zmq.Context()
        self._chan = ipc.Channel(self._ctx, secret, local=self._dir.address(FRONT_ENDPOINT),
                                 remote=self._dir.address(CORE_ENDPOINT))
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._closed = False
        try:
            self._proc = ipc.start_child(MODULE, [self._dir.path], secret, stdout=2)
            self._chan.send(CoreStartup(config, ipc.WireModelConfig.from_config(model_config), heartbeat_s))
            ready = self._wait_ready(config.worker_start_timeout_s)
        except BaseException:
            self._stop(timeout_s=0.0)
            raise
        self.num_kv_blocks = ready.num_kv_blocks
        self.pid = self._proc.pid
        self._reader = threading.Thread(target=self._read, name="tandem-core-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> CoreReady:
        deadline = time.monotonic() + timeout_s
        assert self._proc is not None
        while True:
            try:
                ready = self._chan.recv(CoreReady, timeout_s=_POLL_S)
                break
            except TimeoutError:
                pass
            code = self._proc.poll()
            if code is not None:
                raise EngineStartError(f"the engine core process {describe_exit(code)} while starting "
                                       "(its error is in the log above)")
            if time.monotonic() > deadline:
                raise EngineStartError(f"the engine core did not start within {timeout_s:.0f} s")
        if ready.error is not None:
            raise EngineStartError(f"the engine core failed to start:\n{ready.error.rstrip()}")
        return ready

    def _read(self) -> None:
        """Hand every batch to the event loop; when the process is gone, say so (once)."""
        assert self._proc is not None
        try:
            while not self._stopping.is_set():
                batch = self._chan.try_recv(CoreOutputBatch)
                if batch is not None:
                    self._deliver(batch)
                    continue
                code = self._proc.poll()
                if code is not None:
                    while (batch := self._chan.try_recv(CoreOutputBatch)) is not None:
                        self._deliver(batch)
                    self._die(f"the engine core process (pid {self._proc.pid}) {describe_exit(code)}")
                    return
                self._chan.socket.poll(int(_POLL_S * 1000))
        except Exception as e:  # a batch that does not decode: the channel cannot be trusted
            self._die(f"lost the engine core channel: {type(e).__name__}: {e}")

    def send(self, msg: CoreInput) -> None:
        if self.dead_error is None:
            self._chan.send(msg)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop (it finishes in-flight steps), then make sure it has."""
        self._stopping.set()  # the reader must not take the exit that follows for a crash
        if self._proc is not None and self._proc.poll() is None and self.dead_error is None:
            self._chan.send(CoreInput(shutdown=True))
        self._stop(timeout_s)

    def _stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the process, then kill it; close everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        proc = self._proc
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
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join()
        self._die("the engine core was shut down", expected=True)
        self._chan.close()
        self._ctx.term()
        self._dir.remove()
