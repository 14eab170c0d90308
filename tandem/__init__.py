"""tandem: an LLM serving engine whose scheduler runs one step ahead of the device."""
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "__version__"]
from tandem._version import __version__


def __getattr__(name: str):
    # Lazy: importing tandem should not load torch/transformers until an engine is built.
    if name == "LLM":
        from tandem.entrypoints.llm import LLM

        return LLM
    if name == "EngineConfig":
        from tandem.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
