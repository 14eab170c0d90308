"""The API server's JSON-schema check (``entrypoints.openai.structured.check_json_schema``)
runs jsonschema's meta-schema check once per distinct schema: it costs milliseconds on the
event loop, and clients resend the same schema. Equal schemas written in another key order
share the verdict; a bad schema stays a 400 every time it comes."""
from __future__ import annotations

import jsonschema
import pytest

from tandem.entrypoints.openai import structured
from tandem.entrypoints.openai.errors import APIError

pytestmark = pytest.mark.timeout(60)


def test_a_schema_is_checked_once(monkeypatch) -> None:
    structured._schema_error.cache_clear()
    calls = []
    real = jsonschema.validators.validator_for

    def counting(schema, *a, **kw):
        calls.append(schema)
        return real(schema, *a, **kw)

    monkeypatch.setattr(jsonschema.validators, "validator_for", counting)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": [1, 2]}}}
    reordered = {"properties": {"b": {"enum": [1, 2]}, "a": {"type": "integer"}}, "type": "object"}
    for s in (schema, schema, reordered, '{"type": "object", "properties": {"a": {"type": "integer"}, '
                                         '"b": {"enum": [1, 2]}}}'):
        assert structured.check_json_schema(s, "response_format") == schema
    assert calls.count(schema) == 1  # (jsonschema also looks up validators for its meta-schemas)


def test_a_bad_schema_is_refused_every_time() -> None:
    structured._schema_error.cache_clear()
    for _ in range(2):
        with pytest.raises(APIError) as e:
            structured.check_json_schema({"type": 5}, "response_format.json_schema.schema")
        assert e.value.status == 400 and "invalid JSON schema at 'type'" in str(e.value)
    assert structured._schema_error.cache_info().hits == 1
