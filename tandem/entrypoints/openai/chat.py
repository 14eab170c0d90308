"""``POST /v1/chat/completions``: messages through the chat template, choices out, streamed or not.

Tools and output constraints are decided before the request runs (``tools.ToolPlan``,
``structured.structured_outputs_of``); a constrained streaming request waits for its first
output (its grammar compiled, or it gets a 400) before the response starts. Each choice's text
goes through a tool-call extractor when calls are to be parsed: the same one, piece by piece,
for a stream, so streamed tool-call deltas add up to the non-streamed ``tool_calls``.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.entrypoints.openai.errors import bad_request
from tandem.entrypoints.openai.logprobs import clamp, prompt_logprobs_json
from tandem.entrypoints.openai.protocol import (TEMPLATE_CALL_ARGS, ChatCompletionRequest, ChatMessage,
                                                ChatTemplateFields, StreamOptions)
from tandem.entrypoints.openai.serving import ChoiceBuilder, OpenAIServing, created, sse, usage
from tandem.entrypoints.openai.structured import structured_outputs_of
from tandem.entrypoints.openai.tool_parsers import ToolCallExtractor
from tandem.entrypoints.openai.tool_parsers import collect as collect_tool_calls
from tandem.entrypoints.openai.tools import ToolPlan
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


def _generation_prompt(req: ChatTemplateFields) -> bool:
    """``add_generation_prompt``, whose default depends on ``continue_final_message`` (as in vLLM)."""
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request("give continue_final_message or add_generation_prompt, not both: a continued "
                              "message cannot be followed by a new turn", "continue_final_message")
        return False
    return True if req.add_generation_prompt is None else req.add_generation_prompt


class ChatServing(OpenAIServing):
    PARAM_NAMES = {"prompt": "messages", "logprobs": "top_logprobs"}

    def prompt_ids(self, req: ChatTemplateFields, messages: list[ChatMessage],
                   tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """Token ids of ``messages`` through the chat template, as ``req``'s template fields ask;
        ``tools``: the function definitions the template offers the model (None: no tools)."""
        add_generation_prompt = _generation_prompt(req)
        reserved = sorted(TEMPLATE_CALL_ARGS & (req.chat_template_kwargs or {}).keys())
        if reserved:
            field = reserved[0] in type(req).model_fields
            raise bad_request(f"chat_template_kwargs cannot set {reserved[0]!r}: it is an argument of the template "
                              "call itself" + (f"; give it as the request field '{reserved[0]}'" if field else ""),
                              "chat_template_kwargs")
        try:
            return self.engine.apply_chat_template(
                [m.as_template_dict() for m in messages], add_generation_prompt, self.settings.chat_template,
                continue_final_message=req.continue_final_message, add_special_tokens=bool(req.add_special_tokens),
                documents=req.documents, tools=tools, template_kwargs=req.template_kwargs())
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
        plan = ToolPlan(req, self.settings.tool_call_parser)
        constraint, constraint_param = structured_outputs_of(req)
        if plan.constraint is not None:
            if constraint is not None:
                raise bad_request(f"tool_choice {'required' if plan.named is None else 'naming a function'} "
                                  f"constrains the output already; drop {constraint_param}", constraint_param)
            constraint, constraint_param = plan.constraint, "tools"
        ids = self.prompt_ids(req, req.messages, plan.template_tools)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(requested, len(ids), None, param)
        top = req.top_logprobs or 0
        params = self.sampling_params(req, max_tokens, top if req.logprobs else None,
                                      prompt_logprobs=req.prompt_logprobs, structured_outputs=constraint)
        request_id, streams = self.start("chatcmpl", [ids], [params])
        if req.stream:
            refused = await self.compiled(request, streams, constraint_param) if constraint is not None else None
            if refused is not None:
                return refused
            return self.stream_response(self._stream(request_id, req.n, len(ids), streams, req.stream_options,
                                                     top, plan))
        outputs = await self.collect(request, streams, constraint_param)
        if isinstance(outputs, Response):
            return outputs  # the client left, or a request failed in the engine
        choices = [{"index": c.index, **self._message(c, plan), "logprobs": chat_logprobs(c, 0, len(c.token_ids), top),
                    "stop_reason": c.stop_reason} for c in outputs[0].outputs]
        body = {"id": request_id, "object": "chat.completion", "created": created(), "model": self.model_name,
                "choices": choices, "usage": usage([len(ids)], outputs)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(outputs[0].prompt_logprobs)  # vLLM's place for them
        return JSONResponse(body)

    @staticmethod
    def _message(c: CompletionOutput, plan: ToolPlan) -> dict[str, Any]:
        """``message`` and ``finish_reason`` of a finished choice, its tool calls parsed out."""
        if not plan.parses_tool_calls:
            return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
        content, calls = collect_tool_calls(plan.extractor(), c.text)
        if not calls:
            return {"message": {"role": "assistant", "content": content}, "finish_reason": c.finish_reason}
        return {"message": {"role": "assistant", "content": content if content.strip() else None, "tool_calls": calls},
                "finish_reason": "tool_calls" if c.finish_reason == "stop" else c.finish_reason}

    @staticmethod
    def _stream_choice(top: int, plan: ToolPlan) -> ChoiceBuilder:
        extractors: dict[int, ToolCallExtractor] = {}
        called: set[int] = set()

        def choice(_: RequestOutput, index: int, c: CompletionOutput, text: str, start: int, end: int,
                   offset: int) -> Optional[dict[str, Any]]:
            delta: dict[str, Any] = {}
            finish_reason = c.finish_reason
            if plan.parses_tool_calls:
                ext = extractors.setdefault(index, plan.extractor())
                got = ext.feed(text)
                if finish_reason is not None:
                    got.add(ext.finish())
                text = got.content
                if got.calls:
                    delta["tool_calls"] = [d.as_json() for d in got.calls]
                    called.add(index)
                if finish_reason == "stop" and index in called:
                    finish_reason = "tool_calls"
            if text:
                delta = {"content": text, **delta}
            logprobs = chat_logprobs(c, start, end, top)
            if not delta and finish_reason is None and logprobs is None:
                return None  # text an extractor holds back (a tool call not complete yet)
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason}
        return choice

    def _stream(self, request_id: str, n: int, prompt_len: int, streams: list, options: Optional[StreamOptions],
                top: int, plan: ToolPlan) -> AsyncIterator[bytes]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created(), "model": self.model_name}
        role = sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None} for i in range(n)]})
        return self.stream_choices(streams, n, head, self._stream_choice(top, plan), options, [prompt_len],
                                   prelude=role)
