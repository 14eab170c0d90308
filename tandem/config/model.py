"""The model as resolved once, on the driver, and passed down to every layer and process.

``EngineConfig`` says what the user asked for (a path, ``dtype="auto"``, maybe a
``max_model_len``); ``ModelConfig`` is what that resolves to: the HF folder actually
loaded (a GGUF converted into the cache), the HF config read from it, the concrete dtype
and device, the context length, the step limits (the device's defaults where the user gave
none), the EOS ids, and the ``TANDEM_*`` environment switches.
It is built by ``tandem.models.model_config.resolve_model_config`` and never re-derived
below: workers, executors and the scheduler read it instead of loading ``config.json``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class EnvSwitches:
    """The environment variables tandem reads, read once (on the driver) and sent down.

    - ``TANDEM_CACHE_DIR`` (``cache_dir``): root of the on-disk cache (converted GGUF
      models); default ``~/.cache/tandem``.
    - ``TANDEM_DIST_BACKEND`` (``dist_backend``): ``torch.distributed`` backend for tensor
      parallelism; default ``nccl`` on CUDA, ``gloo`` on the CPU. ``gloo`` on CUDA lets
      several ranks share one GPU (slow, for testing the TP path on one GPU).
    - ``TANDEM_LOG_LEVEL`` (``log_level``): log level of worker processes and actors.
    - ``TANDEM_RAY_WAIT_FOR_RESOURCES`` (``ray_wait_for_resources``): let the Ray executor
      wait for an autoscaling cluster to grow instead of failing at once.
    - ``TANDEM_GEMV_MAX_ROWS`` (``gemv_max_rows``): on the Triton path, batches of at most
      this many tokens (up to 8) run each projection as one fused GEMV
      (``tandem.kernels.gemv``); 0 keeps them on the GEMM path. Unset: one token, for models
      small enough that it measured faster (``tandem.kernels.gemv.auto_max_rows``).
    - ``TANDEM_PDL`` (``pdl``): the Triton decoder-layer kernels launch with programmatic
      dependent launch (``tandem.kernels.pdl``) on a Hopper or later GPU, so each may start
      while the one before it finishes (0.5B batch 1 on an H100: +8-14%); ``0`` turns it off.
    - ``TANDEM_MIXED_GRAPH_MAX_TOKENS`` (``mixed_graph_max_tokens``): with CUDA graphs, a
      batch that is not pure decode (prefill chunks beside decodes) of up to this many tokens
      (e.g. 1024) replays a graph captured for its token bucket
      (``tandem.worker.model_runner``). 0, the default (served on an H100 the graphs gave no
      gain: ``benchmarks/RESULTS.md``, 2026-12-07, eighth session), runs such batches eagerly.
    - ``TANDEM_ASYNC_DEPTH`` (``async_depth``): with async scheduling, how many steps the
      engine core keeps in flight (``EngineCore.depth``). 2, the default, launches step N+1
      before it waits for step N; 3 also launches N+2 before that wait, so a host step that
      is as long as a short device step (batch 1 on a slow host) still finds the next step
      queued. Not with speculative decoding (its proposals follow the step before).
    - ``TANDEM_GATED_GRAPHS`` (``gated_graphs``): with CUDA graphs and gated sampling, a
      greedy constrained decode step runs whole in one graph replay: the forward, the wait
      for its bitmask, the mask (read from the pinned host buffer the fill thread wrote) and
      the argmax (``ModelRunner._gated_graph_body``). Off by default until a GPU run shows
      the engine thread's saving (a flag-wait launch, two copies and a second replay a step).
    """

    cache_dir: str = "~/.cache/tandem"
    dist_backend: Optional[str] = None
    log_level: str = "WARNING"
    ray_wait_for_resources: bool = False
    gemv_max_rows: Optional[int] = None
    pdl: bool = True
    mixed_graph_max_tokens: int = 0
    async_depth: int = 2
    gated_graphs: bool = False

    @classmethod
    def from_environ(cls, environ: Optional[dict[str, str]] = None) -> "EnvSwitches":
        env = os.environ if environ is None else environ
        return cls(
            cache_dir=env.get("TANDEM_CACHE_DIR") or cls.cache_dir,
            dist_backend=env.get("TANDEM_DIST_BACKEND") or None,
            log_level=(env.get("TANDEM_LOG_LEVEL") or cls.log_level).upper(),
            ray_wait_for_resources=env.get("TANDEM_RAY_WAIT_FOR_RESOURCES", "").lower() in ("1", "true", "yes"),
            gemv_max_rows=int(env["TANDEM_GEMV_MAX_ROWS"]) if env.get("TANDEM_GEMV_MAX_ROWS") else None,
            pdl=env.get("TANDEM_PDL", "1").lower() not in ("0", "false", "no"),
            mixed_graph_max_tokens=int(env.get("TANDEM_MIXED_GRAPH_MAX_TOKENS") or cls.mixed_graph_max_tokens),
            async_depth=int(env.get("TANDEM_ASYNC_DEPTH") or cls.async_depth),
            gated_graphs=env.get("TANDEM_GATED_GRAPHS", "").lower() in ("1", "true", "yes"),
        )

    @property
    def cache_root(self) -> str:
        return os.path.abspath(os.path.expanduser(self.cache_dir))


@dataclass(frozen=True)
class ModelInfo:
    """What the front end needs of the model (tokenizer, limits, EOS ids): plain data, so an
    API-server process learns it from the engine core without importing torch or the
    transformers model code that a ``ModelConfig``'s ``hf_config`` needs."""

    folder: str
    tokenizer: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything about the model that the layers below the front end need (see module doc)."""

    folder: str  # HF-style folder that is loaded (config.json + safetensors)
    tokenizer: str  # tokenizer folder
    hf_config: Any  # transformers PretrainedConfig read from ``folder``
    dtype: str  # "float32" | "bfloat16" | "float16" (never "auto")
    device: str  # "cpu" | "cuda" (never "auto")
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int  # most requests in one step
    max_num_batched_tokens: int  # token budget of one step
    env: EnvSwitches = field(default_factory=EnvSwitches)

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(self.folder, self.tokenizer, self.max_model_len, self.vocab_size, self.eos_token_ids,
                         self.device, self.max_num_seqs, self.max_num_batched_tokens)

    @property
    def architecture(self) -> str:
        archs = list(getattr(self.hf_config, "architectures", None) or [])
        return archs[0] if archs else "?"

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(getattr(self.hf_config, "head_dim", None) or self.hf_config.hidden_size // self.num_heads)

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    def num_kv_heads_per_rank(self, tp: int) -> int:
        """KV heads each tensor-parallel rank holds: split, or replicated when tp > heads."""
        return max(1, self.num_kv_heads // tp)

    def kv_block_bytes(self, block_size: int, tp: int = 1) -> int:
        """Bytes one KV block takes on one rank (K and V, every layer)."""
        return 2 * self.num_layers * block_size * self.num_kv_heads_per_rank(tp) * self.head_dim * self.dtype_bytes

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse, before any worker starts, a model whose heads or MLP cannot split over ``tp`` ranks."""
        if tp == 1:
            return
        heads, kv = self.num_heads, self.num_kv_heads
        problems = []
        if heads % tp:
            problems.append(f"num_attention_heads {heads} is not divisible by it")
        if tp < kv and kv % tp:
            problems.append(f"num_key_value_heads {kv} is not divisible by it")
        if tp > kv and tp % kv:
            problems.append(f"it exceeds num_key_value_heads {kv} without being a multiple of it")
        inter = getattr(self.hf_config, "intermediate_size", None)
        if inter is not None and inter % tp:
            problems.append(f"intermediate_size {inter} is not divisible by it")
        if problems:
            raise ValueError(f"tensor_parallel_size {tp} does not fit this model: " + "; ".join(problems))
