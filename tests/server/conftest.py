"""One shared server for the client, bad-input, metrics and disconnect tests (starting one
costs two torch imports); tests that kill or stop a server start their own."""
from __future__ import annotations

import signal

import pytest

from server_utils import ServerProcess

# Small enough to be quick, large enough for 64 concurrent streams and long requests.
SERVER_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "512", "--block-size", "16", "--max-num-seqs", "64",
               "--max-request-body-bytes", "200000", "--max-n", "8", "--max-prompts", "16")


@pytest.fixture(scope="session")
def server(tiny_llama, tmp_path_factory):
    s = ServerProcess(tiny_llama, *SERVER_ARGS, tmp=tmp_path_factory.mktemp("server"))
    yield s
    assert s.stop(signal.SIGINT) == 0, s.log.read_text()  # Ctrl-C: the same clean stop as SIGTERM


@pytest.fixture(scope="session")
def client(server):
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def slow_model(tiny_factory) -> str:
    """Wide enough that a 450-token request takes seconds: time to disconnect or kill mid-request."""
    return tiny_factory("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                        num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """The reference for the shared server: the same model and cache shape, offline and in process."""
    from tandem import LLM

    llm = LLM(tiny_llama, max_model_len=512, num_kv_blocks=512, block_size=16)
    yield llm
    llm.shutdown()
