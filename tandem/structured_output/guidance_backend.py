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

_FORMATS = {"regex": "regex", "choice": "choice", "grammar": "grammar"}


# Compact JSON with one space after "," and ":" (as the xgrammar backend writes it) unless the
# schema's own "x-guidance" options say otherwise: free whitespace lets a small model emit
# newlines until max_tokens.
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _GuidanceMatcher(Matcher):
    """llguidance's matcher "stops" once only a stop token may follow, and then consumes no
    token (a stop token neither), so the end of the grammar is tracked here: it has ended
    once a stop token was accepted, as xgrammar's matcher says."""

    __slots__ = ("_m", "_stop", "_ended")

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self._stop = stop_token_ids
        self._ended = False

    def accept_token(self, token: int) -> bool:
        if self._m.is_stopped():
            ok = token in self._stop
        else:
            # try_consume_tokens consumes nothing and returns 0 for a disallowed token,
            # leaving the matcher usable (consume_token would put it in its error state).
            ok = self._m.try_consume_tokens([token]) == 1
        self._ended = ok and token in self._stop
        return ok

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self._ended

    def draft_masks(self, drafts: list[int], bitmask: Any, first_row: int) -> int:
        """On a copy (llguidance consumes no token for a stop token once stopped, so a
        rollback count would not match what was accepted)."""
        return Matcher.draft_masks(_GuidanceMatcher(self._m.deep_copy(), self._stop), drafts, bitmask, first_row)

    def rollback(self, num_tokens: int) -> None:
        pass  # only ever called on the throw-away copy of draft_masks


class _GuidanceCompiled(CompiledGrammar):
    """A matcher at the start of the grammar: each request gets a copy."""

    def __init__(self, template: Any, stop_token_ids: frozenset[int]) -> None:
        self._template = template
        self._stop = stop_token_ids

    def new_matcher(self) -> Matcher:
        return _GuidanceMatcher(self._template.deep_copy(), self._stop)


class GuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)
        self._stop = frozenset(stop_token_ids)
        self._executor = llg.LLExecutor()  # llguidance's thread pool for a step's rows

    def fill_bitmasks(self, matchers: list[Matcher], bitmask: Any, rows: list[int]) -> None:
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(m._m, row) for m, row in zip(matchers, rows)], bitmask)  # type: ignore[attr-defined]

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            if spec.kind in ("json", "json_object"):
                grammar = llg.LLMatcher.grammar_from_json_schema(spec.text, defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
            else:
                grammar = llg.grammar_from(_FORMATS[spec.kind], spec.text)  # type: ignore[arg-type]
            matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(f"{WHAT[spec.kind]} does not compile: {one_line(str(e))}") from None
        if matcher.is_error():  # llguidance reports grammar errors this way, not by raising
            raise GrammarCompileError(f"{WHAT[spec.kind]} does not compile: {one_line(matcher.get_error())}")
        return _GuidanceCompiled(matcher, self._stop)
