"""SamplingParams: vLLM's fields and defaults, strict validation, cheap reads, round trips."""
from __future__ import annotations

import math
import re
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import SamplingParams
from tandem.validation import InvalidValuesError, ParamError

pytestmark = pytest.mark.timeout(120)

DEFAULTS = dict(
    n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, frequency_penalty=0.0,
    presence_penalty=0.0, seed=None, max_tokens=16, min_tokens=0, stop=[], stop_token_ids=[], ignore_eos=False,
    logprobs=None, prompt_logprobs=None, include_stop_str_in_output=False, skip_special_tokens=True,
    spaces_between_special_tokens=True, detokenize=True,
    logit_bias=None, structured_outputs=None,
)
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"]


def test_fields_and_defaults_unchanged():
    assert list(SamplingParams.model_fields) == list(DEFAULTS)
    assert SamplingParams().model_dump() == DEFAULTS
    for name, field in SamplingParams.model_fields.items():
        assert field.description, name


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=-2), "top_k must be an integer >= -1, got -2"),
    (dict(top_k=1.5), "top_k must be an integer, got float 1.5"),
    (dict(seed="abc"), "seed must be an integer, got str 'abc'"),
    (dict(seed=1.5), "seed must be an integer, got float 1.5"),
    (dict(seed=2**70), "seed must be an integer in [-9223372036854775808, 9223372036854775807], got "),
    (dict(seed=True), "seed must be an integer, got bool True"),
    (dict(logprobs="5"), "logprobs must be an integer, got str '5'"),
    (dict(logprobs=-1), "logprobs must be an integer >= 0, got -1"),
    (dict(prompt_logprobs=2.0), "prompt_logprobs must be an integer, got float 2.0"),
    (dict(temperature="hot"), "temperature must be a number, got str 'hot'"),
    (dict(temperature=-1), "temperature must be >= 0, got -1"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(min_p=2), "min_p must be in [0, 1], got 2"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0, got 0"),
    (dict(frequency_penalty=3), "frequency_penalty must be in [-2, 2], got 3"),
    (dict(presence_penalty=-2.5), "presence_penalty must be in [-2, 2], got -2.5"),
    (dict(n=0), "n must be an integer >= 1, got 0"),
    (dict(n=True), "n must be an integer, got bool True"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(max_tokens="16"), "max_tokens must be an integer, got str '16'"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0, got -1"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens (5) must be <= max_tokens (2)"),
    (dict(stop=5), "stop must be a string or a list of strings, got int 5"),
    (dict(stop=["a", 3]), "stop[1] must be a string, got int 3"),
    (dict(stop=[""]), "stop strings must be non-empty, got ['']"),
    (dict(stop=""), "stop strings must be non-empty, got ['']"),
    (dict(stop_token_ids=[-1]), "stop_token_ids[0] must be an integer >= 0, got -1"),
    (dict(stop_token_ids=[2, 1.0]), "stop_token_ids[1] must be an integer, got float 1.0"),
    (dict(stop_token_ids=7), "stop_token_ids must be a list, got int 7"),
    (dict(ignore_eos="no"), "ignore_eos must be true or false, got str 'no'"),
    (dict(temprature=0), "unknown option 'temprature' (did you mean 'temperature'?)"),
])
def test_bad_values_name_field_and_value(kwargs, message):
    with pytest.raises(InvalidValuesError) as ei:
        SamplingParams(**kwargs)
    text = str(ei.value)
    assert text.startswith("invalid sampling params: ") and message in text, text
    assert "\n" not in text


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_refused_everywhere(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("top_k, stored", [(-1, 0), (0, 0), (1, 1), (50, 50), (None, 0)])
def test_top_k_off_values(top_k, stored):
    """vLLM: -1 and 0 both disable top-k (stored as 0, what the sampler reads as off)."""
    assert SamplingParams(top_k=top_k).top_k == stored


def test_seed_range_is_signed_64_bit():
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63)


@pytest.mark.parametrize("stop, expected", [
    ("x", ["x"]), (["a", "b"], ["a", "b"]), (("a",), ["a"]), (None, []), ([], []),
])
def test_stop_accepts_a_string_or_a_list(stop, expected):
    assert SamplingParams(stop=stop).stop == expected


def test_max_tokens_none_means_to_the_end_of_the_context():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_int_for_float_field_becomes_float():
    sp = SamplingParams(temperature=0, top_p=1)
    assert type(sp.temperature) is float and type(sp.top_p) is float and sp.greedy


def test_properties():
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().uses_penalties
    for kw in (dict(repetition_penalty=1.1), dict(frequency_penalty=0.1), dict(presence_penalty=-0.1)):
        assert SamplingParams(**kw).uses_penalties, kw


def test_clone_validates_and_copies_lists():
    sp = SamplingParams(stop=["a"], stop_token_ids=[3], temperature=0.5)
    c = sp.clone(max_tokens=4)
    assert c.max_tokens == 4 and c.temperature == 0.5 and c.stop == ["a"]
    c.stop.append("b")
    assert sp.stop == ["a"]
    with pytest.raises(ValueError, match="top_p must be in"):
        sp.clone(top_p=0)


def test_assignment_is_validated():
    sp = SamplingParams()
    sp.temperature = 0.2
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        sp.temperature = math.nan
    assert sp.temperature == 0.2


def test_fields_are_plain_instance_attributes():
    """The engine reads fields of every request every step: no descriptor or __getattr__ in the way."""
    sp = SamplingParams(temperature=0.3)
    assert sp.__dict__["temperature"] == 0.3
    assert "temperature" not in type(sp).__dict__


def test_pickle_and_msgspec_round_trip():
    sp = SamplingParams(n=2, temperature=0.7, top_k=-1, seed=-5, stop="x", stop_token_ids=[4], logprobs=3,
                        max_tokens=None)
    assert pickle.loads(pickle.dumps(sp)) == sp
    assert SamplingParams.model_validate(sp.model_dump()) == sp
    msgspec = pytest.importorskip("msgspec")
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(sp.model_dump()))
    assert SamplingParams.model_validate(wire) == sp


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8), temperature=st.floats(0, 5), top_p=st.floats(0.01, 1), top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1), penalty=st.floats(-2, 2), seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    max_tokens=st.none() | st.integers(1, 4096), stop=st.lists(st.text(min_size=1), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 10**6), max_size=3), flags=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_any_valid_params_round_trip(n, temperature, top_p, top_k, min_p, penalty, seed, max_tokens, stop,
                                     stop_token_ids, flags):
    sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                        frequency_penalty=penalty, presence_penalty=-penalty, seed=seed, max_tokens=max_tokens,
                        stop=stop, stop_token_ids=stop_token_ids, ignore_eos=flags[0], detokenize=flags[1],
                        skip_special_tokens=flags[2], include_stop_str_in_output=flags[3])
    again = SamplingParams.model_validate(sp.model_dump())
    assert again == sp and pickle.loads(pickle.dumps(sp)) == sp
    assert again.top_k == (0 if top_k == -1 else top_k)


@pytest.mark.timeout(30)
def test_logit_bias_takes_openai_string_keys_and_checks_ranges():
    assert SamplingParams(logit_bias={"5": -100, 7: 2.5}).logit_bias == {5: -100.0, 7: 2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad, words in [({"abc": 1}, "token ids"), ({5: 101}, "[-100, 100]"), ({-1: 1}, "non-negative"),
                       ({5: float("nan")}, "logit_bias"), ([1, 2], "logit_bias")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            SamplingParams(logit_bias=bad)
    sp = SamplingParams(logit_bias={"5": 1})
    assert SamplingParams.model_validate(sp.model_dump()) == sp


@pytest.mark.parametrize("kwargs, param", [
    (dict(logit_bias={5: 500}), "logit_bias"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids[1]"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(temperature=-1, top_p=2), "temperature"),
    (dict(bogus=1), "bogus"),
    (dict(structured_outputs={"json": {}, "regex": "a"}), "structured_outputs"),
])
def test_a_refusal_names_its_parameter(kwargs, param):
    """A server reads the refused parameter from the error (``param``), never from its text."""
    with pytest.raises(ParamError) as ei:
        SamplingParams(**kwargs)
    assert ei.value.param == param
    assert ei.value.params[0] == param and len(ei.value.params) == len(ei.value.problems)
