"""The structured-output workload of ``tandem bench serve`` (``--structured-output-ratio``).

A share of the requests is sent with a JSON schema, as vLLM's structured-output serving
benchmark does, in the fields each endpoint takes:

* ``/v1/completions``: ``"structured_outputs": {"json": schema}`` (vLLM's extension);
* ``/v1/chat/completions``: OpenAI's ``"response_format": {"type": "json_schema",
  "json_schema": {"name": ..., "schema": schema}}``.

Everything else about those requests (prompt, output length, ``ignore_eos``) is unchanged, so
runs at different ratios differ only in the constraint. The default schema asks for a list
of at least 512 user records, which no request can close within its ``max_tokens``: every
output token of a constrained request is generated under the grammar, and every request
still produces exactly ``max_tokens`` tokens — the measurement is the engine's cost of
constrained decoding, not a change in output length. ``--structured-output-schema FILE``
sends another schema instead.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Optional, Sequence

import numpy as np

from tandem.bench.datasets import DatasetError, SampleRequest

SCHEMA_NAME = "bench_records"

DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "users": {
            "type": "array",
            "minItems": 512,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 24},
                    "email": {"type": "string", "maxLength": 40},
                    "age": {"type": "integer", "minimum": 13, "maximum": 120},
                    "plan": {"enum": ["free", "pro", "team", "enterprise"]},
                    "active": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                },
                "required": ["id", "name", "email", "age", "plan", "active", "tags"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["users"],
    "additionalProperties": False,
}


def load_schema(path: Optional[str]) -> dict[str, Any]:
    """The schema in ``path`` (a JSON object), or the default one."""
    if path is None:
        return DEFAULT_SCHEMA
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise DatasetError(f"--structured-output-schema: cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise DatasetError(f"--structured-output-schema: {path} is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise DatasetError(f"--structured-output-schema: {path} must hold a JSON object (a JSON schema)")
    return schema


def constrain(samples: Sequence[SampleRequest], ratio: float, schema: dict[str, Any],
              seed: int = 0) -> list[SampleRequest]:
    """``round(ratio * n)`` of the requests, spread by a seeded permutation, get ``schema``."""
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise DatasetError(f"--structured-output-ratio must be in [0, 1], got {ratio}")
    n = round(ratio * len(samples))
    chosen = set(np.random.default_rng(seed).permutation(len(samples))[:n].tolist())
    return [dataclasses.replace(s, schema=schema) if i in chosen else s for i, s in enumerate(samples)]


def request_fields(schema: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The body fields that constrain one request to ``schema``."""
    if chat:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": schema}}}
    return {"structured_outputs": {"json": schema}}
