"""One worker: owns a device, the model weights, the KV cache and a model runner.

The executor talks to workers only through the methods here, so the same class serves the
in-process executor, worker processes (``executor/multiproc.py``) and Ray actors
(``executor/ray_executor.py``). With tensor parallelism every rank runs every step; only
rank 0 (the driver rank) samples, and only its ``execute_model`` returns an output.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional, cast

import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.distributed import init_tensor_parallel
from tandem.layers import use_fused_kernels, use_small_batch_gemv
from tandem.layers.attention import resolve_backend
from tandem.models.registry import CausalLM
from tandem.types.grammar import GrammarOutput
from tandem.types.scheduler_output import SchedulerOutput
from tandem.worker.async_output import AsyncModelOutput
from tandem.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _gemv_rows(asked: Optional[int], hf_config: Any) -> int:
    """The rows up to which decoder layers take the fused GEMV kernels: what
    ``TANDEM_GEMV_MAX_ROWS`` asked (capped at the kernels' limit), else the model-size rule."""
    from tandem.kernels.gemv import MAX_ROWS, auto_max_rows

    if asked is not None:
        return max(0, min(asked, MAX_ROWS))
    return auto_max_rows(hf_config.hidden_size, hf_config.intermediate_size)


class Worker:
    """One rank. ``rank``/``distributed_init_method`` matter only with tensor parallelism:
    the worker joins the group before building the model, whose layers then hold this
    rank's shard."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, rank: int = 0,
                 distributed_init_method: Optional[str] = None, local_rank: Optional[int] = None) -> None:
        from tandem.models.loader import load_model

        self.config = config
        self.model_config = model_config
        self.rank = rank
        world_size = config.tensor_parallel_size
        device = torch.device(model_config.device)
        if device.type == "cuda":
            # local_rank: the GPU index this process sees (Ray gives each actor one GPU: 0).
            # With more ranks than GPUs (only workable with a gloo backend), ranks share GPUs.
            index = (local_rank if local_rank is not None
                     else (rank % torch.cuda.device_count() if world_size > 1 else (device.index or 0)))
            device = torch.device("cuda", index)
            torch.cuda.set_device(device)
        self.device = device
        self.dtype = _DTYPES[model_config.dtype]
        init_tensor_parallel(rank, world_size, distributed_init_method, device, backend=model_config.env.dist_backend)
        # The engine's seed, for unseeded sampling (the default generator of this device).
        torch.random.manual_seed(config.seed)
        module = load_model(model_config.folder, self.dtype, self.device, hf_config=model_config.hf_config)
        self.model = cast(CausalLM, module)
        backend = resolve_backend(config.attention_backend, self.device)
        graphs = not config.enforce_eager and device.type == "cuda" and backend == "triton" and world_size == 1
        if not config.enforce_eager and device.type == "cuda" and not graphs:
            logger.info("CUDA graphs off (attention backend %s, tensor_parallel_size %d): decode runs eagerly",
                        backend, world_size)
        # The GEMV kernels do not all-reduce a row-parallel layer's partial sums: one rank only.
        gemv = backend == "triton" and world_size == 1
        if backend == "triton":
            from tandem.kernels import pdl

            pdl.set_enabled(model_config.env.pdl and pdl.supported(self.device))
            use_fused_kernels(module)
            if gemv:
                use_small_batch_gemv(module, _gemv_rows(model_config.env.gemv_max_rows, model_config.hf_config))
        # Speculative decoding with a draft model: loaded beside the target, its KV cache in
        # the same blocks (the target's block table addresses both).
        from tandem.models.draft import draft_model_config

        self.draft_config = draft_model_config(config, model_config, check=False)
        draft: Optional[CausalLM] = None
        if self.draft_config is not None:
            draft_module = load_model(self.draft_config.folder, self.dtype, self.device,
                                      hf_config=self.draft_config.hf_config)
            if backend == "triton":
                use_fused_kernels(draft_module)
                if gemv:
                    use_small_batch_gemv(draft_module, _gemv_rows(model_config.env.gemv_max_rows,
                                                                  self.draft_config.hf_config))
            draft = cast(CausalLM, draft_module)
        self.runner = ModelRunner(self.model, model_config.vocab_size, config.block_size, model_config.max_model_len,
                                  model_config.max_num_seqs, model_config.max_num_batched_tokens, self.device,
                                  self.dtype, attention_backend=backend, cuda_graphs=graphs,
                                  speculative=config.speculative_config, draft_model=draft,
                                  mixed_graph_max_tokens=model_config.env.mixed_graph_max_tokens,
                                  gated_graphs=model_config.env.gated_graphs)
        self.draft = draft

    def enable_gated_sampling(self) -> None:
        """The engine gates constrained steps: ``init_kv_cache``'s warm-up compiles the
        device-side wait too, not the first constrained request."""
        self.runner.warm_gated_sampling = True

    def block_bytes(self) -> int:
        tp = self.config.tensor_parallel_size
        draft = self.draft_config.kv_block_bytes(self.config.block_size, tp) if self.draft_config is not None else 0
        return self.model_config.kv_block_bytes(self.config.block_size, tp) + draft

    @torch.inference_mode()
    def determine_num_kv_blocks(self) -> int:
        """KV blocks that fit: measured after a warm-up forward on CUDA, a fixed budget on CPU."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":
            return max(1, int(self.config.cpu_kv_cache_gib * (1 << 30)) // self.block_bytes())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        n = self.model_config.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, dtype=torch.int64, device=self.device) % 64
        hidden = self.model(ids, pos)  # no forward context: plain causal pass, nothing cached
        # The sampler's costliest path (float32 logits, top-k/top-p sort) at the largest batch.
        self.runner.profile_sampler(self.model.compute_logits(hidden[: self.model_config.max_num_seqs]))
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - before
        del hidden
        torch.cuda.empty_cache()
        # This instance's share: weights + activation peak + KV <= utilization * total, and
        # never more than is actually free (another engine may share the device).
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if self.draft is not None:
            weights += sum(p.numel() * p.element_size() for p in self.draft.parameters())
        free, total = torch.cuda.mem_get_info()
        budget = min(total * self.config.gpu_memory_utilization - weights - activations,
                     free - activations - (512 << 20))
        blocks = int(budget // self.block_bytes())
        if blocks < 1:
            raise RuntimeError("no GPU memory left for the KV cache; raise gpu_memory_utilization")
        logger.info("KV cache: %d blocks (%.2f GiB)", blocks, blocks * self.block_bytes() / (1 << 30))
        return blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        tp = self.config.tensor_parallel_size
        dc = self.draft_config
        if dc is not None:  # before the target's: its init warms up and captures graphs
            self.runner.init_draft_kv_cache(num_blocks, dc.num_layers, dc.num_kv_heads_per_rank(tp), dc.head_dim)
        self.runner.init_kv_cache(num_blocks, mc.num_layers, mc.num_kv_heads_per_rank(tp), mc.head_dim)

    def execute_model(self, so: SchedulerOutput) -> Optional[AsyncModelOutput]:
        """Launch one step. Rank 0 returns its output handle; other ranks return None (they
        ran the same forward and received the sampled ids, but report nothing). A step with
        constrained requests returns None on every rank: ``sample_tokens`` finishes it."""
        out = self.runner.execute_model(so)
        return out if self.rank == 0 else None

    def prepare_model(self, so: SchedulerOutput) -> None:
        """Build step ``so``'s host inputs ahead of the pending sampling call (the uniproc
        executor; see ``ModelRunner.prepare``)."""
        self.runner.prepare(so)

    def sample_tokens(self, grammar: GrammarOutput) -> Optional[AsyncModelOutput]:
        """Mask and sample the constrained step launched last (rank 0; the others take part
        in the broadcast of the ids and return None)."""
        out = self.runner.sample_tokens(grammar)
        return out if self.rank == 0 else None

    def get_pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        """Leave the tensor-parallel group and give the device memory back: the weights, the
        KV cache and the graphs go with the runner, and the caching allocator's reserve is
        emptied, so a process that outlives its ``LLM`` (a benchmark, a notebook) can start
        another engine or let another process use the GPU."""
        from tandem.distributed import destroy_tensor_parallel

        destroy_tensor_parallel()
        runner = getattr(self, "runner", None)
        if runner is not None and runner.stats_steps:
            logger.info("model runner: %d steps, %d through CUDA graphs (%d of them mixed batches); %d constrained "
                        "steps sampled by a masked sampling graph", runner.stats_steps, runner.stats_graph_steps,
                        runner.stats_mixed_graph_steps, runner.stats_masked_graph_steps)
        if self.device.type == "cuda" and hasattr(self, "runner"):
            import gc

            del self.runner, self.model
            gc.collect()
            torch.cuda.empty_cache()


def resolve_worker_class(path: str) -> type:
    """Import ``package.module.ClassName`` (``config.worker_cls``): the class each rank runs."""
    import importlib

    module_name, _, cls_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"worker_cls must be a dotted path package.module.Class, got {path!r}")
    cls = getattr(importlib.import_module(module_name), cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise ValueError(f"worker_cls {path!r} is not a subclass of tandem.worker.worker.Worker")
    return cls
