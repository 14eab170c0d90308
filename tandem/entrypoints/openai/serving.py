"""What the completion and chat endpoints share: turning a request into engine requests,
collecting or streaming their outputs, aborting them when the client goes away.

A request with several prompts becomes one engine request per prompt (each may have
``n`` children); choice ``i * n + j`` is child ``j`` of prompt ``i``. Outputs are cumulative,
so a stream sends each choice the text it has not sent yet; a stream's text therefore
concatenates to exactly the non-streamed text.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tandem.engine.async_llm import AsyncLLM, RequestStream
from tandem.engine.input_processor import ContextLengthError, output_budget
from tandem.engine.messages import EngineDeadError
from tandem.entrypoints.openai.errors import APIError, bad_request, error_body
from tandem.entrypoints.openai.protocol import StreamOptions, _SamplingRequest
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.types.engine_output import INVALID_REQUEST
from tandem.validation import ParamError

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    served_model_names: list[str]
    api_key: Optional[str] = None
    max_n: int = 16  # most choices per prompt
    max_prompts: int = 64  # most prompts in one completion request
    max_body_bytes: int = 4 << 20
    chat_template: Optional[str] = None
    # --enable-auto-tool-choice --tool-call-parser NAME: tool_choice "auto" parses calls with NAME.
    tool_call_parser: Optional[str] = None


_JSON = msgspec.json.Encoder()


def sse(data: Any) -> bytes:
    """One server-sent event carrying ``data`` as compact UTF-8 JSON (msgspec: a streamed
    token costs one of these, so no ``json.dumps`` on the hot path)."""
    return b"data: " + _JSON.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
# A streamed choice's JSON from (its prompt's output, choice index, output, new text, first new
# token, end token, characters of text sent before this chunk); None when it has nothing to send.
ChoiceBuilder = Callable[[RequestOutput, int, CompletionOutput, str, int, int, int], Optional[dict[str, Any]]]
UNFINISHED = "the request was aborted before it finished (the server is shutting down)"


async def wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (the body has been read, so only a disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens found in the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage(prompt_lens: Sequence[int], outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return usage_body(sum(prompt_lens), completion, sum(o.num_cached_tokens for o in outputs))


class OpenAIServing:
    # The request field that carries a SamplingParams / engine parameter, where the names differ.
    PARAM_NAMES: dict[str, str] = {}

    def __init__(self, engine: AsyncLLM, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.model_name = settings.served_model_names[0]

    # -- checks --------------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.settings.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def check_common(self, req: _SamplingRequest, num_prompts: int) -> None:
        self.check_model(req.model)
        if req.n > self.settings.max_n:
            raise bad_request(f"n must be at most {self.settings.max_n}, got {req.n}", "n")
        if num_prompts > self.settings.max_prompts:
            raise bad_request(f"at most {self.settings.max_prompts} prompts per request, got {num_prompts}", "prompt")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not self.engine.is_running:
            raise APIError(503, f"the engine is not running: {self.engine.dead_error or 'shut down'}",
                           code="engine_dead")

    def max_tokens(self, requested: Optional[int], num_prompt_tokens: int, default: Optional[int],
                   param: str = "max_tokens") -> Optional[int]:
        """The output budget (the engine's ``output_budget`` checks it; None: to the end of the
        context); a prompt or an explicit budget past the context is OpenAI's
        context_length_exceeded 400."""
        try:
            budget = output_budget(self.engine.max_model_len, num_prompt_tokens, requested, default)
            return None if requested is None and default is None else budget
        except ContextLengthError as e:
            if e.requested is None:
                raise bad_request(f"This model's maximum context length is {e.limit} tokens. However, your prompt "
                                  f"has {e.num_prompt_tokens} tokens; it must leave room for at least one output "
                                  "token.", self.PARAM_NAMES.get("prompt", "prompt"), "context_length_exceeded"
                                  ) from None
            raise bad_request(f"This model's maximum context length is {e.limit} tokens. However, you requested "
                              f"{e.num_prompt_tokens + e.requested} tokens ({e.num_prompt_tokens} in the prompt, "
                              f"{e.requested} in the completion). Please reduce the prompt or the completion.",
                              param, "context_length_exceeded") from None

    @staticmethod
    def sampling_params(req: _SamplingRequest, max_tokens: Optional[int], logprobs: Optional[int],
                        **extra: Any) -> SamplingParams:
        """The request's sampling settings; ``extra`` adds endpoint-specific ones (prompt_logprobs, ...)."""
        kw: dict[str, Any] = dict(
            **extra,
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed, ignore_eos=req.ignore_eos,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []), logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens, logit_bias=req.logit_bias or None,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                kw[name] = value
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise _refused_params(e) from None

    # -- running -------------------------------------------------------------------------
    def start(self, prefix: str, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
              ) -> tuple[str, list[RequestStream]]:
        """Submit one engine request per prompt; all or none (a refusal aborts the ones added)."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params)):
                streams.append(self.engine.add_request(f"{request_id}-{i}", ids, sp))
        except (ValueError, EngineDeadError) as e:
            for s in streams:
                self.engine.abort(s.request_id)
            if isinstance(e, EngineDeadError):
                raise APIError(503, f"the engine is not running: {e}", code="engine_dead") from None
            raise _refused_params(e, self.PARAM_NAMES) from None
        return request_id, streams

    def abort(self, streams: Sequence[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.engine.abort(s.request_id)

    async def collect(self, request: Request, streams: list[RequestStream], invalid_param: Optional[str] = None,
                      first: bool = False) -> list[RequestOutput] | Response:
        """Every request's final output (``first``: its first output, left to be iterated
        again), or the response to send instead: 499 (and everything aborted) if the client
        left first, 400 if a request was refused in the engine core (a constraint that does
        not compile, named ``invalid_param``), 500 with the engine's message if one failed."""
        async def wait(stream: RequestStream) -> RequestOutput:
            out: Optional[RequestOutput] = None
            if first:
                out = await stream.ready()
            else:
                async for out in stream:
                    pass
            if out is None or not (first or out.finished):
                raise APIError(503, UNFINISHED, code="aborted")
            return out

        results = asyncio.ensure_future(asyncio.gather(*(wait(s) for s in streams)))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not results.done():
                results.cancel()
                self.abort(streams)
            gone.cancel()
        if results.cancelled():
            return Response(status_code=499)  # the client is gone; nobody reads this
        outputs: list[RequestOutput] = results.result()
        for o in outputs:
            if o.error is not None or any(c.finish_reason == "error" for c in o.outputs):
                self.abort(streams)
                if o.error_kind == INVALID_REQUEST:
                    return bad_request(o.error or "the request was refused", invalid_param).response()
                return JSONResponse(error_body(500, o.error or "the request failed in the engine",
                                               code="engine_error"), status_code=500)
        return outputs

    async def compiled(self, request: Request, streams: list[RequestStream],
                       param: Optional[str]) -> Optional[Response]:
        """A constrained streaming request waits for its first output before answering 200: the
        constraint compiled. Otherwise the response to send instead (400 naming ``param`` if it
        did not compile; 499, 500 as for ``collect``)."""
        first = await self.collect(request, streams, param, first=True)
        return first if isinstance(first, Response) else None

    @staticmethod
    async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream as they come."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, Optional[RequestOutput]]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, out = await queue.get()
                if out is None:
                    remaining -= 1
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()

    async def stream_choices(self, streams: list[RequestStream], n: int, head: dict[str, Any],
                             choice: ChoiceBuilder, options: Optional[StreamOptions],
                             prompt_lens: list[int], prelude: Optional[bytes] = None) -> AsyncIterator[bytes]:
        """The SSE body both endpoints stream: ``prelude`` (chat's role chunk), then one chunk
        per engine output that moved any choice (choice ``i * n + c.index`` for prompt ``i``;
        with ``continuous_usage_stats`` each with the usage so far), then the usage chunk if
        asked, then ``[DONE]``. An engine error or a server abort ends it with an error
        event. Leaving early (the client went away: the task is cancelled) aborts the
        requests. One generator from the engine's outputs to the response: every streamed
        token passes through it, so no layers of wrapping generators."""
        include_usage = options is not None and options.include_usage
        continuous = options is not None and options.continuous_usage
        prompt_tokens = sum(prompt_lens)
        tracker = ChoiceTracker(len(streams) * n)
        finals: dict[int, RequestOutput] = {}
        cached = [0] * len(streams)  # each prompt's prefix-cache hit, known from its first output on

        def chunk_of(i: int, out: RequestOutput) -> Optional[bytes]:
            cached[i] = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                index = i * n + c.index
                offset = tracker.text_sent[index]
                d = tracker.delta(index, c)
                if d is not None:
                    piece = choice(out, index, c, *d, offset)
                    if piece is not None:
                        choices.append(piece)
            if out.finished:
                finals[i] = out
            if not choices:
                return None
            body = {**head, "choices": choices}
            if continuous:
                body["usage"] = usage_body(prompt_tokens, sum(tracker.tokens_sent), sum(cached))
            return sse(body)

        try:
            if prelude is not None:
                yield prelude
            single = len(streams) == 1
            source: Any = streams[0] if single else self.merged(streams)
            async for item in source:
                i, out = (0, item) if single else item
                if out.error is not None:
                    yield self.error_event(out.error)
                    yield SSE_DONE
                    return
                data = chunk_of(i, out)
                if data is not None:
                    yield data
            if len(finals) < len(streams):  # aborted by the server (shutting down): not a normal end
                yield self.error_event(UNFINISHED)
                yield SSE_DONE
                return
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage(prompt_lens, [finals[i] for i in sorted(finals)])})
            yield SSE_DONE
        finally:  # the client went away (the task is cancelled) or the stream ended
            self.abort(streams)

    @staticmethod
    def stream_response(body: AsyncIterator[bytes]) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    def error_event(message: str) -> bytes:
        return sse(error_body(500, message, code="engine_error"))


def _refused_params(e: ValueError, names: Optional[dict[str, str]] = None) -> APIError:
    """The 400 for a request that SamplingParams or the engine's input checks refused, with
    the ``param`` the refusal names (a ``ParamError``), as the request calls it (``names``)."""
    param = e.param if isinstance(e, ParamError) else None
    return bad_request(str(e), (names or {}).get(param, param) if param is not None else None)


def created() -> int:
    return int(time.time())


class ChoiceTracker:
    """Per choice of a streamed response: how much text and how many tokens were sent."""

    def __init__(self, num_choices: int) -> None:
        self.text_sent = [0] * num_choices
        self.tokens_sent = [0] * num_choices
        self.done = [False] * num_choices

    def delta(self, index: int, c: CompletionOutput) -> Optional[tuple[str, int, int]]:
        """(new text, first new token, end token) for choice ``index``, or None if nothing new."""
        if self.done[index]:
            return None
        text = c.text[self.text_sent[index]:]
        start, end = self.tokens_sent[index], len(c.token_ids)
        if not text and start == end and c.finish_reason is None:
            return None
        self.text_sent[index] = len(c.text)
        self.tokens_sent[index] = end
        self.done[index] = c.finish_reason is not None
        return text, start, end
