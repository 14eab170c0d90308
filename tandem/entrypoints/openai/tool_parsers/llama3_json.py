"""``--tool-call-parser llama3_json``: Llama 3.1/3.2's JSON tool calls: an output that starts
with ``{`` (or ``<|python_tag|>``) is one or more ``{"name": ..., "parameters": {...}}``
objects separated by ``;``; any other output is content.

The decision waits for the first non-blank characters; a tool-call output is handed out at
the end, when it can be parsed whole (an output that then does not parse is content).
"""
from __future__ import annotations

import json
from typing import Optional

from tandem.entrypoints.openai.tool_parsers.base import Extracted, ToolCallDelta, ToolCallExtractor, new_call_id
from tandem.entrypoints.openai.tool_parsers.hermes import parse_call

PYTHON_TAG = "<|python_tag|>"


def parse_calls(text: str) -> Optional[list[tuple[str, str]]]:
    """The calls of a ``{...}; {...}`` text, or None if it is not one."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos = 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except ValueError:
            return None
        call = parse_call(body[pos:end], keys=("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return calls or None


class Llama3JsonToolParser(ToolCallExtractor):
    def __init__(self) -> None:
        self.buffer = ""
        self.mode = ""  # "" (undecided), "content" or "calls"

    def feed(self, text: str) -> Extracted:
        if self.mode == "content":
            return Extracted(content=text)
        self.buffer += text
        head = self.buffer.lstrip()
        if self.mode == "" and head:
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.mode = "calls"
            elif not PYTHON_TAG.startswith(head):
                self.mode = "content"
                out, self.buffer = Extracted(content=self.buffer), ""
                return out
        return Extracted()

    def finish(self) -> Extracted:
        text, self.buffer = self.buffer, ""
        calls = parse_calls(text) if self.mode == "calls" else None
        if calls is None:
            return Extracted(content=text)
        return Extracted(calls=[ToolCallDelta(i, new_call_id(), name, args) for i, (name, args) in enumerate(calls)])
