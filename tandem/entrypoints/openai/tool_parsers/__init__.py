"""Tool calls out of generated text, one extractor per way of writing them.

``hermes`` and ``llama3_json`` parse what a model chose to write (``tool_choice: "auto"``,
picked with ``tandem serve --tool-call-parser``); ``NamedToolCalls`` and ``RequiredToolCalls``
read the output of a constrained request (a named function or ``"required"``).
"""
from __future__ import annotations

from tandem.entrypoints.openai.tool_parsers.base import (Extracted, ToolCallDelta, ToolCallExtractor, collect,
                                                         merge_calls)
from tandem.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tandem.entrypoints.openai.tool_parsers.json_array import RequiredToolCalls
from tandem.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from tandem.entrypoints.openai.tool_parsers.named import NamedToolCalls

TOOL_PARSERS: dict[str, type[ToolCallExtractor]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def get_tool_parser(name: str) -> type[ToolCallExtractor]:
    return TOOL_PARSERS[name]


__all__ = ["Extracted", "HermesToolParser", "Llama3JsonToolParser", "NamedToolCalls", "RequiredToolCalls",
           "TOOL_PARSERS", "ToolCallDelta", "ToolCallExtractor", "collect", "get_tool_parser", "merge_calls"]
