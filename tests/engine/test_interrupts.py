"""Ctrl-C during ``LLM.generate`` loses nothing: after every interrupt every KV block is free
again, the cache's accounting checks out, and the same ``LLM`` still serves a request that
needs the whole cache (sync, async, and with worker processes)."""
from __future__ import annotations

import os
import random
import signal
import threading

import pytest

from tandem import LLM, SamplingParams

NUM_BLOCKS, BLOCK = 48, 4


def _assert_clean(llm: LLM) -> None:
    core = llm.engine.core
    assert not core.batch_queue, "a step is still in flight after the interrupted call returned"
    assert not core.scheduler.requests, "requests survived the interrupt"
    kv = core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks lost"
    kv.check_integrity()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async", "multiproc"])
def test_ctrl_c_during_generate_frees_every_block(tiny_llama, mode):
    rng = random.Random(7)
    kw = dict(block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_num_seqs=8, max_num_batched_tokens=64,
              async_scheduling=mode != "sync")
    if mode == "multiproc":
        kw["executor"] = "multiproc"
    prompts = [[rng.randrange(2, 128) for _ in range(rng.randint(4, 24))] for _ in range(8)]
    sp = SamplingParams(temperature=0.8, seed=1, max_tokens=150, ignore_eos=True)
    interrupted = 0
    with LLM(tiny_llama, **kw) as llm:
        for i in range(6):
            timer = threading.Timer(0.05 + 0.1 * i, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            try:
                llm.generate(prompts, sp, use_tqdm=False)
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                timer.cancel()
                timer.join()
            _assert_clean(llm)
        assert interrupted >= 4, "the calls finished before the interrupts came: make them longer"
        # Every block is usable again: a request that needs the whole cache runs.
        whole = NUM_BLOCKS * BLOCK
        out = llm.generate([[5] * (whole - 64)],
                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 64
        _assert_clean(llm)


@pytest.mark.timeout(60)
def test_ctrl_c_while_reading_a_step_leaves_it_readable():
    """A KeyboardInterrupt inside the host read is not the step's error (CI once saw it turn
    into ``InvalidStateError`` and fail the request): the interrupt propagates, the future
    stays unresolved, and the next ``result()`` returns the step's output."""
    from tandem.executor.uniproc import _StepFuture
    from tandem.types.runner_output import ModelRunnerOutput

    out = ModelRunnerOutput(3, ["a"], [[7]])

    class Launched:
        calls = 0

        def get(self) -> ModelRunnerOutput:
            Launched.calls += 1
            if Launched.calls == 1:
                raise KeyboardInterrupt
            return out

    fut = _StepFuture(Launched())  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):
        fut.result()
    assert not fut.done()
    assert fut.result() is out and fut.result() is out and Launched.calls == 2
