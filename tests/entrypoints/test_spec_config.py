"""Bad speculative configurations (issue 20): each a one-line error, nothing started.

Checked through the API (``LLM(...)`` raises ``ValueError`` before any worker exists) and
the CLI (``--speculative-config '<json>'``: exit status 2, one ``error:`` line)."""
from __future__ import annotations

import json

import pytest

from tandem import LLM
from tandem.config import EngineConfig
from tandem.entrypoints import cli

pytestmark = pytest.mark.timeout(120)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def one_line_error(fn, *args, **kw) -> str:
    with pytest.raises(ValueError) as ei:
        fn(*args, **kw)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("spec, words", [
    ({"method": "medusa", "num_speculative_tokens": 4}, "method must be one of 'ngram' or 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min (5) must be <= prompt_lookup_max (4)"),
    ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "/nope"}, "does not exist"),
    ({**NGRAM, "model": "/tmp"}, "uses no model"),
    ({**NGRAM, "num_speculative_token": 4}, "num_speculative_token"),
])
def test_config_errors(spec, words):
    msg = one_line_error(EngineConfig, speculative_config=spec)
    assert words in msg, msg


def test_valid_configs():
    c = EngineConfig(speculative_config=NGRAM).speculative_config
    assert c is not None and (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 4, 1, 4)
    assert EngineConfig().speculative_config is None


def test_draft_vocabulary_mismatch(tiny_llama, tiny_factory):
    other = tiny_factory("llama", vocab_size=256)
    msg = one_line_error(LLM, tiny_llama, num_kv_blocks=64, speculative_config={
        "method": "draft_model", "model": other, "num_speculative_tokens": 3})
    assert "vocabulary of 256 tokens, the target 128" in msg, msg


def test_draft_model_that_does_not_fit(tiny_llama, monkeypatch):
    import tandem.models.draft as draft

    monkeypatch.setattr(draft, "available_memory_bytes", lambda: 1024)
    msg = one_line_error(LLM, tiny_llama, num_kv_blocks=64, speculative_config={
        "method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3})
    assert "for its weights, but only 1 KiB of cpu memory is available" in msg, msg


@pytest.mark.parametrize("value, words", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be an integer in [1, 16]"),
    ("not json", "speculative"),
])
def test_cli_errors(tiny_llama, capsys, value, words):
    rc = cli.main(["generate", "--model", tiny_llama, "--num-kv-blocks", "64", "--speculative-config", value,
                   "--prompt", "t5"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error:") and words in err, err


def test_cli_generates_with_speculation(tiny_llama, capsys):
    """The flag works: same text as without it."""
    outs = []
    for extra in ([], ["--speculative-config", json.dumps(NGRAM)]):
        rc = cli.main(["generate", "--model", tiny_llama, "--num-kv-blocks", "64", "--max-tokens", "12",
                       "--temperature", "0", "--prompt", "t5 t6 t7 t5 t6 t7 t5", *extra])
        assert rc == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()
