"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Strict means a wrong type is refused rather than coerced (``"1"`` is not an int, ``true`` is
not a number), and a field the server does not know is refused by name rather than
ignored. Fields OpenAI defines that tandem does not implement (``suffix``, ``best_of``...)
are refused with a sentence saying so, before validation, so the client learns why instead
of getting output that silently ignored its request.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.entrypoints.openai.errors import bad_request

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# Fields OpenAI (or vLLM) accepts that this server refuses, with the value that is harmless.
_UNSUPPORTED_COMMON = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                       "response_format", "prediction", "audio", "modalities",
                       "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_HARMLESS: dict[str, Any] = {"echo": False, "suffix": "", "best_of": 1}
UNSUPPORTED = {
    "completions": _UNSUPPORTED_COMMON + ("suffix", "best_of"),
    "chat": _UNSUPPORTED_COMMON + ("echo",),
}


def refuse_unsupported(body: dict[str, Any], endpoint: str) -> None:
    """Raise a 400 naming the first unsupported field that asks for something."""
    for name in UNSUPPORTED[endpoint]:
        if name in body and body[name] is not None and body[name] != _HARMLESS.get(name, None):
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


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


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got a part of type {kind!r}")
        elif not isinstance(v, str):
            raise ValueError("content must be a string or a list of text parts")
        return v

    def as_template_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        msg = {"role": self.role, "content": text}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]
