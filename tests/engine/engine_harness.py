"""A workload driver for engine tests: timed arrivals, token-count aborts, exact comparison."""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Optional

from tandem.engine.llm_engine import LLMEngine
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

# Constraints over the tiny models' word vocabulary ("t0".."t127"; a token's raw text is
# "t<id>", EOS is t1), each with the Python regex its outputs must fully match. Chosen so
# that no allowed token leads to a dead end (every token starts with "t", so e.g. "t2" may
# only be allowed where "t" can follow).
TINY_CONSTRAINTS: list[tuple[StructuredOutputsParams, str]] = [
    (StructuredOutputsParams(regex=r"(t2[0-9]?|t3[0-9]?)+"), r"(t2[0-9]?|t3[0-9]?)+"),
    (StructuredOutputsParams(regex=r"t4(t5[0-9]?)*t6"), r"t4(t5[0-9]?)*t6"),
    (StructuredOutputsParams(regex=r"(t7[0-9]?t8[0-9]?){1,3}"), r"(t7[0-9]?t8[0-9]?){1,3}"),
    (StructuredOutputsParams(choice=["t2t3", "t4t5t6", "t7"]), r"t2t3|t4t5t6|t7"),
    (StructuredOutputsParams(choice=["t9t9t9", "t8"]), r"t9t9t9|t8"),
    (StructuredOutputsParams(grammar='root ::= "t2" item* "t9"\nitem ::= "t3" | "t4" | "t5" "t6"'),
     r"t2(t3|t4|t5t6)*t9"),
]


def tiny_text(token_ids: list[int]) -> str:
    """The raw text of tiny-vocabulary tokens, as the grammar sees it (no separators)."""
    return "".join(f"t{t}" for t in token_ids)


@dataclass
class WorkItem:
    rid: str
    prompt: list[int]
    params: SamplingParams
    arrive_step: int = 0
    abort_after: Optional[int] = None  # abort once child 0 has this many tokens
    pattern: Optional[str] = None  # a constrained request: the regex its finished outputs match


def random_workload(seed: int, vocab: int, n_reqs: int = 12, max_prompt: int = 40,
                    shared_prefix: bool = True, constrained: float = 0.0) -> list[WorkItem]:
    """Random prompt lengths and arrivals, aborts, stop strings/ids, EOS, max/min tokens,
    penalties, seeded sampling and n > 1; with ``constrained`` > 0, that share of the
    requests also gets one of ``TINY_CONSTRAINTS`` (and no min_tokens, which could forbid
    the EOS a finished grammar requires)."""
    rng = random.Random(seed)
    crng = random.Random(seed + 1)  # its own stream: the rest of the workload stays as without
    prefix = [rng.randrange(2, vocab) for _ in range(rng.randint(4, 12))]
    items = []
    for i in range(n_reqs):
        plen = rng.randint(1, max_prompt)
        prompt = [rng.randrange(2, vocab) for _ in range(plen)]
        if shared_prefix and rng.random() < 0.4:
            prompt = prefix + prompt[: max(1, plen - len(prefix))]
        greedy = rng.random() < 0.5
        kw: dict = dict(
            max_tokens=rng.randint(1, 24),
            temperature=0.0 if greedy else rng.choice([0.7, 1.0, 1.3]),
            seed=None if greedy else rng.randrange(1 << 30),
            ignore_eos=rng.random() < 0.2,
        )
        if not greedy:
            kw["top_k"] = rng.choice([0, 0, 5, 20])
            kw["top_p"] = rng.choice([1.0, 1.0, 0.9])
            kw["min_p"] = rng.choice([0.0, 0.0, 0.05])
            kw["n"] = rng.choice([1, 1, 1, 2, 3])
        if rng.random() < 0.3:
            kw["repetition_penalty"] = rng.choice([1.2, 0.9])
            kw["frequency_penalty"] = rng.choice([0.0, 0.5])
            kw["presence_penalty"] = rng.choice([0.0, 0.7])
        if rng.random() < 0.3:
            kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(2, vocab)]
        if rng.random() < 0.3:
            kw["stop"] = [f"t{rng.randrange(2, vocab)}"]
            kw["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.3:
            kw["logprobs"] = rng.choice([0, 2])
        abort_after = rng.randint(0, 6) if rng.random() < 0.15 else None
        pattern = None
        if crng.random() < constrained:
            kw["structured_outputs"], pattern = crng.choice(TINY_CONSTRAINTS)
            kw["min_tokens"] = 0
        items.append(WorkItem(f"r{i}", prompt, SamplingParams(**kw), rng.randint(0, 10), abort_after, pattern))
    return items


def assert_follow_constraints(outputs: dict[str, Optional[RequestOutput]], items: list[WorkItem]) -> int:
    """Every constrained output that ended with EOS fully matches its pattern, and none
    failed (the others were cut by max_tokens, a stop string or id, or an abort); returns how
    many ended with EOS."""
    complete = 0
    for w in items:
        out = outputs.get(w.rid)
        if w.pattern is None or out is None:
            continue
        for c in out.outputs:
            ids = list(c.token_ids)
            ended = c.finish_reason == "stop" and c.stop_reason is None and bool(ids) and ids[-1] == 1
            if ended:
                ids = ids[:-1]
                complete += 1
                assert re.fullmatch(w.pattern, tiny_text(ids)), f"{w.rid}: {tiny_text(ids)!r} !~ {w.pattern}"
            else:
                assert c.finish_reason != "error", f"{w.rid} failed: {out.error}"
    return complete


@dataclass
class RunResult:
    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    steps: int = 0


def run_workload(engine: LLMEngine, items: list[WorkItem], max_steps: int = 20000) -> RunResult:
    """Drive the engine until every request finished; fail (never hang) past ``max_steps``."""
    pending = sorted(items, key=lambda w: w.arrive_step)
    by_id = {w.rid: w for w in items}
    res = RunResult()
    latest: dict[str, RequestOutput] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrive_step <= step:
            w = pending.pop(0)
            engine.add_request(w.rid, w.prompt, w.params)
            if w.abort_after == 0:
                engine.abort_request(w.rid)
                latest[w.rid] = None  # type: ignore[assignment]
        for out in engine.step():
            latest[out.request_id] = out
            w = by_id.get(out.request_id)
            if w is None:
                continue
            if (w.abort_after is not None and not out.finished
                    and len(out.outputs[0].token_ids) >= w.abort_after):
                engine.abort_request(w.rid)
        step += 1
        assert step < max_steps, f"engine did not finish within {max_steps} steps (livelock?)"
    res.outputs = latest
    res.steps = step
    engine.core.kv_cache.check_integrity()
    assert engine.core.kv_cache.num_owned_total() == 0, "KV blocks leaked"
    return res


def summarize(out: Optional[RequestOutput]) -> list:
    """What must match exactly between sync and async: ids, text, finish reasons."""
    if out is None:
        return []
    return [(c.token_ids, c.text, c.finish_reason if c.finish_reason != "abort" else None, c.stop_reason)
            for c in out.outputs]


def assert_same(a: dict[str, Optional[RequestOutput]], b: dict[str, Optional[RequestOutput]],
                items: list[WorkItem], lp_tol: float = 1e-4) -> None:
    for w in items:
        oa, ob = a.get(w.rid), b.get(w.rid)
        if w.abort_after is not None:
            # An aborted request's last output may be its final one or none at all:
            # compare the tokens both saw up to the abort point.
            if oa and ob:
                for ca, cb in zip(oa.outputs, ob.outputs):
                    n = min(len(ca.token_ids), len(cb.token_ids))
                    assert ca.token_ids[:n] == cb.token_ids[:n], f"{w.rid}: aborted request tokens differ"
            continue
        assert summarize(oa) == summarize(ob), f"{w.rid} ({w.params}) differs:\n{summarize(oa)}\n{summarize(ob)}"
        for ca, cb in zip(oa.outputs, ob.outputs):
            if ca.logprobs is None:
                assert cb.logprobs is None
                continue
            assert len(ca.logprobs) == len(cb.logprobs)
            for pa, pb in zip(ca.logprobs, cb.logprobs):
                assert pa.keys() == pb.keys(), f"{w.rid}: top logprob tokens differ: {pa} {pb}"
                for t in pa:
                    assert math.isclose(pa[t].logprob, pb[t].logprob, abs_tol=lp_tol)
                    assert pa[t].rank == pb[t].rank
