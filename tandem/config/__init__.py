"""Configuration: what the user asks for (``EngineConfig``) and what it resolves to (``ModelConfig``)."""
from tandem.config.engine import EngineConfig
from tandem.config.model import EnvSwitches, ModelConfig, ModelInfo

__all__ = ["EngineConfig", "EnvSwitches", "ModelConfig", "ModelInfo"]
