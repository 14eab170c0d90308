"""Scheduler unit tests, driven without a model.

Every step is answered by a fake ``ModelRunnerOutput`` (the tokens are chosen by the test)
and applied with ``Scheduler.update_from_output``. "Async" means up to two
``SchedulerOutput``s in flight: ``schedule()`` for step N+1 runs *before*
``update_from_output`` for step N, exactly as the engine loop (``tandem/engine/core.py``)
does with a queue depth of 2.

For the randomized tests a ``SimWorker`` stands in for the device: it keeps each request's
token list and block table, writes a fingerprint of the full prefix into every KV slot it
computes and checks, before each step, that every slot the step reads holds the right
prefix. It executes a step when it is launched (device order), so prefix-cache hits,
block reuse after preemption/free and placeholder positions are all checked for content,
and outputs can be compared with a sequential reference.
"""
from __future__ import annotations

import random
import zlib
from collections import deque
from typing import Callable, Optional

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from tandem.scheduler.kv_cache import KVCacheManager
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput
from tandem.scheduler.scheduler import Scheduler
from tandem.types.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)

EOS = 1


# -- helpers -------------------------------------------------------------------------------
def prompt_of(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def mkreq(rid: str, prompt: int | list[int], max_tokens: int = 16, eos: tuple[int, ...] = (EOS,),
          **sp) -> Request:
    if isinstance(prompt, int):
        prompt = prompt_of(prompt, base=100 + 1000 * (zlib.crc32(rid.encode()) % 1000))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), list(eos), max_tokens)


def mksched(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32,
            max_model_len: int = 512, chunked: bool = True, prefix: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, enable_chunked_prefill=chunked)


def fake_output(so: SchedulerOutput, tokens: int | dict[str, int] | Callable = 7) -> ModelRunnerOutput:
    """One sampled token per request whose step samples; ``tokens`` picks it."""
    ids, toks = [], []
    for r in so.requests:
        if not r.samples:
            continue
        if callable(tokens):
            t = tokens(r)
        elif isinstance(tokens, dict):
            t = tokens.get(r.req_id, 7)
        else:
            t = tokens
        ids.append(r.req_id)
        toks.append(t)
    return ModelRunnerOutput(step_id=so.step_id, req_ids=ids, sampled_token_ids=toks)


def sched_of(so: SchedulerOutput, rid: str):
    found = [r for r in so.requests if r.req_id == rid]
    assert len(found) <= 1
    return found[0] if found else None


def check_request_invariants(s: Scheduler) -> None:
    for req in list(s.requests.values()) + list(s.running):
        assert req.num_output_placeholders >= 0, req
        assert req.num_computed_tokens <= req.num_tokens + req.num_output_placeholders, req
        assert len(req.output_token_ids) + req.num_output_placeholders <= req.max_tokens, req
        assert req.num_tokens_with_placeholders <= s.max_model_len, req
        assert req.num_inflight_steps >= 0
    assert len(s.running) <= s.max_num_seqs
    assert len({id(r) for r in s.running}) == len(s.running)
    assert not ({id(r) for r in s.running} & {id(r) for r in s.waiting})
    s.kv.check_integrity()


def token_fn_default(rid: str, prefix: tuple[int, ...]) -> int:
    """Deterministic 'model': the next token depends on the request and its whole prefix."""
    h = zlib.crc32(repr((rid, prefix)).encode())
    return EOS if h % 9 == 0 else 2 + h % 60


class SimWorker:
    """Device stand-in: per-request token list + block table, KV slots holding prefix fingerprints."""

    def __init__(self, block_size: int, token_fn: Callable[[str, tuple[int, ...]], int] = token_fn_default):
        self.bs = block_size
        self.token_fn = token_fn
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.reqs: dict[str, dict] = {}
        self.dropped_tokens: dict[str, list[int]] = {}  # preempted -> tokens it had

    def _slot(self, st: dict, pos: int) -> tuple[int, int]:
        assert pos // self.bs < len(st["table"]), f"position {pos} beyond block table {st['table']}"
        return st["table"][pos // self.bs], pos % self.bs

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
            self.dropped_tokens.pop(rid, None)
        for rid in so.preempted_req_ids:
            st = self.reqs.pop(rid, None)
            if st is not None:
                self.dropped_tokens[rid] = list(st["tokens"])
        ids, toks = [], []
        for r in so.requests:
            if r.new is not None:
                assert r.req_id not in self.reqs, f"{r.req_id} sent as new while the worker still has it"
                if r.req_id in self.dropped_tokens:  # resumed after preemption
                    assert r.new.token_ids == self.dropped_tokens.pop(r.req_id), \
                        "resumed request must carry exactly the tokens the worker confirmed"
                st = self.reqs[r.req_id] = {"tokens": list(r.new.token_ids), "table": list(r.new_block_ids)}
            else:
                st = self.reqs[r.req_id]
                st["table"] += r.new_block_ids
            start, n = r.num_computed_tokens, r.num_scheduled_tokens
            assert n > 0
            tokens = st["tokens"]
            # Everything before `start` must already be in the KV cache with the right content.
            for q in range(start):
                assert self.kv.get(self._slot(st, q)) == tuple(tokens[:q + 1]), \
                    f"{r.req_id}: KV at position {q} holds the wrong prefix"
            # Every block written belongs to this request alone among live requests.
            written = {st["table"][q // self.bs] for q in range(start, start + n)}
            for other, ost in self.reqs.items():
                if other != r.req_id:
                    assert not (written & set(ost["table"])), f"{r.req_id} writes a block {other} holds"
            for q in range(start, start + n):
                assert q < len(tokens), f"{r.req_id}: computes position {q} with no token known"
                self.kv[self._slot(st, q)] = tuple(tokens[:q + 1])
            if r.samples:
                assert start + n == len(tokens), "samples only at the end of the known tokens"
                t = self.token_fn(r.req_id, tuple(tokens))
                tokens.append(t)
                ids.append(r.req_id)
                toks.append(t)
            else:
                assert start + n < len(tokens)
        return ModelRunnerOutput(step_id=so.step_id, req_ids=ids, sampled_token_ids=toks)


class Driver:
    """The engine loop, with a bounded queue of in-flight steps (depth 1 = sync, 2 = async)."""

    def __init__(self, s: Scheduler, depth: int, worker: Optional[SimWorker] = None):
        self.s = s
        self.depth = depth
        self.worker = worker or SimWorker(s.kv.block_size)
        self.queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.steps: list[SchedulerOutput] = []

    def step(self) -> None:
        launched = False
        if len(self.queue) < self.depth and self.s.has_unfinished_requests():
            so = self.s.schedule()
            if not so.is_empty:
                assert so.total_num_scheduled_tokens <= self.s.max_num_batched_tokens
                assert len(so.requests) <= self.s.max_num_seqs
                self.steps.append(so)
                self.queue.append((so, self.worker.execute(so)))
                launched = True
        if self.queue and (not launched or len(self.queue) >= self.depth):
            so, out = self.queue.popleft()
            for o in self.s.update_from_output(so, out):
                assert o.req_id not in self.finish, f"output for {o.req_id} after it finished"
                self.outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish[o.req_id] = o.finish_reason
        elif not launched:
            assert not self.s.has_unfinished_requests(), "stall: nothing schedulable, nothing in flight"
        check_request_invariants(self.s)

    def run(self, max_iters: int = 10_000) -> None:
        it = 0
        while self.s.has_unfinished_requests() or self.queue:
            self.step()
            it += 1
            assert it < max_iters, "did not finish"


def reference(req: Request, max_model_len: int, token_fn=token_fn_default) -> tuple[list[int], str]:
    """Sequential generation with the same 'model' and stop rules."""
    sp = req.sampling_params
    toks = list(req.prompt_token_ids)
    out: list[int] = []
    while True:
        t = token_fn(req.request_id, tuple(toks))
        out.append(t)
        toks.append(t)
        if len(out) >= sp.min_tokens:
            if not sp.ignore_eos and t in req.eos_token_ids:
                return out, "stop"
            if t in sp.stop_token_ids:
                return out, "stop"
        if len(out) >= req.max_tokens or len(toks) >= max_model_len:
            return out, "length"


# -- token budget, chunked prefill, max_num_seqs ------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("chunked", [True, False])
def test_token_budget_respected_every_step(depth, chunked):
    s = mksched(num_blocks=256, budget=16, max_num_seqs=6, chunked=chunked, max_model_len=64)
    reqs = [mkreq(f"r{i}", 3 + (5 * i) % 14, max_tokens=6, ignore_eos=True) for i in range(10)]
    for r in reqs:
        s.add_request(r)
    d = Driver(s, depth)
    d.run()
    assert d.steps
    for so in d.steps:
        assert 0 < so.total_num_scheduled_tokens <= 16
        assert len({r.req_id for r in so.requests}) == len(so.requests)
    assert s.stats.num_scheduled_tokens == sum(so.total_num_scheduled_tokens for so in d.steps)
    for r in reqs:
        assert d.outputs[r.request_id] == reference(r, 64)[0]
        assert d.finish[r.request_id] == "length"


def test_chunked_prefill_splits_prompt_and_samples_only_on_final_chunk():
    s = mksched(budget=4, chunked=True)
    r = mkreq("long", 10, max_tokens=3)
    s.add_request(r)
    chunks = []
    for expected_start, expected_n, expected_samples in [(0, 4, False), (4, 4, False), (8, 2, True)]:
        so = s.schedule()
        sr = sched_of(so, "long")
        assert (sr.num_computed_tokens, sr.num_scheduled_tokens, sr.samples) == \
            (expected_start, expected_n, expected_samples)
        assert (sr.new is not None) == (expected_start == 0)
        chunks.append(so)
        out = fake_output(so, 42)
        if not expected_samples:
            assert out.req_ids == []
        outs = s.update_from_output(so, out)
        if not expected_samples:
            assert outs == [] and r.output_token_ids == [] and r.num_output_placeholders == 0
    # The first output token comes from the final chunk.
    assert r.output_token_ids == [42]
    assert outs[0].req_id == "long" and outs[0].new_token_ids == [42]
    assert r.num_computed_tokens == 10
    # Then decode: one token per step.
    so = s.schedule()
    sr = sched_of(so, "long")
    assert (sr.num_computed_tokens, sr.num_scheduled_tokens, sr.samples) == (10, 1, True)


def test_chunked_prefill_shares_budget_with_decodes():
    s = mksched(budget=6, chunked=True)
    a = mkreq("a", 3, max_tokens=10, ignore_eos=True)
    s.add_request(a)
    so = s.schedule()
    s.update_from_output(so, fake_output(so))
    b = mkreq("b", 20, max_tokens=2)
    s.add_request(b)
    so = s.schedule()
    # the running decode goes first, the new prompt gets the rest of the budget
    assert [(x.req_id, x.num_scheduled_tokens) for x in so.requests] == [("a", 1), ("b", 5)]
    assert not sched_of(so, "b").samples


def test_without_chunked_prefill_prompt_larger_than_budget_waits():
    s = mksched(budget=8, chunked=False)
    big = mkreq("big", 9)
    s.add_request(big)
    so = s.schedule()
    assert so.is_empty
    assert big.status == RequestStatus.WAITING and list(s.waiting) == [big]
    assert big.num_computed_tokens == 0 and s.kv.num_free_blocks == s.kv.num_blocks


def test_without_chunked_prefill_prompt_is_never_split():
    """A prompt that fits the whole budget waits while decodes use part of it, then runs whole."""
    s = mksched(budget=8, chunked=False)
    a = mkreq("a", 3, max_tokens=3, ignore_eos=True)
    s.add_request(a)
    so = s.schedule()
    s.update_from_output(so, fake_output(so))
    b = mkreq("b", 8, max_tokens=1)
    s.add_request(b)
    while not a.is_finished:
        so = s.schedule()
        assert [x.req_id for x in so.requests] == ["a"], "b must not be split around a's decode"
        s.update_from_output(so, fake_output(so))
    so = s.schedule()
    sr = sched_of(so, "b")
    assert (sr.num_computed_tokens, sr.num_scheduled_tokens, sr.samples) == (0, 8, True)


@pytest.mark.parametrize("depth", [1, 2])
def test_max_num_seqs_respected(depth):
    s = mksched(num_blocks=256, budget=64, max_num_seqs=3)
    reqs = [mkreq(f"r{i}", 4, max_tokens=5, ignore_eos=True) for i in range(7)]
    for r in reqs:
        s.add_request(r)
    so = s.schedule()
    assert [x.req_id for x in so.requests] == ["r0", "r1", "r2"]
    assert len(s.running) == 3 and len(s.waiting) == 4
    d = Driver(s, depth)
    d.queue.append((so, d.worker.execute(so)))
    d.run()
    assert all(len(so.requests) <= 3 for so in d.steps)
    assert all(d.finish[r.request_id] == "length" for r in reqs)


def _batches(steps: list[SchedulerOutput]) -> list[list[tuple[str, int, int]]]:
    return [[(r.req_id, r.num_computed_tokens, r.num_scheduled_tokens) for r in so.requests] for so in steps]


@pytest.mark.parametrize("seed", range(6))
def test_async_schedules_exactly_the_sync_batches_when_finishes_are_predictable(seed):
    """Finishes by max_tokens and max_model_len are known at schedule time: a request whose
    last token is in flight takes neither a sequence slot nor budget, so async mode runs the
    very batches sync mode runs (on the GPU, other batch shapes give other bf16 numbers)."""
    rng = random.Random(seed)
    specs = [(f"r{i}", rng.randint(1, 20), rng.randint(1, 12)) for i in range(24)]

    def run(depth: int) -> Driver:
        s = mksched(num_blocks=4096, block_size=4, budget=rng_budget, max_num_seqs=5, max_model_len=28)
        for rid, plen, mt in specs:
            s.add_request(mkreq(rid, plen, max_tokens=mt, ignore_eos=True))
        d = Driver(s, depth)
        d.run()
        return d

    rng_budget = random.Random(seed).choice([7, 16, 64])
    sync, async_ = run(1), run(2)
    assert _batches(async_.steps) == _batches(sync.steps)
    assert async_.outputs == sync.outputs


# -- preemption -----------------------------------------------------------------------------------
def _three_full_requests(prefix: bool):
    # 6 blocks of 4 tokens. a: 8 tokens (its next decode needs a 3rd block), b, c: 7 tokens.
    s = mksched(num_blocks=6, block_size=4, budget=64, prefix=prefix)
    a = mkreq("a", 8, max_tokens=2, ignore_eos=True)
    b = mkreq("b", 7, max_tokens=4, ignore_eos=True)
    c = mkreq("c", 7, max_tokens=4, ignore_eos=True)
    for r in (a, b, c):
        s.add_request(r)
    so = s.schedule()
    assert [x.req_id for x in so.requests] == ["a", "b", "c"]
    assert s.kv.num_free_blocks == 0
    s.update_from_output(so, fake_output(so, {"a": 10, "b": 20, "c": 30}))
    return s, a, b, c


@pytest.mark.parametrize("prefix", [False, True])
def test_preemption_evicts_most_recently_admitted_and_resumes_with_real_tokens(prefix):
    s, a, b, c = _three_full_requests(prefix)
    so = s.schedule()  # a needs a new block: the victim is c (admitted last), not b
    assert so.preempted_req_ids == ["c"]
    assert [x.req_id for x in so.requests] == ["a", "b"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.stats.num_preemptions == 1
    assert s.kv.num_owned(c) == 0 and s.waiting[0] is c and c not in s.running
    assert b.status == RequestStatus.RUNNING
    s.kv.check_integrity()
    s.update_from_output(so, fake_output(so, {"a": 11, "b": 21}))
    assert a.is_finished  # max_tokens=2: its blocks come back
    # c comes back with prompt + the token it received, recomputed from scratch (or a cache hit).
    for _ in range(3):
        so = s.schedule()
        sr = sched_of(so, "c")
        if sr is not None:
            break
        s.update_from_output(so, fake_output(so, 22))
    assert sr is not None and sr.new is not None
    assert sr.new.token_ids == c.prompt_token_ids + [30]
    assert sr.new.num_prompt_tokens == 7
    if prefix:
        assert sr.num_computed_tokens in (0, 4)  # its first full block may still be cached
    else:
        assert sr.num_computed_tokens == 0
    assert sr.num_computed_tokens + sr.num_scheduled_tokens == 8 and sr.samples
    assert c.status == RequestStatus.RUNNING and s.running[-1] is c
    s.update_from_output(so, fake_output(so, 31))
    assert c.output_token_ids == [30, 31]
    s.kv.check_integrity()


def test_preempted_request_recomputes_to_identical_output():
    """With the sim worker: preemption under heavy pressure never changes what is generated."""
    for depth in (1, 2):
        s = mksched(num_blocks=7, block_size=4, budget=16, prefix=True)
        reqs = [mkreq(f"p{i}", 5 + i, max_tokens=12) for i in range(4)]
        for r in reqs:
            s.add_request(r)
        d = Driver(s, depth)
        d.run()
        assert s.stats.num_preemptions > 0
        for r in reqs:
            assert (d.outputs[r.request_id], d.finish[r.request_id]) == reference(r, 512)
        assert s.kv.num_free_blocks == s.kv.num_blocks


def test_waiting_requests_not_admitted_in_a_step_that_preempted():
    s, a, b, c = _three_full_requests(prefix=False)
    d = mkreq("d", 1, max_tokens=1)
    s.add_request(d)
    so = s.schedule()
    assert so.preempted_req_ids == ["c"]
    assert sched_of(so, "d") is None and sched_of(so, "c") is None


def test_preempted_request_with_inflight_step_waits_for_its_output():
    s = mksched(num_blocks=3, block_size=4, budget=8, prefix=False)
    a = mkreq("a", 1, max_tokens=4, ignore_eos=True)
    r = mkreq("r", 6, max_tokens=4, ignore_eos=True)
    s.add_request(a)
    s.add_request(r)
    for toks in ({"a": 10, "r": 50}, {"a": 11, "r": 51}):  # two synchronous steps
        so = s.schedule()
        s.update_from_output(so, fake_output(so, toks))
    so1 = s.schedule()  # a@2, r@7: both sample
    so2 = s.schedule()  # async, before so1's output: r@8 needs a 3rd block -> r (the tail) preempted
    assert so2.preempted_req_ids == ["r"] and [x.req_id for x in so2.requests] == ["a"]
    assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
    assert r.num_inflight_steps == 1 and r.num_output_placeholders == 1  # its so1 token is coming
    assert s.kv.num_free_blocks == 2  # r's blocks are back: it would fit now...
    so3 = s.schedule()  # ...but it must not resume before its so1 token arrived (queue deeper than 2)
    assert sched_of(so3, "r") is None and so3.is_empty
    assert r.status == RequestStatus.PREEMPTED and s.waiting[0] is r
    s.update_from_output(so1, fake_output(so1, {"a": 12, "r": 52}))
    assert r.output_token_ids == [50, 51, 52]
    assert r.num_output_placeholders == 0 and r.num_inflight_steps == 0
    s.update_from_output(so2, fake_output(so2, {"a": 13}))
    assert a.status == RequestStatus.FINISHED_LENGTH
    so4 = s.schedule()
    sr = sched_of(so4, "r")
    assert sr is not None and sr.new is not None
    assert sr.new.token_ids == r.prompt_token_ids + [50, 51, 52]
    # recomputed from scratch, in chunks of the budget (8): the sample comes with the last one
    assert (sr.num_computed_tokens, sr.num_scheduled_tokens, sr.samples) == (0, 8, False)
    s.update_from_output(so4, fake_output(so4, 99))
    so5 = s.schedule()
    sr = sched_of(so5, "r")
    assert (sr.num_computed_tokens, sr.num_scheduled_tokens, sr.samples) == (8, 1, True)
    s.update_from_output(so5, fake_output(so5, 53))
    assert r.output_token_ids == [50, 51, 52, 53] and r.status == RequestStatus.FINISHED_LENGTH
    assert s.kv.num_free_blocks == 3
    s.kv.check_integrity()


def _empty_step_preemption_setup(variant: str):
    """Async state where the only schedulable request cannot get a block, because the other
    blocks are held by a request that is finished-but-in-flight ('pending') or running at its
    token limit with its last token in flight ('at_end')."""
    s = mksched(num_blocks=4, block_size=4, budget=64)
    if variant == "pending":
        other = mkreq("o", 7, max_tokens=4)
    else:
        other = mkreq("o", 7, max_tokens=2, ignore_eos=True)
    a = mkreq("a", 7, max_tokens=4, ignore_eos=True)
    s.add_request(other)
    s.add_request(a)
    so0 = s.schedule()  # both prefills: all 4 blocks in use
    so1 = s.schedule()  # both decode at position 7 (no new block)
    assert [x.req_id for x in so1.requests] == ["o", "a"] and s.kv.num_free_blocks == 0
    s.update_from_output(so0, fake_output(so0, {"o": EOS if variant == "pending" else 5, "a": 5}))
    if variant == "pending":
        assert other.is_finished and s.kv.num_owned(other) == 2  # freed once so1 completes
    else:
        assert not other.is_finished and s._at_end(other)
    return s, a, other, so1


@pytest.mark.parametrize("variant", ["pending", "at_end"])
def test_async_preemption_in_a_step_that_schedules_nothing(variant):
    s, a, other, so1 = _empty_step_preemption_setup(variant)
    so2 = s.schedule()  # a@8 needs a 3rd block, none free: a preempts itself -> nothing scheduled
    assert so2.is_empty
    # The worker must still hear about the preemption before `a` is sent again as new.
    s.update_from_output(so1, fake_output(so1, 6))
    sent_preempted = list(so2.preempted_req_ids)
    while s.has_unfinished_requests():
        so = s.schedule()
        assert not so.is_empty
        sent_preempted += so.preempted_req_ids
        sr = sched_of(so, "a")
        if sr is not None and sr.new is not None:
            assert "a" in sent_preempted, "a resumed as new while the worker still holds its old state"
            assert sr.new.token_ids == a.prompt_token_ids + a.output_token_ids
        s.update_from_output(so, fake_output(so, 7))
    assert a.status == RequestStatus.FINISHED_LENGTH and len(a.output_token_ids) == 4
    assert s.kv.num_free_blocks == 4
    s.kv.check_integrity()


@pytest.mark.parametrize("variant", ["pending", "at_end"])
def test_async_blocked_request_setup_is_legitimate(variant):
    """The state used above is reachable and consistent (the bug is only in the next schedule())."""
    s, a, other, so1 = _empty_step_preemption_setup(variant)
    check_request_invariants(s)
    assert a.status == RequestStatus.RUNNING and a.num_inflight_steps == 1


def test_failed_step_does_not_leave_its_blocks_in_the_prefix_cache():
    s = mksched(num_blocks=16, block_size=4)
    prompt = list(range(300, 309))
    a = Request("a", prompt, SamplingParams(max_tokens=4), [EOS], 4)
    s.add_request(a)
    so = s.schedule()
    outs = s.fail_step(so, "device error")
    assert [o.finish_reason for o in outs] == ["error"] and a.status == RequestStatus.FINISHED_ERROR
    assert s.kv.num_free_blocks == 16
    s.kv.check_integrity()
    b = Request("b", prompt, SamplingParams(max_tokens=4), [EOS], 4)
    s.add_request(b)
    so = s.schedule()
    assert sched_of(so, "b").num_computed_tokens == 0, "prefix hit on KV of a step that failed"


def test_fail_step_finishes_requests_and_frees_blocks():
    s = mksched(num_blocks=16, block_size=4)
    a, b = mkreq("a", 5), mkreq("b", 6)
    s.add_request(a)
    s.add_request(b)
    so0 = s.schedule()
    so1 = s.schedule()
    outs = s.fail_step(so0, "boom")
    assert sorted(o.req_id for o in outs) == ["a", "b"] and all(o.error == "boom" for o in outs)
    assert a.status == b.status == RequestStatus.FINISHED_ERROR
    assert s.kv.num_free_blocks < 16  # so1 still in flight
    assert s.fail_step(so1, "boom") == []
    assert s.kv.num_free_blocks == 16 and not s.has_pending_work()
    s.kv.check_integrity()


# -- async placeholders -------------------------------------------------------------------------
def test_async_decode_scheduled_before_previous_output_counts_placeholder():
    s = mksched()
    r = mkreq("r", 5, max_tokens=10, ignore_eos=True)
    s.add_request(r)
    so0 = s.schedule()
    assert r.num_output_placeholders == 1 and r.num_computed_tokens == 5
    so1 = s.schedule()  # step N+1 before step N's output
    sr = sched_of(so1, "r")
    assert sr is not None and sr.new is None
    assert (sr.num_computed_tokens, sr.num_scheduled_tokens, sr.samples) == (5, 1, True)
    assert r.num_output_placeholders == 2 and r.num_tokens == 5 and r.num_computed_tokens == 6
    s.update_from_output(so0, fake_output(so0, 3))
    assert r.num_output_placeholders == 1 and r.output_token_ids == [3]
    so2 = s.schedule()
    assert sched_of(so2, "r").num_computed_tokens == 6
    s.update_from_output(so1, fake_output(so1, 4))
    s.update_from_output(so2, fake_output(so2, 5))
    assert r.num_output_placeholders == 0 and r.output_token_ids == [3, 4, 5]
    assert r.num_computed_tokens == 7 and r.num_tokens == 8


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_async_request_at_max_tokens_counting_placeholders_not_scheduled_again(max_tokens):
    s = mksched()
    r = mkreq("r", 5, max_tokens=max_tokens, ignore_eos=True)
    other = mkreq("o", 5, max_tokens=50, ignore_eos=True)
    s.add_request(r)
    s.add_request(other)
    inflight: deque[SchedulerOutput] = deque()
    n_scheduled_samples = 0
    while not r.is_finished:
        so = s.schedule()
        sr = sched_of(so, "r")
        if sr is not None:
            n_scheduled_samples += sr.samples
        assert len(r.output_token_ids) + r.num_output_placeholders <= max_tokens
        if not r.is_finished:
            # at the limit it stays running, in place: never dropped and re-added
            assert r.status == RequestStatus.RUNNING and s.running[0] is r and r not in s.waiting
        inflight.append(so)
        if len(inflight) == 2:
            done = inflight.popleft()
            s.update_from_output(done, fake_output(done, 9))
    while inflight:
        done = inflight.popleft()
        s.update_from_output(done, fake_output(done, 9))
    assert n_scheduled_samples == max_tokens, "one token too many was scheduled"
    assert r.output_token_ids == [9] * max_tokens
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert s.stats.num_dropped_tokens == 0


def test_async_at_limit_request_keeps_its_place_in_running():
    s = mksched()
    a = mkreq("a", 3, max_tokens=1, ignore_eos=True)
    b = mkreq("b", 3, max_tokens=9, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    so0 = s.schedule()
    so1 = s.schedule()
    assert [x.req_id for x in so1.requests] == ["b"]  # a is at its limit counting its placeholder
    assert s.running == [a, b]
    so2 = s.schedule()
    assert [x.req_id for x in so2.requests] == ["b"] and s.running == [a, b]
    for so in (so0, so1, so2):
        s.update_from_output(so, fake_output(so))
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [7]
    assert s.running == [b]


@pytest.mark.parametrize("depth", [1, 2])
def test_placeholders_never_negative_and_zero_when_idle(depth):
    s = mksched(num_blocks=20, budget=8)
    reqs = [mkreq(f"r{i}", 3 + i, max_tokens=8) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    d = Driver(s, depth)  # Driver checks placeholders >= 0 after each step
    max_ph = 0
    while s.has_unfinished_requests() or d.queue:
        d.step()
        max_ph = max([max_ph] + [r.num_output_placeholders for r in reqs])
    # between steps: sync has none left, async exactly the one of the step still in flight
    assert max_ph == depth - 1
    for r in reqs:
        assert r.num_output_placeholders == 0 and r.num_inflight_steps == 0
        assert (d.outputs[r.request_id], d.finish[r.request_id]) == reference(r, 512)


# -- tokens for finished/aborted requests -----------------------------------------------------
def test_async_token_after_eos_is_dropped():
    s = mksched()
    r = mkreq("r", 5, max_tokens=10)
    s.add_request(r)
    so0 = s.schedule()
    so1 = s.schedule()
    outs = s.update_from_output(so0, fake_output(so0, EOS))
    assert outs[0].finish_reason == "stop" and r.status == RequestStatus.FINISHED_STOPPED
    assert r.num_output_placeholders == 0
    outs = s.update_from_output(so1, fake_output(so1, 33))
    assert outs == []
    assert r.output_token_ids == [EOS]
    assert s.stats.num_dropped_tokens == 1
    assert r.num_output_placeholders == 0


def test_token_for_aborted_request_is_dropped():
    s = mksched()
    r = mkreq("r", 5, max_tokens=10)
    keep = mkreq("k", 5, max_tokens=10)
    s.add_request(r)
    s.add_request(keep)
    so0 = s.schedule()
    assert s.abort_requests(["r"]) == [r]
    assert r.status == RequestStatus.FINISHED_ABORTED and r.status.finish_reason == "abort"
    outs = s.update_from_output(so0, fake_output(so0, 33))
    assert [o.req_id for o in outs] == ["k"]
    assert r.output_token_ids == [] and s.stats.num_dropped_tokens == 1
    so1 = s.schedule()
    assert "r" in so1.finished_req_ids and sched_of(so1, "r") is None


# -- freeing blocks ------------------------------------------------------------------------------
def _count_releases(s: Scheduler) -> list[list[int]]:
    calls: list[list[int]] = []
    orig = s.kv.pool.release

    def release(blocks):
        calls.append([b.block_id for b in blocks])
        return orig(blocks)

    s.kv.pool.release = release  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("how", ["eos", "abort"])
def test_finished_request_blocks_freed_after_inflight_step_exactly_once(how):
    s = mksched(num_blocks=16, block_size=4)
    releases = _count_releases(s)
    r = mkreq("r", 8, max_tokens=10)
    s.add_request(r)
    so0 = s.schedule()
    so1 = s.schedule()  # decode at position 8 -> a third block
    owned = s.kv.block_ids(r)
    assert len(owned) == 3 and s.kv.num_free_blocks == 13
    if how == "eos":
        s.update_from_output(so0, fake_output(so0, EOS))
    else:
        s.abort_requests(["r"])
        s.update_from_output(so0, fake_output(so0, 5))
    assert r.is_finished
    # step 1 is still in flight and writes into r's blocks: they must not be free yet
    assert s.kv.num_free_blocks == 13 and s.kv.num_owned(r) == 3
    assert releases == []
    assert s.has_pending_work() and not s.has_unfinished_requests()
    s.kv.check_integrity()
    s.update_from_output(so1, fake_output(so1, 5))
    assert s.kv.num_free_blocks == 16 and s.kv.num_owned(r) == 0
    assert sorted(sum(releases, [])) == sorted(owned) and len(releases) == 1
    assert not s.has_pending_work()
    s.kv.check_integrity()
    # nothing frees it again
    assert s.schedule().is_empty
    s.abort_requests(["r"])
    s.kv.free(r)
    assert len(releases) == 1 and s.kv.num_free_blocks == 16
    s.kv.check_integrity()


def test_finished_without_inflight_step_frees_immediately():
    s = mksched(num_blocks=16)
    r = mkreq("r", 8, max_tokens=10)
    s.add_request(r)
    so = s.schedule()
    assert s.kv.num_free_blocks == 14
    s.update_from_output(so, fake_output(so, EOS))
    assert s.kv.num_free_blocks == 16
    s.kv.check_integrity()


def test_abort_waiting_request():
    s = mksched(max_num_seqs=1)
    a, b = mkreq("a", 4), mkreq("b", 4)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    assert list(s.waiting) == [b]
    assert s.abort_requests(["b"]) == [b]
    assert not s.waiting and b.status == RequestStatus.FINISHED_ABORTED
    s.update_from_output(so, fake_output(so))
    s.kv.check_integrity()


def test_abort_unknown_or_finished_is_noop():
    s = mksched(num_blocks=16)
    assert s.abort_requests(["nope"]) == []
    r = mkreq("r", 4, max_tokens=1)
    s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, fake_output(so, 5))
    assert r.status == RequestStatus.FINISHED_LENGTH
    free = s.kv.num_free_blocks
    assert s.abort_requests(["r", "nope"]) == []
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert s.kv.num_free_blocks == free == 16
    s.kv.check_integrity()


def test_request_id_reuse():
    s = mksched(num_blocks=32)
    a = mkreq("x", 4, max_tokens=3)
    s.add_request(a)
    with pytest.raises(ValueError, match="already"):
        s.add_request(mkreq("x", 5))
    so0 = s.schedule()
    with pytest.raises(ValueError):  # running is live too
        s.add_request(mkreq("x", 5))
    so1 = s.schedule()
    s.abort_requests(["x"])  # finished, but its two steps are still in flight
    b = mkreq("x", 6, max_tokens=2)
    s.add_request(b)  # a finished id can be reused at once
    so2 = s.schedule()
    sr = sched_of(so2, "x")
    assert sr is not None and sr.new is not None and sr.new.token_ids == b.prompt_token_ids
    assert "x" in so2.finished_req_ids  # the worker drops the old one first
    # the old request's in-flight tokens never reach the new one
    s.update_from_output(so0, fake_output(so0, 40))
    s.update_from_output(so1, fake_output(so1, 41))
    assert b.output_token_ids == [] and s.stats.num_dropped_tokens == 2
    s.update_from_output(so2, fake_output(so2, 42))
    assert b.output_token_ids == [42] and a.output_token_ids == []
    so3 = s.schedule()
    s.update_from_output(so3, fake_output(so3, 43))
    assert b.status == RequestStatus.FINISHED_LENGTH and b.output_token_ids == [42, 43]
    assert s.kv.num_free_blocks == 32
    s.kv.check_integrity()
    s.add_request(mkreq("x", 3))  # and again after a normal finish


# -- prefix-cache hashing and placeholders -------------------------------------------------------
def test_block_hashes_cover_only_real_tokens_during_async():
    from tandem.scheduler.kv_cache import _ROOT_HASH, hash_block

    s = mksched(block_size=4)
    r = mkreq("r", 7, max_tokens=10, ignore_eos=True)
    s.add_request(r)
    so0 = s.schedule()
    so1 = s.schedule()  # computes the placeholder at position 7 (the end of block 1)
    assert r.num_computed_tokens == 8 and r.num_tokens == 7
    assert len(r.block_hashes) == r.num_tokens // 4 == 1
    blocks = s.kv.req_blocks[id(r)]
    assert blocks[0].block_hash == r.block_hashes[0]
    assert blocks[1].block_hash is None, "a block holding a placeholder must not enter the cache"
    assert all(b is not blocks[1] for b in s.kv.pool.cached.values())
    s.update_from_output(so0, fake_output(so0, 77))
    # the real token arrived: block 1 is full of real, computed tokens now
    assert len(r.block_hashes) == 2
    p = r.prompt_token_ids
    h0 = hash_block(_ROOT_HASH, p[:4])
    assert r.block_hashes == [h0, hash_block(h0, p[4:7] + [77])]
    assert blocks[1].block_hash == r.block_hashes[1]
    so2 = s.schedule()
    assert len(r.block_hashes) == r.num_tokens // 4
    for so in (so1, so2):
        s.update_from_output(so, fake_output(so, 78))


def test_prefix_hit_from_a_finished_request():
    s = mksched(num_blocks=16, block_size=4)
    shared = list(range(500, 510))
    a = Request("a", shared + [1000], SamplingParams(max_tokens=1), [EOS], 1)
    s.add_request(a)
    so = s.schedule()
    s.update_from_output(so, fake_output(so))
    assert a.is_finished
    b = Request("b", shared + [2000, 2001], SamplingParams(max_tokens=1), [EOS], 1)
    s.add_request(b)
    so = s.schedule()
    sr = sched_of(so, "b")
    assert sr.num_computed_tokens == 8 and sr.num_scheduled_tokens == 4 and sr.samples
    assert b.num_cached_tokens == 8
    assert sr.new_block_ids[:2] == [blk.block_id for blk in s.kv.req_blocks[id(b)][:2]]
    s.update_from_output(so, fake_output(so))
    s.kv.check_integrity()


# -- stop conditions --------------------------------------------------------------------------
def _run_single(r: Request, tokens: list[int], depth: int = 1, max_model_len: int = 512):
    s = mksched(max_model_len=max_model_len)
    s.add_request(r)
    feed = iter(tokens)
    inflight: deque[SchedulerOutput] = deque()
    outs = []
    for _ in range(200):
        if not s.has_unfinished_requests() and not inflight:
            break
        so = s.schedule()
        if not so.is_empty:
            inflight.append(so)
        if inflight and (so.is_empty or len(inflight) >= depth):
            done = inflight.popleft()
            outs += s.update_from_output(done, fake_output(done, lambda _r: next(feed)))
        check_request_invariants(s)
    assert not s.has_pending_work()
    assert s.kv.num_free_blocks == s.kv.num_blocks
    return s, outs


@pytest.mark.parametrize("depth", [1, 2])
def test_min_tokens_eos_before_min_does_not_finish(depth):
    r = mkreq("r", 4, max_tokens=10, min_tokens=3)
    s, outs = _run_single(r, [EOS, EOS, EOS, 5, 5, 5], depth)
    assert r.output_token_ids == [EOS, EOS, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED and outs[-1].finish_reason == "stop"


@pytest.mark.parametrize("depth", [1, 2])
def test_ignore_eos(depth):
    r = mkreq("r", 4, max_tokens=4, ignore_eos=True)
    s, outs = _run_single(r, [EOS] * 6, depth)
    assert r.output_token_ids == [EOS] * 4
    assert r.status == RequestStatus.FINISHED_LENGTH and outs[-1].finish_reason == "length"


@pytest.mark.parametrize("depth", [1, 2])
def test_stop_token_ids(depth):
    r = mkreq("r", 4, max_tokens=10, stop_token_ids=[13])
    s, outs = _run_single(r, [5, 6, 13, 7, 8], depth)
    assert r.output_token_ids == [5, 6, 13]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == 13
    assert s.stats.num_dropped_tokens == (1 if depth == 2 else 0)


def test_multiple_eos_ids():
    r = mkreq("r", 4, max_tokens=10, eos=(1, 2))
    _run_single(r, [5, 2, 7])
    assert r.output_token_ids == [5, 2] and r.status == RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("depth", [1, 2])
def test_max_model_len_finish(depth):
    r = mkreq("r", 5, max_tokens=100, ignore_eos=True)
    s, outs = _run_single(r, list(range(10, 30)), depth, max_model_len=8)
    assert r.output_token_ids == [10, 11, 12]
    assert r.num_tokens == 8
    assert r.status == RequestStatus.FINISHED_LENGTH and outs[-1].finish_reason == "length"
    assert s.stats.num_dropped_tokens == 0, "scheduled past max_model_len counting placeholders"


# -- liveness -----------------------------------------------------------------------------------
def run_random_workload(seed: int, depth: int, num_blocks: int, block_size: int, chunked: bool,
                        prefix: bool, max_num_seqs: int) -> Scheduler:
    """Random arrivals, aborts, EOS/stop tokens, min_tokens and id reuse, driven to the end.

    Every request must finish within a bounded number of iterations, non-aborted ones with
    exactly the sequential reference output, and all blocks must be free at the end.
    """
    rng = random.Random(seed)
    max_model_len = 40
    budget = rng.choice([8, 16, 48]) if chunked else 48  # without chunking: budget >= max_model_len
    s = mksched(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, budget=budget,
                max_model_len=max_model_len, chunked=chunked, prefix=prefix)
    d = Driver(s, depth)
    shared = [rng.randrange(2, 60) for _ in range(rng.randint(2, 9))]
    arrivals = []
    for i in range(rng.randint(1, 14)):
        plen = rng.randint(1, 25)
        prompt = [rng.randrange(2, 60) for _ in range(plen)]
        if rng.random() < 0.5:
            prompt = (shared + prompt)[:plen]
        kw = dict(ignore_eos=rng.random() < 0.3)
        max_tokens = rng.randint(1, 14)
        if rng.random() < 0.3:
            kw["min_tokens"] = rng.randint(0, max_tokens)
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(2, 60)]
        rid = f"q{rng.randrange(4)}" if rng.random() < 0.3 else f"r{i}"  # some ids get reused
        arrivals.append((rng.randint(0, 25), mkreq(rid, prompt, max_tokens=max_tokens, **kw)))
    arrivals.sort(key=lambda x: x[0])
    all_reqs: list[Request] = []
    aborted: set[int] = set()
    it = 0
    while arrivals or s.has_unfinished_requests() or d.queue:
        while arrivals and arrivals[0][0] <= it:
            _, r = arrivals.pop(0)
            if r.request_id in s.requests:
                with pytest.raises(ValueError):
                    s.add_request(r)
                continue
            try:
                s.add_request(r)
            except ValueError:  # needs more blocks than the whole cache
                assert s.kv.blocks_needed(min(r.num_prompt_tokens + r.max_tokens, max_model_len)) > num_blocks
                continue
            # the worker's outputs for a reused id belong to the new request from here on
            d.outputs.pop(r.request_id, None)
            d.finish.pop(r.request_id, None)
            all_reqs.append(r)
        if s.requests and rng.random() < 0.06:
            victim = s.requests[rng.choice(sorted(s.requests))]
            s.abort_requests([victim.request_id])
            aborted.add(id(victim))
        if arrivals and not s.has_unfinished_requests() and not d.queue:
            it += 1
            continue
        d.step()
        for r in all_reqs:  # record outputs of finished requests before an id is reused
            if r.is_finished and not hasattr(r, "_checked"):
                r._checked = True  # type: ignore[attr-defined]
                if id(r) not in aborted:
                    assert (d.outputs.get(r.request_id), d.finish.get(r.request_id)) == \
                        reference(r, max_model_len), r
                else:
                    exp = reference(r, max_model_len)[0]
                    assert r.output_token_ids == exp[:len(r.output_token_ids)]
        it += 1
        assert it < 3000, "livelock: requests did not finish"
    assert all(r.is_finished for r in all_reqs)
    assert not s.has_pending_work() and not s.running and not s.waiting
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.kv.num_owned_total() == 0
    s.kv.check_integrity()
    return s


_WORKLOAD = dict(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4]),
    chunked=st.booleans(),
    prefix=st.booleans(),
    max_num_seqs=st.sampled_from([1, 3, 8]),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.sampled_from([6, 10, 16, 40]), **_WORKLOAD)
def test_liveness_sync_queue_depth_1(seed, num_blocks, block_size, chunked, prefix, max_num_seqs):
    run_random_workload(seed, 1, num_blocks, block_size, chunked, prefix, max_num_seqs)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_WORKLOAD)
def test_liveness_async_queue_depth_2_without_kv_pressure(seed, block_size, chunked, prefix, max_num_seqs):
    # Enough blocks for every request at once (<= 14 requests of <= 40 tokens): no preemption
    # (the test below covers KV pressure).
    s = run_random_workload(seed, 2, 14 * 40, block_size, chunked, prefix, max_num_seqs)
    assert s.stats.num_preemptions == 0


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          phases=[Phase.generate], suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.sampled_from([6, 10, 16]), **_WORKLOAD)
def test_liveness_async_queue_depth_2_under_kv_pressure(seed, num_blocks, block_size, chunked, prefix,
                                                         max_num_seqs):
    run_random_workload(seed, 2, num_blocks, block_size, chunked, prefix, max_num_seqs)
