"""The in-process executor keeps the same contract as the remote ones: a call that only
primes the pipeline (an empty step) is answered, and futures resolve in call order."""
from __future__ import annotations

import pytest

from executor_test_utils import BASE, VOCAB
from tandem.config import EngineConfig
from tandem.core.sched_output import SchedulerOutput
from tandem.executor.uniproc import UniProcExecutor


@pytest.mark.timeout(60)
def test_empty_priming_step_is_answered_on_the_real_runner(tiny_llama):
    ex = UniProcExecutor(EngineConfig(model=tiny_llama, **BASE), tiny_llama, 256)
    try:
        assert ex.collective_rpc("get_model_info")[0].vocab_size == VOCAB
        ex.collective_rpc("init_kv_cache", 16)
        futs = [ex.execute_model(SchedulerOutput(step_id=i, requests=[])) for i in range(3)]
        outs = [f.result(timeout=10) for f in futs]
        assert [o.step_id for o in outs] == [0, 1, 2]
        assert all(o.req_ids == [] and o.sampled_token_ids == [] for o in outs)
    finally:
        ex.shutdown()
