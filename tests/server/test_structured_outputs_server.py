"""Structured outputs and tool calls through ``tandem serve`` on the embedded SmolLM2 (a real
BPE vocabulary, so any JSON can be written), driven by raw HTTP, the ``openai`` client and,
when installed, LangChain: every constrained answer parses and validates against its schema,
and a streamed answer reassembles to the non-streamed one."""
from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_utils import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "SmolLM2-135M-Instruct"
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "genre": {"enum": ["fantasy", "crime", "science fiction"]},
        "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 25},
                                                    "alive": {"type": "boolean"}},
                   "required": ["name", "alive"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "pages": {"type": "integer", "minimum": 10, "maximum": 2000},
    },
    "required": ["title", "genre", "author", "tags", "pages"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess("", "--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      tmp=tmp_path_factory.mktemp("so_server"), chat_template=False)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=900) as c:
        yield c


def post(srv, path: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{srv.url}/v1/{path}", json={"model": MODEL, "temperature": 0, **body}, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def stream(srv, path: str, **body: Any) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{srv.url}/v1/{path}", json={"model": MODEL, "temperature": 0, "stream": True, **body},
                      timeout=900) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def calls_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def test_json_schema_answers_validate(srv):
    """Enums, a nested object, a bounded array, an integer range and a boolean: greedy and sampled."""
    prompt = [{"role": "user", "content": "Describe a fictional book as JSON."}]
    for sampling in ({}, {"temperature": 0.8, "seed": 5}, {"temperature": 1.0, "seed": 11}):
        r = post(srv, "chat/completions", messages=prompt, max_tokens=150, **sampling,
                 response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK,
                                                                         "strict": True}})
        c = r["choices"][0]
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), BOOK)
    for key in ("structured_outputs", "guided_json"):
        body = {"structured_outputs": {"json": BOOK}} if key == "structured_outputs" else {"guided_json": BOOK}
        c = post(srv, "completions", prompt="A book as JSON:", max_tokens=150, **body)["choices"][0]
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["text"]), BOOK)


def test_json_object_regex_choice_and_grammar(srv):
    prompt = [{"role": "user", "content": "Describe a fictional book as JSON."}]
    c = post(srv, "chat/completions", messages=prompt, max_tokens=200, temperature=0.8, seed=3,
             response_format={"type": "json_object"})["choices"][0]
    assert c["finish_reason"] == "stop" and isinstance(json.loads(c["message"]["content"]), dict)
    regex = r"[A-Z][a-z]{1,12} is (sunny|rainy|cloudy)\."
    c = post(srv, "chat/completions", messages=ASK_WEATHER, max_tokens=30,
             structured_outputs={"regex": regex})["choices"][0]
    assert re.fullmatch(regex, c["message"]["content"]), c
    c = post(srv, "completions", prompt="The capital of France is", max_tokens=10,
             guided_choice=["Paris", "London", "Berlin"])["choices"][0]
    assert c["text"] in ("Paris", "London", "Berlin")
    grammar = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    c = post(srv, "completions", prompt="What is 7 times 6?", max_tokens=10,
             structured_outputs={"grammar": grammar})["choices"][0]
    assert re.fullmatch(r"The answer is [0-9][0-9]?\.", c["text"]), c


def test_a_json_answer_cut_by_max_tokens_ends_with_length(srv):
    c = post(srv, "chat/completions", messages=[{"role": "user", "content": "A book as JSON."}], max_tokens=5,
             response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK}})["choices"][0]
    assert c["finish_reason"] == "length"
    with pytest.raises(ValueError):
        json.loads(c["message"]["content"])


def test_named_and_required_tool_calls_validate(srv):
    named = post(srv, "chat/completions", messages=ASK_WEATHER, max_tokens=60, tools=TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})["choices"][0]
    assert named["finish_reason"] == "tool_calls" and named["message"]["content"] is None
    [(name, args)] = calls_of(named["message"])
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER)
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", named["message"]["tool_calls"][0]["id"])
    add = [{"role": "user", "content": "What is 12 plus 30?"}]
    # (Greedy, this small model repeats the add call until max_tokens: one call at most there.)
    for messages, extra in ((ASK_WEATHER, {}), (ASK_WEATHER, {"temperature": 0.9, "seed": 7}),
                            (add, {"temperature": 0.9, "seed": 7}), (add, {"parallel_tool_calls": False})):
        c = post(srv, "chat/completions", messages=messages, max_tokens=120, tools=TOOLS, tool_choice="required",
                 **extra)["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        calls = calls_of(c["message"])
        assert calls and (len(calls) == 1 or "parallel_tool_calls" not in extra)
        for name, args in calls:
            jsonschema.validate(args, SCHEMAS[name])


def reassemble(events: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str]:
    """Content, tool calls and finish reason of choice 0, from OpenAI-shaped stream deltas."""
    content, calls, finish = "", {}, None
    for e in events:
        for ch in e["choices"]:
            delta = ch["delta"]
            content += delta.get("content") or ""
            for d in delta.get("tool_calls", []):
                call = calls.setdefault(d["index"], {"id": None, "type": "function",
                                                     "function": {"name": None, "arguments": ""}})
                if "id" in d:
                    assert call["id"] is None, "a call's id comes once, in its first delta"
                    call["id"], call["function"]["name"] = d["id"], d["function"]["name"]
                    assert d["type"] == "function"
                call["function"]["arguments"] += d["function"].get("arguments", "")
            finish = ch["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("case", ["named", "required", "auto"])
def test_streamed_tool_calls_reassemble_to_the_non_streamed_answer(srv, case):
    body: dict[str, Any] = {"messages": ASK_WEATHER, "max_tokens": 120, "tools": TOOLS}
    if case == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    elif case == "required":
        body["tool_choice"] = "required"
    else:  # "auto" with the hermes parser; a regex makes this small model write a call the hermes way
        body["structured_outputs"] = {"regex": r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                                               r'\{"city": "[A-Z][a-z]{1,10}", "unit": "celsius"\}\}\n</tool_call>'}
    full = post(srv, "chat/completions", **body)["choices"][0]
    content, calls, finish = reassemble(stream(srv, "chat/completions", **body))
    assert finish == full["finish_reason"] == "tool_calls"
    assert (content or "").strip() == (full["message"]["content"] or "").strip()
    strip_ids = [{**c, "id": None} for c in calls]
    assert strip_ids == [{**c, "id": None} for c in full["message"]["tool_calls"]]
    for name, args in calls_of({"tool_calls": calls}):
        jsonschema.validate(args, SCHEMAS[name])
    if case == "auto":
        assert full["message"]["content"] == "Checking.\n"


def test_tool_call_conversation_replays(srv):
    """The answer's tool call, a tool result and the next turn go back in: accepted, answered."""
    first = post(srv, "chat/completions", messages=ASK_WEATHER, max_tokens=60, tools=TOOLS,
                 tool_choice="required")["choices"][0]["message"]
    call = first["tool_calls"][0]
    messages = [{"role": "developer", "content": "Answer briefly."}, *ASK_WEATHER, first,
                {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees and sunny"}]
    r = post(srv, "chat/completions", messages=messages, max_tokens=20, tools=TOOLS, tool_choice="none")
    assert r["choices"][0]["message"]["content"] and r["usage"]["prompt_tokens"] > 20


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]
    capital: bool


def test_openai_client_parse_with_a_pydantic_model(client):
    r = client.beta.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                                           response_format=City, max_tokens=100, temperature=0)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"
    tool = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Rome."}], max_tokens=100, temperature=0,
        tools=[openai.pydantic_function_tool(City)], tool_choice={"type": "function", "function": {"name": "City"}})
    assert isinstance(tool.choices[0].message.tool_calls[0].function.parsed_arguments, City)


def test_langchain_with_structured_output(srv):
    langchain_openai = pytest.importorskip("langchain_openai")

    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{srv.url}/v1", api_key="x", temperature=0,
                                      max_tokens=60, timeout=900, max_retries=0)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Ann is 31 years old. Who is it?")
        assert isinstance(person, Person), method
