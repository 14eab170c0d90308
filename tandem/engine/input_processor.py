"""Prompts in, validated core requests out: tokenize, check limits, expand ``n > 1``.

Everything a request can be refused for is checked here, before it reaches the engine
core, so a bad request fails in the caller's thread with a ``ValueError`` that names the
problem, and the core (possibly another process) never sees it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from tandem.config import EngineConfig, ModelInfo
from tandem.engine.messages import EngineCoreRequest
from tandem.sampling_params import SamplingParams
from tandem.validation import ParamError

# The child seed of a seeded n > 1 request: distinct per child, fixed per (seed, index).
_CHILD_SEED_STRIDE = 1_000_003


@dataclass
class ProcessedRequest:
    """A validated request: its prompt and the core requests of its children."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[EngineCoreRequest]


class ContextLengthError(ParamError):
    """The prompt leaves no room for an output token, or the prompt plus an explicitly
    requested output (``requested``) exceed the context (``limit``). The numbers travel
    with it, so a server can word the refusal its own way (OpenAI's context_length_exceeded)."""

    def __init__(self, limit: int, num_prompt_tokens: int, requested: Optional[int] = None) -> None:
        self.limit = limit
        self.num_prompt_tokens = num_prompt_tokens
        self.requested = requested
        if requested is None:
            super().__init__(f"the prompt has {num_prompt_tokens} tokens, but max_model_len is {limit}: it must "
                             "leave room for at least one generated token", "prompt")
        else:
            super().__init__(f"the prompt ({num_prompt_tokens} tokens) and max_tokens ({requested}) exceed "
                             f"max_model_len ({limit})", "max_tokens")


def output_budget(limit: int, num_prompt_tokens: int, requested: Optional[int] = None,
                  default: Optional[int] = None) -> int:
    """How many tokens a request may generate in a context of ``limit`` tokens: the one place
    ``max_tokens`` is checked against the context.

    A prompt that leaves no room is refused. An explicit ``requested`` budget must fit
    (OpenAI refuses one that does not); a ``default`` is cut to the room left (the offline
    engine's ``max_tokens``, like vLLM's); with neither, the budget is all the room left.
    Raises ``ContextLengthError``."""
    room = limit - num_prompt_tokens
    if room < 1:
        raise ContextLengthError(limit, num_prompt_tokens)
    if requested is not None:
        if requested > room:
            raise ContextLengthError(limit, num_prompt_tokens, requested)
        return requested
    return room if default is None else min(default, room)


def child_request_id(request_id: str, n: int, index: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class InputProcessor:
    def __init__(self, config: EngineConfig, model: ModelInfo, tokenizer: Any) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = model.max_model_len
        self.eos_token_ids = list(model.eos_token_ids)
        # Set once the core reports its cache size: a request that could never fit is refused
        # here instead of failing inside the core.
        self.num_kv_blocks: Optional[int] = None

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, *, continue_final_message: bool = False,
                            add_special_tokens: bool = False, documents: Optional[list[dict[str, str]]] = None,
                            tools: Optional[list[dict[str, Any]]] = None,
                            template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
        """Token ids of a conversation, through the tokenizer's template (or ``chat_template``).

        ``continue_final_message``: the prompt ends inside the last message (no end-of-turn,
        no generation prompt), so the model continues it. ``add_special_tokens``: tokens such
        as BOS are added on top of what the template writes (templates usually write them).
        ``tools`` (OpenAI's function definitions), ``documents`` and ``template_kwargs`` become
        variables of the template, which may use or ignore them."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; give one (--chat-template) "
                             "or send plain prompts")
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, documents=documents, tokenize=False, chat_template=chat_template, **(template_kwargs or {}))
        return self.tokenize(text, add_special_tokens=add_special_tokens)

    def process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> ProcessedRequest:
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self._check_prompt(token_ids, params)
        if self.num_kv_blocks is not None:
            bs = self.config.block_size
            need = (len(token_ids) + max_tokens + bs - 1) // bs
            if need > self.num_kv_blocks:
                raise ValueError(f"the request needs up to {need} KV blocks ({len(token_ids)} prompt + {max_tokens} "
                                 f"output tokens) but the cache has only {self.num_kv_blocks}; lower max_tokens")
        core_reqs = []
        for i in range(params.n):
            seed = params.seed
            if seed is not None and params.n > 1:
                # Wrapped into the signed 64-bit range the sampler's seeds live in.
                seed = (seed * _CHILD_SEED_STRIDE + i + 2**63) % 2**64 - 2**63
            core_reqs.append(EngineCoreRequest(child_request_id(request_id, params.n, i), token_ids, params,
                                               self.eos_token_ids, max_tokens, seed))
        return ProcessedRequest(request_id, text, token_ids, params, core_reqs)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """Refuse what cannot run (``ParamError`` naming the parameter); returns the output budget."""
        if not token_ids:
            raise ParamError("the prompt is empty: give at least one token", "prompt")
        vocab = self.model.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in token_ids):
            raise ParamError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        max_tokens = output_budget(self.max_model_len, len(token_ids), default=params.max_tokens)
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ParamError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}",
                             "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.config.max_logprobs:
                raise ParamError(f"{name}={v} exceeds max_logprobs={self.config.max_logprobs}", name)
        budget = self.model.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and len(token_ids) > budget:
            raise ParamError(f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                             f"({budget}) with chunked prefill off", "prompt")
        return max_tokens
