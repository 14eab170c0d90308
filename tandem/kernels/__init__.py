"""GPU kernels (Triton) for tandem. Triton is optional.

Importing this package never imports Triton: ``HAS_TRITON`` says whether it is installed and
:func:`triton_available` whether it actually imports. The kernels themselves load lazily on
first attribute access (``tandem.kernels.paged_attention`` etc.), which imports Triton and
defines the ``@triton.jit`` functions, so ``TRITON_INTERPRET=1`` (CPU interpreter) must be set
before that first access. Import the functions with ``from tandem.kernels import
paged_attention`` (the function; the module of the same name is
``sys.modules["tandem.kernels.paged_attention"]``). The pure-torch references need only torch.

See :mod:`tandem.kernels.paged_attention` for the design.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from typing import Any

__all__ = [
    "HAS_TRITON",
    "triton_available",
    "write_kv_cache",
    "paged_attention",
    "choose_num_kv_splits",
    "write_kv_cache_reference",
    "paged_attention_reference",
]

HAS_TRITON: bool = importlib.util.find_spec("triton") is not None

_KERNEL_MODULE = __name__ + ".paged_attention"
_KERNEL_ATTRS = {"write_kv_cache", "paged_attention", "choose_num_kv_splits", "is_interpreting"}
_REFERENCE_ATTRS = {"write_kv_cache_reference", "paged_attention_reference"}


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


def _bind_kernels(module: types.ModuleType) -> None:
    """Expose the kernel functions as package attributes."""
    for attr in _KERNEL_ATTRS:
        globals()[attr] = getattr(module, attr)


class _Package(types.ModuleType):
    """The submodule ``paged_attention`` shares its name with its main function. Importing a
    submodule makes the import system ``setattr`` it on the package, which would shadow the
    function; this hook binds the functions instead, so ``from tandem.kernels import
    paged_attention`` is always the function (the module is in ``sys.modules``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ == _KERNEL_MODULE:
            _bind_kernels(value)
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _KERNEL_ATTRS:
        if not triton_available():
            raise ImportError(f"tandem.kernels.{name} needs triton (pip install triton)")
        _bind_kernels(importlib.import_module(_KERNEL_MODULE))
        return globals()[name]
    if name in _REFERENCE_ATTRS:
        module = importlib.import_module("tandem.kernels.reference")
        return getattr(module, name)
    raise AttributeError(f"module 'tandem.kernels' has no attribute {name!r}")
