"""Llama-family decoder (Llama, Mistral, Qwen2) over flattened tokens and the paged KV cache.

The three architectures differ only in small switches, read from the HF config:

* q/k/v bias: ``config.attention_bias`` (Llama also puts it on ``o_proj``); Qwen2 always
  has q/k/v bias and never an ``o_proj`` bias, without saying so in its config.
* sliding window: Mistral's ``config.sliding_window`` applies to every layer when set;
  configs with ``layer_types`` (Qwen2/Qwen3) use it only on ``"sliding_attention"`` layers.
* ``head_dim`` from the config when present (it need not be ``hidden_size / num_heads``).

Module and parameter names mirror HF's so checkpoints load by name; the only renames are
the fused ``qkv_proj`` and ``gate_up_proj``, fed through ``stacked_params_mapping``.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch
from torch import nn

from tandem.layers.activation import SiluAndMul
from tandem.layers.attention import Attention
from tandem.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
    default_weight_loader,
)
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, get_rope
from tandem.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

logger = logging.getLogger(__name__)


def get_head_dim(config: Any) -> int:
    """``config.head_dim`` when set (Qwen3, Mistral-Nemo...), else ``hidden_size // num_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def get_attention_biases(config: Any) -> tuple[bool, bool]:
    """``(qkv_bias, o_proj_bias)`` as HF builds them for this config's model type."""
    if getattr(config, "model_type", None) == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def get_layer_sliding_window(config: Any, layer_idx: int) -> Optional[int]:
    """The sliding window HF applies in layer ``layer_idx``, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:  # older Qwen2-style configs
        return None
    return int(window)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}: only 'silu' is implemented")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Fused QKV projection, rotary (applied inside ``Attention``), paged attention, output projection.

    Subclasses normalize each head of q and k before rotary by overriding ``_qk_norms``
    (Qwen3's per-head RMSNorm); the attention layer applies them, fused with rotary and
    the KV-cache write on the Triton path.
    """

    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.head_dim = get_head_dim(config)
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        qkv_bias, o_bias = get_attention_biases(config)
        self.qkv_proj = QKVParallelLinear(self.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, self.hidden_size, bias=o_bias)
        # One RotaryEmbedding shared by all layers (its cos/sin cache is model-wide).
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim ** -0.5,
            layer_idx=layer_idx,
            sliding_window=get_layer_sliding_window(config, layer_idx),
        )

    def _qk_norms(self) -> Optional[tuple[RMSNorm, RMSNorm]]:
        """``(q_norm, k_norm)`` applied to each head before rotary, or None."""
        return None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, self.qkv_proj(hidden_states)))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Attention over the fused QKV projection's output, before ``o_proj``."""
        q, k, v = self.qkv_proj.split(qkv)
        # The q/k norms and rotary are applied by the attention layer, which fuses them into
        # the KV-cache write on the Triton path.
        return self.attn(q, k, v, rope=(positions, self.rotary_emb), qk_norm=self._qk_norms())


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is passed along and added inside the norms.

    A batch of at most ``gemv_max_rows`` tokens (0: never; the worker sets it on the Triton
    path) runs each projection as one GEMV with the norm and SiLU fused in
    (``tandem.kernels.gemv``): five launches a layer where the GEMM path takes about ten, which
    is what bounds a small decode batch.
    """

    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 attention_cls: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx, rotary_emb)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gemv_max_rows = 0

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if 0 < hidden_states.shape[0] <= self.gemv_max_rows:
            return self._forward_gemv(positions, hidden_states, residual)
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def _forward_gemv(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                      residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for a few tokens: norm + QKV (+ rotary + KV write, where the attention
        allows: ``gemv.FUSE_ROPE``), [rotary + KV write,] attention, o_proj, residual add +
        norm + gate_up + SiLU-and-multiply, down."""
        from tandem.kernels import gemv as gemv_mod
        from tandem.kernels.gemv import RopeWrite, gemv

        attn, mlp = self.self_attn, self.mlp
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        qkv_w, qkv_b = attn.qkv_proj.weight, attn.qkv_proj.bias
        target = attn.attn.rope_write_target(attn.rotary_emb, attn._qk_norms()) if gemv_mod.FUSE_ROPE else None
        rope = None
        if target is not None:
            rot = attn.rotary_emb
            rope = RopeWrite(positions, rot.cos_cache, rot.sin_cache, target[0], target[1].slot_mapping,
                             attn.num_heads, attn.num_kv_heads, attn.head_dim)
        if residual is None:
            out = gemv(hidden_states, qkv_w, qkv_b, norm=(ln1.weight, ln1.eps), rope=rope)
            residual = hidden_states
        else:
            out, residual = gemv(hidden_states, qkv_w, qkv_b, norm=(ln1.weight, ln1.eps), residual=residual,
                                 rope=rope)
        attended = attn.attend(positions, out) if target is None else attn.attn.attend_rotated(out, *target)
        hidden_states = gemv(attended, attn.o_proj.weight, attn.o_proj.bias)
        act, residual = gemv(hidden_states, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                             norm=(ln2.weight, ln2.eps), residual=residual, silu=True)
        return gemv(act, mlp.down_proj.weight, mlp.down_proj.bias), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, attention_cls: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(config, get_head_dim(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, attention_cls) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual: Optional[torch.Tensor] = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if residual is None:  # no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Causal LM over flattened tokens: ``forward`` returns hidden states, ``compute_logits``
    projects only the rows the caller samples from (saves the vocab matmul on prefill).

    Attention metadata and the KV caches come from ``tandem.layers.attention.set_forward_context``.
    """

    attention_cls: type[LlamaAttention] = LlamaAttention
    # (fused param name, checkpoint name, shard id)
    stacked_params_mapping: list[tuple[str, str, ShardId]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    # Checkpoint tensors that are derived state, not parameters.
    skip_weight_substrings: tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      tie_to=self.model.embed_tokens if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (in the model dtype) on every rank: a collective under tensor
        parallelism. The sampler upcasts to float32 only when it needs more than an argmax."""
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors into our (partly fused) parameters.

        Returns the names of the parameters that were fully loaded. Raises ValueError for a
        checkpoint tensor with no matching parameter (a wrong architecture would otherwise
        load silently) and for parameters, or shards of fused ones, the checkpoint lacks.
        """
        params = dict(self.named_parameters())
        shards_needed: dict[str, set[ShardId]] = {}
        for pname in params:
            for fused, _, shard in self.stacked_params_mapping:
                if f".{fused}." in pname:
                    shards_needed.setdefault(pname, set()).add(shard)
        shards_done: dict[str, set[ShardId]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if any(s in name for s in self.skip_weight_substrings):
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # the tied head is the embedding, which the checkpoint also holds
            target, shard = name, None
            for fused, ckpt_name, shard_id in self.stacked_params_mapping:
                if f".{ckpt_name}." in name:
                    target, shard = name.replace(f".{ckpt_name}.", f".{fused}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(self).__name__}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                if shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"cannot load checkpoint tensor {name!r}: {e}") from e
            if shard is None:
                loaded.add(target)
            else:
                shards_done.setdefault(target, set()).add(shard)
        for pname, needed in shards_needed.items():
            if shards_done.get(pname, set()) >= needed:
                loaded.add(pname)
        missing = sorted(self._checkpoint_names(p, shards_needed.get(p, set()) - shards_done.get(p, set()))
                         for p in params if p not in loaded)
        if missing:
            flat = [n for group in missing for n in group]
            raise ValueError(f"checkpoint is missing {len(flat)} weight(s) of {type(self).__name__}: "
                             + ", ".join(flat[:20]) + (" ..." if len(flat) > 20 else ""))
        logger.debug("loaded %d parameters", len(loaded))
        return loaded

    def _checkpoint_names(self, pname: str, missing_shards: set[ShardId]) -> list[str]:
        """Checkpoint names that would have filled (the missing shards of) parameter ``pname``."""
        if not missing_shards:
            return [pname]
        return sorted(pname.replace(f".{fused}.", f".{ckpt}.")
                      for fused, ckpt, shard in self.stacked_params_mapping
                      if shard in missing_shards and f".{fused}." in pname)
