"""The llguidance backend (``structured_outputs_backend="guidance"``): an Earley parser over
a lazily built lexer, no per-grammar precomputation, so compiling is fast and any JSON
schema feature llguidance knows is available."""
from __future__ import annotations

from typing import Any

import llguidance as llg
import llguidance.hf
import llguidance.torch

from tandem.structured_output.backend import (CompiledGrammar, GrammarBackend, GrammarCompileError, GrammarSpec,
                                              Matcher, WHAT, one_line)

_FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}


class _GuidanceMatcher(Matcher):
    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept_token(self, token: int) -> bool:
        # try_consume_tokens consumes nothing and returns 0 for a disallowed token, leaving
        # the matcher usable (consume_token would put it into its error state for good).
        return self._m.try_consume_tokens([token]) == 1

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self._m.is_stopped()


class _GuidanceCompiled(CompiledGrammar):
    """A matcher at the start of the grammar: each request gets a copy."""

    def __init__(self, template: Any) -> None:
        self._template = template

    def new_matcher(self) -> Matcher:
        return _GuidanceMatcher(self._template.deep_copy())


class GuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            grammar = llg.grammar_from(_FORMATS[spec.kind], spec.text)  # type: ignore[arg-type]
            matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(f"{WHAT[spec.kind]} does not compile: {one_line(str(e))}") from None
        if matcher.is_error():  # llguidance reports grammar errors this way, not by raising
            raise GrammarCompileError(f"{WHAT[spec.kind]} does not compile: {one_line(matcher.get_error())}")
        return _GuidanceCompiled(matcher)
