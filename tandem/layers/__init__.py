"""Model building blocks: attention over the paged cache, linear, norm, rotary, sampler."""
from torch import nn


def use_fused_kernels(model: nn.Module, on: bool = True) -> int:
    """Switch RMSNorm, rotary and SiLU-and-multiply to their Triton kernels (the GPU path);
    returns how many modules changed. The eager torch code stays the CPU path and reference."""
    n = 0
    for m in model.modules():
        if hasattr(m, "fused"):
            m.fused = on
            n += 1
    return n


def use_small_batch_gemv(model: nn.Module, max_rows: int) -> int:
    """Let decoder layers run batches of at most ``max_rows`` tokens through the fused GEMV
    kernels (``tandem.kernels.gemv``; 0 turns it off); returns how many layers changed."""
    n = 0
    for m in model.modules():
        if hasattr(m, "gemv_max_rows"):
            m.gemv_max_rows = max_rows
            n += 1
    return n
