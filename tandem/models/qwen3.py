"""Qwen3: the Llama block plus a per-head RMSNorm on q and k before rotary.

Everything else (fused projections, rotary, paged attention, weight mapping) is the Llama
implementation; only the attention's ``_qk_norms`` hook differs (the attention layer
applies the norms, in the rotary + KV-write kernel on the Triton path). Qwen3 has no
q/k/v bias unless ``config.attention_bias`` says so, which the Llama code already reads.
"""
from __future__ import annotations

from typing import Any


from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary_emb)
        # Normalizes over head_dim only, independently for every head (HF: "unlike olmo").
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _qk_norms(self) -> tuple[RMSNorm, RMSNorm]:
        return self.q_norm, self.k_norm


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
