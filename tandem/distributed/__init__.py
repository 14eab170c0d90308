"""Tensor-parallel process group and the few collectives the model needs."""
from tandem.distributed.parallel_state import (  # noqa: F401
    destroy_tensor_parallel,
    get_tp_rank,
    get_tp_world_size,
    init_tensor_parallel,
    tp_all_gather,
    tp_all_reduce,
    tp_broadcast,
)
