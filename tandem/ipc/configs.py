"""Configurations on the wire: ``ModelConfig`` as a typed struct, its HF config as a dict.

``EngineConfig`` needs nothing here: it is plain data (a dataclass or a pydantic model) and
the codec sends it as itself. ``ModelConfig`` holds a transformers ``PretrainedConfig``,
which is a class with code; in transformers 5 it is also a dataclass, whose native
encoding would carry class internals rather than the config's own serialization. So it
travels as ``to_dict()`` and is rebuilt through transformers' registry of config classes
(``CONFIG_MAPPING``, keyed by ``model_type``): no other class can come out of it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from tandem.config import ModelConfig

__all__ = ["WireModelConfig", "hf_config_from_dict"]


def hf_config_from_dict(fields: dict[str, Any]) -> Any:
    """The transformers config ``PretrainedConfig.to_dict()`` described."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise msgspec.ValidationError(f"unknown transformers model_type {model_type!r}")
    return CONFIG_MAPPING[model_type](**fields)


class WireModelConfig(msgspec.Struct, frozen=True):
    """A ``ModelConfig`` as data: ``hf_config`` as its ``to_dict()``, every other field by
    name. ``to_config()`` checks those fields against ``ModelConfig``'s declared types."""

    hf_config: dict[str, Any]
    fields: dict[str, Any]

    @classmethod
    def from_config(cls, mc: ModelConfig) -> "WireModelConfig":
        others = {f.name: getattr(mc, f.name) for f in dataclasses.fields(mc) if f.name != "hf_config"}
        return cls(hf_config=mc.hf_config.to_dict(), fields=others)

    def to_config(self) -> ModelConfig:
        return msgspec.convert({**self.fields, "hf_config": hf_config_from_dict(self.hf_config)}, ModelConfig)
