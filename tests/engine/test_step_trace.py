"""``TANDEM_STEP_TRACE``: the engine core's per-step timeline (``tandem.step_trace``)."""
from __future__ import annotations

import json

import pytest

from engine_harness import WorkItem, run_workload
from tandem import step_trace
from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.timeout(120)


def test_the_trace_spans_every_step_and_the_fill_threads_jobs(tiny_llama, tmp_path, monkeypatch):
    """Async, gated, the fills and accepts on their thread: each launched step has its
    schedule, launch (the model runner's prepare, forward and sample inside it, and a gated
    step's open and queue_accept around them), wait for its ids, accept and update on the
    engine thread, in that order, and each constrained step its fill and accept spans on the
    fill thread; the file is written at shutdown."""
    monkeypatch.setattr(step_trace, "TRACE", step_trace.StepTrace(str(tmp_path / "trace")))
    e = LLMEngine(EngineConfig(model=tiny_llama, async_scheduling=True, block_size=4, num_kv_blocks=128))
    e.core.structured.set_gated_background(True)
    so = StructuredOutputsParams(regex="(t2[0-9]?)+")
    items = [WorkItem("c", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, structured_outputs=so)),
             WorkItem("u", [8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
    run_workload(e, items)
    launched = e.core.stats.num_launched
    gated = e.core.stats.num_gated
    e.shutdown()
    files = list(tmp_path.glob("trace.*.jsonl"))
    assert len(files) == 1
    events = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [ns for ns, *_ in events] == sorted(ns for ns, *_ in events)
    for thread in {ev[4] for ev in events}:  # each thread's CPU time and switch counts never go back
        mine = [ev[1:4] for ev in events if ev[4] == thread]
        for k in range(3):
            assert [c[k] for c in mine] == sorted(c[k] for c in mine)
    engine_thread = [(phase, edge, step) for *_, thread, phase, edge, step in events if thread == "MainThread"]
    steps = sorted({step for phase, _, step in engine_thread if phase == "launch"})
    assert len(steps) == launched
    for s in steps:
        seq = [(phase, edge) for phase, edge, step in engine_thread if step == s]
        assert seq[:2] == [("schedule", "e"), ("launch", "b")]
        end = seq.index(("launch", "e"))
        runner = [(p, e) for p in ("prepare", "forward", "sample") for e in ("b", "e")]
        assert seq[2:end] in (runner, [("open", "b"), ("open", "e"), *runner, ("queue_accept", "b"),
                                       ("queue_accept", "e")])
        assert seq[end + 1:] in ([("wait_output", "b"), ("wait_output", "e"), ("update", "e")],
                           [("wait_output", "b"), ("wait_output", "e"), ("wait_accept", "e"), ("update", "e")])
    fill_thread = [(phase, edge, step) for *_, thread, phase, edge, step in events if thread == "tandem-gated-fill"]
    for phase in ("fill", "accept"):
        spans = [(edge, step) for p, edge, step in fill_thread if p == phase]
        assert len(spans) == 2 * gated and gated > 0
        assert spans == [(edge, step) for _, step in spans[::2] for edge in ("b", "e")]
    assert step_trace.TRACE is not None and not step_trace.TRACE.events


def test_a_trace_never_written_stops_growing(monkeypatch, tmp_path):
    """A process that never writes its trace (a multiprocess executor's worker marks its
    launches too) keeps at most ``MAX_EVENTS`` marks."""
    monkeypatch.setattr(step_trace, "MAX_EVENTS", 3)
    trace = step_trace.StepTrace(str(tmp_path / "trace"))
    for k in range(5):
        trace.mark("launch", "b", k)
    assert [ev[7] for ev in trace.events] == [0, 1, 2]


def test_the_summary_measures_end_only_phases_and_drops_unopened_spans():
    """``step_trace_summary.spans``: ``update`` runs from the step's previous mark on its
    thread; a "sample" end whose beginning never came (its launch raised) is no span."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "step_trace_summary.py"
    spec = importlib.util.spec_from_file_location("step_trace_summary", path)
    assert spec is not None and spec.loader is not None
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    ms = 1_000_000
    events = [[0, 0, 0, 0, "T", "prepare", "b", 7], [1 * ms, 1000, 0, 0, "T", "prepare", "e", 7],
              [3 * ms, 3000, 0, 0, "T", "sample", "e", 7],
              [4 * ms, 3000, 1, 0, "T", "wait_output", "b", 7], [6 * ms, 3000, 1, 0, "T", "wait_output", "e", 7],
              [9 * ms, 6000, 1, 0, "T", "update", "e", 7]]
    got = summary.spans(events)
    assert got[("T", "prepare")] == [(1.0, 1.0, 0, 0)]
    assert ("T", "sample") not in got
    assert got[("T", "update")] == [(3.0, 3.0, 0, 0)]
