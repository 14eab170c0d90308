"""The xgrammar backend (the default, as in vLLM): compiled grammars with token masks
precomputed per grammar state, a C++ matcher per request."""
from __future__ import annotations

import threading
from typing import Any

import xgrammar as xgr

from tandem.structured_output.backend import (CompiledGrammar, GrammarBackend, GrammarCompileError, GrammarSpec,
                                              Matcher, WHAT, one_line)


def _ebnf_literal(s: str) -> str:
    """``s`` as an EBNF string literal: quotes, backslashes and control characters escaped."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices``."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def is_ebnf(grammar: str) -> bool:
    """GBNF/EBNF rules are written ``name ::= ...``; anything else is taken as Lark."""
    return "::=" in grammar


class _XGrammarMatcher(Matcher):
    # ``native``: the matcher's native object, what the batch calls take (read once here:
    # xgrammar's ``_handle`` is a property, and the batch calls run while another thread,
    # the engine's, waits for the GIL).
    __slots__ = ("_m", "native")

    def __init__(self, compiled: Any) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self.native = self._m._handle

    def accept_token(self, token: int) -> bool:
        return self._m.accept_token(token)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class _XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def new_matcher(self) -> Matcher:
        return _XGrammarMatcher(self._compiled)


# A share of a step's bitmask is filled by one native call on the calling thread. xgrammar's
# own thread pool ("auto": half the cores) made every section of the engine's step slower
# on a 16-core GPU host (H100, 256 constrained rows: fill 2.7 ms on 8 threads against
# 1.05 ms on one, the whole step 8.4 ms against 5.0), and a served engine shares the host
# with its API servers. The manager runs the calls on its fill threads, off the engine
# thread, a share of the rows each.
NATIVE_FILL_THREADS = 1
# The native batch calls (xgrammar 0.2.x), on the matchers' native objects: the accept
# without the public wrapper's conversion of every result to a Python bool
# (``XGrammarBackend.accept_tokens``), the fill without its pass over the matchers.
_batch_accept = xgr.matcher._core.BatchGrammarMatcher.batch_accept_token
_NativeBatchMatcher = xgr.matcher._core.BatchGrammarMatcher


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # tandem keeps its own cache of compiled grammars (by constraint); xgrammar's would
        # only hold the same ones a second time.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.native_fill_threads = NATIVE_FILL_THREADS
        self._local = threading.local()  # a BatchGrammarMatcher per fill thread

    def accept_tokens(self, matchers: list[Matcher], tokens: list[int]) -> list[bool]:
        # One native call for the batch. Its result is an FFI array whose conversion to
        # Python bools costs more than the call saves, so it is searched natively for a
        # refusal (``0 in``: ArrayContains) and converted only when there is one, which the
        # bitmask makes rare. 256 matchers on the CPU machine: 0.11 ms, against 0.22 ms for a
        # call per matcher through xgrammar's wrapper (0.17 ms on its handles).
        if len(matchers) < 2:
            return [m._m.accept_token(t) for m, t in zip(matchers, tokens)]  # type: ignore[attr-defined]
        result = _batch_accept([m.native for m in matchers], tokens, False)  # type: ignore[attr-defined]
        if 0 not in result:  # its elements are ints (0 refused, 1 accepted): False would match none
            return [True] * len(matchers)
        return [bool(x) for x in result]

    def fill_bitmasks(self, matchers: list[Matcher], bitmask: Any, rows: list[int]) -> None:
        if len(matchers) == 1:
            super().fill_bitmasks(matchers, bitmask, rows)
            return
        batch = getattr(self._local, "batch", None)
        if batch is None:
            batch = self._local.batch = _NativeBatchMatcher(self.native_fill_threads)  # type: ignore[call-arg]
        batch.batch_fill_next_token_bitmask([m.native for m in matchers], bitmask, rows, False)  # type: ignore[attr-defined]

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        c = self._compiler
        try:
            if spec.kind in ("json", "json_object"):
                # Compact JSON (no free whitespace): a small model otherwise tends to emit
                # whitespace until max_tokens where a value should follow.
                compiled = c.compile_json_schema(spec.text, any_whitespace=False)
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.text)
            elif spec.kind == "choice":
                compiled = c.compile_grammar(choice_grammar(spec.choices))
            elif is_ebnf(spec.text):
                compiled = c.compile_grammar(spec.text)
            else:
                compiled = c.compile_lark(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(f"{WHAT[spec.kind]} does not compile: {one_line(str(e))}") from None
        return _XGrammarCompiled(compiled)
