"""The real server, driven by the official ``openai`` client, against the offline ``LLM``."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)

# Words of the test tokenizer; none starts with t1 or t0, which it would split off as the
# special tokens t1 (EOS) and t0 (BOS).
PROMPTS = ["t5 t6 t7", "t9 t20 t21 t22 t23", "t40", "t7 t7 t7 t8 t99 t30 t3"]


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def reference(offline: LLM, prompts: list, **kw) -> list[str]:
    outs = offline.generate(prompts, SamplingParams(**kw), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_health_version_models(server, model, tiny_llama):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert "version" in httpx.get(f"{server.url}/version").json()
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["id"] == model == tiny_llama and card["max_model_len"] == 512


def test_greedy_completions_match_offline(client, model, offline):
    want = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, out in zip(PROMPTS, want):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == out.outputs[0].text
        assert r.choices[0].finish_reason == out.outputs[0].finish_reason
        n_prompt = len(prompt.split())
        assert r.usage.prompt_tokens == n_prompt
        assert r.usage.completion_tokens == len(out.outputs[0].token_ids)
        assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens


def test_token_id_prompts_and_prompt_lists(client, model, offline):
    ids = [[5, 6, 7], [9, 10, 11, 12, 13]]
    want = reference(offline, ids, temperature=0, max_tokens=8)
    r = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == want
    single = client.completions.create(model=model, prompt=ids[1], max_tokens=8, temperature=0)
    assert single.choices[0].text == want[1]
    texts = client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.text for c in texts.choices] == reference(offline, PROMPTS[:2], temperature=0, max_tokens=8)
    assert texts.usage.prompt_tokens == 3 + 5


def test_chat_goes_through_the_template(server, client, model, offline):
    messages = [{"role": "system", "content": "t20 t21"}, {"role": "user", "content": "t5 t6"},
                {"role": "assistant", "content": [{"type": "text", "text": "t7"}]},
                {"role": "user", "content": [{"type": "text", "text": "t8 "}, {"type": "text", "text": "t9"}]}]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    # system : t20 t21 t2 user : t5 t6 t2 assistant : t7 t2 user : t8 t9 t2 t3 (":" is unknown: t0)
    assert ids == [0, 0, 20, 21, 2, 0, 0, 5, 6, 2, 0, 0, 7, 2, 0, 0, 8, 9, 2, 3]
    want = reference(offline, [ids], temperature=0, max_tokens=10)[0]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)
    r2 = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, temperature=0)
    assert r2.choices[0].message.content == want


def _streamed_completion(client, **kw) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_streamed_text_equals_non_streamed_for_the_same_seed(client, model):
    kw = dict(model=model, prompt="t5 t6 t7", max_tokens=20, temperature=1.0, seed=11, n=2)
    full = client.completions.create(**kw)
    texts, reasons, usage = _streamed_completion(client, **kw)
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens

    chat_kw = dict(model=model, messages=[{"role": "user", "content": "t9 t20"}], max_tokens=20, temperature=1.0,
                   seed=5, n=2)
    full_chat = client.chat.completions.create(**chat_kw)
    got: dict[int, str] = {}
    roles = set()
    usage_seen = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat_kw):
        usage_seen = chunk.usage or usage_seen
        for c in chunk.choices:
            roles.add(c.delta.role)
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
    assert got == {c.index: c.message.content for c in full_chat.choices}
    assert "assistant" in roles
    assert usage_seen is not None and usage_seen.total_tokens == full_chat.usage.total_tokens


def test_continuous_usage_stats_counts_up_in_every_chunk(client, model):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it): every chunk with
    choices carries the usage so far, rising to the final usage chunk's figures."""
    kw = dict(model=model, prompt="t5 t6 t7", max_tokens=12, temperature=0, n=2, extra_body={"ignore_eos": True})
    options = {"include_usage": True, "continuous_usage_stats": True}
    seen, final = [], None
    for chunk in client.completions.create(stream=True, stream_options=options, **kw):
        if chunk.choices:
            assert chunk.usage is not None, chunk
            assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
            seen.append(chunk.usage.completion_tokens)
        else:
            final = chunk.usage
    assert final is not None and final.completion_tokens == 24
    assert seen == sorted(seen) and seen[-1] == 24 and seen[0] >= 1
    assert final == client.completions.create(**kw).usage
    plain = [c.usage for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
             if c.choices]
    assert plain and all(u is None for u in plain), "usage only in the last chunk without continuous_usage_stats"


def test_seed_reproducible_and_n_choices_differ(client, model):
    kw = dict(model=model, prompt="t30 t31", max_tokens=16, temperature=1.0, n=2)
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    c = client.completions.create(seed=8, **kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert a.choices[0].text != a.choices[1].text  # n > 1 children get their own seeds
    assert [x.text for x in a.choices] != [x.text for x in c.choices]


def test_stop_strings_streamed_and_not(client, model, offline):
    full = reference(offline, ["t9 t20 t21 t22 t23"], temperature=0, max_tokens=12, ignore_eos=True)[0]
    words = full.split()
    stop = words[3]
    cut = full[: full.index(stop)]  # the earliest match of the text, which may be inside an earlier word
    kw = dict(model=model, prompt="t9 t20 t21 t22 t23", max_tokens=12, temperature=0, stop=[stop, "zzz"],
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    texts, reasons, _ = _streamed_completion(client, **kw)
    assert texts[0] == cut and reasons[0] == "stop"
    inc = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}})
    assert inc.choices[0].text.endswith(stop) and inc.choices[0].text.startswith(cut)


def test_lengths_and_vllm_extras(client, model, offline):
    r = client.completions.create(model=model, prompt="t5", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True, "min_tokens": 5})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    # top_k=1 samples the argmax whatever the temperature.
    greedy = reference(offline, ["t5 t6"], temperature=0, max_tokens=8)[0]
    k1 = client.completions.create(model=model, prompt="t5 t6", max_tokens=8, temperature=1.5, seed=3,
                                   extra_body={"top_k": 1})
    assert k1.choices[0].text == greedy
    pen = client.completions.create(model=model, prompt="t5 t6", max_tokens=8, temperature=0, presence_penalty=1.5,
                                    frequency_penalty=1.0, top_p=0.9, extra_body={"repetition_penalty": 1.3,
                                                                                  "min_p": 0.05})
    want = reference(offline, ["t5 t6"], temperature=0, max_tokens=8, presence_penalty=1.5, frequency_penalty=1.0,
                     top_p=0.9, repetition_penalty=1.3, min_p=0.05)[0]
    assert pen.choices[0].text == want
    first = int(greedy.split()[0][1:])
    stopped = client.completions.create(model=model, prompt="t5 t6", max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [first]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt="t5 t6 t7", max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(" " + t for t in lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 3 <= len(top) <= 4
        assert top[tok] == pytest.approx(val) and val == pytest.approx(max(top.values()))  # greedy: the top one
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "t5"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(" " + c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode() == c.token
    none = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "t5"}], max_tokens=2)
    assert none.choices[0].logprobs is None


def test_64_concurrent_streams_are_correct(server, model, offline):
    prompts = [f"t{20 + i % 50} t{2 + i % 7} t{(3 * i) % 80 + 20}" for i in range(64)]
    want = reference(offline, prompts, temperature=0, max_tokens=24, ignore_eos=True)

    async def one(c: openai.AsyncOpenAI, prompt: str) -> str:
        text = ""
        stream = await c.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += "".join(ch.text for ch in chunk.choices)
        return text

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=64))) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in prompts)), 300)

    assert asyncio.run(run()) == want


def test_logit_bias_is_applied(client, model):
    """OpenAI's string token ids; +100 makes t42 the only choice, in completions and chat."""
    out = client.completions.create(model=model, prompt="t5 t6", max_tokens=5, temperature=0,
                                    logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text.split() == ["t42"] * 5
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "t5"}], max_tokens=3,
                                          temperature=0.9, logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content.split() == ["t42"] * 3
