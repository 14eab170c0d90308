"""The engine core's busy loop, shared by the in-thread and the separate-process core.

One iteration: take every message that has arrived (without waiting while there is work;
waiting up to a heartbeat interval when idle), apply its adds and aborts, run one
``EngineCore.step()``, and send a ``CoreOutputBatch`` if the step produced outputs. The
loop also sends one when it goes idle (so a freed request's blocks show in /metrics at
once) and a heartbeat at least every ``heartbeat_s`` (so a front end can tell a busy core
from a hung one). Transport is two callables, so a thread and a process share this code.
"""
from __future__ import annotations

import logging
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
        self.send = send
        self.heartbeat_s = heartbeat_s
        self.idle_seconds = 0.0
        core.track_queue_times = True

    def run(self) -> None:
        """Loop until a shutdown message; a failure is sent as a fatal batch, then re-raised."""
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

    def _run(self) -> None:
        last_sent = time.monotonic()
        changed = False  # something happened since the last batch that the stats should show
        while True:
            busy = self.core.has_work()
            t0 = time.monotonic()
            msg = self.recv(0.0 if busy else max(0.0, self.heartbeat_s - (t0 - last_sent)))
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
                outputs += self.core.step()
                changed = True
            now = time.monotonic()
            if outputs or (changed and not self.core.has_work()) or now - last_sent >= self.heartbeat_s:
                self.send(CoreOutputBatch(outputs, self.core.make_stats(self.idle_seconds)))
                last_sent, changed = now, False

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
