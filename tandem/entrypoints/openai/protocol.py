"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Strict means a wrong type is refused rather than coerced (``"1"`` is not an int, ``true`` is
not a number), and a field the server does not know is refused by name rather than
ignored. Fields OpenAI defines that tandem does not implement (``suffix``, ``best_of``...)
are refused with a sentence saying so, before validation, so the client learns why instead
of getting output that silently ignored its request.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.entrypoints.openai.errors import bad_request

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# Fields OpenAI (or vLLM) accepts that this server refuses, with the value that is harmless.
_UNSUPPORTED_COMMON = ("functions", "function_call", "prediction", "audio", "modalities")
_HARMLESS: dict[str, Any] = {"echo": False, "suffix": "", "best_of": 1}
UNSUPPORTED = {
    "completions": _UNSUPPORTED_COMMON + ("suffix", "best_of", "tools", "tool_choice", "parallel_tool_calls"),
    "chat": _UNSUPPORTED_COMMON + ("echo",),
}


def refuse_unsupported(body: dict[str, Any], endpoint: str) -> None:
    """Raise a 400 naming the first unsupported field that asks for something."""
    for name in UNSUPPORTED[endpoint]:
        if name in body and body[name] is not None and body[name] != _HARMLESS.get(name, None):
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(_Strict):
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")  # ("schema" is a BaseModel method)
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('type "json_schema" needs json_schema: {"name": ..., "schema": {...}}')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f'json_schema is only allowed with type "json_schema", not {self.type!r}')
        return self


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension (load generators such as guidellm send it): with include_usage, every
    # chunk also carries the usage so far.
    continuous_usage_stats: bool = False

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class _SamplingRequest(_Strict):
    """The generation settings both endpoints share (OpenAI's, plus vLLM's extras)."""

    model: Optional[str] = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[str | list[str]] = None
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)
    max_tokens: Optional[int] = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    # OpenAI's shape: {"token id as a string": bias in [-100, 100]}; checked by SamplingParams
    # (range) and the engine (vocabulary), each refusal a 400 naming logit_bias.
    logit_bias: Optional[dict[str, float]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's extension: the logprobs of each prompt token (and its top-k), in vLLM's shape.
    prompt_logprobs: Optional[int] = Field(None, ge=0)
    user: Optional[str] = None  # an end-user id: accepted, as OpenAI does, and only logged
    # Constrained output (tandem/entrypoints/openai/structured.py): OpenAI's response_format,
    # vLLM's structured_outputs ({json | regex | choice | grammar | json_object}, checked as
    # SamplingParams' StructuredOutputsParams) and vLLM's older guided_* fields, as aliases.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[dict[str, Any] | str] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Optional[str | list[str]]) -> Optional[str | list[str]]:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return v


class CompletionRequest(_SamplingRequest):
    # A text, a list of texts, a list of token ids, or a list of lists of token ids; checked
    # by hand because pydantic's union errors would list every member's complaint.
    prompt: Any
    # 0 only with echo: the prompt's logprobs without a completion (checked by the endpoint).
    max_tokens: Optional[int] = Field(None, ge=0)
    logprobs: Optional[int] = Field(None, ge=0)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        """Normalised to a list of prompts, each a text or a list of token ids."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and v:
            if ids(v):
                return [v]
            if all(isinstance(p, str) for p in v) or all(ids(p) for p in v):
                return v
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                         "of token ids")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A tool call of an earlier assistant turn, replayed in ``messages``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One message of a conversation: OpenAI's roles, with ``developer`` read as ``system``,
    ``tool`` results answering a ``tool_call_id``, and assistant turns that called tools
    (``tool_calls``, with ``content`` null or empty)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[str | list[TextPart]] = Field(...)  # required, but null is allowed (checked below)
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    # Fields of an OpenAI response message, so that one can be sent back as it came: accepted
    # while they carry nothing (null, or no annotations), refused otherwise (nothing renders them).
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: Optional[list[Any]] = Field(None, max_length=0)

    @model_validator(mode="before")
    @classmethod
    def _tool_call_turn_may_omit_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and "content" not in data and data.get("role") == "assistant" \
                and data.get("tool_calls"):
            return {**data, "content": None}
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got a part of type {kind!r}")
        elif v is not None and not isinstance(v, str):
            raise ValueError("content must be a string or a list of text parts")
        return v

    @model_validator(mode="after")
    def _role_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} messages")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content must be a string or a list of text parts (null only for an assistant "
                             "message with tool_calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"only tool messages carry a tool_call_id, not {self.role} messages")
        return self

    def as_template_dict(self) -> dict[str, Any]:
        """The message as HF chat templates read it: text content (``""`` for none), ``developer``
        as ``system``, and tool-call arguments as objects (templates render them with
        ``tojson``; a text that is not a JSON object stays text)."""
        if self.content is None:
            text = ""
        else:
            text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in self.tool_calls]
        return msg


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    add_generation_prompt: bool = True
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Literal["none", "auto", "required"] | NamedToolChoice] = None
    parallel_tool_calls: Optional[bool] = None  # false: tool_choice "required" makes exactly one call

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required") or isinstance(v, dict):
            return v
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]
