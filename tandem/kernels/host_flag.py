"""A stream waits on the device until a flag in host memory reaches a value: gated sampling.

Why: a constrained step's sampling needs the token bitmask that the engine core fills on the
host while the step's forward runs. Sent as a second call once the bitmask is filled, the
sampling cost the engine thread a call per step and tied the device to the engine thread's
timing. Gated, the engine thread launches the forward, this wait, the bitmask's copy and the
masked sampling in one go; the fill thread raises the flag when the bitmask is ready, and the
device goes on by itself (``tandem.structured_output.gated``).

The flag is an int32 in page-locked host memory, which the device reads over the bus (with
unified addressing a pinned buffer's host address is also its device address). The kernel
is one warp polling it with volatile loads until ``flag >= target``; copies queued after it
read the bitmask only then. The host writes the bitmask before the flag, and the device's
copy engine reads it after seeing the flag.

A bounded number of polls (``MAX_POLLS``, tens of seconds) keeps a flag that is never raised
(a bug) from hanging the device for good: the step then samples with whatever the buffer
holds, and the engine fails it (its fill reports the error).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Each poll is a read across the bus (about a microsecond): some tens of seconds in all.
MAX_POLLS = 1 << 25


@triton.jit(do_not_specialize=["target"])  # one compiled variant whatever the value
def _wait_flag_kernel(flag_addr, target, max_polls):
    ptr = flag_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
    v = tl.load(ptr, volatile=True)
    n = 0
    while (v < target) & (n < max_polls):
        v = tl.load(ptr, volatile=True)
        n += 1


def wait_for_host_flag(flag: torch.Tensor, target: int, max_polls: int = MAX_POLLS) -> None:
    """Queue on the current stream a wait until ``flag[0] >= target`` (``flag``: int32, in
    pinned host memory; ``max_polls`` bounds the wait)."""
    assert flag.dtype == torch.int32 and (flag.is_pinned() or flag.device.type == "cpu")
    _wait_flag_kernel[(1,)](flag.data_ptr(), target, max_polls, num_warps=1)


# -- the same wait inside a CUDA graph (``ModelRunner``'s gated decode graphs) ---------------
# A captured kernel keeps its arguments, but a gated step's flag target changes every step:
# here the flag's address and the target are read from a small device tensor that the step's
# staging upload rewrites (``GATE_*`` below index it).
GATE_FLAG_ADDR, GATE_TARGET, GATE_BITMASK_ADDR = 0, 1, 2
GATE_WORDS = 3  # int64 entries of a staged gate


@triton.jit
def _wait_staged_flag_kernel(gate_ptr, max_polls):
    ptr = tl.load(gate_ptr).to(tl.pointer_type(tl.int32))  # GATE_FLAG_ADDR
    target = tl.load(gate_ptr + 1).to(tl.int32)  # GATE_TARGET
    v = tl.load(ptr, volatile=True)
    n = 0
    while (v < target) & (n < max_polls):
        v = tl.load(ptr, volatile=True)
        n += 1


def wait_for_staged_flag(gate: torch.Tensor, max_polls: int = MAX_POLLS) -> None:
    """Queue a wait until the int32 at address ``gate[GATE_FLAG_ADDR]`` (pinned host memory)
    reaches ``gate[GATE_TARGET]``; ``gate`` is an int64 tensor on the stream's device, read
    when the wait runs (so a graph that captured this call waits for each replay's values)."""
    assert gate.dtype == torch.int64 and gate.numel() >= GATE_WORDS
    _wait_staged_flag_kernel[(1,)](gate, max_polls, num_warps=1)
