"""``AsyncLLM``: the asyncio front end of a server.

It validates and tokenizes requests (``InputProcessor``), detokenizes and applies stop
strings (``OutputProcessor``) on the event loop, while the engine core runs its step loop
elsewhere (its own process by default) behind an ``EngineCoreClient``. Adds and aborts made
during one turn of the event loop go to the core as one message; one output-handler task
takes the core's per-step batches and feeds each request's ``RequestStream``.

Outputs are cumulative, so a stream keeps only the newest state: while a request runs, the
stream is merely told that it changed and builds its ``RequestOutput`` when read, so a slow
reader skips intermediate states instead of queueing them, and nobody pays for outputs that
are never read.

The core is dead when its process exits, when nothing at all (not even a heartbeat) comes
for ``hang_timeout_s`` (it is frozen), or when one step runs longer than the engine's
``rpc_timeout_s`` (it is hung: the limit the executor sets for a worker's answer). Then
every live request ends with an error, new ones are refused with ``EngineDeadError``, and
``on_dead`` is called (a server shuts down: a half-alive server must not keep running).

This module imports neither torch nor the model code: an API-server process runs it with
only the tokenizer, and learns the model (``ModelInfo``) from the core. ``AsyncLLM.start``
starts a core of its own (a process, or a thread for tests); a server with several
API-server processes connects each one's ``AsyncLLM`` to a shared core instead.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from tandem.config import EngineConfig, ModelInfo
from tandem.engine.core_client import CoreProcess, EngineCoreClient
from tandem.engine.input_processor import InputProcessor
from tandem.engine.messages import CoreInput, CoreStats, EngineDeadError
from tandem.engine.output_processor import OutputProcessor
from tandem.engine.stats import IterationStats, StatLogger
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_HANG_TIMEOUT_S = 30.0


class RequestStream:
    """The outputs of one request: an async iterator ending with the finished output."""

    def __init__(self, request_id: str, build: Callable[[], RequestOutput]) -> None:
        self.request_id = request_id
        self.finished = False
        self._build = build  # the request's current output (while it is live)
        self._final: Optional[RequestOutput] = None
        self._changed = False
        self._closed = False
        self._event = asyncio.Event()

    def changed(self) -> None:
        """New tokens arrived; the output is built when read."""
        self._changed = True
        self._event.set()

    def put_final(self, out: RequestOutput) -> None:
        self._final = out
        self._event.set()

    def close(self) -> None:
        """End the iteration now (the request was aborted)."""
        self._closed = True
        self._changed = False
        self._event.set()

    async def ready(self) -> Optional[RequestOutput]:
        """Wait for the next output without taking it (iterating still yields it next); None
        if the stream ended first. A server waits so for a constrained request's first output,
        which tells whether its grammar compiled, before it answers a streaming request 200."""
        while self._final is None and not self._changed:
            if self.finished or self._closed:
                return None
            self._event.clear()
            await self._event.wait()
        return self._final if self._final is not None else self._build()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while self._final is None and not self._changed:
            if self.finished or self._closed:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()
        if self._final is not None:
            out, self._final, self.finished = self._final, None, True
        else:
            out = self._build()
        self._changed = False
        return out


class AsyncLLM:
    """The asyncio engine front end over a running core (see the module docstring)."""

    def __init__(self, config: EngineConfig, client: EngineCoreClient, model: ModelInfo, *,
                 stat_logger: Optional[StatLogger] = None, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        from tandem.tokenizer import load_tokenizer

        self.config = config
        self.model = model
        self.client = client
        self.tokenizer = load_tokenizer(model.tokenizer)
        self.input_processor = InputProcessor(config, model, self.tokenizer)
        self.input_processor.num_kv_blocks = client.num_kv_blocks
        self.output_processor = OutputProcessor(self.tokenizer, config.enable_prefix_caching)
        self.stat_logger = stat_logger
        self.hang_timeout_s = hang_timeout_s
        self.latest_stats = CoreStats(num_kv_blocks=client.num_kv_blocks, num_free_kv_blocks=client.num_kv_blocks)
        self.dead_error: Optional[str] = None
        # Called once (on the loop) with the reason when the core is found dead.
        self.on_dead: Optional[Callable[[str], None]] = None
        self._streams: dict[str, RequestStream] = {}
        self._pending = CoreInput()
        self._flush_scheduled = False
        self._handler: Optional[asyncio.Task] = None
        self._shut_down = False

    @classmethod
    def start(cls, config: EngineConfig, **kwargs: Any) -> "AsyncLLM":
        """An ``AsyncLLM`` with an engine-core process of its own (the core resolves the model;
        ``inproc_client.start_inproc`` runs the core in a thread instead, for tests)."""
        core = CoreProcess(config)
        try:
            return cls(config, core.connect(0, owner=True), core.model, **kwargs)
        except BaseException:
            core.shutdown(timeout_s=0.0)
            raise

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._shut_down

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    # -- tokens and text (for handlers: /tokenize, chat templates) ----------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.tokenize(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation (``ValueError`` if the tokenizer has no template)."""
        return self.input_processor.apply_chat_template(messages, add_generation_prompt, chat_template,
                                                        **template_kwargs)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of token ids (``ValueError`` for an id outside the vocabulary)."""
        vocab = self.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}), got {bad[0]}")
        return self.tokenizer.decode(list(token_ids))

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    arrival_time: Optional[float] = None) -> RequestStream:
        """Validate and submit a request (``ValueError`` if it is bad, ``EngineDeadError`` if the
        core is gone); iterate the returned stream for its outputs. Call on the event loop."""
        if not self.is_running:
            raise EngineDeadError(self.dead_error or "the engine is shut down")
        self._ensure_handler()
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use by a running request")
        req = self.input_processor.process(request_id, prompt, params)
        adds = self.output_processor.add_request(req, arrival_time)
        stream = RequestStream(request_id, lambda: self.output_processor.make_output(request_id))
        self._streams[request_id] = stream
        self._pending.adds += adds
        self._schedule_flush()
        return stream

    async def generate(self, request_id: str, prompt: str | Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they grow; leaving the loop early aborts the request."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are a no-op."""
        core_ids = self.output_processor.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close()
        if not core_ids:
            return
        # A child whose add is still waiting for the next flush is simply not sent (the core
        # applies a message's aborts before its adds); the core hears of the rest.
        gone = set(core_ids)
        unsent = {r.request_id for r in self._pending.adds}
        self._pending.adds = [r for r in self._pending.adds if r.request_id not in gone]
        self._pending.aborts += [c for c in core_ids if c not in unsent]
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        msg, self._pending = self._pending, CoreInput()
        if msg and self.is_running:
            self.client.send(msg)

    # -- outputs -------------------------------------------------------------------------
    def begin(self) -> None:
        """Start reading the core's batches now, on the running loop (a server does so at
        start-up, so a core that dies while no request runs is noticed too)."""
        self._ensure_handler()

    def _ensure_handler(self) -> None:
        if self._handler is None:
            self._handler = asyncio.get_running_loop().create_task(self._output_handler(),
                                                                   name="tandem-output-handler")

    async def _output_handler(self) -> None:
        try:
            while not self._shut_down:
                try:
                    batch = await asyncio.wait_for(self.client.get_output(), self.hang_timeout_s)
                except asyncio.TimeoutError:
                    raise EngineDeadError(f"the engine core sent nothing for {self.hang_timeout_s:.0f} s "
                                          "(not even a heartbeat): it is frozen") from None
                if self._shut_down:
                    # shutdown() cancelled this task, but before Python 3.12 ``wait_for`` swallows
                    # a cancellation that arrives once its awaitable has finished (a batch was
                    # already queued) and returns the batch: the handler would read the core's
                    # heartbeats forever and shutdown() would never return. Stop here.
                    return
                if batch.fatal_error is not None:
                    raise EngineDeadError(f"the engine core failed: {batch.fatal_error}")
                if batch.heartbeat:
                    self.latest_stats = batch.stats
                    if self.stat_logger is not None:
                        self.stat_logger.record(batch.stats, IterationStats())
                    if batch.busy_s > self.config.rpc_timeout_s:
                        raise EngineDeadError(f"an engine step has run for {batch.busy_s:.0f} s, longer than "
                                              f"rpc_timeout_s ({self.config.rpc_timeout_s:g} s): the engine core "
                                              "is hung")
                    continue
                processed = self.output_processor.process_outputs(batch.outputs, final_only=True)
                for rid in processed.updated:
                    stream = self._streams.get(rid)
                    if stream is not None:
                        stream.changed()
                for out in processed.request_outputs:  # finished ones
                    stream = self._streams.pop(out.request_id, None)
                    if stream is not None:
                        stream.put_final(out)
                if processed.core_aborts or processed.core_adds:
                    self._pending.aborts += processed.core_aborts
                    self._pending.adds += processed.core_adds
                    self._schedule_flush()
                self.latest_stats = batch.stats
                if self.stat_logger is not None:
                    self.stat_logger.record(batch.stats, processed.stats)
                await asyncio.sleep(0)  # let the streams' readers run between batches
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not self._shut_down:
                self._fail_all(str(e) if isinstance(e, EngineDeadError) else f"{type(e).__name__}: {e}")
                if not isinstance(e, EngineDeadError):
                    logger.exception("output handler failed")

    def _fail_all(self, error: str) -> None:
        """The core is gone: every live request ends with ``error``; no new one is accepted."""
        self.dead_error = error
        logger.error("engine is dead, failing %d request(s): %s", len(self._streams), error)
        for out in self.output_processor.fail_all(error):
            stream = self._streams.pop(out.request_id, None)
            if stream is not None:
                stream.put_final(out)
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._pending = CoreInput()
        self.client.detach()
        self.client.shutdown(timeout_s=0.0)
        if self.on_dead is not None:
            self.on_dead(error)

    # -- lifecycle -----------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Abort what is still running, stop the core and its workers."""
        if self._shut_down:
            return
        for rid in list(self._streams):
            self.abort(rid)
        self._flush()
        self._shut_down = True
        if self._handler is not None:
            self._handler.cancel()
            try:
                await self._handler
            except asyncio.CancelledError:
                pass
        self.client.detach()
        await asyncio.to_thread(self.client.shutdown)
