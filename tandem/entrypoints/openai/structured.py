"""The request fields that constrain the output, turned into ``SamplingParams.structured_outputs``.

Four spellings reach the same engine feature (``StructuredOutputsParams``: a JSON schema, any
JSON object, a regex, a choice of strings or an EBNF grammar), and a request may use one:

- OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``{"type": "text"}`` asks for nothing);
- vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``;
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
  taken as aliases of the ``structured_outputs`` keys;
- on chat, ``tool_choice`` ``"required"`` or a named function (``tools.py`` builds the schema).

The server checks what it can without compiling anything (API-server processes import no
grammar library): the shape of each field, and that a JSON schema is a valid JSON Schema
(``jsonschema``'s meta-schema check). Compiling happens in the engine core; a constraint that
does not compile there comes back as the request's error and the endpoint answers 400 with
the compiler's message.

The meta-schema check costs milliseconds (4 ms for bench serve's schema on the CPU
machine) and runs on the API server's event loop, where it holds up every stream the
process serves; applications and benchmarks send the same few schemas again and again, so
its verdict is cached by the schema's canonical JSON text.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Optional

import jsonschema
from jsonschema.exceptions import SchemaError

from tandem.entrypoints.openai.errors import bad_request
from tandem.entrypoints.openai.protocol import _SamplingRequest
from tandem.sampling_params import StructuredOutputsParams

GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def check_json_schema(schema: Any, param: str) -> dict[str, Any]:
    """``schema`` (an object, or JSON text of one) as a dict, if it is a valid JSON Schema; else a 400."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"the JSON schema is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"a JSON schema must be an object, got {type(schema).__name__}", param)
    try:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise bad_request(f"a JSON schema must be plain JSON: {e}", param) from None
    error = _schema_error(key)
    if error is not None:
        raise bad_request(error, param)
    return schema


@functools.lru_cache(maxsize=256)
def _schema_error(canonical: str) -> Optional[str]:
    """The meta-schema check's complaint about a schema (given as canonical JSON text), or None."""
    schema = json.loads(canonical)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"invalid JSON schema{f' at {where!r}' if where else ''}: {e.message}"
    return None


def structured_outputs_of(req: _SamplingRequest) -> tuple[Optional[StructuredOutputsParams], Optional[str]]:
    """The constraint the request asks for (or None) and the name of the field that asked."""
    given: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None  # the request model checked it
        schema = check_json_schema(rf.json_schema.schema_, "response_format.json_schema.schema")
        given.append(("response_format", {"json": schema}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for field, key in GUIDED_ALIASES.items():
        value = getattr(req, field)
        if value is not None:
            given.append((field, {key: value}))
    if not given:
        return None, None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"give at most one output constraint, got {names}", given[1][0])
    param, spec = given[0]
    try:
        params = StructuredOutputsParams(**spec)
    except ValueError as e:
        raise bad_request(str(e), param) from None
    if params.json is not None:
        params = params.model_copy(update={"json": check_json_schema(params.json, param)})
    return params, param
