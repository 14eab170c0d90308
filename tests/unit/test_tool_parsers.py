"""Tool-call extractors: what they find in a whole output, and that feeding the same text in
any pieces (as a stream does) hands out pieces that add up to exactly that."""
from __future__ import annotations

import json
import random

import pytest

from tandem.entrypoints.openai.tool_parsers import (HermesToolParser, Llama3JsonToolParser, NamedToolCalls,
                                                    RequiredToolCalls, collect, merge_calls)

WEATHER = '{"city": "Paris, \\"FR\\"", "days": [1, 2], "unit": {"c": true}}'

CASES = [
    # (extractor factory, text, expected content, expected [(name, arguments)])
    (RequiredToolCalls, f'[{{"name": "get_weather", "parameters": {WEATHER}}}]', "",
     [("get_weather", WEATHER)]),
    (RequiredToolCalls, '[ {"parameters":{"q":"x"} , "name":"search"},{"name":"noop","parameters":{}} ]', "",
     [("search", '{"q":"x"}'), ("noop", "{}")]),
    (RequiredToolCalls, '[{"name": "n", "parameters": 42}, {"name": "s\\u00e9", "parameters": "t"}]', "",
     [("n", "42"), ("sé", '"t"')]),
    (lambda: NamedToolCalls("get_weather"), WEATHER, "", [("get_weather", WEATHER)]),
    (HermesToolParser, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                       '</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>\n',
     "Let me look.\n", [("get_weather", '{"city": "Paris"}'), ("b", "{}")]),
    (HermesToolParser, "No tools needed: 1 < 2 and <tool_c is not a tag.", "No tools needed: 1 < 2 and <tool_c is "
                       "not a tag.", []),
    (HermesToolParser, '<tool_call>{"name": "x", "arguments": {"a": 1}}', "", [("x", '{"a": 1}')]),
    (HermesToolParser, "<tool_call>not json</tool_call> done", "<tool_call>not json</tool_call> done", []),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "b", "parameters": '
                           '{}}', "", [("get_weather", '{"city": "Paris"}'), ("b", "{}")]),
    (Llama3JsonToolParser, '<|python_tag|>{"name": "a", "arguments": {"x": [1]}}', "", [("a", '{"x": [1]}')]),
    (Llama3JsonToolParser, "The weather is nice.", "The weather is nice.", []),
    (Llama3JsonToolParser, '{"not": "a call"}', '{"not": "a call"}', []),
]


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("make,text,content,calls", CASES)
def test_whole_output(make, text, content, calls):
    got_content, got_calls = collect(make(), text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    for c in got_calls:
        assert c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") and len(c["id"]) > 20
        json.loads(c["function"]["arguments"])  # every argument text is JSON


@pytest.mark.parametrize("make,text,content,calls", CASES)
def test_any_chunking_adds_up_to_the_whole(make, text, content, calls):
    rng = random.Random(7)
    for _ in range(30):
        ext = make()
        got_content, deltas = "", []
        parts = pieces(text, rng) + ([""] if rng.random() < 0.5 else [])
        for i, part in enumerate(parts):
            got = ext.feed(part)
            if i == len(parts) - 1:
                got.add(ext.finish())
            got_content += got.content
            deltas += got.calls
        # Every call is announced (id and name) by its first delta, before any argument text.
        seen = set()
        for d in deltas:
            assert (d.index in seen) == (d.id is None), d
            seen.add(d.index)
        assert got_content == content
        merged = merge_calls(deltas)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in merged] == calls


def test_delta_json_shape():
    ext = NamedToolCalls("f")
    first, second = ext.feed('{"a"'), ext.feed(": 1}")
    assert first.calls[0].as_json() == {"index": 0, "id": first.calls[0].id, "type": "function",
                                        "function": {"name": "f", "arguments": '{"a"'}}
    assert second.calls[0].as_json() == {"index": 0, "function": {"arguments": ": 1}"}}
