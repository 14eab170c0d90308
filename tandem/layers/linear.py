"""Linear layers whose parameters know how to load checkpoint shards.

Checkpoints store ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` separately,
while we run each group as one fused matmul. Every parameter therefore carries a
``weight_loader(param, loaded_weight, shard_id=None)`` that copies a checkpoint tensor into
the right slice of the fused parameter (``shard_id`` is ``"q"``/``"k"``/``"v"`` for QKV and the
index into ``output_sizes`` for merged column layers).

Tensor parallelism follows the Megatron/vLLM layout: column-parallel layers split the
output dim (each rank computes its slice, no communication), row-parallel layers split the
input dim and sum the partial outputs with an all-reduce. Attention is column (QKV, whole
heads per rank) then row (o_proj); the MLP is column (gate_up) then row (down), so each
block communicates twice. Every layer reads this process's rank and world size from
``tandem.distributed`` when it is built, and its loaders narrow each checkpoint tensor to
the rank's slice. With one rank nothing is split and nothing is communicated.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import get_tp_rank, get_tp_world_size, tp_all_reduce

# What a stacked-params mapping hands a weight loader: "q"/"k"/"v", a merged index, or None.
ShardId = Union[str, int, None]


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
    """Copy a whole checkpoint tensor into ``param`` (dtype converted), checking the shape."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no shards (got shard_id={shard_id!r})")
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint tensor {tuple(loaded_weight.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded_weight)


def _divide(a: int, b: int, what: str = "size") -> int:
    if a % b:
        raise ValueError(f"{what} {a} is not divisible by tensor_parallel_size {b}")
    return a // b


class LinearBase(nn.Module):
    """``y = x W^T + b`` with ``W`` of shape ``[out_per_rank, in_per_rank]``.

    Parameters are allocated uninitialized (``torch.empty``): they are always overwritten by
    the checkpoint, and the model's loader refuses to finish with any parameter unloaded.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: Optional[nn.Parameter] = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks; each rank produces its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.total_output_size = output_size
        super().__init__(input_size, _divide(output_size, get_tp_world_size(), "output size"), bias)

    def _rank_slice(self, loaded_weight: torch.Tensor, size: int) -> torch.Tensor:
        """This rank's ``size`` rows of a (sub-)tensor that holds all ranks' rows."""
        return loaded_weight.narrow(0, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards (got shard_id={shard_id!r})")
        default_weight_loader(param, self._rank_slice(loaded_weight, param.shape[0]))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column layers sharing an input fused into one (e.g. gate_proj + up_proj).

    ``shard_id`` is the index into ``output_sizes``; each shard occupies its own contiguous
    block of this rank's output (``[gate_r | up_r]``), so ``SiluAndMul`` can split it in half.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:  # an already-merged checkpoint tensor
            if self.tp_size == 1:
                return default_weight_loader(param, loaded_weight)
            raise ValueError("loading a pre-merged tensor with tensor parallelism is not supported")
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index < {len(self.output_sizes)}, got {shard_id!r}")
        sizes = [_divide(s, self.tp_size, "output size") for s in self.output_sizes]
        offset, size = sum(sizes[:shard_id]), sizes[shard_id]
        expected = (self.output_sizes[shard_id],) + tuple(param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"shard {shard_id}: expected checkpoint shape {expected}, "
                             f"got {tuple(loaded_weight.shape)}")
        default_weight_loader(param.narrow(0, offset, size), self._rank_slice(loaded_weight, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused: this rank's output is ``[q_r | k_r | v_r]``.

    Query heads are split across ranks; KV heads are split too, or replicated when there
    are fewer KV heads than ranks (each rank then keeps the one KV head its queries use).
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: Optional[int] = None, bias: bool = False) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp = get_tp_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        if tp >= total_num_kv_heads:
            if tp % total_num_kv_heads:
                raise ValueError(f"tensor_parallel_size {tp} must be a multiple of num_key_value_heads "
                                 f"{total_num_kv_heads} when it exceeds it (each rank keeps one whole KV head)")
            self.num_kv_heads = 1
            self.kv_replicas = tp // total_num_kv_heads
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias)
        self.total_output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is None:  # an already-fused qkv tensor
            if self.tp_size == 1:
                return default_weight_loader(param, loaded_weight)
            raise ValueError("loading a pre-fused qkv tensor with tensor parallelism is not supported")
        if shard_id == "q":
            offset, size, rank_idx, total_heads = 0, self.q_size, self.tp_rank, self.total_num_heads
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank_idx, total_heads = self.kv_size, self.tp_rank // self.kv_replicas, self.total_num_kv_heads
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        expected = (total_heads * self.head_size,) + tuple(param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"shard {shard_id!r}: expected checkpoint shape {expected}, "
                             f"got {tuple(loaded_weight.shape)}")
        default_weight_loader(param.narrow(0, offset, size), loaded_weight.narrow(0, rank_idx * size, size))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the fused output back into ``q, k, v`` (views)."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # type: ignore[return-value]


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; the partial outputs are summed with an all-reduce.

    The (whole) bias is added once, after the sum.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.total_input_size = input_size
        super().__init__(_divide(input_size, get_tp_world_size(), "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards (got shard_id={shard_id!r})")
        if param.dim() == 2:
            size = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * size, size)
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        out = tp_all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

