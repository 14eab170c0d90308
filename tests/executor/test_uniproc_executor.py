"""The in-process executor keeps the same contract as the remote ones: a call that only
primes the pipeline (an empty step) is answered, and futures resolve in call order."""
from __future__ import annotations

import os

import pytest

from executor_test_utils import BASE
from tandem.config import EngineConfig
from tandem.models.model_config import resolve_model_config
from tandem.types.scheduler_output import SchedulerOutput
from tandem.executor.uniproc import UniProcExecutor


@pytest.mark.timeout(60)
def test_empty_priming_step_is_answered_on_the_real_runner(tiny_llama):
    cfg = EngineConfig(model=tiny_llama, **BASE)
    ex = UniProcExecutor(cfg, resolve_model_config(cfg))
    try:
        assert ex.collective_rpc("get_pid") == [os.getpid()]
        ex.collective_rpc("init_kv_cache", 16)
        futs = [ex.execute_model(SchedulerOutput(step_id=i, requests=[])) for i in range(3)]
        outs = [f.result(timeout=10) for f in futs]
        assert [o.step_id for o in outs] == [0, 1, 2]
        assert all(o.req_ids == [] and o.sampled_token_ids == [] for o in outs)
    finally:
        ex.shutdown()
