"""The scheduler's side of speculative decoding, without a model: draft counts, optimistic
placeholders and their correction when a verify step's tokens arrive (sync and async),
the caps (max_tokens, max_model_len, budget), constrained requests, ``min_tokens`` under
async, requests that may still need steps, and KV blocks freed exactly once."""
from __future__ import annotations

import pytest

from tandem.sampling_params import SamplingParams
from tandem.scheduler.kv_cache import KVCacheManager
from tandem.scheduler.scheduler import Scheduler
from tandem.scheduler.spec import SpecScheduling
from tandem.types.request import Request, RequestStatus
from tandem.types.runner_output import ModelRunnerOutput
from tandem.types.scheduler_output import SchedulerOutput

pytestmark = pytest.mark.timeout(60)


def mkreq(rid: str, n_prompt: int = 6, max_tokens: int = 20, **sp) -> Request:
    return Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=max_tokens, **sp), [1],
                   max_tokens)


def mksched(k: int = 3, disable: int | None = None, max_model_len: int = 512, num_blocks: int = 64) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, 4, True), max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=max_model_len, enable_chunked_prefill=True, spec=SpecScheduling(k, disable))


def verify_output(so: SchedulerOutput, accepted: dict[str, int], token: int = 7) -> ModelRunnerOutput:
    """Each sampling request emits ``1 + accepted`` tokens (all ``token``)."""
    ids = [r.req_id for r in so.requests if r.samples]
    toks = [[token] * (1 + min(accepted.get(r.req_id, 0), r.num_draft_tokens)) for r in so.requests if r.samples]
    out = ModelRunnerOutput(so.step_id, ids, [t[0] for t in toks])
    if so.num_draft_tokens:
        out.spec_token_ids = toks
    return out


def by_id(so: SchedulerOutput) -> dict:
    return {r.req_id: r for r in so.requests}


def test_sync_accounting():
    s = mksched(k=3)
    req = mkreq("a")
    s.add_request(req)
    so = s.schedule()  # prefill: no drafts
    assert by_id(so)["a"].num_draft_tokens == 0
    s.update_from_output(so, verify_output(so, {}))
    assert (req.num_computed_tokens, len(req.output_token_ids)) == (6, 1)
    so = s.schedule()
    sr = by_id(so)["a"]
    assert (sr.num_computed_tokens, sr.num_scheduled_tokens, sr.num_draft_tokens, sr.correct_drafts) == (6, 4, 3, False)
    assert req.num_output_placeholders == 4 and req.num_computed_tokens == 10
    s.update_from_output(so, verify_output(so, {"a": 1}))  # 2 of 4 emitted
    assert (req.num_output_placeholders, len(req.output_token_ids), req.num_computed_tokens) == (0, 3, 8)
    assert req.num_computed_tokens == req.num_tokens - 1
    st = s.spec.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.accepted_per_position) == (1, 3, 1,
                                                                                                   [1, 0, 0])


def test_async_steps_behind_a_verify_step_are_marked_for_correction():
    s = mksched(k=3)
    req = mkreq("a")
    s.add_request(req)
    so0 = s.schedule()
    s.update_from_output(so0, verify_output(so0, {}))
    so1 = s.schedule()  # verify, 4 placeholders
    so2 = s.schedule()  # scheduled before so1's count: optimistic by so1's rejections
    sr2 = by_id(so2)["a"]
    assert sr2.correct_drafts and sr2.num_computed_tokens == 10 and sr2.num_draft_tokens == 3
    assert req.num_output_placeholders == 8 and req.spec_steps_in_flight == 2
    s.update_from_output(so1, verify_output(so1, {"a": 0}))  # 1 emitted: 3 rejected
    assert req.num_computed_tokens == 14 - 3 and req.num_output_placeholders == 4
    s.update_from_output(so2, verify_output(so2, {"a": 3}))  # all accepted
    assert (len(req.output_token_ids), req.num_output_placeholders, req.spec_steps_in_flight) == (1 + 1 + 4, 0, 0)
    assert req.num_computed_tokens == req.num_tokens - 1


def test_caps_and_exclusions():
    s = mksched(k=4, max_model_len=12)
    a = mkreq("a", n_prompt=6, max_tokens=3)  # room for 2 more tokens after the first
    b = mkreq("b", n_prompt=8, max_tokens=50)  # max_model_len 12: room for 3 more after the first
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    s.update_from_output(so, verify_output(so, {}))
    so = s.schedule()
    assert by_id(so)["a"].num_draft_tokens == 1  # emits at most 2 = max_tokens - 1
    assert by_id(so)["b"].num_draft_tokens == 2  # tokens up to max_model_len: 9 now, 12 at most
    out = verify_output(so, {"a": 1, "b": 2})
    outs = {o.req_id: o for o in s.update_from_output(so, out)}
    assert outs["a"].finish_reason == "length" and len(a.output_token_ids) == 3
    assert outs["b"].finish_reason == "length" and b.num_tokens == 12
    assert s.kv.num_owned_total() == 0


def test_stop_token_inside_an_accepted_run_drops_the_rest():
    s = mksched(k=3)
    req = mkreq("a")
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, verify_output(so, {}))
    so = s.schedule()
    out = verify_output(so, {"a": 3})
    out.spec_token_ids = [[5, 1, 6, 6]]  # EOS second: 6, 6 must not be emitted
    outs = s.update_from_output(so, out)
    assert outs[0].new_token_ids == [5, 1] and outs[0].finish_reason == "stop"
    assert req.output_token_ids == [7, 5, 1] and req.status == RequestStatus.FINISHED_STOPPED
    assert s.kv.num_owned_total() == 0


def test_disable_by_batch_size_and_min_tokens_wait():
    s = mksched(k=2, disable=2)
    for rid in ("a", "b"):
        s.add_request(mkreq(rid))
    so = s.schedule()
    s.update_from_output(so, verify_output(so, {}))
    so = s.schedule()
    assert so.num_draft_tokens == 0  # 2 running >= 2: off for the step
    s.update_from_output(so, verify_output(so, {}))

    s = mksched(k=2)
    req = mkreq("m", min_tokens=5)
    s.add_request(req)
    so0 = s.schedule()
    s.update_from_output(so0, verify_output(so0, {}))
    so1 = s.schedule()
    assert by_id(so1)["m"].num_draft_tokens == 2
    so2 = s.schedule()  # short of min_tokens with a verify step in flight: waits for its count
    assert "m" not in by_id(so2)
    s.update_from_output(so1, verify_output(so1, {"m": 1}))
    so3 = s.schedule()
    assert "m" in by_id(so3) and not by_id(so3)["m"].correct_drafts


def test_a_request_whose_verify_step_is_in_flight_keeps_its_slot():
    """Optimistically at max_tokens, but its drafts may be rejected: not counted as ending,
    so no one takes its sequence slot; scheduled again once its count arrives."""
    s = Scheduler(KVCacheManager(64, 4, True), max_num_seqs=1, max_num_batched_tokens=64, max_model_len=512,
                  enable_chunked_prefill=True, spec=SpecScheduling(3, None))
    a = mkreq("a", max_tokens=5)
    s.add_request(a)
    so0 = s.schedule()
    s.update_from_output(so0, verify_output(so0, {}))
    so1 = s.schedule()  # 3 drafts: optimistically 5 tokens
    s.add_request(mkreq("b"))
    so2 = s.schedule()
    assert so2.is_empty  # "a" is not scheduled (maybe ending) and "b" not admitted (no free slot)
    s.update_from_output(so1, verify_output(so1, {"a": 0}))  # 2 tokens: not ending after all
    so3 = s.schedule()
    assert "a" in by_id(so3) and "b" not in by_id(so3)


def test_constrained_requests_speculate_with_the_drafts_the_worker_returned():
    class Always:
        is_ready, error = True, None

        def accept_token(self, token: int) -> bool:
            return True

    s = mksched(k=3)
    req = mkreq("g")
    req.grammar = Always()  # type: ignore[assignment]
    s.add_request(req)
    so = s.schedule()
    out = verify_output(so, {})
    out.draft_token_ids = {"g": [4, 5, 6]}
    s.update_from_output(so, out)
    assert req.spec_drafts == [4, 5, 6]  # what the engine core masks the next step's positions with
    so = s.schedule()
    assert by_id(so)["g"].num_draft_tokens == 3 and so.grammar_req_ids == ["g"]
