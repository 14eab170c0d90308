"""The engine's one configuration object, validated by pydantic.

Each field carries its type, range and help text in one place; the CLI generates its
flags from these fields (``tandem.entrypoints.cli``), so a new option is added here once
and appears on the command line with the same default and help.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Literal, NamedTuple, Optional

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tandem.config.speculative import SpeculativeConfig
from tandem.validation import INT64_MAX, INT64_MIN, StrictModel, show

logger = logging.getLogger(__name__)

MAX_BLOCK_SIZE = 256  # the largest KV block the attention kernels are built for
_GIB = 1 << 30
_DOTTED_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


class StepLimits(NamedTuple):
    """How large one step may be: the scheduler's limits, and what the worker sizes its
    buffers, CUDA graphs and memory profile for."""

    max_num_seqs: int
    max_num_batched_tokens: int


# The step limits of each device, for the fields left unset. CUDA: the figure the H200 was
# tuned at (a 0.5B model made 86.5k output tok/s at 256/8192, 33.8k at the CPU's 64;
# vLLM also uses 256/8192 or more on H100-class GPUs). The CPU: small steps, whose forward
# pass is slow enough that a larger batch only adds latency.
STEP_DEFAULTS = {"cuda": StepLimits(256, 8192), "cpu": StepLimits(64, 2048)}


class EngineConfig(StrictModel):
    """Everything that shapes an engine instance. Validated on construction and assignment.

    Wrong values raise ``InvalidValuesError`` (a ``ValueError``) with one sentence per
    problem, each naming the field and the value; an unknown keyword names the closest field.
    """

    what = "engine config"

    model: Optional[str] = Field(
        None, description="HF model folder or .gguf file; default: the embedded SmolLM2-135M-Instruct GGUF")
    tokenizer: Optional[str] = Field(None, description="tokenizer folder (default: the model's)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weight/activation dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="cpu, cuda, or auto (cuda when available)")
    block_size: int = Field(16, description=f"tokens per KV cache block (a power of two, at most {MAX_BLOCK_SIZE})")
    num_kv_blocks: Optional[int] = Field(
        None, ge=1, description="number of KV cache blocks (overrides the memory-based sizing)")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="fraction of GPU memory the engine may use (weights + activations + KV)")
    cpu_kv_cache_gib: float = Field(1.0, gt=0.0, description="KV cache size in GiB on the CPU")
    max_num_seqs: Optional[int] = Field(
        None, ge=1, description="most requests in one step (default: the device's, "
                                f"{STEP_DEFAULTS['cuda'].max_num_seqs} on CUDA and "
                                f"{STEP_DEFAULTS['cpu'].max_num_seqs} on the CPU)")
    max_num_batched_tokens: Optional[int] = Field(
        None, ge=1, description="token budget of one step (default: the device's, "
                                f"{STEP_DEFAULTS['cuda'].max_num_batched_tokens} on CUDA and "
                                f"{STEP_DEFAULTS['cpu'].max_num_batched_tokens} on the CPU)")
    max_model_len: Optional[int] = Field(
        None, ge=1, description="longest prompt + output (default: the model's context length)")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = Field(True, description="split long prompts across steps to fit the token budget")
    async_scheduling: bool = Field(True, description="schedule step N+1 while step N runs (token-identical to sync)")
    max_logprobs: int = Field(20, ge=0, description="largest logprobs / prompt_logprobs a request may ask for")
    seed: int = Field(0, ge=INT64_MIN, le=INT64_MAX,
                      description="engine-wide seed of the default random generator, used by requests without "
                                  "their own seed (not the per-request sampling seed)")
    executor: Literal["auto", "uniproc", "multiproc", "ray"] = Field(
        "auto", description="how workers run: uniproc (in this process), multiproc (one process per rank), "
                            "ray (Ray actors, for several machines), auto (uniproc for one rank, else multiproc)")
    tensor_parallel_size: int = Field(1, ge=1, description="number of devices (ranks) a model is split across")
    rpc_timeout_s: float = Field(
        300.0, gt=0.0, description="seconds a worker may take to answer one call before the executor declares it "
                                   "hung and fails (multiproc and ray)")
    worker_cls: str = Field("tandem.worker.worker.Worker", description="dotted path of the class each rank runs "
                                                                      "(a Worker subclass, for extensions and tests)")
    worker_start_timeout_s: float = Field(
        600.0, gt=0.0, description="seconds worker processes may take to start and load the model")
    attention_backend: Literal["auto", "sdpa", "triton"] = Field(
        "auto", description="attention kernels: triton (one launch per layer, CUDA graphs), sdpa (torch SDPA; "
                            "the CPU path and fallback), auto (triton on CUDA when installed, else sdpa)")
    enforce_eager: bool = Field(
        False, description="never capture CUDA graphs (decode then launches every kernel from Python)")
    structured_outputs_backend: Literal["xgrammar", "guidance"] = Field(
        "xgrammar", description="grammar library of structured outputs (JSON schema, regex, choice, grammar): "
                                "xgrammar or guidance (llguidance)")
    structured_outputs_fill_threads: int = Field(
        1, ge=1, le=64, description="threads that fill a split step's token bitmask on a CUDA engine "
                                    "(structured_outputs_sampling split), each a share of the constrained rows (at "
                                    "least 32 rows a share); more shorten the fill when the host has idle cores")
    structured_outputs_sampling: Literal["auto", "gated", "split"] = Field(
        "auto", description="how a constrained step samples: gated (launched with its forward, waiting on the "
                            "device for the bitmask the engine core fills meanwhile on a thread of its own; a worker "
                            "in the engine's process, no speculative decoding), split (a second call once the "
                            "bitmask is filled, as vLLM does), auto (gated where it can run, else split)")
    speculative_config: Optional[SpeculativeConfig] = Field(
        None, description="speculative decoding, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                          "(method ngram: prompt_lookup_min/max; draft_model: model; disable_by_batch_size)")

    @field_validator("block_size")
    @classmethod
    def _block_size_fits_attention(cls, v: int) -> int:
        """1048576 used to be accepted and the process was OOM-killed building the KV cache."""
        if not (1 <= v <= MAX_BLOCK_SIZE and v & (v - 1) == 0):
            raise ValueError(f"block_size must be a power of two <= {MAX_BLOCK_SIZE}, got {show(v)}")
        return v

    @field_validator("model", "tokenizer")
    @classmethod
    def _path_exists(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        """Fail here, naming the field, rather than deep inside the loader."""
        if v is not None and not os.path.exists(v):
            raise ValueError(f"{info.field_name} path {v!r} does not exist (tandem loads local folders and "
                             ".gguf files; it never downloads from a hub)")
        return v

    @field_validator("worker_cls")
    @classmethod
    def _dotted_path(cls, v: str) -> str:
        if not _DOTTED_PATH.fullmatch(v):
            raise ValueError(f"worker_cls must be a dotted path package.module.Class, got {show(v)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "EngineConfig":
        """Checks that involve two fields (each field alone is already valid here)."""
        if self.executor == "uniproc" and self.tensor_parallel_size > 1:
            raise ValueError(f"the uniproc executor runs one rank; tensor_parallel_size={self.tensor_parallel_size} "
                             "needs executor 'multiproc' or 'ray'")
        if self.max_num_batched_tokens is not None:
            self._check_budget(self.max_num_batched_tokens, "")
        return self

    def _check_budget(self, max_num_batched_tokens: int, whose: str) -> None:
        """Without chunked prefill the budget must hold the longest prompt (``whose``: where a
        default budget came from, for the message)."""
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}{whose}) must be >= "
                f"max_model_len ({self.max_model_len}), or the longest prompts could never be scheduled")

    def step_limits(self, device: str) -> StepLimits:
        """The step limits on ``device`` ("cpu" or "cuda"): the values given, else the
        device's defaults (``STEP_DEFAULTS``). Resolved once, with the device, into
        ``ModelConfig``, which every part of the engine reads."""
        default = STEP_DEFAULTS[device]
        limits = StepLimits(default.max_num_seqs if self.max_num_seqs is None else self.max_num_seqs,
                            default.max_num_batched_tokens if self.max_num_batched_tokens is None
                            else self.max_num_batched_tokens)
        self._check_budget(limits.max_num_batched_tokens,
                           "" if self.max_num_batched_tokens is not None else f", the {device} default")
        return limits

    @property
    def max_concurrent_batches(self) -> int:
        """Depth of the engine's in-flight batch queue: 2 overlaps CPU and device work."""
        return 2 if self.async_scheduling else 1

    @property
    def resolved_executor(self) -> str:
        if self.executor != "auto":
            return self.executor
        return "uniproc" if self.tensor_parallel_size == 1 else "multiproc"


def available_memory_bytes() -> Optional[int]:
    """Memory the kernel can hand out now without swapping (``MemAvailable``), or None if unknown.

    Read from ``/proc/meminfo`` on Linux (no psutil dependency), else from ``os.sysconf``.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_cpu_memory(gib: float, what: str = "cpu_kv_cache_gib") -> None:
    """Refuse to allocate ``gib`` GiB of host memory that the machine does not have.

    Without this, a KV cache larger than RAM is allocated page by page while the model
    runs, and the kernel kills the process tens of seconds later with no message.
    """
    available = available_memory_bytes()
    if available is None:
        logger.debug("available memory unknown; not checking %s=%s", what, gib)
        return
    if gib * _GIB > available:
        raise ValueError(f"{what} needs {gib:.2f} GiB, but only {available / _GIB:.2f} GiB of memory is available "
                         "on this machine (MemAvailable); lower it")
