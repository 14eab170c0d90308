"""The engine's front half: prompts in, ``RequestOutput``s out, around an ``EngineCore``.

It validates and tokenizes requests, expands ``n > 1`` into child requests that share the
prompt's KV blocks, detokenizes incrementally, applies stop strings (finishing the core
request early), and assembles logprobs. Everything here is host-side text work, so in a
server it runs beside the core loop, never inside a device step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.engine_core import EngineCore
from tandem.types.engine_output import EngineCoreOutput
from tandem.types.request import Request
from tandem.types.runner_output import SampledLogprobs
from tandem.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestError(RuntimeError):
    """Some requests failed inside the engine; ``outputs`` holds every request's result."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


@dataclass
class _Child:
    index: int
    core_id: str
    params: SamplingParams
    detok: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[PositionLogprobs]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    sent_text_len: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[_Child]
    pending: list[Request]  # children held back until the first one has computed the prompt
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig, model_config: Optional[ModelConfig] = None) -> None:
        from tandem.models.loader import load_tokenizer
        from tandem.models.model_config import resolve_model_config

        self.config = config
        self.model_config = model_config or resolve_model_config(config)
        self.max_model_len = self.model_config.max_model_len
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        self.tokenizer = load_tokenizer(self.model_config.tokenizer)
        self.core = EngineCore(config, self.model_config)
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, _Child]] = {}

    # -- input ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
    ) -> None:
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use by a running request")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "it must leave room for at least one generated token"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.config.max_logprobs:
                raise ValueError(f"{name}={v} exceeds max_logprobs={self.config.max_logprobs}")
        if not self.config.enable_chunked_prefill and len(token_ids) > self.config.max_num_batched_tokens:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) with chunked prefill off")
        room = self.max_model_len - len(token_ids)
        max_tokens = min(params.max_tokens or room, room)

        children: list[_Child] = []
        core_reqs: list[Request] = []
        for i in range(params.n):
            core_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = None
            if params.seed is not None:
                seed = params.seed if params.n == 1 else params.seed * 1_000_003 + i
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                )
            children.append(_Child(i, core_id, params, detok, logprobs=[] if params.logprobs is not None else None))
            core_reqs.append(Request(core_id, token_ids, params, self.eos_token_ids, max_tokens, seed))
        # n > 1: run the first child alone until its prompt blocks are cached, then the rest
        # hit those blocks instead of computing the prompt n times.
        share = params.n > 1 and self.config.enable_prefix_caching
        first, rest = (core_reqs[:1], core_reqs[1:]) if share else (core_reqs, [])
        for r in first:
            self.core.add_request(r)
        parent = _Parent(request_id, text, token_ids, children, rest,
                         prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self._parents[request_id] = parent
        for c in children:
            self._child_of[c.core_id] = (parent, c)

    def abort_request(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return  # unknown or finished: no-op
        self.core.abort_requests([c.core_id for c in parent.children])
        for c in parent.children:
            self._child_of.pop(c.core_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or self.core.has_work()

    # -- output --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        touched: dict[str, _Parent] = {}
        for out in self.core.step():
            entry = self._child_of.get(out.req_id)
            if entry is None:
                continue  # aborted by the caller after the step was launched
            parent, child = entry
            self._apply(parent, child, out)
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            results.append(self._make_output(parent))
            if parent.finished:
                self._parents.pop(parent.request_id, None)
                for c in parent.children:
                    self._child_of.pop(c.core_id, None)
        return results

    def _apply(self, parent: _Parent, child: _Child, out: EngineCoreOutput) -> None:
        if child.finish_reason is not None:
            return
        if out.error is not None:
            parent.error = out.error
        if out.prompt_logprobs and parent.prompt_logprobs is not None and child.index == 0:
            n = child.params.prompt_logprobs or 0
            parent.prompt_logprobs.extend(self._convert_logprobs(lp, n) for lp in out.prompt_logprobs)
        if child.index == 0 and out.new_token_ids:
            parent.num_cached_tokens = out.num_cached_tokens
            if parent.pending:  # the prompt is computed and cached now: release the siblings
                for r in parent.pending:
                    self.core.add_request(r)
                parent.pending = []
        for k, tok in enumerate(out.new_token_ids):
            child.token_ids.append(tok)
            if child.logprobs is not None and k < len(out.logprobs):
                child.logprobs.append(self._convert_logprobs(out.logprobs[k], child.params.logprobs or 0))
            if child.detok is not None:
                matched = child.detok.update([tok])
                if matched is not None:
                    # Stop string: finish here and tell the core to stop the request.
                    child.finish_reason, child.stop_reason = "stop", matched
                    keep = len(child.detok.output_token_ids)
                    del child.token_ids[keep:]
                    if child.logprobs is not None:
                        del child.logprobs[keep:]
                    if out.finish_reason is None:
                        self.core.abort_requests([child.core_id])
                    return
        if out.finish_reason is not None:
            child.finish_reason = out.finish_reason
            child.stop_reason = out.stop_reason
            if parent.pending and out.finish_reason == "error":
                parent.pending = []
                for c in parent.children[1:]:
                    c.finish_reason = "error"

    def _convert_logprobs(self, lp: SampledLogprobs, num: int) -> PositionLogprobs:
        """The chosen token plus this request's own top-``num`` (the batch computed the max)."""
        d: PositionLogprobs = {}
        for j, (tid, val) in enumerate(zip(lp.token_ids[: num + 1], lp.logprobs[: num + 1])):
            rank = lp.rank if j == 0 else j
            if tid not in d:
                d[tid] = Logprob(val, rank, self.tokenizer.decode([tid]))
        return d

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outs = []
        for c in parent.children:
            text = c.detok.output_text if c.detok is not None else ""
            outs.append(CompletionOutput(c.index, text, list(c.token_ids),
                                         None if c.logprobs is None else list(c.logprobs),
                                         c.finish_reason, c.stop_reason))
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             parent.prompt_logprobs, outs, parent.finished, parent.num_cached_tokens,
                             parent.error)

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
