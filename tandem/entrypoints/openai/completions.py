"""``POST /v1/completions``: prompts (texts or token ids) in, choices out, streamed or not."""
from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.entrypoints.openai.protocol import CompletionRequest, StreamOptions
from tandem.entrypoints.openai.serving import OpenAIServing, created, usage
from tandem.outputs import CompletionOutput

# Completions default to 16 tokens (OpenAI's default for this endpoint).
_DEFAULT_MAX_TOKENS = 16


def completion_logprobs(c: CompletionOutput, start: int, end: int, text_offset: int) -> Optional[dict[str, Any]]:
    """OpenAI's legacy logprobs object for tokens ``start:end`` of a choice."""
    if c.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for tid, pos in zip(c.token_ids[start:end], c.logprobs[start:end]):
        chosen = pos[tid]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        tops.append({lp.decoded_token or "": lp.logprob for lp in pos.values()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


class CompletionServing(OpenAIServing):
    async def create(self, req: CompletionRequest, request: Request) -> Response:
        prompts = req.prompt
        self.check_common(req, len(prompts))
        ids_list = [self.engine.tokenize(p, req.add_special_tokens) if isinstance(p, str) else list(p)
                    for p in prompts]
        params = [self.sampling_params(req, self.max_tokens(req.max_tokens, len(ids), _DEFAULT_MAX_TOKENS),
                                       req.logprobs) for ids in ids_list]
        request_id, streams = self.start("cmpl", ids_list, params)
        prompt_lens = [len(ids) for ids in ids_list]
        if req.stream:
            return self.stream_response(self._stream(request_id, req.n, prompt_lens, streams, req.stream_options))
        outputs = await self.collect(request, streams)
        if isinstance(outputs, Response):
            return outputs  # the client left, or a request failed in the engine
        choices = [self._choice(i * req.n + c.index, c, 0, len(c.token_ids))
                   for i, o in enumerate(outputs) for c in o.outputs]
        return JSONResponse({"id": request_id, "object": "text_completion", "created": created(),
                             "model": self.model_name, "choices": choices,
                             "usage": usage(prompt_lens, outputs)})

    @staticmethod
    def _choice(index: int, c: CompletionOutput, start: int, end: int, text: Optional[str] = None,
                text_offset: int = 0) -> dict[str, Any]:
        return {"index": index, "text": c.text if text is None else text,
                "logprobs": completion_logprobs(c, start, end, text_offset),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _stream_choice(self, index: int, c: CompletionOutput, text: str, start: int, end: int,
                       offset: int) -> dict[str, Any]:
        return self._choice(index, c, start, end, text, offset)

    def _stream(self, request_id: str, n: int, prompt_lens: list[int], streams: list,
                options: Optional[StreamOptions]) -> AsyncIterator[bytes]:
        head = {"id": request_id, "object": "text_completion", "created": created(), "model": self.model_name}
        return self.stream_choices(streams, n, head, self._stream_choice, options, prompt_lens)
