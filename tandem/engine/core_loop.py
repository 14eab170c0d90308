"""The engine core's busy loop, shared by the in-thread and the separate-process core.

One iteration: take every message that has arrived (without waiting while there is work;
waiting when idle), apply its adds and aborts, run one ``EngineCore.step()``, and send each
front end whose requests produced outputs one ``CoreOutputBatch`` with them. The loop also
sends every front end a batch when it goes idle, so a freed request's blocks show in
/metrics at once.

Several front ends may share one core (the API-server processes of ``tandem serve
--api-server-count N``): each says ``hello`` with its ``client_index`` first, the core
remembers which front end added each request, and routes every output to that front end
only. A front end that leaves says ``goodbye``: its requests are aborted.

A heartbeat thread sends every front end an empty batch every ``heartbeat_s`` with the
newest stats and ``busy_s``, how long the current step has been running. So a front end
tells apart a core that is frozen or gone (no message at all) from one inside a long step
(heartbeats, ``busy_s`` growing), and can call a step hung once ``busy_s`` passes its limit,
however long a legitimate step takes on a slow machine. Transport is two callables, so a
thread and a process share this code.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Callable, Optional

from tandem import step_trace
from tandem.engine.engine_core import EngineCore
from tandem.engine.messages import DEFAULT_HEARTBEAT_S, CoreInput, CoreOutputBatch, CoreStats
from tandem.types.engine_output import EngineCoreOutput

logger = logging.getLogger(__name__)

# recv(timeout_s) returns the next message, or None when none arrived within the timeout.
Receive = Callable[[float], Optional[CoreInput]]
# send(client_index, batch) delivers a batch to one front end.
Send = Callable[[int, CoreOutputBatch], None]


class EngineCoreLoop:
    def __init__(self, core: EngineCore, recv: Receive, send: Send,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self.core = core
        self.recv = recv
        self._send = send
        self._send_lock = threading.Lock()  # the loop and the heartbeat thread both send
        self.heartbeat_s = heartbeat_s
        self.idle_seconds = 0.0
        self.clients: list[int] = []  # front ends that said hello, in order
        self._owner: dict[str, int] = {}  # request id -> the front end that added it
        self._stats: CoreStats = core.make_stats()
        self._step_started: Optional[float] = None
        self._stop_heartbeat = threading.Event()
        core.track_queue_times = True

    def send(self, client: int, batch: CoreOutputBatch) -> None:
        with self._send_lock:
            self._send(client, batch)

    def send_all(self, batch: CoreOutputBatch) -> None:
        for client in list(self.clients):
            self.send(client, batch)

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
                self.send_all(CoreOutputBatch([], self.core.make_stats(self.idle_seconds), fatal_error=msg))
            except Exception:
                logger.exception("could not report the engine core failure")
            raise
        finally:
            self._stop_heartbeat.set()
            beat.join()

    def _heartbeat(self) -> None:
        while not self._stop_heartbeat.wait(self.heartbeat_s):
            started = self._step_started
            busy = 0.0 if started is None else time.monotonic() - started
            self.send_all(CoreOutputBatch([], self._stats, heartbeat=True, busy_s=busy))

    def _run(self) -> None:
        changed = False  # something happened since the last batch that the stats should show
        while True:
            busy = self.core.has_work()
            t0 = time.monotonic()
            msg = self.recv(0.0 if busy else self.heartbeat_s)
            if not busy:
                self.idle_seconds += time.monotonic() - t0
            outputs: list[EngineCoreOutput] = []
            trace = step_trace.TRACE
            intake = trace if msg is not None else None  # (the trace, when there are messages)
            if intake is not None:
                intake.mark("intake", "b", -1)
            while msg is not None:
                if msg.shutdown:
                    return
                outputs += self._apply(msg)
                changed = True
                msg = self.recv(0.0)
            if intake is not None:
                intake.mark("intake", "e", -1)
            if self.core.has_work():
                self._step_started = time.monotonic()
                outputs += self.core.step()
                self._step_started = None
                changed = True
            went_idle = changed and not self.core.has_work()
            if outputs or went_idle:
                if trace is not None:
                    trace.mark("publish", "b", -1)
                self._stats = self.core.make_stats(self.idle_seconds)
                self._publish(outputs, everyone=went_idle)
                if trace is not None:
                    trace.mark("publish", "e", -1)
                changed = False
                # A constrained step's bitmask may have filled while the outputs went out:
                # its sampling call goes now, not after the next messages are applied.
                self.core.send_filled_sampling()

    def _publish(self, outputs: list[EngineCoreOutput], everyone: bool) -> None:
        """One batch per front end with outputs (every front end if ``everyone``), routed by owner."""
        owner = self._owner
        if len(self.clients) == 1:
            by_client = {self.clients[0]: outputs}
        else:
            by_client = {c: [] for c in self.clients} if everyone else {}
            for out in outputs:
                by_client.setdefault(owner.get(out.req_id, 0), []).append(out)
        for out in outputs:
            if out.finish_reason is not None:
                owner.pop(out.req_id, None)
        for client, outs in by_client.items():
            if outs or everyone:
                self.send(client, CoreOutputBatch(outs, self._stats))

    def _apply(self, msg: CoreInput) -> list[EngineCoreOutput]:
        """Aborts first, so a finished id may be aborted and reused in one message (the front
        end drops the add of a request aborted before it was sent); a request the core
        refuses ends at once with an error instead of failing the loop."""
        client = msg.client_index
        if client not in self.clients:  # hello (or a first message): heartbeats start now
            self.clients.append(client)
        if msg.goodbye:  # the front end is leaving: nothing of its own may keep running
            mine = [rid for rid, c in self._owner.items() if c == client]
            msg.aborts += mine
        if msg.aborts:
            self.core.abort_requests(msg.aborts)
            for rid in msg.aborts:
                self._owner.pop(rid, None)
        if msg.goodbye:
            self.clients.remove(client)
        refused = []
        for r in msg.adds:
            if r.request_id in self._owner:
                refused.append(EngineCoreOutput(r.request_id, [], finish_reason="error",
                                                error=f"request id {r.request_id!r} is already running"))
                continue
            try:
                self.core.add_request(r.to_request())
            except ValueError as e:
                refused.append(EngineCoreOutput(r.request_id, [], finish_reason="error", error=str(e)))
                continue
            self._owner[r.request_id] = client
        for out in refused:  # routed to the sender, though it never became the request's owner
            if client in self.clients:
                self.send(client, CoreOutputBatch([out], self._stats))
        return []
