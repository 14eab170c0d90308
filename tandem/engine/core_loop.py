"""The engine core's busy loop, shared by the in-thread and the separate-process core.

One iteration: take every message that has arrived (without waiting while there is work;
waiting when idle), apply its adds and aborts, run one ``EngineCore.step()``, and send a
``CoreOutputBatch`` if the step produced outputs. The loop also sends one when it goes
idle, so a freed request's blocks show in /metrics at once.

A heartbeat thread sends an empty batch every ``heartbeat_s`` with ``busy_s``, how long the
current step has been running. So the front end tells apart a core that is frozen or gone
(no message at all) from one inside a long step (heartbeats, ``busy_s`` growing), and can
call a step hung once ``busy_s`` passes its limit, however long a legitimate step takes
on a slow machine. Transport is two callables, so a thread and a process share this code.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Callable, Optional

from tandem.engine.engine_core import EngineCore
from tandem.engine.messages import CoreInput, CoreOutputBatch
from tandem.types.engine_output import EngineCoreOutput

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 1.0

# recv(timeout_s) returns the next message, or None when none arrived within the timeout.
Receive = Callable[[float], Optional[CoreInput]]
Send = Callable[[CoreOutputBatch], None]


class EngineCoreLoop:
    def __init__(self, core: EngineCore, recv: Receive, send: Send,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self.core = core
        self.recv = recv
        self._send = send
        self._send_lock = threading.Lock()  # the loop and the heartbeat thread both send
        self.heartbeat_s = heartbeat_s
        self.idle_seconds = 0.0
        self._step_started: Optional[float] = None
        self._stop_heartbeat = threading.Event()
        core.track_queue_times = True

    def send(self, batch: CoreOutputBatch) -> None:
        with self._send_lock:
            self._send(batch)

    def run(self) -> None:
        """Loop until a shutdown message; a failure is sent as a fatal batch, then re-raised."""
        beat = threading.Thread(target=self._heartbeat, name="tandem-core-heartbeat", daemon=True)
        beat.start()
        try:
            self._run()
        except BaseException as e:
            msg = "".join(traceback.format_exception_only(type(e), e)).strip()
            logger.error("engine core loop failed: %s", msg)
            try:
                self.send(CoreOutputBatch([], self.core.make_stats(self.idle_seconds), fatal_error=msg))
            except Exception:
                logger.exception("could not report the engine core failure")
            raise
        finally:
            self._stop_heartbeat.set()
            beat.join()

    def _heartbeat(self) -> None:
        while not self._stop_heartbeat.wait(self.heartbeat_s):
            started = self._step_started
            self.send(CoreOutputBatch([], None, busy_s=0.0 if started is None else time.monotonic() - started))

    def _run(self) -> None:
        changed = False  # something happened since the last batch that the stats should show
        while True:
            busy = self.core.has_work()
            t0 = time.monotonic()
            msg = self.recv(0.0 if busy else self.heartbeat_s)
            if not busy:
                self.idle_seconds += time.monotonic() - t0
            outputs: list[EngineCoreOutput] = []
            while msg is not None:
                if msg.shutdown:
                    return
                outputs += self._apply(msg)
                changed = True
                msg = self.recv(0.0)
            if self.core.has_work():
                self._step_started = time.monotonic()
                outputs += self.core.step()
                self._step_started = None
                changed = True
            if outputs or (changed and not self.core.has_work()):
                self.send(CoreOutputBatch(outputs, self.core.make_stats(self.idle_seconds)))
                changed = False

    def _apply(self, msg: CoreInput) -> list[EngineCoreOutput]:
        """Aborts first, so a finished id may be aborted and reused in one message (the front
        end drops the add of a request aborted before it was sent); a request the core
        refuses ends at once with an error instead of failing the loop."""
        if msg.aborts:
            self.core.abort_requests(msg.aborts)
        refused = []
        for r in msg.adds:
            try:
                self.core.add_request(r.to_request())
            except ValueError as e:
                refused.append(EngineCoreOutput(r.request_id, [], finish_reason="error", error=str(e)))
        return refused
