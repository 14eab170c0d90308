"""RMSNorm with an optional fused residual add.

Statistics are computed in fp32 and the normalized value is cast back before the weight
multiply, exactly like HF's ``LlamaRMSNorm``, so bf16 outputs round the same way. The
residual form (vLLM style) lets decoder layers hand the running residual along instead of
keeping an extra copy per layer, and gives a kernel a single place to fuse add + norm.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``forward(x)`` -> normed ``x``; ``forward(x, residual)`` -> ``(normed(x + residual), x + residual)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.fused = False  # one Triton kernel (tandem.kernels.fused) instead of ~9 eager ones

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self.fused:
            from tandem.kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        # The add happens in the activation dtype, as HF's ``residual + hidden_states`` does.
        residual = x + residual
        return self._norm(residual), residual
