"""``hide_torch``: a front-end process that hides torch still loads the tokenizer, applies
the chat template and decodes, while torch cannot be imported (as with a transformers
release that imports torch whenever ``find_spec("torch")`` finds it)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(300)

SCRIPT = textwrap.dedent('''
    import importlib.util, sys
    from tandem.entrypoints.openai.torch_free import hide_torch
    assert hide_torch()
    import transformers.utils.generic  # imports torch when it finds it (transformers 5.17)
    from tandem.tokenizer import load_tokenizer
    tok = load_tokenizer(sys.argv[1])
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"
    assert len(ids) > 3
    assert importlib.util.find_spec("torch") is None
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("torch imported")
    assert sys.modules["torch"] is None
    assert hide_torch() is True  # hidden already: nothing to do
    print("ok")
''')


def test_tokenizer_and_template_without_torch(default_model_folder):
    r = subprocess.run([sys.executable, "-c", SCRIPT, default_model_folder], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
    assert "PyTorch was not found" not in r.stderr  # the advisory is filtered: hiding it is meant


def test_too_late_once_imported():
    r = subprocess.run([sys.executable, "-c", "import torch, sys\n"
                        "from tandem.entrypoints.openai.torch_free import hide_torch\n"
                        "assert hide_torch() is False and sys.modules['torch'] is torch\nprint('ok')"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
