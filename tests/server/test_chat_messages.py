"""A tool-call conversation replayed through the chat template: ``developer`` as ``system``,
``tool`` results with their ``tool_call_id``, assistant turns with ``content: null`` and
``tool_calls`` (arguments as objects, as HF templates read them), and ``tools`` offered to
the template unless ``tool_choice`` is ``"none"``; the server runs two API-server processes,
and the tool flags reach both.

The tiny model's template spells every part of a message in the tokenizer's words, and the
prompt the server built is read back from ``prompt_logprobs`` (with k = 0 each position
holds exactly its prompt token). Its words never start with t0 or t1, which the tokenizer
splits off as the special tokens BOS and EOS."""
from __future__ import annotations

import httpx
import pytest

from proc_utils import children_of, cmdline
from server_utils import ServerProcess

pytestmark = pytest.mark.timeout(600)

TEMPLATE = (
    "t9 {% if tools %}t60 {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}t30 {% elif m.role == 'user' %}t31 {% elif m.role == 'assistant' %}t32 "
    "{% elif m.role == 'tool' %}t33 {{ m.tool_call_id }} {% else %}t99 {% endif %}"
    "{{ m.content }} {% for c in m.tool_calls or [] %}t34 {{ c.function.name }} {{ c.function.arguments.x }} "
    "{% endfor %}t2 {% endfor %}{% if add_generation_prompt %}t3{% endif %}")

TOOLS = [{"type": "function", "function": {"name": "t50", "description": "a tool",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "developer", "content": "t20"},
    {"role": "user", "content": "t21"},
    {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None, "function_call": None,
     "tool_calls": [{"id": "call-1", "type": "function", "function": {"name": "t50", "arguments": '{"x": "t42"}'}}]},
    {"role": "tool", "tool_call_id": "t77", "content": [{"type": "text", "text": "t43"}]},
    {"role": "assistant", "tool_calls": [{"id": "call-2", "type": "function",
                                          "function": {"name": "t51", "arguments": '{"x": "t44"}'}}]},
    {"role": "tool", "tool_call_id": "t78", "content": "t45"},
    {"role": "user", "content": "t22"},
]


@pytest.fixture(scope="module")
def tool_server(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool_server")
    template = tmp / "tools.jinja"
    template.write_text(TEMPLATE)
    s = ServerProcess(tiny_llama, "--max-model-len", "256", "--num-kv-blocks", "128", "--chat-template", str(template),
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--api-server-count", "2",
                      tmp=tmp, chat_template=False)
    yield s
    assert s.stop() == 0


def prompt_words(server, **body) -> list[str]:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"max_tokens": 2, "prompt_logprobs": 0, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    return ["t9"] + [f"t{next(iter(pos))}" for pos in plp[1:]]


def test_tool_conversation_reaches_the_template(tool_server):
    got = prompt_words(tool_server, messages=CONVERSATION, tools=TOOLS)  # tool_choice "auto" by default
    want = ("t9 t60 t50 t30 t20 t2 t31 t21 t2 t32 t34 t50 t42 t2 t33 t77 t43 t2 t32 t34 t51 t44 t2 "
            "t33 t78 t45 t2 t31 t22 t2 t3").split()
    assert got == want


def test_tokenize_offers_the_tools_as_chat_does(tool_server):
    """/tokenize with messages and tools counts the prompt chat completions builds."""
    r = httpx.post(f"{tool_server.url}/tokenize", json={"messages": CONVERSATION, "tools": TOOLS}, timeout=120)
    assert r.status_code == 200, r.text
    assert [f"t{i}" for i in r.json()["tokens"]] == prompt_words(tool_server, messages=CONVERSATION, tools=TOOLS)
    r = httpx.post(f"{tool_server.url}/tokenize", json={"prompt": "t5", "tools": TOOLS}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_tool_choice_none_offers_no_tools(tool_server):
    got = prompt_words(tool_server, messages=CONVERSATION[:2], tools=TOOLS, tool_choice="none")
    assert got == "t9 t30 t20 t2 t31 t21 t2 t3".split()


def test_auto_without_calls_is_plain_content(tool_server):
    """The hermes parser finds no call in this model's words: the answer is content, as without tools."""
    body = {"messages": CONVERSATION, "max_tokens": 6, "temperature": 0}
    plain = httpx.post(f"{tool_server.url}/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"},
                       timeout=120).json()["choices"][0]
    auto = httpx.post(f"{tool_server.url}/v1/chat/completions", json={**body, "tools": TOOLS}, timeout=120).json()
    choice = auto["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] in ("stop", "length")
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert auto["usage"]["prompt_tokens"] > 0 and plain["finish_reason"] in ("stop", "length")


def test_the_flags_reach_every_api_server_process(tool_server):
    """Two API-server processes: each parses "auto" (neither refuses it as unconfigured), and
    neither has loaded a grammar library (compiling is the engine core's)."""
    seen: set[str] = set()
    for _ in range(40):
        with httpx.Client(timeout=120) as c:  # a fresh connection: the kernel picks the process
            r = c.post(f"{tool_server.url}/v1/chat/completions",
                       json={"messages": CONVERSATION[:2], "tools": TOOLS, "max_tokens": 2})
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-tandem-api-server"])
        if len(seen) == 2:
            break
    assert seen == {"1", "2"}
    for pid in children_of(tool_server.proc.pid):
        if "tandem.entrypoints.openai.server_process" in cmdline(pid):
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            assert "xgrammar" not in maps and "llguidance" not in maps and "libtorch" not in maps
