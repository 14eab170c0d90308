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
                            chat_template: Optional[str] = None, **template_kwargs: Any) -> list[int]:
        """Token ids of a conversation, through the tokenizer's template (or ``chat_template``);
        ``template_kwargs`` reach the template (``tools``, ``continue_final_message``, ...)."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; give one (--chat-template) "
                             "or send plain prompts")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, chat_template=chat_template, **template_kwargs)
        return self.tokenize(text, add_special_tokens=False)

    def process(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> ProcessedRequest:
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(token_ids, params)
        room = self.max_model_len - len(token_ids)
        max_tokens = min(params.max_tokens or room, room)
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

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it must leave room for at least one generated token"
            )
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.config.max_logprobs:
                raise ValueError(f"{name}={v} exceeds max_logprobs={self.config.max_logprobs}")
        if not self.config.enable_chunked_prefill and len(token_ids) > self.config.max_num_batched_tokens:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) with chunked prefill off")
