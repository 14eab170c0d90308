"""tandem: an LLM serving engine whose scheduler runs one step ahead of the device."""
from tandem import cpu_threads as _cpu_threads

_cpu_threads.apply_to_this_process()  # before anything loads torch: see tandem/cpu_threads.py

from tandem._version import __version__  # noqa: E402
from tandem.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "__version__"]


def __getattr__(name: str):
    # Lazy: importing tandem should not load torch/transformers until an engine is built.
    if name == "LLM":
        from tandem.entrypoints.llm import LLM

        return LLM
    if name == "EngineConfig":
        from tandem.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
