"""GPU kernels written in Triton: paged attention (``attention``) and the fused small ops
of a decoder layer (``fused``). Triton is optional.

Importing this package never imports Triton; importing ``tandem.kernels.attention`` or
``tandem.kernels.fused`` does (and defines the ``@triton.jit`` kernels, so
``TRITON_INTERPRET=1``, which runs them on CPU tensors for tests, must be set before Triton
is first imported). The engine imports them only when the Triton backend is chosen.
``tandem.kernels.reference`` holds pure-torch references that need only torch.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util



def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # sys.modules["triton"] is None: import blocked
        return False


HAS_TRITON: bool = _has_triton()


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when ``import triton`` succeeds (installed and importable)."""
    if not HAS_TRITON:
        return False
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # broken install, missing driver libs, ...
        return False
    return True
