"""Programmatic dependent launch (PDL) for the decoder layer's Triton kernels, Hopper and later.

Why: at batch 1 a decode step is ~170 small kernels in a CUDA graph, and between two of them
the GPU drains the first grid before it starts launching the second, a few microseconds each
time. With PDL a kernel may start while the one before it still runs: it first does what
needs nothing from that kernel (the GEMV kernels issue their weight loads, which are most of
their bytes) and then waits (``griddepcontrol.wait``) until the kernel before it has finished
and its writes are visible. Each kernel also lets the next one start at once
(``griddepcontrol.launch_dependents``); the wait keeps that safe whatever runs next.

The rule each kernel keeps: before its wait it reads only model weights (never written while
a step runs) and writes nothing. A kernel launched without PDL (torch's, cuBLAS's) waits for
its predecessor as usual, and a PDL kernel after it waits for it in full at its wait, so PDL
and plain kernels mix freely in one stream or graph.

One switch for the process (``set_enabled``), set by the worker on a device that supports
it unless ``TANDEM_PDL=0``; the kernels' wrappers read it at launch (a graph keeps what it
captured). Off, the kernels compile without the grid-dependency instructions and launch
plainly. Measured on an H100 (0.5B shape, batch 1, in CUDA graphs; ``benchmarks/RESULTS.md``):
1,082-1,126 -> 1,212-1,234 tok/s.
"""
from __future__ import annotations

from typing import Any

import torch

_enabled = False


def supported(device: torch.device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0 (Hopper) or later, and a Triton
    that has the grid-dependency instructions and the ``launch_pdl`` launch option (3.3+)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return (hasattr(cuda_extra, "gdc_wait") and hasattr(cuda_extra, "gdc_launch_dependents")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def launch_options() -> dict[str, Any]:
    """Keyword arguments for a Triton launch: ``PDL`` (the kernel's constexpr switch) and,
    when on, Triton's ``launch_pdl`` launch attribute."""
    return {"PDL": True, "launch_pdl": True} if _enabled else {"PDL": False}
