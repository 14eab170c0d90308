"""The engine core loop in a thread of this process, behind the ``EngineCoreClient`` interface.

For tests and embedding: the core shares the GIL with the front end, so a server runs its
core in a process of its own (``core_client.ProcessEngineCoreClient``). The loop thread
puts batches on a thread-safe queue and wakes the event loop; the loop side checks the
queue again after clearing the wake-up event, so no wake-up is lost. Once the thread is
gone, ``get_output`` raises after the batches already queued.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Optional

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.core_client import EngineCoreClient
from tandem.engine.core_loop import EngineCoreLoop
from tandem.engine.engine_core import EngineCore
from tandem.engine.messages import CoreInput, CoreOutputBatch, EngineDeadError

logger = logging.getLogger(__name__)


class InprocEngineCoreClient(EngineCoreClient):
    """The core loop in a thread of this process (one front end, index 0)."""

    def __init__(self, core: EngineCore, heartbeat_s: Optional[float] = None) -> None:
        self.core = core
        self.num_kv_blocks = core.kv_cache.num_blocks
        self._outputs: queue.SimpleQueue[CoreOutputBatch] = queue.SimpleQueue()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wakeup: Optional[asyncio.Event] = None
        self._inputs: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self._inputs.put(CoreInput(hello=True))
        kw = {} if heartbeat_s is None else {"heartbeat_s": heartbeat_s}
        self._loop_runner = EngineCoreLoop(core, self._recv, self._deliver, **kw)
        self._thread = threading.Thread(target=self._run, name="tandem-engine-core", daemon=True)
        self._thread.start()

    # -- the core's side (its thread) ----------------------------------------------------
    def _recv(self, timeout_s: float) -> Optional[CoreInput]:
        try:
            return self._inputs.get(timeout=timeout_s) if timeout_s > 0 else self._inputs.get_nowait()
        except queue.Empty:
            return None

    def _deliver(self, client: int, batch: CoreOutputBatch) -> None:
        self._outputs.put(batch)
        self._wake()

    def _run(self) -> None:
        try:
            self._loop_runner.run()
        except BaseException as e:
            self._die(f"engine core thread failed: {type(e).__name__}: {e}")
        else:
            self._die("the engine core was shut down", expected=True)

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

    # -- the front end's side ------------------------------------------------------------
    def send(self, msg: CoreInput) -> None:
        self._inputs.put(msg)

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

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self._inputs.put(CoreInput(shutdown=True))
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("engine core thread did not stop within %.0f s", timeout_s)
            return
        self.core.shutdown()


def start_inproc(config: EngineConfig, model_config: Optional[ModelConfig] = None, **kwargs: Any) -> AsyncLLM:
    """An ``AsyncLLM`` whose engine core runs in a thread of this process (tests, embedding)."""
    from tandem.engine.prepare import prepare_model

    model_config = model_config or prepare_model(config)
    return AsyncLLM(config, InprocEngineCoreClient(EngineCore(config, model_config)), model_config.info, **kwargs)
