"""Fields real clients send (issue 21), in raw HTTP against the real server: each accepted
field either changes the prompt or output as vLLM's does, or changes nothing and is logged
once; the tokenizer is discoverable (/tokenizer_info, /v1/models); usage reports cached tokens."""
from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest

from server_utils import CHAT_TEMPLATE

pytestmark = pytest.mark.timeout(300)

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "t5 t6"}]
GREEDY = {"max_tokens": 6, "temperature": 0}


def post(server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(server, **body: Any) -> list[int]:
    return post(server, "/tokenize", body)["tokens"]


def warnings_for(server, name: str) -> int:
    return server.log.read_text().count(f"ignoring the request field {name!r}")


# Accepted and ignored: none may change the output. Values are the kinds clients send.
IGNORED_CHAT = {"store": True, "metadata": {"run": "r1"}, "service_tier": "auto", "prompt_cache_key": "k1",
                "safety_identifier": "user-1", "include_reasoning": False}
IGNORED_BOTH = {"request_id": "req-1", "session_id": "s1", "stream_interval": 4, "return_token_offsets": True,
                "return_mm_kwargs": False, "routed_experts_prompt_start": 0, "truncation_side": "left"}
# Refused fields with values that ask for nothing: accepted and dropped (no warning needed).
HARMLESS_CHAT = {"n": None, "stream": None, "logprobs": None, "functions": None, "function_call": None,
                 "tools": None, "echo": False, "modalities": ["text"], "use_beam_search": False,
                 "length_penalty": 1.0, "priority": 0, "bad_words": [], "thinking_token_budget": -1,
                 "return_token_ids": False, "mm_processor_kwargs": {}, "chat_template": None}
HARMLESS_COMPLETIONS = {"n": None, "echo": False, "suffix": "", "best_of": 1, "use_beam_search": False,
                        "watermarking": False, "vllm_xargs": {}, "prompt_embeds": None, "cache_salt": None}


def test_chat_fields_that_change_nothing_are_accepted_and_warned_once(server):
    want = post(server, CHAT, {"messages": MSG, **GREEDY})
    parts = [{"type": "text", "text": "t5 ", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "t6"}]
    body = {"messages": [{"role": "user", "content": parts}], **GREEDY, **IGNORED_CHAT, **IGNORED_BOTH,
            **HARMLESS_CHAT}
    for _ in range(2):
        got = post(server, CHAT, body)
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    for name in [*IGNORED_CHAT, *IGNORED_BOTH, "cache_control"]:
        assert warnings_for(server, name) == 1, (name, server.log.read_text()[-3000:])
    for name in HARMLESS_CHAT:
        assert warnings_for(server, name) == 0, name


def test_completion_fields_that_change_nothing_are_accepted(server):
    want = post(server, C, {"prompt": "t5 t6 t7", **GREEDY})
    got = post(server, C, {"prompt": "t5 t6 t7", **GREEDY, **IGNORED_BOTH, **HARMLESS_COMPLETIONS})
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    streamed = httpx.post(server.url + C, timeout=60, json={
        "prompt": "t5 t6 t7", **GREEDY, "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert streamed.status_code == 200
    text = "".join(c["text"] for line in streamed.text.splitlines() if line.startswith("data: {")
                   for c in json.loads(line[6:])["choices"])
    assert text == want["choices"][0]["text"]


def test_chat_template_kwargs_documents_and_reasoning_effort_reach_the_template(server):
    plain = tokenize(server, messages=MSG)
    assert plain == [0, 0, 5, 6, 2, 3]  # user : t5 t6 t2 t3 (":" and "user" are unknown: t0)
    assert tokenize(server, messages=MSG, chat_template_kwargs={"hint": "t22"}) == [22] + plain
    assert tokenize(server, messages=MSG, documents=[{"title": "a", "text": "t23 t24"}]) == [23, 24] + plain
    assert tokenize(server, messages=MSG, reasoning_effort="low") == [30] + plain  # enable_thinking true
    assert tokenize(server, messages=MSG, reasoning_effort="none") == [31] + plain
    # chat_template_kwargs win over what reasoning_effort implies, as in vLLM
    assert tokenize(server, messages=MSG, reasoning_effort="high",
                    chat_template_kwargs={"enable_thinking": False}) == [31] + plain
    # the same prompts through chat completions: the prompt grows, and the output is the
    # continuation of exactly those ids
    for body, ids in (({"chat_template_kwargs": {"hint": "t22"}}, [22] + plain),
                      ({"documents": [{"text": "t23 t24"}], "reasoning_effort": "minimal"}, [23, 24, 30] + plain)):
        r = post(server, CHAT, {"messages": MSG, **GREEDY, **body})
        assert r["usage"]["prompt_tokens"] == len(ids)
        assert r["choices"][0]["message"]["content"] == post(server, C, {"prompt": ids, **GREEDY})["choices"][0]["text"]


def test_continue_final_message_and_add_generation_prompt(server):
    msgs = MSG + [{"role": "assistant", "content": "t7 t8"}]
    full = tokenize(server, messages=msgs)
    assert full == [0, 0, 5, 6, 2, 0, 0, 7, 8, 2, 3]
    assert tokenize(server, messages=msgs, add_generation_prompt=False) == full[:-1]
    cont = tokenize(server, messages=msgs, continue_final_message=True)
    assert cont == full[:-2]  # ends inside the assistant message: no end of turn, no generation prompt
    r = post(server, CHAT, {"messages": msgs, **GREEDY, "continue_final_message": True})
    assert r["usage"]["prompt_tokens"] == len(cont)
    assert r["choices"][0]["message"]["content"] == post(server, C, {"prompt": cont, **GREEDY})["choices"][0]["text"]
    # explicit add_generation_prompt false with continue_final_message is the same request
    r2 = post(server, CHAT, {"messages": msgs, **GREEDY, "continue_final_message": True,
                             "add_generation_prompt": False})
    assert r2["choices"][0]["message"] == r["choices"][0]["message"]


def test_add_special_tokens_and_spaces_between_special_tokens(server):
    ids = tokenize(server, prompt="t5 t6")
    assert tokenize(server, prompt="t5 t6", add_special_tokens=False) == ids == [5, 6]  # the tiny tokenizer adds none
    want = post(server, C, {"prompt": "t5 t6", **GREEDY})
    for extra in ({"add_special_tokens": False}, {"spaces_between_special_tokens": False},
                  {"spaces_between_special_tokens": True, "skip_special_tokens": False}):
        got = post(server, C, {"prompt": "t5 t6", **GREEDY, **extra})
        assert got["usage"]["prompt_tokens"] == 2
        if "skip_special_tokens" not in extra:
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
    chat = post(server, CHAT, {"messages": MSG, **GREEDY, "add_special_tokens": True,
                               "spaces_between_special_tokens": False})
    assert chat["usage"]["prompt_tokens"] == len(tokenize(server, messages=MSG, add_special_tokens=True))


def test_tokenizer_is_discoverable(server, tiny_llama):
    """/tokenizer_info (vLLM's shape, what lm-eval's remote tokenizer reads) and /v1/models
    both name a folder that loads the very tokenizer the server uses."""
    from transformers import AutoTokenizer

    info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "t1" and info["bos_token"] == "t0" and info["unk_token"] == "t0"
    assert info["tokenizer_class"] and info["chat_template"] == CHAT_TEMPLATE
    assert "vocab_file" not in info
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert card["tokenizer"] == info["name_or_path"]
    tok = AutoTokenizer.from_pretrained(card["tokenizer"])
    text = "t5 t9 t77 t3"
    assert tok(text, add_special_tokens=False).input_ids == tokenize(server, prompt=text, add_special_tokens=False)
    assert tok.decode([5, 9, 77]) == post(server, "/detokenize", {"tokens": [5, 9, 77]})["prompt"]


def _stream_usages(server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[6:])["usage"] for line in r.iter_lines()
                if line.startswith("data: {") and json.loads(line[6:]).get("usage")]


def test_usage_reports_cached_prompt_tokens(server):
    prompt = " ".join(f"t{60 + i}" for i in range(40))  # 40 tokens: two full 16-token blocks to reuse
    first = post(server, C, {"prompt": prompt, **GREEDY})
    assert set(first["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    again = post(server, C, {"prompt": prompt, **GREEDY})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # two blocks; the rest is computed
    assert again["usage"]["prompt_tokens"] == 40
    usages = _stream_usages(server, C, {"prompt": prompt, **GREEDY,
                                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert len(usages) >= 2 and all(u["prompt_tokens_details"]["cached_tokens"] == 32 for u in usages)
    # chat: the same conversation twice ("user : <40 tokens> t2 t3" through the template: 44 tokens)
    msgs = [{"role": "user", "content": prompt}]
    post(server, CHAT, {"messages": msgs, **GREEDY})
    usages = _stream_usages(server, CHAT, {"messages": msgs, **GREEDY, "stream_options": {"include_usage": True}})
    assert len(usages) == 1 and usages[0]["prompt_tokens_details"]["cached_tokens"] == 32
    chat = post(server, CHAT, {"messages": msgs, **GREEDY})
    assert chat["usage"]["prompt_tokens"] == 44 and chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_engine_core_threads_wait_passively(server):
    """The process that runs the model got tandem's OpenMP wait policy in its environment
    before it loaded torch (issue 21: spinning threads stall beside a busy neighbour)."""
    with open(f"/proc/{server.core_pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        pytest.skip("the test run set its own OpenMP wait policy")
    assert env.get(b"OMP_WAIT_POLICY") == b"PASSIVE" and env.get(b"KMP_BLOCKTIME") == b"0", env
