"""``POST /v1/completions``: prompts (texts or token ids) in, choices out, streamed or not.

``echo`` puts the prompt in front of each choice's text and, with ``logprobs``, the prompt
tokens' logprobs in front of the generated ones (``null`` for the first prompt token, which
has no context): OpenAI's legacy log-likelihood interface, which lm-eval's
``local-completions`` uses. ``max_tokens: 0`` is allowed with echo and returns only the
prompt; the engine still samples one token to finish the request (as vLLM does), which the
response leaves out and ``usage.completion_tokens`` counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tandem.entrypoints.openai.errors import bad_request
from tandem.entrypoints.openai.logprobs import legacy_logprobs, prompt_logprobs_json
from tandem.entrypoints.openai.protocol import CompletionRequest
from tandem.entrypoints.openai.serving import ChoiceBuilder, OpenAIServing, created, usage
from tandem.entrypoints.openai.structured import structured_outputs_of
from tandem.outputs import CompletionOutput, PositionLogprobs, RequestOutput

# Completions default to 16 tokens (OpenAI's default for this endpoint).
_DEFAULT_MAX_TOKENS = 16


@dataclass
class _Shape:
    """How one request's choices are rendered."""

    req: CompletionRequest
    prompt_texts: list[str]  # per prompt, what echo prepends
    n: int

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt is the whole answer."""
        return self.req.echo and self.req.max_tokens == 0


class CompletionServing(OpenAIServing):
    async def create(self, req: CompletionRequest, request: Request) -> Response:
        prompts = req.prompt
        self.check_common(req, len(prompts))
        self._check_echo(req)
        ids_list = [self.engine.tokenize(p, req.add_special_tokens) if isinstance(p, str) else list(p)
                    for p in prompts]
        shape = _Shape(req, [], req.n)
        # Echo with logprobs scores the prompt too: its positions get as many alternatives as the output's.
        prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None or not req.echo else req.logprobs
        constraint, constraint_param = structured_outputs_of(req)
        params = [self.sampling_params(req, self.max_tokens(1 if shape.prompt_only else req.max_tokens, len(ids),
                                                            _DEFAULT_MAX_TOKENS),
                                       req.logprobs, prompt_logprobs=prompt_logprobs, structured_outputs=constraint)
                  for ids in ids_list]
        request_id, streams = self.start("cmpl", ids_list, params)  # the prompts are valid from here on
        if req.echo:
            shape.prompt_texts = [p if isinstance(p, str) else self.engine.detokenize(p) for p in prompts]
        prompt_lens = [len(ids) for ids in ids_list]
        head = {"id": request_id, "object": "text_completion", "created": created(), "model": self.model_name}
        if req.stream:
            refused = await self.compiled(request, streams, constraint_param) if constraint is not None else None
            if refused is not None:
                return refused
            return self.stream_response(self.stream_choices(streams, req.n, head, self._stream_choice(shape),
                                                            req.stream_options, prompt_lens))
        outputs = await self.collect(request, streams, constraint_param)
        if isinstance(outputs, Response):
            return outputs  # the client left, or a request failed in the engine
        choices = []
        for i, o in enumerate(outputs):
            for c in o.outputs:
                choice = self._choice(shape, o, i * req.n + c.index, c, c.text, 0, len(c.token_ids), 0, True)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)
                choices.append(choice)
        return JSONResponse({**head, "choices": choices, "usage": usage(prompt_lens, outputs)})

    @staticmethod
    def _check_echo(req: CompletionRequest) -> None:
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be at least 1; 0 is allowed only with echo (to score the prompt)",
                              "max_tokens")
        if req.max_tokens == 0 and req.min_tokens > 0:
            raise bad_request("min_tokens must be 0 when max_tokens is 0", "min_tokens")
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("prompt_logprobs are not available when stream is true (use echo with logprobs)",
                              "prompt_logprobs")

    def _choice(self, shape: _Shape, out: RequestOutput, index: int, c: CompletionOutput, text: str, start: int,
                end: int, text_offset: int, first: bool) -> dict[str, Any]:
        """Choice ``index``'s tokens ``start:end`` (and ``text``), after the prompt if this is the
        first piece of an echoed choice."""
        token_ids: list[int] = c.token_ids[start:end]
        positions: list[Optional[PositionLogprobs]] = list(c.logprobs[start:end]) if c.logprobs is not None else []
        finish_reason, stop_reason = c.finish_reason, c.stop_reason
        if shape.prompt_only:
            text, token_ids, positions = "", [], []
            if finish_reason is not None:
                finish_reason, stop_reason = "length", None
        if shape.req.echo:
            prompt_text = shape.prompt_texts[index // shape.n]
            if first:
                text = prompt_text + text
                token_ids = out.prompt_token_ids + token_ids
                positions = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + positions
            else:
                text_offset += len(prompt_text)
        logprobs = None
        if c.logprobs is not None:
            logprobs = legacy_logprobs(token_ids, positions, text_offset, lambda t: self.engine.detokenize([t]))
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def _stream_choice(self, shape: _Shape) -> ChoiceBuilder:
        started: set[int] = set()

        def choice(out: RequestOutput, index: int, c: CompletionOutput, text: str, start: int, end: int,
                   offset: int) -> dict[str, Any]:
            first = index not in started
            started.add(index)
            return self._choice(shape, out, index, c, text, start, end, offset, first)

        return choice
