"""Strict pydantic models whose errors read as one sentence per problem, and their CLI flags.

``EngineConfig`` and ``SamplingParams`` are built from user input: Python keywords, CLI
flags, JSONL rows and HTTP bodies. pydantic does the checking; this module turns its
multi-line ``ValidationError`` dump into a ``ValueError`` that names each field and the
value refused, and suggests the closest field for a misspelt keyword. It also generates one
command-line flag per field, so the CLI has the Python API's defaults and help texts. It
sits below every package (it imports only pydantic), so both models use it.

Convention for custom validators: they raise ``ValueError`` with a complete sentence that
names the field and the value (``"block_size must be ..., got 12"``); it is shown as is.
"""
from __future__ import annotations

import argparse
import json
import difflib
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError

_MAX_SHOWN = 80  # characters of a refused value shown in a message
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # seeds: what a signed 64-bit generator seed holds

# What a field of each type must be, for pydantic's type-error codes.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "finite_number": "a finite number",
}
_BOUNDS = {"gt": "> {}", "ge": ">= {}", "lt": "< {}", "le": "<= {}"}
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


class ParamError(ValueError):
    """A refused value, with the parameter it belongs to: ``param`` names the field
    (``"logit_bias"``, ``"stop_token_ids[0]"``), or is None when no one field is to blame.
    A server puts it in its 400 body as it is, instead of looking for a name in the message.
    A ``ValueError``, so every caller that handles bad input handles it."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidValuesError(ParamError):
    """One or more user-given values were refused; ``problems`` holds one sentence each,
    ``params`` the field each names (None for a problem of several fields), and ``param``
    the first problem's field.

    A ``ValueError`` so callers (and the CLI) treat it like every other bad-input error.
    """

    def __init__(self, what: str, problems: list[str], params: Optional[list[Optional[str]]] = None) -> None:
        self.problems = problems
        self.params = params if params is not None else [None] * len(problems)
        super().__init__(f"invalid {what}: " + "; ".join(problems), self.params[0] if self.params else None)


def show(value: Any) -> str:
    """``repr`` of a refused value, cut short so one huge input cannot flood a message."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _location(loc: tuple[Any, ...]) -> str:
    """``('stop_token_ids', 1)`` -> ``stop_token_ids[1]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _number(v: Any) -> str:
    """``1.0`` -> ``1``: bounds read as the user would write them."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _range_text(model: type[BaseModel], loc: tuple[Any, ...], ctx: dict[str, Any]) -> str:
    """The field's whole allowed range (``in (0, 1]``), not just the bound that was crossed."""
    bounds: dict[str, Any] = {}
    field = model.model_fields.get(loc[0]) if len(loc) == 1 else None
    for meta in field.metadata if field is not None else []:
        for key in _BOUNDS:
            if getattr(meta, key, None) is not None:
                bounds[key] = getattr(meta, key)
    if not bounds:
        bounds = {k: v for k, v in ctx.items() if k in _BOUNDS}
    low = [k for k in ("gt", "ge") if k in bounds]
    high = [k for k in ("lt", "le") if k in bounds]
    if low and high:
        lo, hi = low[0], high[0]
        return (f"in {'(' if lo == 'gt' else '['}{_number(bounds[lo])}, "
                f"{_number(bounds[hi])}{')' if hi == 'lt' else ']'}")
    return " and ".join(_BOUNDS[k].format(_number(bounds[k])) for k in low + high)


def _integer_field(model: type[BaseModel], loc: tuple[Any, ...], value: Any) -> bool:
    """Whether the value belongs in an int field (``Optional[int]`` too), so a range reads
    "an integer >= 1"; list items fall back to the value's own type."""
    field = model.model_fields.get(loc[0]) if len(loc) == 1 else None
    if field is None:
        return isinstance(value, int) and not isinstance(value, bool)
    return field.annotation is int or int in get_args(field.annotation)


def _param(err: Any) -> Optional[str]:
    """The field one pydantic error is about: the one a validator's ``ParamError`` names, else
    the error's location (none for a check over several fields)."""
    raised = (err.get("ctx") or {}).get("error")
    if isinstance(raised, ParamError) and raised.param is not None:
        return raised.param
    return _location(tuple(err["loc"])) or None


def _describe(model: type[BaseModel], err: dict[str, Any]) -> str:
    """One pydantic error as one sentence naming the field and the refused value."""
    loc, kind, value = tuple(err["loc"]), err["type"], err.get("input")
    ctx = err.get("ctx") or {}
    name = _location(loc)
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "extra_forbidden":
        return unknown_field_message(str(loc[0]), list(model.model_fields))
    if kind == "literal_error":
        return f"{name} must be one of {ctx.get('expected')}, got {show(value)}"
    if kind in _BOUND_ERRORS:
        integer = _integer_field(model, loc, value)
        return f"{name} must be {'an integer ' if integer else ''}{_range_text(model, loc, ctx)}, got {show(value)}"
    if kind in _EXPECTED:
        return f"{name} must be {_EXPECTED[kind]}, got {type(value).__name__} {show(value)}"
    return f"{name}: {err['msg']}, got {show(value)}"


def unknown_field_message(name: str, fields: list[str], noun: str = "option") -> str:
    """Name the unknown keyword and the closest real one (or all of them)."""
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else "valid names: " + ", ".join(sorted(fields))
    return f"unknown {noun} {name!r} ({hint})"


class StrictModel(BaseModel):
    """A pydantic model that refuses loose input and raises ``InvalidValuesError``.

    Strict: a bool is not an int, a string is not a number, NaN and infinities are
    refused, unknown keywords are refused. Assignment is validated too, so a model can
    never hold a value its constructor would refuse.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True)

    what: ClassVar[str] = "values"  # how error messages name the model ("engine config")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise self._refused(e) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:  # noqa: D102 - pydantic's, with readable errors
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            raise cls._refused(e) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise self._refused(e) from None

    @classmethod
    def _refused(cls, e: ValidationError) -> InvalidValuesError:
        described: dict[str, Optional[str]] = {}  # problem -> its field, each problem once
        for err in e.errors(include_url=False):
            described.setdefault(_describe(cls, err), _param(err))
        return InvalidValuesError(cls.what, list(described), list(described.values()))

    # -- command-line flags -------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: Any, dests: Optional[dict[str, str]] = None) -> None:
        """One flag per field on ``parser`` (or an argument group): the default is the field's,
        the help its description. Bools get ``--x/--no-x``, ``Literal`` fields choices, list
        fields a repeatable flag, ``Optional`` fields also take ``none``. ``dests`` renames
        a field's flag (``{"seed": "sampling_seed"}`` -> ``--sampling-seed``)."""
        for name, field in cls.model_fields.items():
            dest = (dests or {}).get(name, name)
            flag = "--" + dest.replace("_", "-")
            annotation, optional = _unwrap_optional(field.annotation)
            kw: dict[str, Any] = {"dest": dest, "help": field.description,
                                  "default": field.get_default(call_default_factory=True)}
            if annotation is bool:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
                continue
            if get_origin(annotation) is Literal:
                kw["choices"] = get_args(annotation)
                conv: Callable[[str], Any] = str
            elif get_origin(annotation) is list:
                kw["action"] = "append"
                kw["help"] += " (repeatable)"
                conv = _base_type(get_args(annotation)[0])
            elif get_origin(annotation) is dict:
                kw["help"] += " (a JSON object, e.g. '{\"42\": -100}')"
                conv = _json_object
            elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
                kw["help"] += " (a JSON object of its fields)"
                conv = _json_object
            else:
                conv = annotation
            kw["type"] = _none_or(conv) if optional else conv
            if optional:
                kw["help"] += "; 'none' for None"
            parser.add_argument(flag, **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, dests: Optional[dict[str, str]] = None,
                      **overrides: Any) -> Any:
        """The model built (and validated) from its flags' values, with ``overrides`` applied."""
        values = {name: getattr(args, (dests or {}).get(name, name)) for name in cls.model_fields}
        return cls(**{**values, **overrides})


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """``Optional[int]`` -> ``(int, True)``."""
    if get_origin(annotation) is Union:
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def _base_type(annotation: Any) -> Any:
    """``Annotated[int, Field(ge=0)]`` -> ``int``."""
    args = get_args(annotation)
    return args[0] if args and hasattr(annotation, "__metadata__") else annotation


def _json_object(text: str) -> Any:
    """A dict field's flag takes a JSON object; the model's own validation checks its contents."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def _none_or(conv: Callable[[str], Any]) -> Callable[[str], Any]:
    """An Optional field's flag also takes ``none`` (``--max-tokens none``: to the end of the context)."""
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else conv(text)

    parse.__name__ = getattr(conv, "__name__", "value")  # argparse names it in "invalid int value"
    return parse
