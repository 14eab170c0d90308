"""Model building blocks: attention over the paged cache, linear, norm, rotary, sampler."""
from typing import Any

from torch import nn


def _set_everywhere(model: nn.Module, attr: str, value: Any) -> int:
    """Set ``attr`` on every module of ``model`` that has it; returns how many."""
    n = 0
    for m in model.modules():
        if hasattr(m, attr):
            setattr(m, attr, value)
            n += 1
    return n


def use_fused_kernels(model: nn.Module, on: bool = True) -> int:
    """Switch RMSNorm, rotary and SiLU-and-multiply to their Triton kernels (the GPU path);
    returns how many modules changed. The eager torch code stays the CPU path and reference."""
    return _set_everywhere(model, "fused", on)


def use_small_batch_gemv(model: nn.Module, max_rows: int) -> int:
    """Let decoder layers run batches of at most ``max_rows`` tokens through the fused GEMV
    kernels (``tandem.kernels.gemv``; 0 turns it off); returns how many layers changed."""
    return _set_everywhere(model, "gemv_max_rows", max_rows)
