"""Configuration: what the user asks for (``EngineConfig``) and what it resolves to (``ModelConfig``)."""
from tandem.config.engine import STEP_DEFAULTS, EngineConfig, StepLimits
from tandem.config.model import EnvSwitches, ModelConfig, ModelInfo
from tandem.config.speculative import SpeculativeConfig

__all__ = ["STEP_DEFAULTS", "EngineConfig", "EnvSwitches", "ModelConfig", "ModelInfo", "SpeculativeConfig",
           "StepLimits"]
