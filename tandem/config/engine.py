"""The engine's one configuration object, and the CLI flags generated from it.

Every field carries its help text in ``metadata`` so ``add_cli_args`` can mirror the
dataclass exactly: a new option is added in one place and appears on the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_EXECUTORS = ("auto", "uniproc", "multiproc", "ray")


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineConfig:
    """Everything that shapes an engine instance. Validated on construction."""

    model: Optional[str] = _opt(
        None, "HF model folder or .gguf file; default: the embedded SmolLM2-135M-Instruct GGUF"
    )
    tokenizer: Optional[str] = _opt(None, "tokenizer folder (default: the model's)")
    dtype: str = _opt("auto", "weight/activation dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16",
                      choices=_DTYPES)
    device: str = _opt("auto", "cpu, cuda, or auto (cuda when available)", choices=_DEVICES)
    block_size: int = _opt(16, "tokens per KV cache block")
    num_kv_blocks: Optional[int] = _opt(None, "number of KV cache blocks (overrides the memory-based sizing)")
    gpu_memory_utilization: float = _opt(0.9, "fraction of GPU memory the engine may use (weights + activations + KV)")
    cpu_kv_cache_gib: float = _opt(1.0, "KV cache size in GiB on the CPU")
    max_num_seqs: int = _opt(64, "most requests in one step")
    max_num_batched_tokens: int = _opt(2048, "token budget of one step")
    max_model_len: Optional[int] = _opt(None, "longest prompt + output (default: the model's context length)")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = _opt(True, "split long prompts across steps to fit the token budget")
    async_scheduling: bool = _opt(True, "schedule step N+1 while step N runs (token-identical to sync)")
    max_logprobs: int = _opt(20, "largest logprobs / prompt_logprobs a request may ask for")
    seed: int = _opt(0, "seed of the default random generator (unseeded requests)")
    executor: str = _opt("auto", "how workers run: uniproc (in this process), multiproc (one process per rank), "
                         "ray (Ray actors, for several machines), auto (uniproc for one rank, else multiproc)",
                         choices=_EXECUTORS)
    tensor_parallel_size: int = _opt(1, "number of devices (ranks) a model is split across")
    rpc_timeout_s: float = _opt(300.0, "seconds a worker may take to answer one call before the executor "
                                "declares it hung and fails (multiproc and ray)")
    worker_cls: str = _opt("tandem.worker.worker.Worker",
                           "dotted path of the class each rank runs (a Worker subclass, for extensions and tests)")
    worker_start_timeout_s: float = _opt(600.0, "seconds worker processes may take to start and load the model")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        errors: list[str] = self._type_errors()
        if errors:
            raise ValueError("invalid engine config: " + "; ".join(errors))

        def check(cond: bool, msg: str) -> None:
            if not cond:
                errors.append(msg)

        check(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        check(self.device in _DEVICES, f"device must be one of {_DEVICES}, got {self.device!r}")
        check(self.executor in _EXECUTORS, f"executor must be one of {_EXECUTORS}, got {self.executor!r}")
        check(isinstance(self.block_size, int) and self.block_size >= 1 and (self.block_size & (self.block_size - 1)) == 0,
              f"block_size must be a power of two >= 1, got {self.block_size!r}")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
              f"num_kv_blocks must be >= 1, got {self.num_kv_blocks!r}")
        check(0.0 < self.gpu_memory_utilization <= 1.0,
              f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check(self.cpu_kv_cache_gib > 0, f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1,
              f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        check(self.max_model_len is None or self.max_model_len >= 1,
              f"max_model_len must be >= 1, got {self.max_model_len!r}")
        check(self.max_logprobs >= 0, f"max_logprobs must be >= 0, got {self.max_logprobs}")
        check(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        check(not (self.executor == "uniproc" and self.tensor_parallel_size > 1),
              f"the uniproc executor runs one rank; tensor_parallel_size={self.tensor_parallel_size} needs "
              "executor 'multiproc' or 'ray'")
        check(self.rpc_timeout_s > 0, f"rpc_timeout_s must be > 0, got {self.rpc_timeout_s}")
        check(self.worker_start_timeout_s > 0,
              f"worker_start_timeout_s must be > 0, got {self.worker_start_timeout_s}")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            errors.append(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}), or the longest prompts could never be scheduled"
            )
        if self.model is not None and not os.path.exists(self.model):
            errors.append(f"model path {self.model!r} does not exist (tandem loads local folders and .gguf files; "
                          "it never downloads from a hub)")
        if errors:
            raise ValueError("invalid engine config: " + "; ".join(errors))

    def _type_errors(self) -> list[str]:
        """Each field must hold its declared type (bool is not an int; an int is a float)."""
        errors = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            t = f.type if isinstance(f.type, str) else str(f.type)
            optional = "Optional" in t
            if v is None:
                if not optional:
                    errors.append(f"{f.name} must not be None")
                continue
            base = t.replace("Optional[", "").rstrip("]")
            ok = {
                "bool": isinstance(v, bool),
                "int": isinstance(v, int) and not isinstance(v, bool),
                "float": isinstance(v, (int, float)) and not isinstance(v, bool),
                "str": isinstance(v, str),
            }.get(base, True)
            if not ok:
                errors.append(f"{f.name} must be of type {base}, got {type(v).__name__} {v!r}")
        return errors

    @property
    def max_concurrent_batches(self) -> int:
        """Depth of the engine's in-flight batch queue: 2 overlaps CPU and device work."""
        return 2 if self.async_scheduling else 1

    @property
    def resolved_executor(self) -> str:
        if self.executor != "auto":
            return self.executor
        return "uniproc" if self.tensor_parallel_size == 1 else "multiproc"

    # -- CLI mirroring -------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (``--max-num-seqs``; booleans get ``--x / --no-x``)."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            default = f.default
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if "bool" in kind:
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                    help=help_text)
                continue
            if "int" in kind:
                conv: Any = int
            elif "float" in kind:
                conv = float
            else:
                conv = str
            kwargs: dict[str, Any] = {"type": conv, "default": default, "help": help_text}
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
