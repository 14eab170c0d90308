"""Benchmark workloads: random prompts, ShareGPT and prompt/output_len files, and their errors."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional, Sequence

import aiohttp
import pytest

from openai_stub import FakeOpenAIServer
from tandem.bench.datasets import (SHAREGPT_MAX_PROMPT_LEN, DatasetError, SampleRequest, load_file_dataset,
                                   random_requests, to_text_prompts)
from tandem.bench.tokenizers import LocalTokenizer, ServerTokenizer, TokenizerError

pytestmark = pytest.mark.timeout(60)


class WordTokenizer:
    """Test double of a tokenizer: one token per whitespace-separated word."""

    vocab_size: Optional[int] = None

    def __init__(self) -> None:
        self.calls = 0

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        self.calls += 1
        return [[len(w) for w in t.split()] for t in texts]

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return [" ".join(f"t{i}" for i in x) for x in ids]


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def load(path, n=100, tok=None, **kw) -> list[SampleRequest]:
    return asyncio.run(load_file_dataset(str(path), n, tok if tok is not None else WordTokenizer(), **kw))


def conv(human: str, gpt: str) -> dict:
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


# ------------------------------------------------------------------------------ random


def test_random_exact_lengths_and_ids():
    reqs = random_requests(20, input_len=32, output_len=8, vocab_size=50, seed=0)
    assert len(reqs) == 20
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len == 32
        assert r.expected_output_len == 8
        assert all(isinstance(t, int) and 0 <= t < 50 for t in r.prompt)
    assert len({tuple(r.prompt) for r in reqs}) == 20  # not all the same prompt


def test_random_range_ratio_bounds():
    reqs = random_requests(400, input_len=100, output_len=10, range_ratio=0.5, seed=1)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and min(outs) >= 5 and max(outs) <= 15
    assert min(ins) < 60 and max(ins) > 140  # the whole range is used
    assert all(t < 128 for r in reqs for t in r.prompt)  # default id range fits any vocabulary


def test_random_prefix_is_shared():
    reqs = random_requests(10, input_len=5, output_len=3, prefix_len=16, vocab_size=1000, seed=2)
    prefix = reqs[0].prompt[:16]
    assert all(r.prompt[:16] == prefix and r.prompt_len == 21 for r in reqs)
    assert len({tuple(r.prompt[16:]) for r in reqs}) > 1


def test_random_seeded():
    a = random_requests(5, 10, 4, 0.3, seed=3)
    assert a == random_requests(5, 10, 4, 0.3, seed=3)
    assert a != random_requests(5, 10, 4, 0.3, seed=4)


def test_random_bad_settings():
    for kw in (dict(range_ratio=1.0), dict(range_ratio=-0.1), dict(prefix_len=-1), dict(output_len=0)):
        args = dict(num_prompts=3, input_len=10, output_len=5) | kw
        with pytest.raises(DatasetError):
            random_requests(**args)
    with pytest.raises(DatasetError):
        random_requests(0, 10, 5)


def test_random_to_text_for_chat():
    reqs = random_requests(3, 4, 2, vocab_size=20, seed=0)
    text = asyncio.run(to_text_prompts(reqs, WordTokenizer()))
    for before, after in zip(reqs, text):
        assert after.prompt == " ".join(f"t{i}" for i in before.prompt)
        assert after.prompt_len == 4 and after.expected_output_len == 2
    with pytest.raises(DatasetError):
        asyncio.run(to_text_prompts(reqs, None))


# ------------------------------------------------------------------------------- files


def test_sharegpt_json_list_filters_like_vllm(tmp_path: Path):
    data = [
        conv(words(10), words(20)),                     # ok: 10 in, 20 out
        conv(words(3), words(20)),                      # prompt too short (< 4)
        conv(words(10), words(2)),                      # output too short (< 4)
        conv(words(SHAREGPT_MAX_PROMPT_LEN + 1), words(5)),  # prompt too long
        conv(words(1000), words(1100)),                 # total too long (> 2048)
        {"conversations": [{"from": "human", "value": "only one turn"}]},  # no pair
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": words(6)},
                           {"from": "gpt", "value": words(7)}]},  # pair after a system turn
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = load(path)
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(6, 7), (10, 20)]
    assert all(isinstance(r.prompt, str) for r in reqs)


def test_sharegpt_output_len_override_and_sampling(tmp_path: Path):
    path = tmp_path / "sharegpt.jsonl"
    rows = [conv(words(5 + i), words(2)) for i in range(30)]  # replies too short unless overridden
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DatasetError, match="no usable requests"):
        load(path)
    reqs = load(path, n=10, output_len=50, seed=0)
    assert len(reqs) == 10 and all(r.expected_output_len == 50 for r in reqs)
    again = load(path, n=10, output_len=50, seed=0)
    other = load(path, n=10, output_len=50, seed=1)
    assert [r.prompt for r in reqs] == [r.prompt for r in again]
    assert [r.prompt for r in reqs] != [r.prompt for r in other]  # shuffled by the seed


def test_sharegpt_tokenizes_lazily(tmp_path: Path):
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(json.dumps(conv(words(8), words(8))) for _ in range(1000)))
    tok = WordTokenizer()
    reqs = load(path, n=5, tok=tok)
    assert len(reqs) == 5 and tok.calls == 1  # one batch was enough


def test_prompt_records(tmp_path: Path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "a b c", "output_len": 7}),
        "",
        json.dumps({"prompt": [5, 6, 7, 8], "output_len": 2}),
        json.dumps({"prompt": words(4), "output_len": 1}),
    ]))
    reqs = load(path)
    assert reqs == [SampleRequest("a b c", 3, 7), SampleRequest([5, 6, 7, 8], 4, 2),
                    SampleRequest(words(4), 4, 1)]  # file order kept, no length filter
    assert [r.expected_output_len for r in load(path, output_len=9)] == [9, 9, 9]
    assert len(load(path, n=2)) == 2


def test_fewer_usable_than_asked_is_a_warning(tmp_path: Path, caplog):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "x y", "output_len": 3}))
    assert len(load(path, n=5)) == 1
    assert "only 1 usable" in caplog.text


@pytest.mark.parametrize("content, match", [
    ('{"prompt": "a", "output_len": 3}\n{"prompt": "b", "output_len": 3\n', r"p\.jsonl:2: not valid JSON"),
    ('{"prompt": "a", "output_len": 3}\n\n[1, 2', r"p\.jsonl:3: not valid JSON"),
    ('[{"prompt": "a", "output_len": 3},\n {"prompt": }]', r"p\.jsonl:2: not valid JSON"),
    ("", "is empty"),
    ("  \n\n", "is empty"),
    ("[]", "is empty"),
    ('{"prompt": "a"}', r"p\.jsonl:1: record has no 'output_len'"),
    ('{"prompt": "a", "output_len": 0}', "positive integer"),
    ('{"prompt": "", "output_len": 3}', "non-empty string"),
    ('{"prompt": [1, "x"], "output_len": 3}', "list of token ids"),
    ('{"text": "a"}', "neither 'conversations'"),
    ('"just a string"', "expected a JSON object"),
    ('{"conversations": []}', "no usable requests"),
])
def test_file_errors_are_one_line(tmp_path: Path, content: str, match: str):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=match) as e:
        load(path)
    assert "\n" not in str(e.value)


def test_missing_file_and_directory(tmp_path: Path):
    with pytest.raises(DatasetError, match="not found"):
        load(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="directory"):
        load(tmp_path)


def test_text_needs_a_tokenizer(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a b", "output_len": 3}))
    with pytest.raises(DatasetError, match="no tokenizer"):
        asyncio.run(load_file_dataset(str(path), 5, None))
    path.write_text(json.dumps({"prompt": [1, 2], "output_len": 3}))  # token ids need none
    assert asyncio.run(load_file_dataset(str(path), 5, None)) == [SampleRequest([1, 2], 2, 3)]


# -------------------------------------------------------------------------- tokenizers


def test_local_tokenizer(tmp_path: Path):
    from tiny_models import make_word_tokenizer

    make_word_tokenizer(64).save_pretrained(tmp_path)
    tok = LocalTokenizer(str(tmp_path))
    assert tok.vocab_size == 64
    assert asyncio.run(tok.encode(["t5 t6 t7"])) == [[5, 6, 7]]
    assert asyncio.run(tok.decode([[5, 6]])) == ["t5 t6"]
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        LocalTokenizer(str(tmp_path / "missing"))


@pytest.mark.parametrize("strict", [False, True])
def test_server_tokenizer(strict: bool):
    async def go(base_url: str) -> tuple:
        async with aiohttp.ClientSession() as s:
            tok = ServerTokenizer(s, base_url, "stub-model")  # encode first
            a = await tok.encode(["t1 t2 t3", "t9", "x y"]), await tok.decode([[4, 5], [6]])
            tok = ServerTokenizer(s, base_url, "stub-model")  # decode first
            b = await tok.encode(["t1 t2 t3", "t9", "x y"]), await tok.decode([[4, 5], [6]])
            return a, b

    with FakeOpenAIServer(strict_fields=strict) as srv:
        a, b = asyncio.run(go(srv.base_url))
    assert a == b == ([[1, 2, 3], [9], [3, 3]], ["t4 t5", "t6"])


def test_server_tokenizer_unreachable():
    from openai_stub import unused_port

    async def go():
        async with aiohttp.ClientSession() as s:
            await ServerTokenizer(s, f"http://127.0.0.1:{unused_port()}", None).encode(["a"])

    with pytest.raises(TokenizerError, match="/tokenize failed"):
        asyncio.run(go())
