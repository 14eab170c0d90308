"""Per-request generation settings, mirroring vLLM's ``SamplingParams``.

Validation happens here, at construction (pydantic, strict), so a bad request fails before
it reaches the scheduler with a message that names the field and the value.
"""
from __future__ import annotations

import json as _json
import warnings
from typing import Annotated, Any, Optional

from pydantic import Field, field_validator, model_validator

from tandem.validation import INT64_MAX, INT64_MIN, ParamError, StrictModel, show

_GREEDY_EPS = 1e-5


# vLLM names the schema field ``json``, which shadows pydantic's deprecated ``BaseModel.json()``:
# harmless (nothing here calls that method), so the field keeps vLLM's name.
warnings.filterwarnings("ignore", message='Field name "json" in "StructuredOutputsParams" shadows',
                        category=UserWarning)


class StructuredOutputsParams(StrictModel):
    """Constrain a request's output to a JSON schema, a regex, one of several strings or an EBNF
    grammar (vLLM's ``StructuredOutputsParams``); exactly one of the constraints is given."""

    what = "structured outputs"

    json: Optional[dict[str, Any] | str] = Field(None, description="a JSON schema (object or JSON text) the "
                                                                   "output must validate against")
    regex: Optional[str] = Field(None, description="a regular expression the whole output must match")
    choice: Optional[list[str]] = Field(None, description="the output is exactly one of these strings")
    grammar: Optional[str] = Field(None, description="an EBNF (GBNF) grammar the output must follow")
    json_object: Optional[bool] = Field(None, description="the output is any JSON object")

    @field_validator("json", mode="before")
    @classmethod
    def _schema_text_is_json(cls, v: Any) -> Any:
        """A schema given as JSON text is parsed here (a JSON object then), so a typo is a
        clear error now rather than a grammar compiler's message later."""
        if not isinstance(v, str):
            return v
        try:
            schema = _json.loads(v)
        except ValueError as e:
            raise ValueError(f"json is not valid JSON text ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json must be a JSON schema object, got {type(schema).__name__} {show(v)}")
        return schema

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputsParams":
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, regex, choice, grammar and json_object, "
                             f"got {given or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured outputs: choice must list at least one string")
        return self


class SamplingParams(StrictModel):
    """How to sample one request's continuation.

    ``temperature == 0`` means greedy decoding. ``top_k`` of 0 or -1 and ``top_p == 1``
    disable those filters (-1 is stored as 0). ``seed`` makes the request's sampling
    reproducible regardless of which other requests share its batch (and of async
    scheduling and preemption): the noise for output token ``i`` is derived from
    ``(seed, i)`` alone. ``max_tokens=None`` generates to the end of the context.

    Strict types: a bool is not an int, a string is not a number, NaN and infinities are
    refused; a wrong value raises ``InvalidValuesError`` (a ``ValueError``). Fields are
    plain instance attributes, as cheap to read as a dataclass's (the engine reads them for
    every request every step). Instances pickle, and ``SamplingParams.model_validate(
    sp.model_dump())`` round-trips to an equal object: ``model_dump()`` holds only ints,
    floats, strings, bools, None and lists, so it crosses a process boundary as msgspec
    or JSON and is validated again on the other side.
    """

    what = "sampling params"

    n: int = Field(1, ge=1, description="completions to generate for the prompt")
    temperature: float = Field(1.0, ge=0.0, description="randomness of sampling; 0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="keep the smallest set of tokens whose probability "
                                                          "reaches top_p (1 = off)")
    top_k: int = Field(0, ge=-1, description="keep the k most likely tokens (0 or -1 = off)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens less likely than min_p times the most "
                                                          "likely one (0 = off)")
    repetition_penalty: float = Field(1.0, gt=0.0, description="divide the logits of tokens already in the prompt "
                                                               "or output by this (1 = off)")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtract this times each token's count "
                                                                       "in the output so far (0 = off)")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtract this from tokens already in "
                                                                      "the output (0 = off)")
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX,
                                description="per-request sampling seed (a signed 64-bit int) for reproducible "
                                            "sampling; default: the engine's random generator")
    max_tokens: Optional[int] = Field(16, ge=1, description="most tokens to generate (None: to the end of the "
                                                            "context)")
    min_tokens: int = Field(0, ge=0, description="generate at least this many tokens before EOS or a stop "
                                                 "token may end the output")
    stop: list[str] = Field(default_factory=list, description="strings that end the output when generated "
                                                              "(not included unless include_stop_str_in_output)")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="token ids that end the output when generated")
    ignore_eos: bool = Field(False, description="keep generating after the EOS token")
    logprobs: Optional[int] = Field(None, ge=0, description="return the log-probabilities of this many most "
                                                            "likely tokens at each output position")
    prompt_logprobs: Optional[int] = Field(None, ge=0, description="return the log-probabilities of this many "
                                                                   "most likely tokens at each prompt position")
    include_stop_str_in_output: bool = Field(False, description="keep the matched stop string in the output text")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the output text")
    spaces_between_special_tokens: bool = Field(
        True, description="put spaces between special tokens in the output text (slow tokenizers only: fast "
                          "ones, like Hugging Face's, decode special tokens as written)")
    detokenize: bool = Field(True, description="decode the output into text (off: token ids only)")
    logit_bias: Optional[dict[int, float]] = Field(
        None, description="token id -> value in [-100, 100] added to that token's logit before sampling "
                          "(-100 bans a token, 100 all but forces it)")
    structured_outputs: Optional[StructuredOutputsParams] = Field(
        None, description="constrain the output to a JSON schema, regex, choice or grammar")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        """A single string is one stop string; None or a tuple are accepted like the old dataclass did."""
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, tuple):
            return list(v)
        if not isinstance(v, list):
            raise ValueError(f"stop must be a string or a list of strings, got {type(v).__name__} {show(v)}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: list[str]) -> list[str]:
        """An empty stop string would match before every token."""
        if any(not s for s in v):
            raise ValueError(f"stop strings must be non-empty, got {show(v)}")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_list(cls, v: Any) -> Any:
        if v is None:
            return []
        return list(v) if isinstance(v, tuple) else v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys_as_ints(cls, v: Any) -> Any:
        """OpenAI's JSON spells token ids as string keys ({"50256": -100}): take decimal ones."""
        if not isinstance(v, dict):
            return v
        out: dict[Any, Any] = {}
        for k, val in v.items():
            if isinstance(k, str):
                if not k.strip().isdigit():
                    raise ValueError(f"logit_bias keys must be token ids, got {show(k)}")
                k = int(k)
            out[k] = val
        return out

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: Optional[dict[int, float]]) -> Optional[dict[int, float]]:
        if v is None:
            return v
        for k, val in v.items():
            if k < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {k}")
            if not -100.0 <= val <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {show(val)} for token {k}")
        return v or None

    @field_validator("top_k", mode="before")
    @classmethod
    def _top_k_none_is_off(cls, v: Any) -> Any:
        return 0 if v is None else v

    @field_validator("top_k")
    @classmethod
    def _top_k_one_off_value(cls, v: int) -> int:
        """-1 (vLLM's old "off") and 0 mean the same; keep one so the sampler sees one."""
        return 0 if v == -1 else v

    @model_validator(mode="after")
    def _min_le_max(self) -> "SamplingParams":
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def clone(self, **changes: Any) -> "SamplingParams":
        """A validated copy with ``changes`` applied (lists are copied, never shared)."""
        return SamplingParams(**{**self.model_dump(), **changes})
