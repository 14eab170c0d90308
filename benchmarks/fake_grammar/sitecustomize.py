"""The engine's constrained path without xgrammar's native work, for benchmarks only.

``use_fake_grammar()`` replaces the xgrammar backend's two batch calls by their cheapest
stand-ins: every row of a step's bitmask allows every token, and every token is accepted.
The engine then runs its constrained steps as it always does (the gated fill thread, its
hand-offs, the masked sampling, the accepts) minus the grammar work itself, which tells
the cost of that work (its time and its effect on the threads beside it) from the cost of
the machinery around it. Outputs are not constrained, so they mean nothing.

``host_step.py --fake-grammar`` calls it in its own process. A server's engine core is a
process of its own; this file is its ``sitecustomize`` when this folder leads
``PYTHONPATH`` (``gpu_serve.py --fake-grammar``), and with ``TANDEM_BENCH_FAKE_GRAMMAR=1``
it patches the backend module as that module is imported, in every process that imports it.
"""
from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any

_MODULE = "tandem.structured_output.xgrammar_backend"


def _patch(module: Any) -> None:
    backend = module.XGrammarBackend
    backend.fill_bitmasks = lambda self, matchers, bitmask, rows: bitmask.fill_(-1)
    backend.accept_tokens = lambda self, matchers, tokens: [True] * len(matchers)


def use_fake_grammar() -> None:
    """Patch the backend in this process (importing it now)."""
    import importlib

    _patch(importlib.import_module(_MODULE))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the backend module through the other finders, and patches it once executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                execute = spec.loader.exec_module

                def exec_module(module: Any) -> None:
                    execute(module)
                    _patch(module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


if os.environ.get("TANDEM_BENCH_FAKE_GRAMMAR") == "1":
    sys.meta_path.insert(0, _PatchOnImport())
