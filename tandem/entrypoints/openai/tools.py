"""``tools`` and ``tool_choice`` on chat completions: what reaches the chat template, what
constrains the output, and how the output becomes ``tool_calls``.

- ``"none"``: the tools are not offered (the template does not see them) and nothing is parsed.
- ``"auto"`` (the default when tools are given, as in OpenAI and vLLM): the template offers
  the tools and the model decides; its text is parsed by the server's tool-call parser
  (``--enable-auto-tool-choice --tool-call-parser hermes|llama3_json``, as vLLM), without which
  ``"auto"`` is a 400, as in vLLM.
- ``"required"`` and a named function are *enforced*: the output is constrained to a JSON
  schema built from the tools' parameter schemas, so it always parses into valid calls. A
  named function's output is its arguments object; ``"required"`` gives an array of
  ``{"name", "parameters"}`` objects, one ``anyOf`` branch per tool (vLLM's shape), with at
  most one item when ``parallel_tool_calls`` is false.
"""
from __future__ import annotations

from typing import Any, Optional

from tandem.entrypoints.openai.errors import bad_request
from tandem.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from tandem.entrypoints.openai.structured import check_json_schema
from tandem.entrypoints.openai.tool_parsers import (NamedToolCalls, RequiredToolCalls, ToolCallExtractor,
                                                    get_tool_parser)
from tandem.sampling_params import StructuredOutputsParams

_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as chat templates read them: OpenAI's JSON shape, unset fields left out."""
    return [t.model_dump(exclude_none=True, by_alias=True) for t in tools]


class ToolPlan:
    """One request's decisions about tools, made before it runs."""

    def __init__(self, req: ChatCompletionRequest, auto_parser: Optional[str]) -> None:
        """``auto_parser``: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on."""
        tools = req.tools or []
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if choice != "none" and not tools:
            raise bad_request("tool_choice needs tools: give the tools the model may call", "tool_choice")
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise bad_request(f"tool names must be unique, {dup!r} is given twice", "tools")
        self.schemas = {t.function.name: self._parameters(i, t) for i, t in enumerate(tools)}
        self.choice = choice
        self.named: Optional[str] = None
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in self.schemas:
                raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among "
                                  f"the tools ({', '.join(names)})", "tool_choice")
            self.named = choice.function.name
        if choice == "auto" and auto_parser is None:
            raise bad_request('"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                              '--tool-call-parser', "tool_choice")
        self.auto_parser = auto_parser if choice == "auto" else None
        self.one_call = req.parallel_tool_calls is False
        self.template_tools = template_tools(tools) if choice != "none" else None

    @staticmethod
    def _parameters(i: int, tool: ChatTool) -> dict[str, Any]:
        if tool.function.parameters is None:
            return dict(_NO_ARGUMENTS)
        return check_json_schema(tool.function.parameters, f"tools[{i}].function.parameters")

    @property
    def constraint(self) -> Optional[StructuredOutputsParams]:
        """The output constraint that enforces ``required`` or a named function (None otherwise)."""
        if self.named is not None:
            return StructuredOutputsParams(json=self.schemas[self.named])
        if self.choice != "required":
            return None
        items = {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
             "required": ["name", "parameters"]} for name, schema in self.schemas.items()]}
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
        if self.one_call:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    @property
    def parses_tool_calls(self) -> bool:
        return self.named is not None or self.choice == "required" or self.auto_parser is not None

    def extractor(self) -> ToolCallExtractor:
        """A fresh extractor of one choice's tool calls (``parses_tool_calls`` must be true)."""
        if self.named is not None:
            return NamedToolCalls(self.named)
        if self.choice == "required":
            return RequiredToolCalls()
        assert self.auto_parser is not None
        return get_tool_parser(self.auto_parser)()
