"""The grammar backend interface: compile a constraint once, match it per request.

A backend turns a ``GrammarSpec`` (one constraint of ``StructuredOutputsParams``, in a
hashable form) into a ``CompiledGrammar``, which is shared by every request with that
constraint; each request then gets its own ``Matcher``: advanced by the tokens the
request receives, asked for the bitmask of the tokens allowed next.

Backends import their library (which imports torch) only when created, so this module and
the package import cheaply and never from an API-server process.
"""
from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from tandem.sampling_params import StructuredOutputsParams

GrammarKind = Literal["json", "regex", "choice", "grammar", "json_object"]

# A JSON object, any: what ``json_object`` (OpenAI's ``{"type": "json_object"}``) means.
ANY_OBJECT_SCHEMA = '{"type": "object"}'


# How a compile error names the constraint.
WHAT = {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
        "choice": "the choice", "grammar": "the grammar"}


class GrammarCompileError(ValueError):
    """The constraint does not compile: the request's fault, with the compiler's message."""


class GrammarBackendError(RuntimeError):
    """The backend could not be built for this model (the engine's problem, not a request's)."""


def _json_text(schema: Any) -> str:
    """A schema object as compact JSON text, keys in their order. msgspec's encoder, not
    ``json.dumps``: this runs on the engine thread for every constrained request it adds
    (8x faster on the bench's schema); what it cannot encode gets ``json.dumps``'s error."""
    try:
        return msgspec.json.encode(schema).decode()
    except (TypeError, msgspec.EncodeError):
        return json.dumps(schema)


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint, hashable: the key of the compiled-grammar cache.

    ``text`` is the JSON schema as JSON text (property order kept: it is the order the
    output follows), the regex, the grammar, or the JSON list of choices.
    """

    kind: GrammarKind
    text: str

    @classmethod
    def of(cls, params: StructuredOutputsParams) -> "GrammarSpec":
        if params.json is not None:
            return cls("json", params.json if isinstance(params.json, str) else _json_text(params.json))
        if params.regex is not None:
            return cls("regex", params.regex)
        if params.choice is not None:
            return cls("choice", json.dumps(params.choice))
        if params.grammar is not None:
            return cls("grammar", params.grammar)
        return cls("json_object", ANY_OBJECT_SCHEMA)

    @property
    def choices(self) -> list[str]:
        return list(json.loads(self.text))


class Matcher(abc.ABC):
    """One request's position in its grammar. Used by the engine thread only."""

    @abc.abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) when the grammar does not allow it."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 bitmask tensor."""

    @property
    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (a stop token was accepted): nothing more is allowed."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        raise NotImplementedError

    def draft_masks(self, drafts: list[int], bitmask: Any, first_row: int) -> int:
        """Speculative decoding: rows ``first_row + j`` get the tokens allowed after
        ``drafts[:j]``, for ``j`` up to the number of drafts the grammar accepts (returned;
        the rest are cut: they can never be emitted). The matcher ends as it began."""
        self.fill_bitmask(bitmask, first_row)
        valid = 0
        for d in drafts:
            if self.is_terminated or not self.accept_token(d):
                break
            valid += 1
            if not self.is_terminated:
                self.fill_bitmask(bitmask, first_row + valid)
        if valid:
            self.rollback(valid)
        return valid


class CompiledGrammar(abc.ABC):
    """A compiled constraint, shared by every request that has it."""

    @abc.abstractmethod
    def new_matcher(self) -> Matcher:
        """A matcher at the start of the grammar."""


class GrammarBackend(abc.ABC):
    """Compiles constraints for one tokenizer and vocabulary. ``compile`` runs in worker
    threads (several at once), never on the engine's step loop."""

    @abc.abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec``; raises ``GrammarCompileError`` with the compiler's message."""

    def accept_tokens(self, matchers: list[Matcher], tokens: list[int]) -> list[bool]:
        """``accept_token`` for each matcher (none of them terminated) and its token (a
        step's worth; a backend may take the batch in one call)."""
        return [m.accept_token(t) for m, t in zip(matchers, tokens)]

    def fill_bitmasks(self, matchers: list[Matcher], bitmask: Any, rows: list[int]) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` for ``matchers[i]`` (a whole step's worth; a
        backend may spread the rows over threads)."""
        for m, row in zip(matchers, rows):
            m.fill_bitmask(bitmask, row)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def one_line(message: str) -> str:
    """A compiler's message as one line: without a C++ log prefix (``[12:00:00] file.cc:42:``),
    whitespace runs folded, cut to a readable length."""
    text = " ".join(_LOG_PREFIX.sub("", message.strip()).split())
    return text if len(text) <= 500 else text[:500] + " ..."


def create_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
    """The backend ``name`` names (``EngineConfig.structured_outputs_backend``), built for
    ``tokenizer`` (a Hugging Face fast tokenizer) and the model's ``vocab_size`` (which may
    exceed the tokenizer's: the extra ids are never allowed)."""
    if name == "xgrammar":
        from tandem.structured_output.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "guidance":
        from tandem.structured_output.guidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"unknown structured outputs backend {name!r} (xgrammar or guidance)")
