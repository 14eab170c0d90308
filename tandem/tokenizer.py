"""Loading a model folder's tokenizer without importing torch.

The API-server processes of ``tandem serve`` tokenize, apply chat templates and detokenize,
and nothing else: they must start fast and small, so they never import torch. transformers'
``AutoTokenizer`` does (its ``transformers.models.auto`` package pulls in the modeling code),
so the class is found the way ``AutoTokenizer`` finds it, from ``tokenizer_class`` in
``tokenizer_config.json``, and taken from transformers' lazy top-level module, which imports
only that class's own module. ``AutoTokenizer`` remains the fallback for folders that name
no class transformers exports (it gives the same object, at the cost of importing torch).
"""
from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = ["load_tokenizer"]


def _tokenizer_class_name(folder: str) -> Optional[str]:
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name.isidentifier() else None


def _tokenizer_class(folder: str) -> Any:
    """The fast tokenizer class the folder names, or None when transformers exports no such class."""
    import transformers

    name = _tokenizer_class_name(folder)
    candidates = [] if name is None else ([name] if name.endswith("Fast") else [name + "Fast", name])
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        candidates.append("PreTrainedTokenizerFast")  # what AutoTokenizer does for a bare tokenizer.json
    for candidate in candidates:
        try:
            cls = getattr(transformers, candidate)
        except (AttributeError, ImportError):
            continue
        if callable(getattr(cls, "from_pretrained", None)):
            return cls
    return None


@functools.lru_cache(maxsize=4)
def load_tokenizer(folder: str) -> Any:
    """The folder's fast tokenizer, loaded once per folder per process (the model config
    reads its EOS id; the front end then uses the same object)."""
    cls = _tokenizer_class(folder)
    if cls is not None:
        tokenizer = cls.from_pretrained(folder, local_files_only=True)
        if getattr(tokenizer, "is_fast", False):  # a slow (sentencepiece) class: AutoTokenizer picks the fast one
            return tokenizer
    logger.debug("no torch-free tokenizer class for %s: using AutoTokenizer", folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, use_fast=True, local_files_only=True)
