"""The codec: every message type the engine sends round-trips typed, nothing is unpickled,
and what is not plain data is refused by the sender."""
from __future__ import annotations

import pickle
from typing import Any, Optional

import msgspec
import pytest
import torch

from tandem.config import EngineConfig, EnvSwitches
from tandem.ipc import DecodeError, WireModelConfig, decode, encode
from tandem.sampling_params import SamplingParams
from tandem.types.errors import ErrorPayload
from tandem.types.runner_output import ModelRunnerOutput, SampledLogprobs
from tandem.types.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput


def scheduler_output(num_requests: int = 256, step_id: int = 7) -> SchedulerOutput:
    """A large step: every 8th request is new (prompt + sampling params), the rest decode."""
    reqs = []
    for i in range(num_requests):
        new = None
        if i % 8 == 0:
            new = NewRequestData(token_ids=list(range(100 + i)), num_prompt_tokens=100,
                                 sampling_params=SamplingParams(temperature=0.7, top_k=5, seed=i, stop=["x"]),
                                 eos_token_ids=[1, 2], sample_seed=i)
        reqs.append(ScheduledRequest(f"req-{i}", num_computed_tokens=100 + i, num_scheduled_tokens=1,
                                     new_block_ids=[i, i + 1], samples=True, new=new))
    return SchedulerOutput(step_id=step_id, requests=reqs, finished_req_ids=["gone"], preempted_req_ids=["p"])


@pytest.mark.timeout(30)
def test_scheduler_and_runner_outputs_round_trip_typed():
    so = scheduler_output()
    back = decode(encode(so), SchedulerOutput)
    assert back == so
    assert isinstance(back.requests[0].new.sampling_params, SamplingParams)
    out = ModelRunnerOutput(step_id=3, req_ids=["a", "b"], sampled_token_ids=[5, 6],
                            logprobs=[SampledLogprobs([5, 1], [-0.1, -2.0], 1)] * 2,
                            prompt_logprobs={"a": [SampledLogprobs([7], [-0.5], 2)]})
    assert decode(encode(out), Optional[ModelRunnerOutput]) == out
    assert decode(encode(None), Optional[ModelRunnerOutput]) is None
    err = ErrorPayload("ValueError", "bad", "Traceback ...")
    assert decode(encode(err), ErrorPayload) == err


@pytest.mark.timeout(30)
def test_configs_round_trip(tiny_llama):
    from tandem.models.model_config import resolve_model_config

    cfg = EngineConfig(model=tiny_llama, max_num_seqs=3, tensor_parallel_size=2, executor="multiproc")
    assert decode(encode(cfg), EngineConfig) == cfg
    mc = resolve_model_config(cfg)
    back = decode(encode(WireModelConfig.from_config(mc)), WireModelConfig).to_config()
    assert type(back.hf_config) is type(mc.hf_config)
    assert back.hf_config.to_dict() == mc.hf_config.to_dict()
    assert back.env == mc.env and isinstance(back.env, EnvSwitches)
    assert back.eos_token_ids == mc.eos_token_ids and isinstance(back.eos_token_ids, tuple)
    assert (back.folder, back.dtype, back.max_model_len) == (mc.folder, mc.dtype, mc.max_model_len)
    assert back.kv_block_bytes(4, 2) == mc.kv_block_bytes(4, 2)


@pytest.mark.timeout(30)
def test_model_config_fields_are_checked_and_unknown_hf_types_refused(tiny_llama):
    from tandem.models.model_config import resolve_model_config

    wire = WireModelConfig.from_config(resolve_model_config(EngineConfig(model=tiny_llama)))
    bad_field = WireModelConfig(hf_config=wire.hf_config, fields={**wire.fields, "max_model_len": "long"})
    with pytest.raises(msgspec.ValidationError):
        bad_field.to_config()
    with pytest.raises(msgspec.ValidationError, match="model_type"):
        WireModelConfig(hf_config={**wire.hf_config, "model_type": "os.system"}, fields=wire.fields).to_config()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tensor", [
    torch.randn(3, 4), torch.ones(5, dtype=torch.bfloat16), torch.tensor(7), torch.empty(0, 3),
    torch.arange(6).reshape(2, 3).t(), torch.tensor([True, False]), torch.randn(2, 2, dtype=torch.float16),
], ids=["f32", "bf16", "scalar", "empty", "non-contiguous", "bool", "f16"])
def test_tensors_travel_as_raw_buffers(tensor):
    back = decode(encode({"t": tensor}), dict[str, torch.Tensor])["t"]
    assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
    assert decode(encode([tensor]), list)[0].dtype == tensor.dtype  # also where the type says Any
    if back.dtype != torch.bool:
        back.add_(1)  # writable: it owns its memory, not a view of the message


@pytest.mark.timeout(30)
def test_pydantic_models_round_trip_and_are_validated_on_arrival():
    pydantic = pytest.importorskip("pydantic")

    class Params(pydantic.BaseModel):
        temperature: float = 1.0
        stop: list[str] = []

        @pydantic.field_validator("temperature")
        @classmethod
        def _finite(cls, v: float) -> float:
            if not 0 <= v < 100:
                raise ValueError("temperature out of range")
            return v

    p = Params(temperature=0.5, stop=["a"])
    assert decode(encode(p), Params) == p
    with pytest.raises(msgspec.ValidationError, match="temperature out of range"):  # msgspec wraps pydantic's
        decode(encode({"temperature": 500.0}), Params)


@pytest.mark.timeout(30)
def test_what_is_not_data_is_refused_by_the_sender():
    class Opaque:
        pass

    with pytest.raises(TypeError, match="cannot cross a process boundary"):
        encode(Opaque())
    with pytest.raises(TypeError):
        encode({"f": lambda: 0})


class _Boom:
    """A pickle that would run code if anyone unpickled it."""

    ran: list[Any] = []

    def __reduce__(self):
        return (_Boom.ran.append, ("pickle ran",))


@pytest.mark.timeout(30)
def test_a_pickle_payload_is_never_unpickled():
    payload = pickle.dumps(_Boom())
    for tp in (SchedulerOutput, Any, dict):
        with pytest.raises(DecodeError):
            decode(payload, tp)
    assert _Boom.ran == []
    with pytest.raises(msgspec.ValidationError):  # a well-formed message of the wrong shape
        decode(encode({"step_id": "x"}), SchedulerOutput)
