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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
