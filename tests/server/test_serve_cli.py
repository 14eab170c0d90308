"""The server's command line: a mistake is one ``error:`` line and exit 2 before anything
starts; a port that is taken is exit 1 with no process left behind."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.entrypoints.openai", *args], capture_output=True, text=True,
                          timeout=240)


@pytest.mark.parametrize("args, words", [
    (["/no/such/model"], "does not exist"),
    (["--max-n", "0"], "--max-n must be >= 1"),
    (["--block-size", "3"], "block_size"),
    (["--max-num-seqs", "-1"], "max_num_seqs"),
    (["--chat-template", "/no/such/template.jinja"], "No such file"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)"),
])
def test_mistakes_exit_2_with_one_line(args, words, tiny_llama):
    model = [] if args[0].startswith("/") else [tiny_llama]
    r = serve(*model, *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_model_given_twice(tiny_llama, tiny_factory):
    r = serve(tiny_llama, "--model", tiny_factory("qwen2"))
    assert r.returncode == 2 and "given twice" in r.stderr, r.stderr


def test_port_in_use_exits_1_before_loading_anything(tiny_llama):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = serve(tiny_llama, "--port", str(port))
    assert r.returncode == 1, r.stderr
    assert r.stderr == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
