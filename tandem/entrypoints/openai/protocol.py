"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Strict means a wrong type is refused rather than coerced (``"1"`` is not an int, ``true`` is
not a number), and a field that neither OpenAI nor vLLM defines is refused by name rather
than ignored, so a typo never passes silently. The fields they define fall in three groups:

- implemented (sampling settings, ``response_format``, ``tools``, ``echo``,
  ``chat_template_kwargs``, ``continue_final_message``...);
- ignored, because they change nothing tandem generates (``store``, ``metadata``,
  ``service_tier``, ``request_id``...): accepted, type-checked, and logged with a warning the
  first time each one is seen in the process (``IGNORED``);
- refused, because honouring them would change the output and tandem cannot (beam search,
  ``suffix``, ``best_of``, the deprecated ``functions``...): a 400 with a sentence saying why,
  before validation, unless the value asks for nothing (null, ``best_of: 1``, ``n: null``...),
  which is dropped.
"""
from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.entrypoints.openai.errors import bad_request

logger = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# Fields OpenAI (or vLLM) accepts that this server refuses, with the values that are harmless.
_UNSUPPORTED_COMMON = ("functions", "function_call", "prediction", "audio", "modalities")
# vLLM's extensions that tandem does not implement (and OpenAI's newer chat fields).
_UNSUPPORTED_VLLM = ("use_beam_search", "length_penalty", "watermarking", "truncate_prompt_tokens",
                     "allowed_token_ids", "logprob_token_ids", "bad_words", "priority", "cache_salt",
                     "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection",
                     "thinking_token_budget", "return_tokens_as_token_ids", "return_token_ids")
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "suffix": ("",), "best_of": (1,), "modalities": (["text"],), "use_beam_search": (False,),
    "length_penalty": (1.0,), "watermarking": (False,), "bad_words": ([],), "priority": (0,), "vllm_xargs": ({},),
    "thinking_token_budget": (-1,), "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
    "return_prompt_text": (False,), "media_io_kwargs": ({},), "mm_processor_kwargs": ({},),
}
UNSUPPORTED = {
    "completions": _UNSUPPORTED_COMMON + ("suffix", "best_of", "tools", "tool_choice", "parallel_tool_calls")
    + _UNSUPPORTED_VLLM + ("prompt_embeds",),
    "chat": _UNSUPPORTED_COMMON + ("echo",) + _UNSUPPORTED_VLLM + (
        "chat_template", "media_io_kwargs", "mm_processor_kwargs", "return_prompt_text", "verbosity",
        "web_search_options"),
}
# Why each refused field is refused (the 400's message and docs/bad-inputs.md).
WHY_UNSUPPORTED: dict[str, str] = {
    "tools": "tool calling is on /v1/chat/completions", "tool_choice": "tool calling is on /v1/chat/completions",
    "parallel_tool_calls": "tool calling is on /v1/chat/completions",
    "functions": "the deprecated function calling is not implemented; give tools instead",
    "function_call": "the deprecated function calling is not implemented; give tool_choice instead",
    "prediction": "predicted outputs are not implemented", "audio": "this server generates text only",
    "modalities": "this server generates text only (modalities [\"text\"] is accepted)",
    "suffix": "fill-in-the-middle is not implemented",
    "echo": "echo is on /v1/completions (the prompt and, with logprobs, its logprobs)",
    "best_of": "best-of sampling is not implemented; n gives several choices",
    "use_beam_search": "beam search is not implemented", "length_penalty": "beam search is not implemented",
    "watermarking": "watermarking is not implemented",
    "truncate_prompt_tokens": "prompts are never truncated; send a shorter prompt",
    "allowed_token_ids": "not implemented; logit_bias -100 bans tokens",
    "logprob_token_ids": "not implemented; logprobs gives the top tokens",
    "bad_words": "bad-word filtering is not implemented",
    "priority": "requests are scheduled first come, first served",
    "cache_salt": "the prefix cache cannot be salted; every request shares it",
    "kv_transfer_params": "disaggregated serving is not implemented",
    "ec_transfer_params": "disaggregated serving is not implemented",
    "vllm_xargs": "there are no custom extensions", "repetition_detection": "repetition detection is not implemented",
    "thinking_token_budget": "thinking budgets are not implemented",
    "return_tokens_as_token_ids": "not implemented", "return_token_ids": "not implemented",
    "return_prompt_text": "not implemented", "prompt_embeds": "prompt embeddings are not accepted",
    "chat_template": "per-request chat templates are not accepted; start the server with --chat-template",
    "media_io_kwargs": "this server takes text only", "mm_processor_kwargs": "this server takes text only",
    "verbosity": "not implemented", "web_search_options": "web search is not implemented",
}
# Fields whose null means "the default", as OpenAI documents them.
_NULL_MEANS_DEFAULT = ("n", "stream", "logprobs", "echo")
_warned: set[str] = set()


def _harmless(name: str, value: Any) -> bool:
    """Null, or a value that asks for nothing (``false`` is not ``0``: types must match)."""
    return value is None or any(isinstance(value, bool) == isinstance(h, bool) and value == h
                                for h in _HARMLESS.get(name, ()))


def refuse_unsupported(body: dict[str, Any], endpoint: str) -> None:
    """Raise a 400 naming the first unsupported field that asks for something; drop those
    that ask for nothing (unless the request model has a field of that name)."""
    fields = _MODELS[endpoint].model_fields
    for name in UNSUPPORTED[endpoint]:
        if name not in body:
            continue
        if not _harmless(name, body[name]):
            why = WHY_UNSUPPORTED.get(name)
            raise bad_request(f"'{name}' is not supported by this server" + (f": {why}" if why else ""), name,
                              "unsupported_parameter")
        if name not in fields:
            del body[name]


def warn_ignored(name: str, why: str) -> None:
    """Log once per field name and process that a request field was accepted but ignored."""
    if name not in _warned:
        _warned.add(name)
        logger.warning("ignoring the request field %r (%s); later requests with it are not logged", name, why)



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _WarnsIgnored(_Strict):
    """A model with fields that are accepted but ignored: ``IGNORED`` maps each to the reason."""

    IGNORED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="after")
    def _warn_ignored(self) -> Any:
        for name in self.model_fields_set & self.IGNORED.keys():
            if getattr(self, name) is not None:
                warn_ignored(name, self.IGNORED[name])
        return self


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


class StreamOptions(_WarnsIgnored):
    IGNORED = {"include_obfuscation": "chunks are never padded"}

    include_usage: bool = False
    # vLLM's extension (load generators such as guidellm send it): with include_usage, every
    # chunk also carries the usage so far.
    continuous_usage_stats: bool = False
    include_obfuscation: Optional[bool] = None

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


_IGNORED_VLLM = {
    "request_id": "responses carry tandem's own ids", "session_id": "there is no session routing",
    "stream_interval": "each step's tokens are streamed as they come",
    "return_token_offsets": "only vLLM's render endpoints use it",
    "return_mm_kwargs": "only vLLM's render endpoints use it",
    "routed_experts_prompt_start": "no expert-routing data is returned",
    "truncation_side": "prompts are never truncated",
}


class _SamplingRequest(_WarnsIgnored):
    """The generation settings both endpoints share (OpenAI's, plus vLLM's extras)."""

    IGNORED = _IGNORED_VLLM

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI documents ``n``, ``stream``, ``logprobs`` and ``echo`` as nullable: null is the default."""
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in _NULL_MEANS_DEFAULT):
            return {k: v for k, v in data.items() if not (k in _NULL_MEANS_DEFAULT and v is None)}
        return data

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
    spaces_between_special_tokens: bool = True
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
    # Accepted and ignored (IGNORED says why).
    request_id: Optional[str] = None
    session_id: Optional[str] = None
    stream_interval: Optional[int] = Field(None, ge=1)
    return_token_offsets: Optional[bool] = None
    return_mm_kwargs: Optional[bool] = None
    routed_experts_prompt_start: Optional[int] = Field(None, ge=0)
    truncation_side: Optional[Literal["left", "right"]] = None

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
    add_special_tokens: bool = True  # vLLM's: BOS and the like on text prompts

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


class TextPart(_WarnsIgnored):
    IGNORED = {"cache_control": "the prefix cache needs no hints"}

    type: Literal["text"]
    text: str
    cache_control: Optional[dict[str, Any]] = None  # Anthropic-style caching hint (LiteLLM sends it)


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


# apply_chat_template's own arguments: chat_template_kwargs may not set them.
TEMPLATE_CALL_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatTemplateFields(_Strict):
    """How messages become a prompt (vLLM's fields, shared by chat completions and /tokenize)."""

    add_generation_prompt: Optional[bool] = None  # default: true, unless continue_final_message
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of what the template writes
    documents: Optional[list[dict[str, str]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None

    def template_kwargs(self) -> dict[str, Any]:
        """The template's extra variables: ``chat_template_kwargs``, plus ``reasoning_effort``
        (and, as vLLM does, ``enable_thinking`` from it unless the kwargs set it)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs


class ChatCompletionRequest(_SamplingRequest, ChatTemplateFields):
    IGNORED = {**_IGNORED_VLLM,
               "store": "tandem keeps no completions", "metadata": "tandem keeps no completions to tag",
               "service_tier": "tandem has one service tier", "prompt_cache_key": "the prefix cache needs no key",
               "safety_identifier": "an end-user id, like user",
               "include_reasoning": "there is no reasoning parser: reasoning stays in the content"}

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Literal["none", "auto", "required"] | NamedToolChoice] = None
    parallel_tool_calls: Optional[bool] = None  # false: tool_choice "required" makes exactly one call
    # Accepted and ignored (IGNORED says why).
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    include_reasoning: Optional[bool] = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required") or isinstance(v, dict):
            return v
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')


class TokenizeRequest(ChatTemplateFields):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[ChatTool]] = None  # with messages: offered to the template, as chat does
    add_special_tokens: Optional[bool] = None  # default: true for a prompt, false for messages


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


_MODELS: dict[str, type[BaseModel]] = {"completions": CompletionRequest, "chat": ChatCompletionRequest}
