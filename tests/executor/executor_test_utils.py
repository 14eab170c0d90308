"""Shared by the executor tests: the engine settings they compare, and process checks."""
from __future__ import annotations

from proc_utils import pid_alive, wait_gone  # noqa: F401  (re-exported for the tests)

VOCAB = 128
BASE = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=512)
SETTINGS = {
    "default": dict(),
    "preempt+chunked": dict(num_kv_blocks=40, max_num_batched_tokens=12),
}
FAULTY = "faulty_worker.FaultyWorker"
