"""The tensor-parallel group of this process, set once by the worker before the model is built.

Layers read ``get_tp_rank()`` / ``get_tp_world_size()`` when they are constructed and call the
collectives below in ``forward``. With one rank (the default, no ``init_tensor_parallel``
call) every collective is the identity and nothing touches ``torch.distributed``, so a
single-device engine never needs a process group.

Backends: ``gloo`` on the CPU (so TP=2 runs in CI), ``nccl`` on CUDA (override with the
``TANDEM_DIST_BACKEND`` environment variable, read into ``EnvSwitches.dist_backend``).
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class _TPState:
    rank: int = 0
    world_size: int = 1
    group: Optional[dist.ProcessGroup] = None
    owns_default_group: bool = False


_STATE = _TPState()


def init_tensor_parallel(rank: int, world_size: int, init_method: Optional[str], device: torch.device,
                         timeout_s: float = 600.0, backend: Optional[str] = None) -> None:
    """Join the group of ``world_size`` ranks at ``init_method`` (``tcp://host:port``).

    ``world_size == 1`` sets the single-rank state and creates no process group.
    """
    global _STATE
    if world_size == 1:
        _STATE = _TPState()
        return
    if init_method is None:
        raise ValueError("tensor parallelism needs a distributed_init_method (tcp://host:port)")
    # backend "gloo" on CUDA (TANDEM_DIST_BACKEND) lets several ranks share one GPU (slow,
    # host-staged collectives): a way to test the tensor-parallel GPU path on one GPU.
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    owns = False
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        owns = True
    group = dist.group.WORLD
    _STATE = _TPState(rank=rank, world_size=world_size, group=group, owns_default_group=owns)
    logger.info("tensor parallel rank %d/%d (%s)", rank, world_size, backend)


def destroy_tensor_parallel() -> None:
    global _STATE
    if _STATE.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = _TPState()


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_world_size() -> int:
    return _STATE.world_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks (in place); identity on one rank."""
    if _STATE.world_size == 1:
        return x
    dist.all_reduce(x, group=_STATE.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); identity on one rank."""
    if _STATE.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.world_size)]
    dist.all_gather(parts, x, group=_STATE.group)
    return torch.cat(parts, dim=dim)


def tp_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``x`` on every rank with rank ``src``'s values (in place)."""
    if _STATE.world_size == 1:
        return x
    dist.broadcast(x, src=src, group=_STATE.group)
    return x

