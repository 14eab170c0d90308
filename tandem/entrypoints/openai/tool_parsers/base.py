"""What every tool-call extractor shares: the pieces it hands out and how they add up.

An extractor reads one choice's text as it is generated (``feed``, then ``finish``) and
splits it into content and tool calls. It hands out pieces: content text, and tool-call
deltas in OpenAI's streaming shape (the first delta of a call carries its id and name, the
later ones fragments of its arguments). A streamed response sends the pieces as they come;
a non-streamed one feeds the whole text and adds the pieces up (``collect``). Extractors are
written so that the pieces add up to the same calls however the text is cut, which is why a
streamed answer reassembles to exactly the non-streamed one.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """A piece of tool call ``index``: its id and name (first piece), then argument text."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""

    def as_json(self) -> dict[str, Any]:
        """OpenAI's ``delta.tool_calls[]`` entry."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        if self.arguments or self.name is not None:
            function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class Extracted:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: "Extracted") -> "Extracted":
        self.content += other.content
        self.calls += other.calls
        return self


class ToolCallExtractor(ABC):
    """Splits one choice's text into content and tool calls, piece by piece."""

    @abstractmethod
    def feed(self, text: str) -> Extracted:
        """The pieces that ``text`` (the next part of the output) completes."""

    def finish(self) -> Extracted:
        """The pieces held back until the end of the output (none by default)."""
        return Extracted()


def merge_calls(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """Whole calls (OpenAI's ``message.tool_calls``) from their deltas."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        if d.id is not None:
            call["id"] = d.id
        if d.name is not None:
            call["function"]["name"] = d.name
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def collect(extractor: ToolCallExtractor, text: str) -> tuple[str, list[dict[str, Any]]]:
    """The content and whole tool calls of a complete output."""
    got = extractor.feed(text).add(extractor.finish())
    return got.content, merge_calls(got.calls)
