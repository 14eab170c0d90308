"""The draft model of ``speculative_config`` (method ``draft_model``): found, read and
checked against the target when the engine is configured, before anything starts.

A draft proposes token ids the target verifies, so it must share the target's vocabulary
(same size; a different tokenizer of the same size is the user's responsibility, as in
vLLM), and its weights must fit in the memory left on the device.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os

from tandem.config import EngineConfig, ModelConfig
from tandem.config.engine import available_memory_bytes
from tandem.models.loader import load_hf_config, resolve_model

logger = logging.getLogger(__name__)

_GIB = 1 << 30


def draft_model_config(config: EngineConfig, target: ModelConfig, check: bool = True) -> ModelConfig | None:
    """The draft's ``ModelConfig`` (the target's, with the draft's folder and HF config),
    or None without a draft model. Raises ``ValueError`` (one line) when it cannot serve."""
    sc = config.speculative_config
    if sc is None or sc.method != "draft_model":
        return None
    assert sc.model is not None
    folder = resolve_model(sc.model, target.env.cache_root)
    hf = load_hf_config(folder)
    draft = dataclasses.replace(target, folder=folder, hf_config=hf)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {sc.model!r} has a vocabulary of {draft.vocab_size} tokens, the target "
                         f"{target.vocab_size}: a draft must share the target's vocabulary")
    context = getattr(hf, "max_position_embeddings", None)
    if context is not None and context < target.max_model_len:
        raise ValueError(f"the draft model's context length {context} is shorter than max_model_len "
                         f"{target.max_model_len}")
    if check:
        _check_fits(folder, draft, sc.model, config)
    return draft


def weight_bytes(folder: str, dtype_bytes: int) -> int:
    """Bytes the weights take once loaded in a dtype of ``dtype_bytes`` (from the files'
    sizes: every stored tensor is 2 or 4 bytes per element; assume the stored size when in
    doubt)."""
    files = glob.glob(os.path.join(folder, "*.safetensors"))
    stored = sum(os.path.getsize(f) for f in files)
    hf = load_hf_config(folder)
    stored_dtype = str(getattr(hf, "dtype", None) or "float32")
    stored_bytes = 2 if ("16" in stored_dtype) else 4
    return stored * dtype_bytes // stored_bytes


def _check_fits(folder: str, draft: ModelConfig, name: str, config: EngineConfig) -> None:
    need = weight_bytes(folder, draft.dtype_bytes)
    if draft.device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        avail = min(free, int(total * config.gpu_memory_utilization))
    else:
        avail = available_memory_bytes() or 0
        if not avail:
            return
    if need > avail:
        raise ValueError(f"the draft model {name!r} needs {_size(need)} for its weights, but only {_size(avail)} of "
                         f"{draft.device} memory is available; use a smaller draft model")
    logger.info("draft model %s: %s of weights", name, _size(need))


def _size(n: int) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
