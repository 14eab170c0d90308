"""Log-likelihoods over HTTP: ``echo`` with ``logprobs`` (OpenAI's legacy shape, which lm-eval's
``local-completions`` reads), ``max_tokens: 0`` and vLLM's ``prompt_logprobs`` on both
endpoints, each against the offline engine's prompt logprobs on the same tiny model."""
from __future__ import annotations

import json

import httpx
import pytest

from tandem import SamplingParams

pytestmark = pytest.mark.timeout(600)

IDS = [5, 9, 17, 33, 8, 64, 12, 7, 99, 40, 3, 21]


@pytest.fixture(scope="module")
def want(offline):
    """The offline prompt logprobs of IDS (top 2) and the greedy continuation's logprobs."""
    return offline.generate([IDS], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2,
                                                  logprobs=2), use_tqdm=False)[0]


def post(server, path: str, **body) -> dict:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_are_the_prompt_logprobs_then_the_output_ones(server, want):
    r = post(server, "/v1/completions", prompt=IDS, echo=True, logprobs=2, max_tokens=3, temperature=0,
             ignore_eos=True)
    c = r["choices"][0]
    lp = c["logprobs"]
    n = len(IDS)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 3
    assert lp["tokens"] == [f"t{t}" for t in IDS + want.outputs[0].token_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n):
        pos = want.prompt_logprobs[i]
        assert lp["token_logprobs"][i] == pytest.approx(pos[IDS[i]].logprob, abs=1e-5)
        assert lp["top_logprobs"][i] == pytest.approx({lp_.decoded_token: lp_.logprob for lp_ in pos.values()},
                                                      abs=1e-5)
    for k, pos in enumerate(want.outputs[0].logprobs):
        assert lp["token_logprobs"][n + k] == pytest.approx(pos[want.outputs[0].token_ids[k]].logprob, abs=1e-5)
    prompt_text = " ".join(f"t{t}" for t in IDS)
    assert c["text"] == prompt_text + want.outputs[0].text
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # a request that wants prompt logprobs never takes a prefix-cache hit: 0 cached tokens
    assert r["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3,
                          "prompt_tokens_details": {"cached_tokens": 0}}


def test_lm_eval_request_shape(server, want):
    """What lm-eval's local-completions sends: a batch of token-id prompts, echo, logprobs 1,
    max_tokens 1 (and 0), temperature 0; it sums token_logprobs[ctxlen:-1] and checks greediness
    against max(top_logprobs)."""
    for max_tokens in (1, 0):
        r = post(server, "/v1/completions", model=server_model(server), prompt=[IDS, IDS[:5]], echo=True,
                 logprobs=1, max_tokens=max_tokens, temperature=0, seed=1234)
        assert [c["index"] for c in r["choices"]] == [0, 1]
        for c, ids in zip(r["choices"], (IDS, IDS[:5])):
            lp = c["logprobs"]
            assert len(lp["token_logprobs"]) == len(ids) + max_tokens
            ll = sum(lp["token_logprobs"][1:len(ids)])
            assert ll == pytest.approx(sum(want.prompt_logprobs[i][IDS[i]].logprob for i in range(1, len(ids))),
                                       abs=1e-4)
            for tok, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
                assert tok <= max(top.values()) + 1e-6 and 1 <= len(top) <= 2
            if max_tokens == 0:
                assert c["text"] == " ".join(f"t{t}" for t in ids) and c["finish_reason"] == "length"


def server_model(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def test_echo_without_logprobs_and_with_text_prompt(server):
    r = post(server, "/v1/completions", prompt="t5 t6 t7", echo=True, max_tokens=2, temperature=0)
    plain = post(server, "/v1/completions", prompt="t5 t6 t7", max_tokens=2, temperature=0)
    assert r["choices"][0]["text"] == "t5 t6 t7" + plain["choices"][0]["text"]
    assert r["choices"][0]["logprobs"] is None


def test_streamed_echo_matches_the_non_streamed_answer(server):
    body = dict(prompt=[IDS, IDS[:4]], echo=True, logprobs=2, max_tokens=4, temperature=0, ignore_eos=True, n=2)
    full = post(server, "/v1/completions", **body)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    got: dict[int, dict] = {}
    for e in events:
        for ch in e["choices"]:
            g = got.setdefault(ch["index"], {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": []})
            g["text"] += ch["text"]
            for key in g:
                if key != "text":
                    g[key] += ch["logprobs"][key]
    # (text_offset is each chunk's text position plus its tokens' lengths, as in vLLM: with this
    # tokenizer, whose decoder puts spaces between words, it is not comparable across chunkings.)
    for c in full["choices"]:
        g = got[c["index"]]
        assert g["text"] == c["text"] and g["tokens"] == c["logprobs"]["tokens"]
        assert g["token_logprobs"] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-5)
        assert g["top_logprobs"][1:] == [pytest.approx(t, abs=1e-5) for t in c["logprobs"]["top_logprobs"][1:]]


def test_prompt_logprobs_field_on_both_endpoints(server, want):
    r = post(server, "/v1/completions", prompt=IDS, prompt_logprobs=2, max_tokens=1, temperature=0)
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(IDS)
    for i in range(1, len(IDS)):
        ref = want.prompt_logprobs[i]
        assert set(plp[i]) == {str(t) for t in ref}
        for t, lp in ref.items():
            entry = plp[i][str(t)]
            assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert entry["rank"] == lp.rank and entry["decoded_token"] == f"t{t}"
    assert r["choices"][0]["logprobs"] is None
    messages = [{"role": "user", "content": "t5 t6"}]
    chat = post(server, "/v1/chat/completions", messages=messages, prompt_logprobs=1, max_tokens=1)
    ids = post(server, "/tokenize", messages=messages)["tokens"]
    assert len(chat["prompt_logprobs"]) == len(ids) and chat["prompt_logprobs"][0] is None
    assert all(str(ids[i]) in chat["prompt_logprobs"][i] for i in range(1, len(ids)))
    assert "prompt_logprobs" not in post(server, "/v1/chat/completions", messages=messages, max_tokens=1)
