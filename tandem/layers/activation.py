"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for the merged gate_up projection output ``[..., 2d]``.

    Merging gate and up into one matmul halves the number of GEMM launches in the MLP;
    this splits the result again. Matches HF's ``act_fn(gate_proj(x)) * up_proj(x)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fused = False  # one Triton kernel (tandem.kernels.fused) instead of three

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from tandem.kernels.fused import silu_and_mul

            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
