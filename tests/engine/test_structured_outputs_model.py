"""Structured outputs on the embedded SmolLM2-135M-Instruct, through the offline ``LLM``.

Every answer under a JSON schema parses and validates (``jsonschema``): enums, nested
objects, arrays with minItems/maxItems, integers, booleans, numbers; regex, choice and
grammar answers match; a JSON answer cut by max_tokens ends with finish_reason "length";
async and sync give the same tokens; the llguidance backend too; a bad schema is a one-line
``ValueError`` and the engine answers the next call.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams as S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "student": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
        "required": ["name", "age", "student", "color"], "additionalProperties": False},
    "city": {"type": "object", "properties": {
        "city": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20}, "population": {"type": "integer"},
            "coords": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                       "required": ["lat", "lon"], "additionalProperties": False}},
            "required": ["name", "population", "coords"], "additionalProperties": False},
        "capital": {"type": "boolean"}}, "required": ["city", "capital"], "additionalProperties": False},
    "fruits": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3},
        "count": {"type": "integer"}}, "required": ["items", "count"], "additionalProperties": False},
}
ASK = {"person": "Describe a person as JSON.", "city": "Give a city as JSON.", "fruits": "List some fruits as JSON."}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'


def conversations() -> tuple[list, list[SamplingParams], list[str]]:
    """One batch: each schema greedy and seeded at temperature 1, a regex, a choice, a
    grammar, an unconstrained request, and a JSON answer cut short by max_tokens."""
    convs, params, kinds = [], [], []

    def add(kind: str, content: str, **kw) -> None:
        convs.append([{"role": "user", "content": content}])
        params.append(SamplingParams(max_tokens=kw.pop("max_tokens", 96), **kw))
        kinds.append(kind)

    for name, schema in SCHEMAS.items():
        add(name, ASK[name], temperature=0, structured_outputs=S(json=schema))
        add(name, ASK[name], temperature=1.0, seed=11, structured_outputs=S(json=schema))
    add("regex", "Give a code like 123-ab.", temperature=0, structured_outputs=S(regex=REGEX))
    add("choice", "Is the sky blue?", temperature=0.8, seed=3, structured_outputs=S(choice=CHOICES))
    add("grammar", "Is water wet?", temperature=0, structured_outputs=S(grammar=GRAMMAR))
    add("plain", "Say hi.", temperature=0, max_tokens=12)
    add("cut", ASK["person"], temperature=0, max_tokens=6, structured_outputs=S(json=SCHEMAS["person"]))
    return convs, params, kinds


def check_answers(outs, kinds) -> None:
    for out, kind in zip(outs, kinds):
        c = out.outputs[0]
        assert out.error is None, f"{kind}: {out.error}"
        if kind in SCHEMAS:
            assert c.finish_reason == "stop", f"{kind}: {c.finish_reason} {c.text!r}"
            jsonschema.validate(json.loads(c.text), SCHEMAS[kind])
        elif kind == "regex":
            assert re.fullmatch(REGEX, c.text), c.text
        elif kind == "choice":
            assert c.text in CHOICES
        elif kind == "grammar":
            assert c.text in ("The answer is yes.", "The answer is no.")
        elif kind == "cut":
            assert c.finish_reason == "length" and len(c.token_ids) == 6
            assert c.text.startswith("{")
            with pytest.raises(json.JSONDecodeError):
                json.loads(c.text)


@pytest.fixture(scope="module")
def llms(default_model_folder):
    out = {a: LLM(default_model_folder, async_scheduling=a, max_num_seqs=16) for a in (False, True)}
    out[True].engine.core.structured.set_gated_background(True)  # as on CUDA: fills on the gated thread
    out["split"] = LLM(default_model_folder, async_scheduling=True, max_num_seqs=16,
                       structured_outputs_sampling="split")
    yield out
    for m in out.values():
        m.shutdown()


def test_json_regex_choice_grammar_answers_valid_and_async_equals_sync(llms):
    """Sync (gated, jobs inline), async gated (jobs on the fill thread) and async split all
    give the same tokens."""
    convs, params, kinds = conversations()
    outs = {a: m.chat(convs, params, use_tqdm=False) for a, m in llms.items()}
    check_answers(outs[False], kinds)
    for mode in (True, "split"):
        for kind, s, a in zip(kinds, outs[False], outs[mode]):
            assert s.outputs[0].token_ids == a.outputs[0].token_ids, f"{kind}: async ({mode}) differs from sync"
    assert llms[True].engine.core.stats.num_gated > 0
    assert llms["split"].engine.core.stats.num_sampling_deferred > 0
    core = llms[True].engine.core
    assert core.structured.num_compiles == len(SCHEMAS) + 3  # one per distinct constraint


def test_guidance_backend(default_model_folder):
    convs, params, kinds = conversations()
    with LLM(default_model_folder, max_num_seqs=16, structured_outputs_backend="guidance") as llm:
        check_answers(llm.chat(convs, params, use_tqdm=False), kinds)


def test_bad_schema_is_a_one_line_value_error_and_engine_still_answers(llms):
    llm = llms[True]
    bad = SamplingParams(max_tokens=8, structured_outputs=S(json={"type": "object", "properties": {"a": {
        "type": "strin"}}}))
    with pytest.raises(ValueError) as info:
        llm.generate(["Hello", "World"], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    msg = str(info.value)
    assert msg.startswith("prompt 1: the JSON schema does not compile") and "strin" in msg and "\n" not in msg
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["Is the sky blue?"], SamplingParams(max_tokens=4, temperature=0,
                                                           structured_outputs=S(choice=["yes", "no"])),
                       use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")
