"""``GET /tokenizer_info``: the tokenizer's configuration, shaped as vLLM serves it.

The body is what ``tokenizer_config.json`` holds (the tokenizer's ``init_kwargs``, special
tokens written as their text), plus ``tokenizer_class`` and the chat template the server
uses. lm-eval's ``tokenizer_backend=remote`` (and ``auto``, which probes this route) reads
``eos_token``, ``bos_token``, ``pad_token`` and ``chat_template`` from it and tokenizes
through ``/tokenize`` and ``/detokenize``, so it needs no tokenizer files of its own.

vLLM serves the route only with ``--enable-tokenizer-info-endpoint``; tandem always does: it
tells a client nothing that ``/tokenize``, ``/detokenize`` and the model folder do not, and
``name_or_path`` is the folder a client can load the same tokenizer from (for a GGUF model,
the folder tandem converted it into under ``~/.cache/tandem/gguf/``).
"""
from __future__ import annotations

import os
from typing import Any, Optional

# Paths of files inside the tokenizer folder: meaningless to a client on another machine.
_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file")
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def _jsonable(value: Any) -> Any:
    """Special tokens (``AddedToken``) as their text; dicts and lists recursively; other
    objects that JSON cannot hold as their ``str``."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def tokenizer_info(tokenizer: Any, folder: str, chat_template: Optional[str]) -> dict[str, Any]:
    """The body of ``/tokenizer_info`` for ``tokenizer`` loaded from ``folder``;
    ``chat_template``: the server's own template (``--chat-template``), if it has one."""
    info = {k: _jsonable(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if k not in _FILE_KEYS}
    for name in _SPECIAL:
        token = getattr(tokenizer, name, None)
        if info.get(name) is None and token is not None:
            info[name] = _jsonable(token)
    info["name_or_path"] = os.path.abspath(folder)
    info["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info
