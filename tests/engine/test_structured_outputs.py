"""Structured outputs in the engine core, on a tiny model (the embedded model's JSON tests
are in test_structured_outputs_model.py): the grammar's lifecycle around the step loop.

A request waits for its grammar without holding up others; a grammar that does not compile
ends only its request, as the request's fault; an engine with nothing else to do waits for a
compilation instead of reporting a stall; the constrained step's two calls keep their order
under async scheduling; identical constraints compile once.
"""
from __future__ import annotations

import re
import threading

import pytest

from engine_harness import TINY_CONSTRAINTS, WorkItem, assert_same, run_workload, tiny_text
from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.types.engine_output import INVALID_REQUEST

pytestmark = pytest.mark.timeout(120)

REGEX, PATTERN = TINY_CONSTRAINTS[0]


def engine(model: str, a: bool, **kw) -> LLMEngine:
    base = dict(model=model, block_size=4, max_num_seqs=6, max_num_batched_tokens=64, async_scheduling=a,
                num_kv_blocks=256)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def constrained(max_tokens: int = 12, so: StructuredOutputsParams = REGEX, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kw}, max_tokens=max_tokens, structured_outputs=so)


def gate_compilation(e: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every compilation of ``e`` until the returned event is set (a slow compiler)."""
    release = threading.Event()
    manager = e.core.structured
    orig = manager._compile

    def slow(spec):
        assert release.wait(60), "the test never released the compilation"
        return orig(spec)

    monkeypatch.setattr(manager, "_compile", slow)
    return release


@pytest.mark.parametrize("a", [False, True])
def test_waiting_for_grammar_holds_up_no_one(tiny_llama, monkeypatch, a):
    e = engine(tiny_llama, a)
    release = gate_compilation(e, monkeypatch)
    e.add_request("c", [5, 6, 7], constrained())
    e.add_request("u", [8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    done: dict = {}
    for _ in range(200):
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
        if "u" in done:
            break
    assert "u" in done and "c" not in done, "the unconstrained request waited for the other's grammar"
    assert e.core.scheduler.waiting_for_grammar, "the constrained request should still be compiling"
    release.set()
    while e.has_unfinished_requests():
        for out in e.step():
            done[out.request_id] = out
    c = done["c"].outputs[0]
    assert done["c"].error is None and c.finish_reason in ("stop", "length")
    if c.finish_reason == "stop":
        assert re.fullmatch(PATTERN, tiny_text(c.token_ids[:-1]))
    e.shutdown()


def test_nothing_else_to_run_waits_for_the_compilation_instead_of_stalling(tiny_llama, monkeypatch):
    e = engine(tiny_llama, True)
    release = gate_compilation(e, monkeypatch)
    e.add_request("c", [5, 6, 7], constrained())
    for _ in range(3):  # each step waits a little (bounded) and returns: no EngineStallError, no spin
        assert e.step() == []
    assert e.core.stats.num_launched == 0
    release.set()
    out = run_workload(e, [WorkItem("d", [5, 6, 7], constrained())]).outputs
    assert out["d"].outputs[0].finish_reason in ("stop", "length")
    e.shutdown()


@pytest.mark.parametrize("a", [False, True])
def test_bad_grammar_ends_only_its_request_as_its_own_fault(tiny_llama, a):
    e = engine(tiny_llama, a)
    bad = {"regex": StructuredOutputsParams(regex="(t2[0-9"),
           "grammar": StructuredOutputsParams(grammar='root ::= "t2" missing'),
           "lark": StructuredOutputsParams(grammar="start: (")}
    items = [WorkItem(name, [5, 6, 7], constrained(so=so), arrive_step=i) for i, (name, so) in enumerate(bad.items())]
    items += [WorkItem("good", [5, 6, 7], constrained(), arrive_step=1),
              WorkItem("plain", [9, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]
    res = run_workload(e, items).outputs
    for name in bad:
        out = res[name]
        assert out.outputs[0].finish_reason == "error" and out.error_kind == INVALID_REQUEST, name
        assert "does not compile" in out.error and "\n" not in out.error, out.error
        assert not out.outputs[0].token_ids
    assert "Unclosed" in res["regex"].error or "not closed" in res["regex"].error.lower()
    assert res["good"].error is None and res["plain"].outputs[0].finish_reason == "length"
    e.shutdown()


def test_abort_while_compiling_leaves_nothing_behind(tiny_llama, monkeypatch):
    e = engine(tiny_llama, True)
    release = gate_compilation(e, monkeypatch)
    e.add_request("c", [5, 6, 7], constrained())
    e.step()
    e.abort_request("c")
    assert not e.core.scheduler.waiting_for_grammar and not e.has_unfinished_requests()
    assert e.core.scheduler.num_grammar_requests == 0
    release.set()
    out = run_workload(e, [WorkItem("c", [5, 6, 7], constrained())]).outputs  # the id is free again
    assert out["c"].error is None
    e.shutdown()


def test_identical_constraints_compile_once(tiny_llama):
    e = engine(tiny_llama, True)
    items = [WorkItem(f"r{i}", [5, 6 + i], constrained(), arrive_step=i) for i in range(5)]
    run_workload(e, items)
    assert e.core.structured.num_compiles == 1
    run_workload(e, [WorkItem("x", [7], constrained(so=StructuredOutputsParams(regex=REGEX.regex)))])
    assert e.core.structured.num_compiles == 1
    e.shutdown()


def record_calls(monkeypatch, obj, labels: dict) -> list[tuple[str, int]]:
    """Wrap ``obj``'s methods named in ``labels`` so that each call appends
    ``labels[name](argument)`` to the returned list before it runs."""
    calls: list[tuple[str, int]] = []
    for name, label in labels.items():
        def wrapped(arg, _orig=getattr(obj, name), _label=label):
            calls.append(_label(arg))
            return _orig(arg)

        monkeypatch.setattr(obj, name, wrapped)
    return calls


def test_constrained_step_calls_keep_their_order(tiny_llama, monkeypatch):
    """Async: forward N, sample N, forward N+1, sample N+1 — never a forward between a
    constrained step's two calls — and deferred sampling really happens."""
    e = engine(tiny_llama, True, structured_outputs_sampling="split")
    calls = record_calls(monkeypatch, e.core.executor, {
        "execute_model": lambda so: ("forward" if so.grammar_req_ids else "step", so.step_id),
        "sample_tokens": lambda grammar: ("sample", grammar.step_id)})
    items = [WorkItem("c", [5, 6, 7], constrained(20)), WorkItem("u", [8, 9], SamplingParams(temperature=0,
                                                                                          max_tokens=20))]
    run_workload(e, items)
    for (kind, sid), nxt in zip(calls, calls[1:] + [("end", -1)]):
        if kind == "forward":
            assert nxt == ("sample", sid), f"forward of step {sid} followed by {nxt}"
    assert any(k == "forward" for k, _ in calls) and e.core.stats.num_sampling_deferred > 0
    e.shutdown()


def test_next_step_is_built_before_the_deferred_sampling_call_and_equals_sync(tiny_llama, monkeypatch):
    """Async, with a fill still running when the next step is scheduled (as on CUDA, where it
    runs on the fill thread): the inputs of step N+1 are built (``prepare_model``) before
    step N's deferred sampling call, and only launched after it; with requests arriving and
    finishing (rows freed and reused while a step waits for its sampling), seeded and
    greedy, constrained and not, every token equals the synchronous engine's."""
    from tandem.structured_output.manager import PendingGrammarOutput

    monkeypatch.setattr(PendingGrammarOutput, "done", lambda self: False)
    items = [WorkItem(f"c{i}", [5 + i, 6, 7], constrained(6 + 3 * i), arrive_step=i) for i in range(4)]
    items += [WorkItem(f"r{i}", [9, 4 + i], constrained(10, so=TINY_CONSTRAINTS[3][0], temperature=1.1, seed=i),
                       arrive_step=2 * i) for i in range(3)]
    items += [WorkItem(f"u{i}", [8, 9, i + 3], SamplingParams(temperature=0.8, seed=40 + i, max_tokens=4 + 5 * i),
                       arrive_step=i) for i in range(4)]
    expected = run_workload(engine(tiny_llama, False, max_num_batched_tokens=12), items).outputs
    e = engine(tiny_llama, True, structured_outputs_sampling="split", max_num_batched_tokens=12)
    ex = e.core.executor
    calls = record_calls(monkeypatch, ex, {"prepare_model": lambda so: ("prepare", so.step_id),
                                           "execute_model": lambda so: ("launch", so.step_id),
                                           "sample_tokens": lambda grammar: ("sample", grammar.step_id)})
    got = run_workload(e, items).outputs
    assert_same(expected, got, items)
    prepared = [sid for kind, sid in calls if kind == "prepare"]
    assert prepared and ex.worker.runner.stats_prepared_steps == len(prepared)
    for sid in prepared:  # prepare N+1, sample N, launch N+1
        k = calls.index(("prepare", sid))
        assert calls[k + 1][0] == "sample" and calls[k + 1][1] < sid and calls[k + 2] == ("launch", sid), calls[k:k + 3]
    e.shutdown()


def test_a_filled_bitmask_is_sent_before_the_next_step_is_scheduled_and_equals_sync(tiny_llama, monkeypatch):
    """Async, fills done by the time the engine thread looks (the CPU fills inline): a
    deferred sampling call goes out before the next step is scheduled, so nothing is built
    ahead; the worker still sees sample N before forward N+1, and tokens equal sync."""
    items = [WorkItem(f"c{i}", [5 + i, 6, 7], constrained(6 + 3 * i), arrive_step=i) for i in range(3)]
    items += [WorkItem(f"u{i}", [8, 9, i + 3], SamplingParams(temperature=0.8, seed=40 + i, max_tokens=4 + 5 * i),
                       arrive_step=i) for i in range(3)]
    expected = run_workload(engine(tiny_llama, False, max_num_batched_tokens=12), items).outputs
    e = engine(tiny_llama, True, structured_outputs_sampling="split", max_num_batched_tokens=12)
    ex = e.core.executor
    scheduled: list[int] = []
    schedule = e.core.scheduler.schedule

    def spy_schedule():
        so = schedule()
        scheduled.append(len(calls))  # how many worker calls came before this scheduling
        return so

    monkeypatch.setattr(e.core.scheduler, "schedule", spy_schedule)
    calls = record_calls(monkeypatch, ex, {"prepare_model": lambda so: ("prepare", so.step_id),
                                           "execute_model": lambda so: ("launch", so.step_id),
                                           "sample_tokens": lambda grammar: ("sample", grammar.step_id)})
    got = run_workload(e, items).outputs
    assert_same(expected, got, items)
    assert not [c for c in calls if c[0] == "prepare"]
    samples = [k for k, c in enumerate(calls) if c[0] == "sample"]
    assert samples and e.core.stats.num_sampling_deferred > 0
    for k in samples:  # sent before the scheduling that precedes the next launch
        later = [j for j, c in enumerate(calls) if c[0] == "launch" and j > k]
        if later:
            assert any(k < n <= later[0] for n in scheduled), calls[k:later[0] + 1]
    e.shutdown()


def test_fill_threads_come_from_the_engine_config(tiny_llama):
    """``structured_outputs_fill_threads`` (``--structured-outputs-fill-threads``) sizes the
    manager's fill threads; below one it is refused."""
    e = engine(tiny_llama, True, structured_outputs_fill_threads=3)
    assert e.core.structured._fill_threads.num_threads == 3
    e.shutdown()
    with pytest.raises(ValueError, match=r"structured_outputs_fill_threads must be an integer in \[1, 64\], got 0"):
        EngineConfig(model=tiny_llama, structured_outputs_fill_threads=0)


def serve_with_loop(e: LLMEngine, requests: list) -> dict[str, list[int]]:
    """Run ``requests`` (all sent at once) through an ``EngineCoreLoop`` over ``e``'s core,
    as the serving process does; each request's tokens."""
    from tandem.engine.core_loop import EngineCoreLoop
    from tandem.engine.messages import CoreInput

    inbox = [CoreInput(client_index=0, hello=True, adds=requests)]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    ended: set[str] = set()

    def recv(timeout_s: float):
        if inbox:
            return inbox.pop()
        return CoreInput(shutdown=True) if len(ended) == len(requests) and not e.core.has_work() else None

    def send(client: int, batch) -> None:
        for o in batch.outputs:
            tokens[o.req_id] += o.new_token_ids
            if o.finish_reason is not None:
                ended.add(o.req_id)

    EngineCoreLoop(e.core, recv, send, heartbeat_s=30).run()
    return tokens


def test_the_serving_loop_sends_a_filled_bitmask_after_publishing_and_equals_sync(tiny_llama, monkeypatch):
    """Async, fills seen as "running" inside ``step()`` and as done outside it: the deferred
    sampling call goes out from the serving loop, after the outputs are published and before
    the next messages and step, and the tokens equal the sync engine's."""
    from tandem.engine.messages import EngineCoreRequest
    from tandem.structured_output.manager import PendingGrammarOutput

    def requests() -> list:
        cons = [EngineCoreRequest(f"c{i}", [5 + i, 6, 7], constrained(6 + 3 * i), [], 6 + 3 * i) for i in range(3)]
        free = [EngineCoreRequest(f"u{i}", [8, 9, i + 3], SamplingParams(temperature=0.8, seed=40 + i,
                                                                         max_tokens=4 + 5 * i), [], 4 + 5 * i,
                                  sample_seed=40 + i)
                for i in range(3)]
        return cons + free

    expected = serve_with_loop(engine(tiny_llama, False), requests())
    e = engine(tiny_llama, True, structured_outputs_sampling="split")
    in_step = [False]
    step = e.core.step

    def spy_step():
        in_step[0] = True
        try:
            return step()
        finally:
            in_step[0] = False

    monkeypatch.setattr(e.core, "step", spy_step)
    monkeypatch.setattr(PendingGrammarOutput, "done", lambda self: not in_step[0])
    calls = record_calls(monkeypatch, e.core.executor, {"sample_tokens": lambda g: ("sample", in_step[0])})
    got = serve_with_loop(e, requests())
    assert got == expected and all(got.values())
    assert e.core.stats.num_sampling_deferred > 0
    assert ("sample", False) in calls, calls  # sent by the loop, outside a step
    e.shutdown()


def test_a_step_built_ahead_then_interrupted_before_its_launch_leaves_nothing_behind(tiny_llama, monkeypatch):
    """An interrupt between building a step ahead and launching it abandons the step (its
    requests fail); the inputs built for it are dropped, and later requests decode exactly
    as on a fresh engine. (Fills are held "running" so that steps are built ahead.)"""
    from tandem.structured_output.manager import PendingGrammarOutput

    monkeypatch.setattr(PendingGrammarOutput, "done", lambda self: False)
    e = engine(tiny_llama, True, structured_outputs_sampling="split")
    ex = e.core.executor
    runner = ex.worker.runner
    orig_prepare, orig_exec = ex.prepare_model, ex.execute_model
    built: list[int] = []
    fired: list[int] = []

    def prepare_model(so):
        built.append(so.step_id)
        return orig_prepare(so)

    def execute_model(so):
        if not fired and built and built[-1] == so.step_id:
            fired.append(so.step_id)
            raise KeyboardInterrupt
        return orig_exec(so)

    monkeypatch.setattr(ex, "prepare_model", prepare_model)
    monkeypatch.setattr(ex, "execute_model", execute_model)
    e.add_request("c", [5, 6, 7], constrained(12))
    e.add_request("u", [8, 9], SamplingParams(temperature=0, max_tokens=12))
    interrupts = 0
    for _ in range(200):
        if not e.has_unfinished_requests():
            break
        try:
            e.step()
        except KeyboardInterrupt:
            interrupts += 1
    assert fired and interrupts == 1 and not e.has_unfinished_requests()
    assert runner._prepared is not None and runner._prepared[0] == fired[0]  # built, never launched
    late = [WorkItem("late-c", [5, 6, 7], constrained(12)),
            WorkItem("late-u", [8, 9], SamplingParams(temperature=0, max_tokens=12))]
    expected = run_workload(engine(tiny_llama, False), late).outputs
    assert_same(expected, run_workload(e, late).outputs, late)
    assert runner._prepared is None or runner._prepared[0] != fired[0]
    e.shutdown()


@pytest.mark.parametrize("so", [REGEX, TINY_CONSTRAINTS[3][0], TINY_CONSTRAINTS[5][0]], ids=["regex", "choice",
                                                                                              "grammar"])
def test_seeded_constrained_sampling_async_equals_sync_and_is_batch_independent(tiny_llama, so):
    sp = SamplingParams(temperature=1.2, seed=77, max_tokens=16, structured_outputs=so)
    alone = run_workload(engine(tiny_llama, False), [WorkItem("s", [4, 5, 6], sp)]).outputs
    noise = [WorkItem(f"n{i}", [10 + i] * (3 + i), SamplingParams(temperature=0.9, max_tokens=12), i)
             for i in range(4)]
    items = noise + [WorkItem("s", [4, 5, 6], sp, arrive_step=2)]
    for a in (False, True):
        res = run_workload(engine(tiny_llama, a, max_num_batched_tokens=8), items).outputs
        assert_same({"s": alone["s"]}, {"s": res["s"]}, [items[-1]])


def test_front_end_imports_no_grammar_library_and_no_torch():
    """API-server processes must not import torch (xgrammar and llguidance both do): the
    structured-output package and the modules the front end loads import them lazily."""
    import subprocess
    import sys

    code = ("import sys, tandem.structured_output, tandem.engine.engine_core, tandem.engine.async_llm, "
            "tandem.entrypoints.openai.api_server; "
            "print([m for m in ('torch', 'xgrammar', 'llguidance') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- gated sampling (the default for a worker in the engine's process) ---------------------------
def record_gated_jobs(e: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The gated fill thread's jobs as they start: ("fill", sequence number of the bitmask)
    and ("accept", step id); the fill of step S carries S's number, kept in ``seq_of``."""
    from tandem.structured_output.gated import GatedFills

    jobs: list[tuple[str, int]] = []
    fill, accept = GatedFills._fill, GatedFills._accept

    def spy_fill(self, seq, grammars, bitmask, fut):
        jobs.append(("fill", seq))
        return fill(self, seq, grammars, bitmask, fut)

    def spy_accept(self, req_ids, grammars, output, fut):
        out = output.result()
        jobs.append(("accept", out.step_id))
        return accept(self, req_ids, grammars, output, fut)

    monkeypatch.setattr(GatedFills, "_fill", spy_fill)
    monkeypatch.setattr(GatedFills, "_accept", spy_accept)
    return jobs


@pytest.mark.parametrize("background", [False, True])
def test_a_gated_step_is_one_call_and_its_fill_follows_every_earlier_accept(tiny_llama, monkeypatch, background):
    """Async, gated: a constrained step is one ``execute_model`` call (no ``sample_tokens``);
    on the fill thread (or inline) each step's fill comes after the accepts of every step
    launched before it and before its own accept, so a bitmask is always filled from
    matchers that hold every token before its step; tokens equal sync."""
    items = [WorkItem(f"c{i}", [5 + i, 6, 7], constrained(6 + 3 * i), arrive_step=i) for i in range(4)]
    items += [WorkItem(f"u{i}", [8, 9, i + 3], SamplingParams(temperature=0.8, seed=40 + i, max_tokens=4 + 5 * i),
                       arrive_step=i) for i in range(3)]
    expected = run_workload(engine(tiny_llama, False, max_num_batched_tokens=12), items).outputs
    e = engine(tiny_llama, True, max_num_batched_tokens=12)
    assert e.core.gated_sampling
    e.core.structured.set_gated_background(background)
    steps: dict[int, int] = {}  # fill sequence number -> step id
    calls = record_calls(monkeypatch, e.core.executor, {
        "execute_model": lambda so: ("launch", so.step_id, so.grammar is not None),
        "sample_tokens": lambda grammar: ("sample", grammar.step_id, False)})
    open_step = e.core.structured.gated.open_step

    def spy_open(step_id, req_ids, grammars):
        out, fut = open_step(step_id, req_ids, grammars)
        steps[out.gate.seq] = step_id
        return out, fut

    monkeypatch.setattr(e.core.structured.gated, "open_step", spy_open)
    jobs = record_gated_jobs(e, monkeypatch)
    got = run_workload(e, items).outputs
    assert_same(expected, got, items)
    assert not [c for c in calls if c[0] == "sample"] and any(gated for _, _, gated in calls)
    order = [(kind, steps[n] if kind == "fill" else n) for kind, n in jobs]
    gated_steps = sorted(steps.values())
    assert [s for kind, s in order if kind == "fill"] == gated_steps  # in launch order
    for k, (kind, sid) in enumerate(order):
        if kind == "fill":
            accepted_before = {s for kk, s in order[:k] if kk == "accept"}
            assert accepted_before == {s for s in gated_steps if s < sid}, (sid, order[:k + 2])
            assert ("accept", sid) in order[k + 1:]
    assert e.core.stats.num_gated == len(gated_steps) and e.core.stats.num_sampling_deferred == 0
    e.shutdown()


def test_a_slow_fill_holds_the_cpu_worker_at_the_gate_and_tokens_equal_sync(tiny_llama, monkeypatch):
    """Fills on the thread that take longer than the forward: the CPU worker waits at the
    gate before it samples (it never reads a half-filled bitmask), and tokens equal sync."""
    import time

    from tandem.structured_output.gated import GatedFills

    items = [WorkItem(f"c{i}", [5 + i, 6, 7], constrained(8), arrive_step=i) for i in range(3)]
    items += [WorkItem("u", [8, 9], SamplingParams(temperature=0, max_tokens=10))]
    expected = run_workload(engine(tiny_llama, False), items).outputs
    e = engine(tiny_llama, True)
    e.core.structured.set_gated_background(True)
    fill = GatedFills._fill
    waited = []
    wait_filled = GatedFills.wait_filled

    def slow_fill(self, *args):
        time.sleep(0.02)
        return fill(self, *args)

    def spy_wait(self, seq):
        waited.append(int(self.flag[0]) < seq)
        return wait_filled(self, seq)

    monkeypatch.setattr(GatedFills, "_fill", slow_fill)
    monkeypatch.setattr(GatedFills, "wait_filled", spy_wait)
    got = run_workload(e, items).outputs
    assert_same(expected, got, items)
    assert any(waited), "the worker never had to wait for a fill"
    e.shutdown()


@pytest.mark.parametrize("mode", ["gated", "split"])
@pytest.mark.parametrize("a", [False, True])
def test_a_refused_token_ends_its_request_with_the_grammars_reason(tiny_llama, mode, a):
    """A complete answer whose stop token min_tokens forbids leaves the masked sampler no
    allowed token: the token it picks is refused, and the request ends with the grammar's
    reason as its own fault (worked out on the gated fill thread, where the matcher lives);
    the other requests go on."""
    e = engine(tiny_llama, a, structured_outputs_sampling=mode)
    if mode == "gated":
        e.core.structured.set_gated_background(True)
    e.add_request("c", [5, 6, 7], constrained(8, so=StructuredOutputsParams(choice=["t7"]), min_tokens=4))
    e.add_request("u", [8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    done = {}
    for _ in range(200):
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
        if not e.has_unfinished_requests():
            break
    c = done["c"]
    assert c.outputs[0].finish_reason == "error" and c.error_kind == INVALID_REQUEST
    assert "only the stop token may follow, but min_tokens forbids it" in c.error
    assert c.outputs[0].token_ids == [7]
    assert len(done["u"].outputs[0].token_ids) == 6 and done["u"].error is None
    e.shutdown()


@pytest.mark.parametrize("background", [False, True])
def test_a_failing_gated_fill_fails_its_step_and_the_engine_goes_on(tiny_llama, monkeypatch, background):
    """A fill that raises still opens its gate (the worker never waits for ever), fails its
    step's requests with the error, and the engine serves the next requests as before."""
    from tandem.structured_output.gated import GatedFills

    e = engine(tiny_llama, True)
    e.core.structured.set_gated_background(background)
    fill = GatedFills._fill
    calls = [0]

    def failing(self, seq, grammars, bitmask, fut):
        calls[0] += 1
        if calls[0] == 3:
            grammars = [None]  # the fill itself raises (no grammar state)
        return fill(self, seq, grammars, bitmask, fut)

    monkeypatch.setattr(GatedFills, "_fill", failing)
    items = [WorkItem("c", [5, 6, 7], constrained(10)), WorkItem("u", [8, 9], SamplingParams(temperature=0,
                                                                                          max_tokens=10))]
    res = run_workload(e, items)
    assert res.outputs["c"].outputs[0].finish_reason == "error" and "NoneType" in (res.outputs["c"].error or "")
    assert e.core.stats.num_errors == 1
    monkeypatch.setattr(GatedFills, "_fill", fill)
    again = run_workload(e, [WorkItem("c2", [5, 6, 7], constrained(6))])
    c2 = again.outputs["c2"]
    assert c2.error is None and re.fullmatch(PATTERN, tiny_text(c2.outputs[0].token_ids))
    kv = e.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    e.shutdown()


def test_gated_sampling_needs_an_in_process_worker_and_no_speculation(tiny_llama):
    """Asked for where it cannot run (a worker in another process), gated sampling is a clear
    error; auto falls back to split steps there."""
    with pytest.raises(ValueError, match="structured_outputs_sampling='gated' needs the worker in the engine"):
        engine(tiny_llama, True, structured_outputs_sampling="gated",
               speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    e = engine(tiny_llama, True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not e.core.gated_sampling
    e.shutdown()
