"""One worker process of the multiproc executor: receive a call, answer it, in order.

Started as ``python -m tandem.worker.worker_process <endpoint-dir> <rank>`` (through
``tandem.ipc.start_child``), so it runs tandem's code and never the user's ``__main__``.
It talks to the driver over one ``tandem.ipc.Channel``: it receives on ``req-<rank>`` and
sends to ``rep-<rank>`` in the driver's private endpoint directory; every message is
authenticated with the secret that arrived on stdin, and typed:

1. ``WorkerStart`` (the first message): rank, the engine and model configs, the
   tensor-parallel rendezvous address, CPU threads, and the driver's ``sys.path`` (so a
   ``worker_cls`` from the driver's folders imports here too).
2. a ``Reply`` with ``seq == READY_SEQ``: the worker's pid once it is built, or its
   construction error with the traceback — sent before any call is read.
3. ``Call(seq, method, args, kwargs)``; ``seq`` counts up from 0 without gaps. ``method``
   must be on the worker class's allow-list (``MethodTable``: its public methods); each
   argument travels encoded on its own and is decoded into the type the method declares
   for that parameter (``execute_model`` -> ``SchedulerOutput``).
4. ``Reply(seq, rank, result)`` or ``Reply(seq, rank, error=ErrorPayload)``; the driver
   decodes ``result`` into the return type ``Worker`` declares for the method (an
   ``AsyncModelOutput`` arrives as the ``ModelRunnerOutput`` it resolves to).

The one rule that makes the pipeline deadlock-free: **every call gets exactly one reply,
in call order**, whatever it is — a step, a call that only primes the pipeline (an empty
step), a failing call, the shutdown call. The main thread executes calls one by one and
hands each outcome to a single reply thread through a FIFO queue; that thread alone sends.
A step's outcome is its ``AsyncModelOutput``: the reply thread waits for its host copy, so
the main thread is already running the next step while this one's tokens travel back.

The process ends itself when the driver is gone: a thread waits for EOF on stdin (the
driver never closes it while it needs the worker, and the kernel closes it when the
driver dies, SIGKILL included), removes the endpoint directory, and exits. Ctrl-C is the
driver's to handle: the worker ignores SIGINT and is stopped by the driver.
"""
from __future__ import annotations

import inspect
import logging
import os
import queue
import signal
import sys
import threading
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

import msgspec

from tandem.config import EngineConfig
from tandem.ipc import Channel, PrivateDir, WireModelConfig, decode, encode, exit_with_parent, read_secret
from tandem.types.errors import ErrorPayload
from tandem.types.runner_output import ModelRunnerOutput
from tandem.worker.async_output import AsyncModelOutput

READY_SEQ = -1
SHUTDOWN_METHOD = "__shutdown__"
_NONE = msgspec.Raw(encode(None))

logger = logging.getLogger(__name__)


def request_endpoint(rank: int) -> str:
    """Name of the socket the worker of ``rank`` receives calls on."""
    return f"req-{rank}"


def reply_endpoint(rank: int) -> str:
    """Name of the socket the driver receives ``rank``'s replies on."""
    return f"rep-{rank}"


class WorkerStart(msgspec.Struct, frozen=True):
    rank: int
    config: EngineConfig
    model_config: WireModelConfig
    distributed_init_method: Optional[str]
    num_threads: int
    sys_path: list[str]


class Call(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    method: str
    args: list[msgspec.Raw]
    kwargs: dict[str, msgspec.Raw]

    @classmethod
    def of(cls, seq: int, method: str, args: tuple, kwargs: dict) -> "Call":
        return cls(seq, method, [msgspec.Raw(encode(a)) for a in args],
                   {k: msgspec.Raw(encode(v)) for k, v in kwargs.items()})


class Reply(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    rank: int
    result: msgspec.Raw = _NONE
    error: Optional[ErrorPayload] = None


# -- method signatures: the allow-list and the types on the wire ---------------------------
def _wire_type(tp: Any) -> Any:
    """The type a value of ``tp`` travels as: a step's ``AsyncModelOutput`` is resolved by
    the reply thread into the ``ModelRunnerOutput`` it holds."""
    if tp is AsyncModelOutput:
        return ModelRunnerOutput
    if typing.get_origin(tp) is Union:
        return Union[tuple(_wire_type(a) for a in typing.get_args(tp))]
    return tp


def _declared_types(cls: type, name: str) -> dict[str, Any]:
    """Annotations of method ``name`` (parameters and ``return``), the most derived class
    that annotates each one winning: a subclass may override without repeating them."""
    types: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        fn = klass.__dict__.get(name)
        if fn is None:
            continue
        try:
            types.update(typing.get_type_hints(fn))
        except (NameError, TypeError):  # an annotation that cannot be resolved reads as Any
            logger.debug("unresolvable annotations on %s.%s", klass.__qualname__, name)
    return types


@dataclass(frozen=True)
class _Method:
    """The wire types of one method, worked out once: each call only looks them up."""

    positional: tuple[Any, ...]  # parameters that may be passed by position, in order (no self)
    by_name: dict[str, Any]  # parameters that may be passed by name
    extra_positional: Any  # each *args item (None: the method takes none; the call will say so)
    extra_keyword: Any  # each **kwargs value
    result: Any

    @classmethod
    def of(cls, klass: type, name: str) -> "_Method":
        types = _declared_types(klass, name)
        params = list(inspect.signature(getattr(klass, name)).parameters.values())[1:]  # without self
        kinds = inspect.Parameter
        extra = {p.kind: types.get(p.name, Any) for p in params if p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)}
        return cls(
            positional=tuple(types.get(p.name, Any) for p in params
                             if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)),
            by_name={p.name: types.get(p.name, Any) for p in params
                     if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)},
            extra_positional=extra.get(kinds.VAR_POSITIONAL, Any),
            extra_keyword=extra.get(kinds.VAR_KEYWORD, Any),
            result=_wire_type(types.get("return", Any)),
        )

    def arg_type(self, i: int) -> Any:
        return self.positional[i] if i < len(self.positional) else self.extra_positional

    def kwarg_type(self, name: str) -> Any:
        return self.by_name.get(name, self.extra_keyword)


class MethodTable:
    """What a worker class exposes to its driver: its public methods (no leading
    underscore), each argument decoded into the type its parameter declares (``Any``
    where none is declared: then only plain data can arrive). A call with the wrong
    arguments fails as the method itself would, with ``TypeError``."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self._methods: dict[str, _Method] = {}

    def allowed(self, name: str) -> bool:
        return not name.startswith("_") and inspect.isroutine(getattr(self.cls, name, None))

    def _method(self, name: str) -> _Method:
        if name not in self._methods:
            if not self.allowed(name):
                raise AttributeError(f"{name!r} is not a method {self.cls.__qualname__} exposes to its driver")
            self._methods[name] = _Method.of(self.cls, name)
        return self._methods[name]

    def result_type(self, name: str) -> Any:
        """What a call's result decodes into (``Any`` for a method this class lacks)."""
        return self._method(name).result if self.allowed(name) else Any

    def invoke(self, worker: Any, call: Call) -> Any:
        """Decode ``call``'s arguments into their declared types and run the method."""
        m = self._method(call.method)
        args = [decode(raw, m.arg_type(i)) for i, raw in enumerate(call.args)]
        kwargs = {k: decode(raw, m.kwarg_type(k)) for k, raw in call.kwargs.items()}
        return getattr(worker, call.method)(*args, **kwargs)


# -- the reply thread ------------------------------------------------------------------------
class _ReplySender(threading.Thread):
    """Sends replies in the order they were queued; resolves step outputs before sending."""

    def __init__(self, channel: Channel, rank: int) -> None:
        super().__init__(name=f"tandem-reply-{rank}", daemon=True)
        self.channel = channel
        self.rank = rank
        self.q: "queue.Queue[Optional[tuple[int, Any, Optional[ErrorPayload]]]]" = queue.Queue()

    def put(self, seq: int, result: Any = None, error: Optional[ErrorPayload] = None) -> None:
        self.q.put((seq, result, error))

    def close(self) -> None:
        self.q.put(None)
        self.join()

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            self.channel.send(self._reply(*item))

    def _reply(self, seq: int, result: Any, error: Optional[ErrorPayload]) -> Reply:
        if error is not None:
            return Reply(seq, self.rank, error=error)
        try:
            if isinstance(result, AsyncModelOutput):
                result = result.get()  # e.g. a CUDA error surfacing at the copy fails this call
            return Reply(seq, self.rank, result=msgspec.Raw(encode(result)))
        except BaseException as e:  # an unencodable result still gets its one reply
            return Reply(seq, self.rank, error=ErrorPayload.from_exception(e))


# -- the process -----------------------------------------------------------------------------
def _build_worker(start: WorkerStart) -> Any:
    """Apply the driver's settings to this process, then construct the worker."""
    sys.path[:] = list(dict.fromkeys(start.sys_path + sys.path))
    model_config = start.model_config.to_config()
    logging.basicConfig(level=model_config.env.log_level,
                        format=f"%(asctime)s worker{start.rank} %(levelname)s %(name)s: %(message)s")
    import torch

    if start.num_threads > 0:
        torch.set_num_threads(start.num_threads)
    from tandem.worker.worker import resolve_worker_class

    return resolve_worker_class(start.config.worker_cls)(
        start.config, model_config, rank=start.rank, distributed_init_method=start.distributed_init_method)


def _serve(worker: Any, channel: Channel, sender: _ReplySender) -> None:
    table = MethodTable(type(worker))
    expected = 0
    while True:
        call: Call = channel.recv(Call)
        if call.seq != expected:  # cannot happen over one authenticated pipe; refuse loudly if it does
            raise RuntimeError(f"worker got call #{call.seq}, expected #{expected}")
        expected += 1
        if call.method == SHUTDOWN_METHOD:
            sender.put(call.seq)
            return
        try:
            result = table.invoke(worker, call)
        except BaseException as e:
            sender.put(call.seq, error=ErrorPayload.from_exception(e))
            if not isinstance(e, Exception):  # SystemExit and the like: answer, then stop
                raise
            continue
        sender.put(call.seq, result)


def _run(channel: Channel, rank: int) -> None:
    """Start-up handshake, then serve until the shutdown call (module docstring)."""
    sender = _ReplySender(channel, rank)
    sender.start()
    worker = None
    try:
        try:
            worker = _build_worker(channel.recv(WorkerStart))
        except BaseException as e:
            sender.put(READY_SEQ, error=ErrorPayload.from_exception(e))
            return
        sender.put(READY_SEQ, os.getpid())
        _serve(worker, channel, sender)
    finally:
        sender.close()
        if worker is not None:
            try:
                worker.shutdown()
            except Exception:  # best effort: the process is ending anyway
                logger.exception("worker shutdown failed")


def main(argv: list[str]) -> None:
    """Entry point: ``argv`` is ``[endpoint_dir, rank]``; the secret comes on stdin."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    secret = read_secret()
    where, rank = PrivateDir(argv[0]), int(argv[1])
    exit_with_parent(cleanup=where.remove)
    ctx = zmq.Context()
    channel = Channel(ctx, secret, local=where.address(request_endpoint(rank)),
                      remote=where.address(reply_endpoint(rank)))
    try:
        _run(channel, rank)
    finally:
        channel.close(linger_s=5.0)  # flush the last replies on a clean exit
        ctx.term()


if __name__ == "__main__":
    main(sys.argv[1:])
