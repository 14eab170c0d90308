"""A named ``tool_choice``: the whole output is the arguments of that one function (the
grammar constrains it to the function's parameter schema)."""
from __future__ import annotations

from tandem.entrypoints.openai.tool_parsers.base import Extracted, ToolCallDelta, ToolCallExtractor, new_call_id


class NamedToolCalls(ToolCallExtractor):
    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> Extracted:
        if not self.started:
            self.started = True
            return Extracted(calls=[ToolCallDelta(0, new_call_id(), self.name, text)])
        return Extracted(calls=[ToolCallDelta(0, arguments=text)] if text else [])
