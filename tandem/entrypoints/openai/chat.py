"""``POST /v1/chat/completions``: messages through the chat template, choices out, streamed or not."""
from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.entrypoints.openai.errors import bad_request
from tandem.entrypoints.openai.logprobs import clamp, prompt_logprobs_json
from tandem.entrypoints.openai.protocol import ChatCompletionRequest, StreamOptions
from tandem.entrypoints.openai.serving import ChoiceBuilder, OpenAIServing, created, sse, usage
from tandem.outputs import CompletionOutput, Logprob, RequestOutput


def _entry(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": clamp(lp.logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(c: CompletionOutput, start: int, end: int, top: int) -> Optional[dict[str, Any]]:
    """``{"content": [...]}`` for tokens ``start:end``: each chosen token and its ``top`` alternatives."""
    if c.logprobs is None:
        return None
    content = []
    for tid, pos in zip(c.token_ids[start:end], c.logprobs[start:end]):
        ranked = sorted(pos.values(), key=lambda lp: lp.rank)[:top]
        content.append({**_entry(pos[tid]), "top_logprobs": [_entry(lp) for lp in ranked]})
    return {"content": content}


class ChatServing(OpenAIServing):
    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        try:
            return self.engine.apply_chat_template(
                [m.as_template_dict() for m in req.messages], req.add_generation_prompt, self.settings.chat_template)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        except Exception as e:  # a template error (jinja) is the request's or the template's fault
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_common(req, 1)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise bad_request("give max_completion_tokens or max_tokens, not two different values",
                              "max_completion_tokens")
        ids = self.prompt_ids(req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(requested, len(ids), None, param)
        top = req.top_logprobs or 0
        params = self.sampling_params(req, max_tokens, top if req.logprobs else None,
                                      prompt_logprobs=req.prompt_logprobs)
        request_id, streams = self.start("chatcmpl", [ids], [params])
        if req.stream:
            return self.stream_response(self._stream(request_id, req.n, len(ids), streams, req.stream_options,
                                                     top))
        outputs = await self.collect(request, streams)
        if isinstance(outputs, Response):
            return outputs  # the client left, or a request failed in the engine
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c, 0, len(c.token_ids), top),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in outputs[0].outputs]
        body = {"id": request_id, "object": "chat.completion", "created": created(), "model": self.model_name,
                "choices": choices, "usage": usage([len(ids)], outputs)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(outputs[0].prompt_logprobs)  # vLLM's place for them
        return JSONResponse(body)

    @staticmethod
    def _stream_choice(top: int) -> ChoiceBuilder:
        def choice(_: RequestOutput, index: int, c: CompletionOutput, text: str, start: int, end: int,
                   offset: int) -> dict[str, Any]:
            return {"index": index, "delta": {"content": text} if text else {},
                    "logprobs": chat_logprobs(c, start, end, top),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        return choice

    def _stream(self, request_id: str, n: int, prompt_len: int, streams: list,
                options: Optional[StreamOptions], top: int) -> AsyncIterator[bytes]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created(), "model": self.model_name}
        role = sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None} for i in range(n)]})
        return self.stream_choices(streams, n, head, self._stream_choice(top), options, [prompt_len], prelude=role)
