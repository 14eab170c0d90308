"""Resolve an ``EngineConfig`` into the one ``ModelConfig`` the whole engine shares.

The model's ``config.json`` and generation config are read here, once, on the driver
(``LLM``'s up-front checks may parse ``config.json`` earlier, only to name a broken file);
workers, executors and the scheduler receive the result (see ``tandem.config.model``).
"""
from __future__ import annotations

import logging
from typing import Any

from tandem.config import EngineConfig, EnvSwitches, ModelConfig
from tandem.models.loader import default_model_path, load_hf_config, resolve_model
from tandem.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_DEFAULT_CONTEXT = 2048  # for configs that do not state max_position_embeddings


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` is bf16 on CUDA and fp32 on the CPU (bf16 matmuls are slow on most CPUs)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"


def eos_token_ids(folder: str, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from the generation config (which may list several) and the tokenizer."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(folder, local_files_only=True).eos_token_id
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    except (OSError, ValueError):
        pass  # no generation_config.json: the tokenizer's EOS alone
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def resolve_model_config(config: EngineConfig, env: EnvSwitches | None = None) -> ModelConfig:
    """Find (and convert, for GGUF) the model, read its config once, and check it against
    the engine config: context length and the tensor-parallel split."""
    env = env or EnvSwitches.from_environ()
    folder = resolve_model(config.model or default_model_path(), env.cache_root)
    tokenizer_folder = resolve_model(config.tokenizer, env.cache_root) if config.tokenizer else folder
    hf = load_hf_config(folder)
    model_len = getattr(hf, "max_position_embeddings", None) or _DEFAULT_CONTEXT
    if config.max_model_len is not None and config.max_model_len > model_len:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {model_len}")
    max_model_len = config.max_model_len or model_len
    device = resolve_device(config.device)
    limits = config.step_limits(device)
    logger.info("step limits on %s: max_num_seqs %d, max_num_batched_tokens %d", device, *limits)
    if not config.enable_chunked_prefill and limits.max_num_batched_tokens < max_model_len:
        logger.warning("chunked prefill off: prompts longer than %d tokens will be rejected",
                       limits.max_num_batched_tokens)
    mc = ModelConfig(
        folder=folder,
        tokenizer=tokenizer_folder,
        hf_config=hf,
        dtype=resolve_dtype(config.dtype, device),
        device=device,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids(folder, load_tokenizer(tokenizer_folder)),
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        env=env,
    )
    mc.check_tensor_parallel(config.tensor_parallel_size)
    if config.speculative_config is not None:
        from tandem.models.draft import draft_model_config

        draft_model_config(config, mc)  # a draft that cannot serve fails here, before anything starts
    return mc
