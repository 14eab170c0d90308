"""The synchronous engine: prompts in, ``RequestOutput``s out, around an in-process ``EngineCore``.

``add_request`` validates and tokenizes through the ``InputProcessor``; ``step`` runs one
core step and hands its outputs to the ``OutputProcessor`` (detokenize, stop strings,
logprobs, ``n > 1``), then tells the core what that implied (stop-string aborts, released
siblings). The offline ``LLM`` drives it; the server uses ``AsyncLLM``, which shares both
processors but runs the core in its own process.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.input_processor import InputProcessor
from tandem.engine.output_processor import OutputProcessor
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestError(RuntimeError):
    """Some requests failed inside the engine; ``outputs`` holds every request's result."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class LLMEngine:
    def __init__(self, config: EngineConfig, model_config: Optional[ModelConfig] = None) -> None:
        from tandem.tokenizer import load_tokenizer
        from tandem.models.model_config import resolve_model_config

        self.config = config
        self.model_config = model_config or resolve_model_config(config)
        self.max_model_len = self.model_config.max_model_len
        self.tokenizer = load_tokenizer(self.model_config.tokenizer)
        self.core = EngineCore(config, self.model_config)
        self.input_processor = InputProcessor(config, self.model_config.info, self.tokenizer)
        self.input_processor.num_kv_blocks = self.core.kv_cache.num_blocks
        # Nobody reads the per-step stats offline (the server's front end does, for /metrics).
        self.output_processor = OutputProcessor(self.tokenizer, config.enable_prefix_caching, log_stats=False)

    # -- input ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.input_processor.apply_chat_template(messages)

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use by a running request")
        req = self.input_processor.process(request_id, prompt, params)
        for r in self.output_processor.add_request(req):
            self.core.add_request(r.to_request())

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile ``params``' constraint now (the engine core caches it for the request) and
        raise ``ValueError`` with the compiler's message if it does not compile: what the
        offline ``LLM`` does before it adds a request, so a bad schema rejects the call."""
        if params.structured_outputs is None:
            return
        grammar = self.core.structured.grammar_for(params.structured_outputs)
        self.core.structured.wait_for_any([grammar], timeout_s=None)
        if grammar.is_ready and grammar.error is not None:
            raise ValueError(grammar.error)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; unknown or finished ids are a no-op."""
        self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.core.has_work()

    def has_only_leftover_steps(self) -> bool:
        """Every request has ended but steps are still in flight (async scheduling launched
        one past a finish, or an interrupt left one queued): the core still has work for
        nobody."""
        return self.core.has_work() and not self.output_processor.has_unfinished_requests()

    # -- output --------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One core step; ``final_only`` returns outputs of finished requests only."""
        processed = self.output_processor.process_outputs(self.core.step(), final_only)
        if processed.core_aborts:
            self.core.abort_requests(processed.core_aborts)
        for r in processed.core_adds:
            self.core.add_request(r.to_request())
        return processed.request_outputs

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
