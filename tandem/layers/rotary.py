"""Rotary position embedding (RoPE) over flattened tokens.

The model runner hands every layer the absolute position of each token, so cos/sin are
precomputed once for all positions up to ``max_position_embeddings`` and gathered per step:
no per-step trigonometry, and the same tensor addresses on every step (CUDA-graph friendly).

The frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` for the scaled types
(linear, llama3, yarn, longrope, ...), so our numbers follow HF's exactly, including the
attention-scaling factor that yarn/longrope multiply into cos/sin. The rotation is the
neox / HF-Llama "rotate_half" layout (first half of each head paired with the second half).

Everything here is computed in explicit float32, whatever the model's dtype: the process's
default dtype is never read or changed.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def get_rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of ``config`` as one flat dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 stores them in ``config.rope_parameters``; older configs keep
    ``rope_theta`` and an optional ``rope_scaling`` dict (whose type key was once ``type``).
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError(
                "per-layer-type rope_parameters are not supported by this model implementation: "
                f"{sorted(params)}"
            )
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    return params


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flattened ``q [T, H*D]`` and ``k [T, KVH*D]`` given ``positions [T]``.

    ``cos_cache``/``sin_cache`` are ``[max_position, rotary_dim // 2]`` in fp32 (non-persistent
    buffers, so checkpoints never carry them). They are cast to the activation dtype at use,
    exactly like HF, which computes cos/sin in fp32 and then casts to ``x.dtype``. When
    ``rotary_dim < head_dim`` (partial rotary) the remaining dims pass through unchanged.

    The caches are built on the default device, like any module's tensors; a model built on
    the meta device gets real ones from ``init_buffers`` once the loader has chosen the
    device. The frequencies they derive from are kept in fp32 on the CPU as plain attributes
    (not buffers), so casting the module to the model's dtype can never round them.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        long_inv_freq: Optional[torch.Tensor] = None,
        long_from_position: Optional[int] = None,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim ({rotary_dim}) must be even and <= head_dim ({head_dim})")
        if inv_freq.numel() != rotary_dim // 2:
            raise ValueError(f"inv_freq has {inv_freq.numel()} entries, expected rotary_dim // 2 = {rotary_dim // 2}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.attention_scaling = float(attention_scaling)
        self._inv_freq = inv_freq.detach().to(device=_CPU, dtype=torch.float32)
        self._long_inv_freq = (None if long_inv_freq is None or long_from_position is None
                               else long_inv_freq.detach().to(device=_CPU, dtype=torch.float32))
        self._long_from_position = long_from_position
        cos, sin = self._cos_sin(torch.get_default_device())
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self.fused = False  # one in-place Triton kernel for q and k (tandem.kernels.fused)

    def _cos_sin(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin of every position on ``device`` (free on the meta device)."""
        t = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = t[:, None] * self._inv_freq.to(device)[None, :]
        if self._long_inv_freq is not None:
            # longrope: positions past the pretraining length use the long factors.
            long_freqs = t[:, None] * self._long_inv_freq.to(device)[None, :]
            freqs = torch.where(t[:, None] >= self._long_from_position, long_freqs, freqs)
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    def init_buffers(self, device: torch.device) -> None:
        """(Re)compute the fp32 cos/sin caches on ``device``: the loader calls this after
        giving a model built on the meta device its real storage."""
        self.cos_cache, self.sin_cache = self._cos_sin(device)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
                f"attention_scaling={self.attention_scaling}")

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]``; cos/sin ``[T, 1, rotary_dim // 2]`` already in x's dtype."""
        half = self.rotary_dim // 2
        x1 = x[..., :half]
        x2 = x[..., half:self.rotary_dim]
        # Same per-element products and sums as HF's ``x * cos + rotate_half(x) * sin``,
        # so bf16 results round identically.
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if self.rotary_dim == self.head_dim:
            return torch.cat((o1, o2), dim=-1)
        return torch.cat((o1, o2, x[..., self.rotary_dim:]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            from tandem.kernels.fused import rotary_embedding_

            rotary_embedding_(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim, self.rotary_dim)
            return q, k
        T = positions.shape[0]
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        q_shape, k_shape = q.shape, k.shape
        q = self._rotate(q.view(T, -1, self.head_dim), cos, sin).reshape(q_shape)
        k = self._rotate(k.view(T, -1, self.head_dim), cos, sin).reshape(k_shape)
        return q, k


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    """Build the rotary embedding described by an HF config.

    The frequencies are computed on the CPU in fp32 (also when the model is being built on
    the meta device: they are values the caches are derived from, not parameters).

    ``dynamic`` (NTK) scaling is rejected: its frequencies depend on the current sequence
    length, which a precomputed per-position cache (and a batch mixing sequences of
    different lengths) cannot express faithfully.
    """
    params = get_rope_parameters(config)
    rope_type = params["rope_type"]
    max_position = int(getattr(config, "max_position_embeddings", 0) or 0)
    if max_position <= 0:
        raise ValueError("config.max_position_embeddings must be a positive integer for rotary embeddings")
    if "dynamic" in rope_type:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported: dynamic NTK scaling recomputes frequencies from "
            "the current sequence length, which a precomputed per-position cos/sin cache cannot express"
        )
    rotary_dim = int(head_dim * float(params["partial_rotary_factor"]))
    long_inv_freq: Optional[torch.Tensor] = None
    long_from: Optional[int] = None
    # transformers' init functions create some tensors without a device: pin them to the
    # CPU, or a model built under ``torch.device("meta")`` would get frequencies without values.
    with _CPU:
        if rope_type == "default":
            base = float(params["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=_CPU)
                                       .to(torch.float32) / rotary_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unknown rope_type {rope_type!r}; supported: default, "
                                 + ", ".join(k for k in ROPE_INIT_FUNCTIONS if "dynamic" not in k))
            init_fn = ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, scaling = init_fn(config, _CPU)
            if rope_type == "longrope":
                # HF switches the whole sequence to the long factors once it grows past the
                # pretraining length (re-rotating nothing already cached). A paged cache keeps
                # old keys, so we pick per position: short below the boundary, long at/after it.
                params = get_rope_parameters(config)  # the init fn may have standardized it
                orig = int(params.get("original_max_position_embeddings")
                           or getattr(config, "original_max_position_embeddings", max_position))
                long_inv_freq, _ = init_fn(config, _CPU, seq_len=orig + 1)
                long_from = orig
    if inv_freq.numel() * 2 != rotary_dim:
        # Trust the init function (it knows partial_rotary_factor conventions of its model).
        rotary_dim = inv_freq.numel() * 2
    logger.debug("rope %s: head_dim=%d rotary_dim=%d max_position=%d scaling=%s",
                 rope_type, head_dim, rotary_dim, max_position, scaling)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, inv_freq, float(scaling),
                           long_inv_freq=long_inv_freq, long_from_position=long_from)
