"""Keeping torch out of the front-end processes of ``tandem serve``.

The launcher and the API-server processes tokenize, apply chat templates, detokenize and
speak HTTP; torch would cost each of them seconds of start-up and about half a GiB. tandem's
own front-end code never imports it (import-linter's contract checks that), but some
transformers releases (5.17, for one) import torch from ``transformers.utils.generic``
whenever it is installed, so loading a tokenizer pulled it in. ``hide_torch`` makes torch
look absent in the process, the way Python itself marks a module unavailable
(``sys.modules[name] = None``): ``importlib.util.find_spec("torch")`` is then None, so
transformers' ``is_torch_available()`` is False, and any ``import torch`` fails at once.
"""
from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def hide_torch() -> bool:
    """Make torch unimportable in this process; False (and nothing changed) if it was
    imported already."""
    if "torch" in sys.modules:
        if sys.modules["torch"] is None:
            return True  # hidden already
        logger.warning("torch was imported in a front-end process before it could be hidden")
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers' import then advises that "PyTorch was not found": true, and meant.
    logging.getLogger("transformers").addFilter(
        lambda record: not str(record.msg).startswith("PyTorch was not found"))
    return True
