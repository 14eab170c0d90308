"""End to end on the embedded SmolLM2-135M-Instruct GGUF (a few tests; the rest use tiny models)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def folder():
    from tandem.models.loader import default_model_path, resolve_model

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return resolve_model(path)


@pytest.fixture(scope="module")
def llms(folder):
    from tandem import LLM

    out = {a: LLM(folder, async_scheduling=a, max_num_seqs=8) for a in (False, True)}
    yield out
    for m in out.values():
        m.shutdown()


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three colors."}],
]


def test_chat_greedy_matches_hf_sync_and_async(llms, hf):
    from tandem import SamplingParams

    tok = llms[True].get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=24)
    outs = {a: m.chat(PROMPTS, sp, use_tqdm=False) for a, m in llms.items()}
    for conv, o_sync, o_async in zip(PROMPTS, outs[False], outs[True]):
        ids = o_sync.prompt_token_ids
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        got = o_sync.outputs[0].token_ids
        assert got == ref[: len(got)] and (len(got) == len(ref) or got[-1] == tok.eos_token_id)
        assert o_async.outputs[0].token_ids == got
        assert o_async.outputs[0].text == o_sync.outputs[0].text == tok.decode(got, skip_special_tokens=True)
    assert "Paris" in outs[True][0].outputs[0].text


def test_prompt_logprobs_match_hf(llms, hf):
    from tandem import SamplingParams

    m = llms[True]
    out = m.generate(["The quick brown fox jumps over the lazy dog"],
                     SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, logprobs=3), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        lp = out.prompt_logprobs[i]
        assert abs(lp[ids[i]].logprob - ref[i - 1, ids[i]].item()) < 1e-3
        top = torch.topk(ref[i - 1], 2).indices.tolist()
        assert set(top) <= set(lp)
    first = out.outputs[0].logprobs[0]
    tok_id = out.outputs[0].token_ids[0]
    assert first[tok_id].rank == 1 and len(first) == 3 + (tok_id not in torch.topk(ref[-1], 3).indices.tolist())


def test_n_gt_1_shares_prefix_and_stop_strings(llms):
    from tandem import SamplingParams

    m = llms[True]
    sp = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=20)
    a = m.chat(PROMPTS[1], sp, use_tqdm=False)[0]
    b = llms[False].chat(PROMPTS[1], sp, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "children should differ"
    hits_before = m.engine.core.kv_cache.stats_hits
    m.chat(PROMPTS[2], SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=4), use_tqdm=False)
    assert m.engine.core.kv_cache.stats_hits > hits_before, "siblings did not hit the shared prompt blocks"
    text = m.chat(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0].text
    word = text.split()[2]
    stopped = m.chat(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop=[word]), use_tqdm=False)[0]
    c = stopped.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == word and word not in c.text
    assert text.startswith(c.text)


def test_cli_generate_jsonl(folder, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "Hello, my name is"}) + "\n" +
                   json.dumps({"messages": [{"role": "user", "content": "Say hi"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "generate", "--model", folder,
                        "--input", str(inp), "--output", str(out), "--max-tokens", "8", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(len(x["token_ids"]) >= 1 for x in rows)


def test_cli_default_model_runs():
    r = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "generate", "--chat",
                        "--prompt", "What is 2+2?", "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    bad = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "generate", "--prompt", "x",
                          "--max-num-seqs", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "max_num_seqs" in bad.stderr
