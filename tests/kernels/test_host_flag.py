"""The device-side wait on a host flag (``tandem.kernels.host_flag``) that gates a constrained
step's sampling. On the CPU the kernel runs under the Triton interpreter (the flag is read
where it lies); on CUDA the stream really waits: a copy queued after the wait stays undone
until a host thread raises the flag, and then reads what the host wrote before it."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

pytestmark = pytest.mark.timeout(120)


def _interpreted() -> None:
    if not HAS_CUDA:
        from tandem.kernels import host_flag

        if type(host_flag._wait_flag_kernel).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")


def test_a_raised_flag_lets_the_wait_through_and_a_low_one_only_after_its_polls():
    from tandem.kernels.host_flag import wait_for_host_flag

    _interpreted()
    flag = torch.full((1,), 7, dtype=torch.int32, pin_memory=HAS_CUDA)
    wait_for_host_flag(flag, 7)
    wait_for_host_flag(flag, 3)
    wait_for_host_flag(flag, 8, max_polls=50)  # never raised: gives up after its polls
    if HAS_CUDA:
        torch.cuda.synchronize()


def test_a_staged_gate_waits_on_the_flag_and_target_it_holds():
    """``wait_for_staged_flag`` reads the flag's address and the target from a tensor (a
    gated graph's staged gate): a raised flag passes, a low one only after its polls."""
    from tandem.kernels.host_flag import GATE_FLAG_ADDR, GATE_TARGET, GATE_WORDS, wait_for_staged_flag

    _interpreted()
    flag = torch.full((1,), 7, dtype=torch.int32, pin_memory=HAS_CUDA)
    gate = torch.zeros(GATE_WORDS, dtype=torch.int64)
    gate[GATE_FLAG_ADDR] = flag.data_ptr()
    for target, polls in ((7, None), (3, None), (8, 50)):
        gate[GATE_TARGET] = target
        staged = gate.to("cuda") if HAS_CUDA else gate
        wait_for_staged_flag(staged) if polls is None else wait_for_staged_flag(staged, max_polls=polls)
    if HAS_CUDA:
        torch.cuda.synchronize()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (a stream that waits)")
def test_the_stream_waits_for_the_host_to_raise_the_flag():
    from tandem.kernels.host_flag import wait_for_host_flag

    flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    src = torch.zeros(1 << 16, dtype=torch.int32, pin_memory=True)
    dst = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
    for seq in range(1, 4):
        wait_for_host_flag(flag, seq)
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query(), "the copy ran before the flag was raised"

        def raise_flag(seq: int = seq) -> None:
            src.fill_(seq)  # written before the flag, read by the copy after it
            flag[0] = seq

        t = threading.Thread(target=raise_flag)
        t.start()
        done.synchronize()
        t.join()
        assert int(dst.min()) == int(dst.max()) == seq
