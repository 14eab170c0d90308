"""``--tool-call-parser hermes``: calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Hermes 2 Pro, Qwen 2.5 and others), content around them.

Content streams as it comes, except a tail that could be the start of ``<tool_call>``; a call
is handed out whole once its closing tag arrives (or the output ends). A call whose JSON does
not parse stays content, tags included. Whitespace after a call is held back and dropped if
nothing else follows, so the content is the same however the text is cut.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from tandem.entrypoints.openai.tool_parsers.base import Extracted, ToolCallDelta, ToolCallExtractor, new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_call(text: str, keys: tuple[str, ...] = ("arguments",)) -> Optional[tuple[str, str]]:
    """(name, arguments as JSON text) of a ``{"name": ..., "arguments": {...}}`` object, or None."""
    try:
        obj: Any = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser(ToolCallExtractor):
    def __init__(self) -> None:
        self.buffer = ""  # text not yet handed out
        self.in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> Extracted:
        self.buffer += text
        out = Extracted()
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return out
                self._call(self.buffer[:end], out, closed=True)
                self.buffer, self.in_call = self.buffer[end + len(CLOSE):], False
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                out.content += self._content(self.buffer[:start], final=True)
                self.buffer, self.in_call = self.buffer[start + len(OPEN):], True
                continue
            keep = _partial_suffix(self.buffer, OPEN)
            head = self.buffer[:len(self.buffer) - keep]
            if self.num_calls and not head.strip():
                return out  # whitespace after a call: held back until something else comes
            out.content += self._content(head, final=False)
            self.buffer = self.buffer[len(head):]
            return out

    def _content(self, text: str, final: bool) -> str:
        """Content text; whitespace-only text between calls is dropped."""
        return "" if self.num_calls and not text.strip() else text

    def _call(self, body: str, out: Extracted, closed: bool) -> None:
        parsed = parse_call(body.strip())
        if parsed is None:
            out.content += OPEN + body + (CLOSE if closed else "")
            return
        out.calls.append(ToolCallDelta(self.num_calls, new_call_id(), *parsed))
        self.num_calls += 1

    def finish(self) -> Extracted:
        out = Extracted()
        if self.in_call:
            self._call(self.buffer, out, closed=False)  # the model stopped before the closing tag
        elif not (self.num_calls and not self.buffer.strip()):
            out.content += self.buffer
        self.buffer, self.in_call = "", False
        return out
