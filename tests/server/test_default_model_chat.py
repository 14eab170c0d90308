"""`tandem serve` with no model: the embedded SmolLM2 and its own chat template, end to end."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_utils import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_chat_with_the_embedded_model(tmp_path):
    from transformers import AutoTokenizer

    from tandem.config import EngineConfig
    from tandem.models.model_config import resolve_model_config

    srv = ServerProcess("", "--max-model-len", "1024", tmp=tmp_path, chat_template=False)
    try:
        messages = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "What is the capital of France?"}]
        tok = AutoTokenizer.from_pretrained(resolve_model_config(EngineConfig()).tokenizer)
        want = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False).input_ids
        assert httpx.post(f"{srv.url}/tokenize", json={"messages": messages}).json()["tokens"] == want
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=600)
        assert c.models.list().data[0].id == "SmolLM2-135M-Instruct"
        # the tokenizer folder clients are pointed at (README): the GGUF's conversion in the cache
        folder = resolve_model_config(EngineConfig()).tokenizer
        card = httpx.get(f"{srv.url}/v1/models").json()["data"][0]
        info = httpx.get(f"{srv.url}/tokenizer_info").json()
        assert card["tokenizer"] == info["name_or_path"] == folder and "/gguf/" in folder
        assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24, temperature=0)
        assert r.usage.prompt_tokens == len(want)
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        assert srv.stop() == 0
