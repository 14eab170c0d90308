"""HF ``architectures`` name -> our model class.

The engine picks the implementation from ``config.architectures[0]`` exactly as HF's
``AutoModelForCausalLM`` does, so a checkpoint folder needs no extra metadata.
"""
from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch
from torch import nn

from tandem.models.llama import LlamaForCausalLM
from tandem.models.qwen3 import Qwen3ForCausalLM

# Mistral and Qwen2 are Llama with config switches (sliding window, implicit qkv bias).
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


class CausalLM(Protocol):
    """What the engine calls on a model: hidden states of a flattened token batch (with the
    attention metadata in the forward context) and logits for the rows it samples from."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def modules(self) -> Iterator[nn.Module]: ...


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(config: Any) -> type[nn.Module]:
    """The class implementing ``config.architectures[0]``; ValueError if we have none."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        raise ValueError("config has no 'architectures' entry; supported architectures: "
                         + ", ".join(supported_architectures()))
    cls = MODEL_REGISTRY.get(archs[0])
    if cls is None:
        raise ValueError(f"unsupported architecture {archs[0]!r}; supported architectures: "
                         + ", ".join(supported_architectures()))
    return cls
