"""Bad input: every case gets its status and an OpenAI error body naming the problem; after
all of them the server is healthy, holds no request and still answers a good one."""
from __future__ import annotations

from typing import Any, Optional

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "t5"}]


def comp(**kw: Any) -> dict[str, Any]:
    return {"prompt": "t5 t6", "max_tokens": 4, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": OK_MSG, "max_tokens": 4, **kw}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


# (id, method, path, body: dict for JSON / bytes for raw, status, param or None, words in the message)
CASES: list[tuple[str, str, str, Any, int, Optional[str], str]] = [
    ("malformed-json", "POST", C, b'{"prompt": "t5",', 400, None, "not valid JSON"),
    ("json-array", "POST", C, b'[1, 2]', 400, None, "JSON object"),
    ("json-string", "POST", C, b'"t5"', 400, None, "JSON object"),
    ("empty-body", "POST", C, b"", 400, None, "not valid JSON"),
    ("not-utf8", "POST", C, b'\xff\xfe{"prompt": 1}', 400, None, "not valid JSON"),
    ("missing-prompt", "POST", C, {"max_tokens": 4}, 400, "prompt", "required"),
    ("missing-messages", "POST", CHAT, {"max_tokens": 4}, 400, "messages", "required"),
    ("prompt-int", "POST", C, comp(prompt=5), 400, "prompt", "prompt must be"),
    ("prompt-empty-list", "POST", C, comp(prompt=[]), 400, "prompt", "must not be empty"),
    ("prompt-empty-string", "POST", C, comp(prompt=""), 400, "prompt", "prompt is empty"),
    ("prompt-mixed-list", "POST", C, comp(prompt=["t5", [5]]), 400, "prompt", "prompt must be"),
    ("prompt-bool-ids", "POST", C, comp(prompt=[True, 5]), 400, "prompt", "prompt must be"),
    ("token-out-of-vocab", "POST", C, comp(prompt=[5, 100000]), 400, "prompt", "token ids must be"),
    ("token-negative", "POST", C, comp(prompt=[-1, 5]), 400, "prompt", "token ids must be"),
    ("prompt-over-max-model-len", "POST", C, comp(prompt=list(range(2, 600))), 400, "prompt", "context length"),
    ("prompt-plus-max-tokens-over", "POST", C, comp(prompt=list(range(2, 500)), max_tokens=100), 400,
     "max_tokens", "context length"),
    ("chat-prompt-plus-max-tokens-over", "POST", CHAT, chat(max_tokens=600), 400, "max_tokens", "context length"),
    ("chat-prompt-over-max-model-len", "POST", CHAT, chat(messages=[{"role": "user", "content": "t5 " * 600}]), 400,
     "messages", "context length"),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), 400, "max_tokens", "0 is allowed only with echo"),
    ("max-tokens-zero-chat", "POST", CHAT, chat(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    ("max-tokens-zero-min-tokens", "POST", C, comp(max_tokens=0, echo=True, min_tokens=2), 400, "min_tokens",
     "must be 0"),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-5), 400, "max_tokens", "greater than or equal"),
    ("max-tokens-string", "POST", C, comp(max_tokens="10"), 400, "max_tokens", "valid integer"),
    ("max-tokens-float", "POST", C, comp(max_tokens=2.5), 400, "max_tokens", "valid integer"),
    ("max-completion-tokens-zero", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", ""),
    ("temperature-negative", "POST", C, comp(temperature=-0.1), 400, "temperature", "greater than or equal"),
    ("temperature-too-high", "POST", C, comp(temperature=3), 400, "temperature", "less than or equal"),
    ("temperature-string", "POST", C, comp(temperature="hot"), 400, "temperature", "valid number"),
    ("temperature-nan", "POST", C, b'{"prompt": "t5", "temperature": NaN}', 400, "temperature", "finite"),
    ("top-p-zero", "POST", C, comp(top_p=0), 400, "top_p", "greater than 0"),
    ("top-p-over-one", "POST", C, comp(top_p=1.5), 400, "top_p", "less than or equal"),
    ("top-k-below-minus-one", "POST", C, comp(top_k=-2), 400, "top_k", "greater than or equal"),
    ("min-p-over-one", "POST", C, comp(min_p=2), 400, "min_p", "less than or equal"),
    ("presence-penalty-range", "POST", C, comp(presence_penalty=3), 400, "presence_penalty", "less than"),
    ("frequency-penalty-range", "POST", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty", "greater"),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), 400, "repetition_penalty", "greater"),
    ("n-zero", "POST", C, comp(n=0), 400, "n", "greater than or equal to 1"),
    ("n-over-limit", "POST", C, comp(n=1000), 400, "n", "at most 8"),
    ("n-bool", "POST", CHAT, chat(n=True), 400, "n", "valid integer"),
    ("too-many-prompts", "POST", C, comp(prompt=["t5"] * 17), 400, "prompt", "at most 16"),
    ("logprobs-negative", "POST", C, comp(logprobs=-1), 400, "logprobs", "greater than or equal"),
    ("logprobs-over-max", "POST", C, comp(logprobs=50), 400, "logprobs", "max_logprobs"),
    ("top-logprobs-over-20", "POST", CHAT, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs", "less"),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "requires"),
    ("chat-logprobs-int", "POST", CHAT, chat(logprobs=3), 400, "logprobs", "valid boolean"),
    ("logit-bias-not-a-token-id", "POST", C, comp(logit_bias={"abc": 10}), 400, "logit_bias", "token ids"),
    ("logit-bias-over-100", "POST", C, comp(logit_bias={"5": 101}), 400, "logit_bias", "[-100, 100]"),
    ("logit-bias-out-of-vocab", "POST", C, comp(logit_bias={"100000": 1}), 400, "logit_bias", "token ids must be"),
    ("logit-bias-value-string", "POST", CHAT, chat(logit_bias={"5": "high"}), 400, "logit_bias.5", "valid number"),
    ("logit-bias-bad-shape", "POST", CHAT, chat(logit_bias=[1, 2]), 400, "logit_bias", "valid dictionary"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), 400, "stop", "non-empty"),
    ("stop-int", "POST", C, comp(stop=5), 400, "stop", ""),
    ("too-many-stops", "POST", C, comp(stop=[f"s{i}" for i in range(20)]), 400, "stop", "at most 16"),
    ("stop-token-ids-negative", "POST", C, comp(stop_token_ids=[-1]), 400, "stop_token_ids", "non-negative"),
    ("seed-string", "POST", C, comp(seed="abc"), 400, "seed", "valid integer"),
    ("seed-huge", "POST", C, comp(seed=2 ** 70), 400, "seed", "less than or equal"),
    ("min-tokens-over-max", "POST", C, comp(min_tokens=10, max_tokens=2), 400, "min_tokens", "min_tokens"),
    ("unknown-field", "POST", C, comp(bogus=1), 400, "bogus", "Unrecognized request argument"),
    # -- tools (this server runs without --enable-auto-tool-choice) --
    ("tools-auto-without-parser", "POST", CHAT, chat(tools=TOOLS), 400, "tool_choice", "--enable-auto-tool-choice"),
    ("tool-choice-without-tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool_choice", "needs tools"),
    ("tool-choice-missing-tool", "POST", CHAT, chat(tools=TOOLS, tool_choice=named("nope")), 400, "tool_choice",
     "'nope', which is not among the tools"),
    ("tool-choice-bad-value", "POST", CHAT, chat(tools=TOOLS, tool_choice="always"), 400, "tool_choice",
     'must be "none", "auto", "required"'),
    ("tool-invalid-parameter-schema", "POST", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
          tool_choice="required"), 400, "tools[0].function.parameters", "invalid JSON schema"),
    ("tool-duplicate-names", "POST", CHAT, chat(tools=TOOLS + TOOLS, tool_choice="required"), 400, "tools",
     "given twice"),
    ("tool-not-a-function", "POST", CHAT, chat(tools=[{"type": "retrieval"}], tool_choice="required"), 400,
     "tools[0].type", ""),
    ("tool-choice-and-response-format", "POST", CHAT,
     chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), 400, "response_format",
     "constrains the output already"),
    ("tools-on-completions", "POST", C, comp(tools=TOOLS), 400, "tools", "not supported"),
    # -- output constraints --
    ("response-format-bad-type", "POST", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type",
     ""),
    ("response-format-json-schema-missing", "POST", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format", "needs json_schema"),
    ("response-format-invalid-schema", "POST", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}), 400,
     "response_format.json_schema.schema", "invalid JSON schema"),
    ("structured-outputs-two-kinds", "POST", C, comp(structured_outputs={"regex": "a", "choice": ["b"]}), 400,
     "structured_outputs", "exactly one of"),
    ("structured-outputs-unknown-key", "POST", CHAT, chat(structured_outputs={"jsn": {}}), 400,
     "structured_outputs", "did you mean 'json'"),
    ("structured-outputs-json-not-json", "POST", C, comp(structured_outputs={"json": "{oops"}), 400,
     "structured_outputs", "not valid JSON"),
    ("two-constraints", "POST", C, comp(structured_outputs={"regex": "t5"}, guided_choice=["t6"]), 400,
     "guided_choice", "at most one output constraint"),
    ("regex-does-not-compile", "POST", C, comp(structured_outputs={"regex": "t[5"}), 400, "structured_outputs",
     "does not compile"),
    ("regex-does-not-compile-stream", "POST", CHAT, chat(structured_outputs={"regex": "t[5"}, stream=True), 400,
     "structured_outputs", "does not compile"),
    ("grammar-does-not-compile", "POST", CHAT, chat(guided_grammar="root ::= ("), 400, "guided_grammar",
     "does not compile"),
    ("suffix", "POST", C, comp(suffix="t9"), 400, "suffix", "not supported"),
    ("chat-echo", "POST", CHAT, chat(echo=True), 400, "echo", "not supported"),
    ("prompt-logprobs-stream", "POST", C, comp(prompt_logprobs=1, stream=True), 400, "prompt_logprobs",
     "not available when stream"),
    ("chat-prompt-logprobs-stream", "POST", CHAT, chat(prompt_logprobs=1, stream=True), 400, "prompt_logprobs",
     "not available when stream"),
    ("prompt-logprobs-negative", "POST", C, comp(prompt_logprobs=-1), 400, "prompt_logprobs", "greater than or"),
    ("prompt-logprobs-over-max", "POST", CHAT, chat(prompt_logprobs=50), 400, None, "max_logprobs"),
    ("best-of", "POST", C, comp(best_of=3), 400, "best_of", "not supported"),
    ("unknown-model", "POST", C, comp(model="gpt-9"), 404, "model", "does not exist"),
    ("unknown-model-chat", "POST", CHAT, chat(model="gpt-9"), 404, "model", "does not exist"),
    ("empty-messages", "POST", CHAT, chat(messages=[]), 400, "messages", "at least 1"),
    ("invalid-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "t5"}]), 400, "messages[0].role",
     "'system', 'developer', 'user', 'assistant' or 'tool'"),
    ("tool-message-without-id", "POST", CHAT, chat(messages=[{"role": "tool", "content": "t5"}]), 400, "messages[0]",
     "needs the tool_call_id"),
    ("user-content-null", "POST", CHAT, chat(messages=[{"role": "user", "content": None}]), 400, "messages[0]",
     "null only for an assistant message with tool_calls"),
    ("tool-calls-on-user", "POST", CHAT, chat(messages=[{"role": "user", "content": "t5", "tool_calls": [CALL]}]),
     400, "messages[0]", "only assistant messages carry tool_calls"),
    ("assistant-refusal", "POST", CHAT, chat(messages=[{"role": "assistant", "content": "t5", "refusal": "t6"}]),
     400, "messages[0].refusal", "should be None"),
    ("tool-call-arguments-object", "POST", CHAT,
     chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {
         "name": "f", "arguments": {"a": 1}}}]}]), 400, "messages[0].tool_calls[0].function.arguments", ""),
    ("content-int", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content",
     "string or a list of text parts"),
    ("content-image", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content", "only text content parts"),
    ("message-missing-content", "POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content",
     "required"),
    ("message-not-object", "POST", CHAT, chat(messages=["hi"]), 400, "messages[0]", ""),
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), 400,
     "stream_options", "only allowed when stream"),
    ("stream-string", "POST", C, comp(stream="yes"), 400, "stream", "valid boolean"),
    ("body-too-large", "POST", C, {"prompt": "t5 " * 100_000}, 413, None, "larger than"),
    ("unknown-route", "GET", "/v1/nothing-here", None, 404, None, "Not Found"),
    ("wrong-method", "GET", C, None, 405, None, "Method Not Allowed"),
    ("tokenize-both", "POST", "/tokenize", {"prompt": "t5", "messages": OK_MSG}, 400, "prompt", "exactly one"),
    ("tokenize-unknown-model", "POST", "/tokenize", {"prompt": "t5", "model": "x"}, 404, "model", "does not exist"),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [5, 999999]}, 400, "tokens", "must be in"),
    ("detokenize-strings", "POST", "/detokenize", {"tokens": ["t5"]}, 400, "tokens[0]", "valid integer"),
]


def test_the_matrix_is_large_enough():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_openai_error(server, case):
    _, method, path, body, status, param, words = case
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw["content"] = body
        kw["headers"] = {"Content-Type": "application/json"}
    elif body is not None:
        kw["json"] = body
    r = httpx.request(method, server.url + path, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert words in err["message"], err
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err


def test_server_is_healthy_after_bad_input(server):
    # Runs after the matrix (file order): nothing was lost, nothing is left running.
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", json=comp(max_tokens=3, temperature=0), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    m = server.metrics()
    assert m["tandem:num_requests_running"] == 0 and m["tandem:kv_cache_used_blocks"] == 0
