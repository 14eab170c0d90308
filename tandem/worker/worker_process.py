"""The main loop of one worker process (multiproc executor): receive a call, answer it, in order.

Wire protocol, over two ZeroMQ PUSH/PULL pipes per rank (driver binds both, worker connects):

* request: ``pickle((seq, method, args, kwargs))``; ``seq`` counts up from 0 without gaps.
* reply:   ``pickle((seq, rank, ok, payload))``; ``payload`` is the result when ``ok``, else
  ``(exc_type_name, message, traceback_text)``. A ``READY_SEQ`` reply (payload: pid) or an
  error reply with that seq is sent once the worker is built, before any request is read.

The one rule that makes the pipeline deadlock-free: **every request gets exactly one reply,
in request order**, whatever it is — a step, a call that only primes the pipeline (an empty
step), a failing call, the shutdown call. The main thread executes calls one by one and
hands each outcome to a single reply thread through a FIFO queue; that thread alone sends.
A step's outcome is its ``AsyncModelOutput``: the reply thread waits for its host copy, so
the main thread is already running the next step while this one's tokens travel back.

The process also ends itself when the driver dies: a watchdog thread blocks on a pipe
whose only writer is the driver, and exits when it reads EOF (no orphans after a crash).
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
from multiprocessing.connection import Connection
from typing import Any, Optional

from tandem.types.errors import ErrorPayload

READY_SEQ = -1
SHUTDOWN_METHOD = "__shutdown__"

logger = logging.getLogger(__name__)




def _watch_parent(death_conn: Connection) -> None:
    """Exit the process as soon as the driver's end of ``death_conn`` closes."""
    try:
        death_conn.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


class _ReplySender(threading.Thread):
    """Sends replies in the order they were queued; resolves step outputs before sending."""

    def __init__(self, sock: Any, rank: int) -> None:
        super().__init__(name=f"tandem-reply-{rank}", daemon=True)
        self.sock = sock
        self.rank = rank
        self.q: "queue.Queue[Optional[tuple[int, bool, Any]]]" = queue.Queue()

    def put(self, seq: int, ok: bool, payload: Any) -> None:
        self.q.put((seq, ok, payload))

    def close(self) -> None:
        self.q.put(None)
        self.join()

    def run(self) -> None:
        from tandem.worker.async_output import AsyncModelOutput

        while True:
            item = self.q.get()
            if item is None:
                return
            seq, ok, payload = item
            if ok and isinstance(payload, AsyncModelOutput):
                try:
                    payload = payload.get()
                except BaseException as e:  # e.g. a CUDA error surfacing at the copy
                    ok, payload = False, ErrorPayload.from_exception(e)
            try:
                data = pickle.dumps((seq, self.rank, ok, payload), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as e:  # an unpicklable result still gets its one reply
                data = pickle.dumps((seq, self.rank, False, ErrorPayload.from_exception(e)), protocol=pickle.HIGHEST_PROTOCOL)
            self.sock.send(data, copy=False)


def run_worker_process(rank: int, config: Any, model_config: Any,
                       distributed_init_method: Optional[str], request_addr: str, reply_addr: str,
                       death_conn: Connection, num_threads: int) -> None:
    """Entry point of a spawned worker process (see the module docstring for the protocol)."""
    import zmq

    threading.Thread(target=_watch_parent, args=(death_conn,), name="tandem-parent-watch", daemon=True).start()
    logging.basicConfig(level=model_config.env.log_level,
                        format=f"%(asctime)s worker{rank} %(levelname)s %(name)s: %(message)s")
    import torch

    if num_threads > 0:
        torch.set_num_threads(num_threads)
    ctx = zmq.Context()
    requests = ctx.socket(zmq.PULL)
    requests.connect(request_addr)
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 5000)  # flush the last replies on a clean exit
    replies.connect(reply_addr)
    sender = _ReplySender(replies, rank)
    sender.start()
    worker = None
    try:
        try:
            from tandem.worker.worker import resolve_worker_class

            worker = resolve_worker_class(config.worker_cls)(
                config, model_config, rank=rank, distributed_init_method=distributed_init_method)
        except BaseException as e:
            sender.put(READY_SEQ, False, ErrorPayload.from_exception(e))
            return
        sender.put(READY_SEQ, True, os.getpid())
        _serve(worker, requests, sender)
    finally:
        sender.close()
        if worker is not None:
            try:
                worker.shutdown()
            except Exception:  # best effort: the process is ending anyway
                logger.exception("worker shutdown failed")
        requests.close(linger=0)
        replies.close()
        ctx.term()


def _serve(worker: Any, requests: Any, sender: _ReplySender) -> None:
    expected = 0
    while True:
        seq, method, args, kwargs = pickle.loads(requests.recv())
        if seq != expected:  # cannot happen over one PUSH/PULL pipe; refuse loudly if it does
            raise RuntimeError(f"worker got call #{seq}, expected #{expected}")
        expected += 1
        if method == SHUTDOWN_METHOD:
            sender.put(seq, True, None)
            return
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except BaseException as e:
            sender.put(seq, False, ErrorPayload.from_exception(e))
            if not isinstance(e, Exception):  # KeyboardInterrupt/SystemExit: answer, then stop
                raise
            continue
        sender.put(seq, True, result)
