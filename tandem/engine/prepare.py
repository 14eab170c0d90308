"""The model and the machine, checked before any weights load or any process starts.

``prepare_model`` resolves an ``EngineConfig`` into a ``ModelConfig`` (converting a GGUF
once) and refuses, with one clear ``ValueError``, what would otherwise fail later as a
traceback from deep inside the loader, a worker, or the kernel's OOM killer. ``LLM`` calls
it in the caller's process; a server's engine core calls it in its own process, so the
API-server processes never import torch.
"""
from __future__ import annotations

import os
import struct

from tandem.config import EngineConfig, EnvSwitches, ModelConfig
from tandem.config.engine import check_cpu_memory

__all__ = ["prepare_model"]

_GIB = 1 << 30
# What a truncated or corrupt GGUF file raises from the readers (struct, numpy, gguf).
_GGUF_READ_ERRORS = (struct.error, ValueError, KeyError, IndexError, EOFError)
# Any one of these lets transformers build a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def prepare_model(config: EngineConfig) -> ModelConfig:
    """Resolve the model without loading weights, and refuse what would fail later.

    A truncated GGUF, an unreadable tokenizer, ``device="cuda"`` without a GPU, a
    ``worker_cls`` that cannot be imported and a KV cache larger than the machine's memory
    each fail here with one clear ``ValueError``, instead of a traceback from deep inside
    the loader, a worker, or the kernel's OOM killer tens of seconds later.
    """
    from tandem.models.loader import default_model_path, load_hf_config
    from tandem.models.model_config import resolve_model_config

    env = EnvSwitches.from_environ()
    folder = _resolve_model_files(config.model or default_model_path(), env)
    load_hf_config(folder)  # a broken config.json is named as such, not as a tokenizer problem
    _check_tokenizer(_resolve_model_files(config.tokenizer, env) if config.tokenizer else folder)
    model_config = resolve_model_config(config, env)  # reuses the conversion and the tokenizer above
    _check_device(model_config.device)
    _check_worker_cls(config.worker_cls)
    _check_kv_memory(config, model_config)
    return model_config


def _resolve_model_files(path: str, env: EnvSwitches) -> str:
    """The HF folder for ``path``; a GGUF file that cannot be read is named, not dumped."""
    from tandem.models.loader import resolve_model

    if not (os.path.isfile(path) and path.lower().endswith(".gguf")):
        return resolve_model(path, env.cache_root)
    try:
        return resolve_model(path, env.cache_root)
    except _GGUF_READ_ERRORS as e:
        kind = type(e).__name__ if type(e).__module__ == "builtins" else f"{type(e).__module__}.{type(e).__name__}"
        raise ValueError(f"cannot read the GGUF file {path}: it is truncated or corrupt ({kind}: {e})") from e


def _check_tokenizer(folder: str) -> None:
    from tandem.tokenizer import load_tokenizer

    if not any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_FILES):
        raise ValueError(f"cannot load a tokenizer from {folder}: it has none of {', '.join(_TOKENIZER_FILES)}; "
                         "add them or pass a tokenizer folder (--tokenizer)")
    try:
        load_tokenizer(folder)  # cached: the engine gets this same object
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"cannot load a tokenizer from {folder}: {e}") from e


def _check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA GPU is usable here "
                         "(torch.cuda.is_available() is False); use device 'cpu' or 'auto'")


def _check_worker_cls(path: str) -> None:
    from tandem.worker.worker import resolve_worker_class

    try:
        resolve_worker_class(path)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_cls {path!r} cannot be imported: {e}") from e


def _check_kv_memory(config: EngineConfig, model_config: ModelConfig) -> None:
    """The CPU KV cache of every rank must fit in the memory available now."""
    if model_config.device != "cpu":
        return
    tp = config.tensor_parallel_size
    if config.num_kv_blocks is not None:
        gib = config.num_kv_blocks * model_config.kv_block_bytes(config.block_size, tp) * tp / _GIB
        what = f"the KV cache (num_kv_blocks={config.num_kv_blocks} of block_size {config.block_size})"
    else:
        gib = config.cpu_kv_cache_gib * tp
        what = f"the KV cache (cpu_kv_cache_gib={config.cpu_kv_cache_gib}" + (f" x {tp} ranks)" if tp > 1 else ")")
    check_cpu_memory(gib, what)


