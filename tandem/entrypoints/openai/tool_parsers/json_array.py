"""``tool_choice: "required"``: the output is a JSON array of ``{"name", "parameters"}``
objects (the grammar guarantees it), streamed call by call.

A small scanner follows the JSON text character by character, tracking strings and nesting,
to find each array item's ``name`` value and the raw text of its ``parameters`` value. A
call is announced (id and name) once its name is complete, and its arguments are exactly
the characters of its ``parameters`` value, handed out as they arrive; parameters that come
before the name wait for it. The arguments are therefore the model's own JSON text, the
same in any chunking.
"""
from __future__ import annotations

import json
from typing import Optional

from tandem.entrypoints.openai.tool_parsers.base import Extracted, ToolCallDelta, ToolCallExtractor, new_call_id

_OPEN, _CLOSE = "{[", "}]"
_ITEM = 2  # nesting depth of an array item's keys: [ {


class RequiredToolCalls(ToolCallExtractor):
    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.index = -1  # the array item being read
        self.expect = "key"  # at item level: "key", "value" (after a colon) or "" (neither)
        self.key_chars: Optional[list[str]] = None  # an item-level key being read
        self.key = ""
        self.value_key: Optional[str] = None  # the key whose value is being read
        self.value_kind = ""  # "string", "container" or "scalar"
        self.value: list[str] = []
        self.announced = False
        self.pending_args = ""  # parameters text read before the item's name
        self.out = Extracted()

    def feed(self, text: str) -> Extracted:
        self.out = Extracted()
        for ch in text:
            self._char(ch)
        return self.out

    # -- one character ----------------------------------------------------------------
    def _char(self, ch: str) -> None:
        if self.in_string:
            self._string_char(ch)
            return
        if self.value_key is not None and self.value_kind == "scalar":
            if not (ch in ",}" or ch.isspace()):
                self._take(ch)
                return
            self._end_value()  # the delimiter is not part of the value: handle it below
        if self.value_key is not None:  # inside a container value
            self._take(ch)
            if ch == '"':
                self.in_string = True
            elif ch in _OPEN:
                self.depth += 1
            elif ch in _CLOSE:
                self.depth -= 1
                if self.depth == _ITEM:
                    self._end_value()
            return
        if ch.isspace():
            return
        at_item = self.depth == _ITEM
        if ch == '"':
            self.in_string = True
            if at_item and self.expect == "key":
                self.key_chars = []
            elif at_item and self.expect == "value":
                self._start_value("string", ch)
        elif ch in _OPEN:
            if at_item and self.expect == "value":
                self._start_value("container", ch)
            elif self.depth == _ITEM - 1 and ch == "{":
                self.index += 1
                self.announced, self.pending_args, self.expect = False, "", "key"
            self.depth += 1
        elif ch in _CLOSE:
            self.depth -= 1
        elif at_item and ch == ":":
            self.expect = "value"
        elif at_item and ch == ",":
            self.expect = "key"
        elif at_item and self.expect == "value":
            self._start_value("scalar", ch)

    def _string_char(self, ch: str) -> None:
        if self.value_key is not None:
            self._take(ch)
        elif self.key_chars is not None and not (ch == '"' and not self.escaped):
            self.key_chars.append(ch)
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            if self.key_chars is not None:
                self.key = json.loads('"' + "".join(self.key_chars) + '"')
                self.key_chars, self.expect = None, ""
            elif self.value_key is not None and self.value_kind == "string":
                self._end_value()

    # -- values -----------------------------------------------------------------------
    def _start_value(self, kind: str, first: str) -> None:
        self.value_key, self.value_kind, self.value, self.expect = self.key, kind, [], ""
        self._take(first)

    def _take(self, chars: str) -> None:
        """One more character of the value being read: arguments text, or kept for later."""
        if self.value_key != "parameters":
            self.value.append(chars)
        elif not self.announced:
            self.pending_args += chars
        else:
            calls = self.out.calls
            if calls and calls[-1].index == self.index:
                calls[-1].arguments += chars
            else:
                calls.append(ToolCallDelta(self.index, arguments=chars))

    def _end_value(self) -> None:
        key, self.value_key = self.value_key, None
        if key == "name" and not self.announced:
            name = json.loads("".join(self.value))
            self.out.calls.append(ToolCallDelta(self.index, new_call_id(), str(name), self.pending_args))
            self.announced, self.pending_args = True, ""
