"""The GPU fast path, on a CUDA device (skipped elsewhere): Triton attention, CUDA graphs,
the lean host step and async == sync.

Models are random (no weights can be downloaded on the device), built from a config with
the LM head sharpened so greedy choices are rarely near-ties; prompts are token ids.
"""
from __future__ import annotations

import random
import traceback

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(900),
]

VOCAB = 2048


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _tokens(llm, prompts, sp) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def _llm(model: str, **kw):
    from tandem import LLM

    base = dict(block_size=16, max_num_seqs=64, max_num_batched_tokens=1024, gpu_memory_utilization=0.3)
    base.update(kw)
    return LLM(model, **base)


def test_fp32_gpu_greedy_equals_the_cpu_path(sharp_model):
    """Triton kernels in IEEE fp32 and CUDA graphs give the CPU's greedy tokens."""
    from tandem import SamplingParams

    prompts = _prompts(12, 3, 200)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with _llm(sharp_model, device="cpu", dtype="float32") as cpu:
        want = _tokens(cpu, prompts, sp)
    with _llm(sharp_model, device="cuda", dtype="float32", attention_backend="triton") as gpu:
        got = _tokens(gpu, prompts, sp)
        runner = gpu.engine.core.executor.worker.runner
        assert runner.graphs and runner.stats_graph_steps > 0, "decode never ran through a CUDA graph"
    assert got == want


def test_mixed_batches_replay_their_graphs_and_equal_eager(sharp_model, monkeypatch):
    """Prompts arriving while others decode make steps with prefill tokens: with mixed-batch
    graphs those up to the largest token bucket replay a graph; fp32 greedy tokens equal
    the run with every such step eager (``TANDEM_MIXED_GRAPH_MAX_TOKENS=0``), async and sync."""
    from tandem import SamplingParams

    prompts = _prompts(48, 3, 150, seed=11)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    monkeypatch.setenv("TANDEM_MIXED_GRAPH_MAX_TOKENS", "0")
    with _llm(sharp_model, dtype="float32", max_num_batched_tokens=512) as eager:
        want = _tokens(eager, prompts, sp)
        assert not eager.engine.core.executor.worker.runner.mixed_graphs
    monkeypatch.setenv("TANDEM_MIXED_GRAPH_MAX_TOKENS", "512")
    for a in (True, False):
        with _llm(sharp_model, dtype="float32", max_num_batched_tokens=512, async_scheduling=a) as llm:
            runner = llm.engine.core.executor.worker.runner
            assert max(runner.mixed_graphs) == 512
            got = _tokens(llm, prompts, sp)
            assert runner.stats_mixed_graph_steps > 0
        assert got == want


@pytest.mark.parametrize("fused_merge", [False, True])
def test_split_counts_follow_the_context_graphs_equal_eager(sharp_model, monkeypatch, fused_merge):
    """Decode picks its split-KV count from the batch's longest context and replays the graph
    captured for (bucket, count). Chunks of 16 keys make a short prompt's decode cross
    1, 2 and 4 splits (short contexts take one split, no merge kernel) and long ones take
    16; in fp32 the graphs, an eager Triton run and the CPU path all give the same greedy
    tokens, batched and at batch 1, with the merge kernel and with the fused merge."""
    from tandem import SamplingParams

    monkeypatch.setattr("tandem.worker.model_runner.MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr("tandem.kernels.attention.FUSED_MERGE", fused_merge)
    prompts = _prompts(12, 3, 300, seed=4)
    long_alone, short_alone = _prompts(1, 290, 300, seed=5), _prompts(1, 5, 5, seed=6)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    def run(llm) -> tuple[list[list[int]], ...]:
        return _tokens(llm, prompts, sp), _tokens(llm, long_alone, sp), _tokens(llm, short_alone, sp)

    with _llm(sharp_model, device="cpu", dtype="float32") as cpu:
        want = run(cpu)
    for eager in (True, False):
        with _llm(sharp_model, dtype="float32", attention_backend="triton", enforce_eager=eager) as llm:
            runner = llm.engine.core.executor.worker.runner
            assert runner.min_split_tokens == 16
            seen: list[int] = []
            pick = runner._decode_splits

            def spy(num_seqs: int, max_seq_len: int, pick=pick, seen=seen) -> int:
                seen.append(pick(num_seqs, max_seq_len))
                return seen[-1]

            runner._decode_splits = spy
            got = run(llm)
            if not eager:
                assert len({k[1] for k in runner.graphs}) > 1, f"one split count captured: {list(runner.graphs)}"
                assert runner.stats_graph_steps > 0, "decode never ran through a CUDA graph"
        assert {1, 2, 4, 16} <= set(seen), sorted(set(seen))
        assert got == want, f"eager={eager}"


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_bf16_triton_matches_sdpa_on_most_prompts(sharp_model, capsys):
    """Different kernels sum in different orders: bf16 rounding can flip a near-tie, after
    which the two continuations legitimately differ. Most prompts must agree entirely, and
    every first difference must be a near-tie of the reference: the token the Triton path
    chose is in the SDPA path's top 5 there, within 0.5 nats of its choice."""
    from tandem import SamplingParams

    prompts = _prompts(32, 3, 300, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    with _llm(sharp_model, dtype="bfloat16", attention_backend="sdpa", enforce_eager=True) as ref:
        want = ref.generate(prompts, sp, use_tqdm=False)
    with _llm(sharp_model, dtype="bfloat16", attention_backend="triton") as fast:
        got = _tokens(fast, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    same, gaps = 0, []
    for g, w in zip(got, want):
        wt = w.outputs[0].token_ids
        if g == wt:
            same += 1
            continue
        i = _first_divergence(g, wt)
        top = w.outputs[0].logprobs[i]
        assert g[i] in top, f"position {i}: token {g[i]} not in the reference's top 5 {sorted(top)}"
        gaps.append(round(top[wt[i]].logprob - top[g[i]].logprob, 3))
    msg = f"bf16 triton vs sdpa: {same}/{len(prompts)} prompts identical; logprob gaps at first differences {gaps}"
    print(msg)
    assert same > len(prompts) // 2, msg
    assert all(gap <= 0.5 for gap in gaps), msg


def _sync_checked(fn, errors: list[str]):
    """``fn`` run under sync-debug mode "error" (an implicit device->host sync raises); the
    traceback of any failure is kept in ``errors``."""
    def call(arg):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(arg)
        except Exception:
            errors.append(traceback.format_exc())
            raise
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return call


def test_decode_launches_have_no_hidden_synchronization(sharp_model):
    """Every step's launch (staging, graph replay or eager forward, sampling, the async
    copy) runs under sync-debug mode "error": any implicit device->host sync raises."""
    from tandem import SamplingParams

    with _llm(sharp_model, dtype="bfloat16") as llm:
        runner = llm.engine.core.executor.worker.runner
        llm.generate(_prompts(4, 5, 20), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
        errors: list[str] = []
        runner.execute_model = _sync_checked(runner.execute_model, errors)
        prompts = _prompts(24, 5, 120, seed=2)
        params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=24, ignore_eos=True),
                  SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5, max_tokens=24,
                                 min_tokens=4, ignore_eos=True)]
        try:
            outs = llm.generate(prompts, [params[i % 3] for i in range(len(prompts))], use_tqdm=False)
        finally:
            assert not errors, errors[0]
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        assert runner.stats_graph_steps > 0


def _run(model: str, prompts, params, **kw):
    with _llm(model, dtype="bfloat16", **kw) as llm:
        core = llm.engine.core
        toks = _tokens(llm, prompts, params)
        return toks, core.stats.num_launched, core.stats.num_launched_ahead


def test_async_equals_sync_in_bf16_when_finishes_are_predictable(plain_model):
    """The issue's divergence: max_tokens finishes used to change async's batch shapes from
    step 128 on. With finishes known at schedule time both modes run the same batches, so
    even near-tie bf16 tokens agree exactly."""
    from tandem import SamplingParams

    rng = random.Random(3)
    prompts = _prompts(192, 16, 128, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 96), ignore_eos=True) for _ in prompts]
    sync, sync_steps, _ = _run(plain_model, prompts, params, async_scheduling=False)
    asyn, async_steps, ahead = _run(plain_model, prompts, params, async_scheduling=True)
    assert ahead > 0.9 * async_steps
    assert async_steps == sync_steps
    assert asyn == sync


def test_async_vs_sync_with_unpredictable_finishes(sharp_model, capsys):
    """EOS finishes are known only when the token arrives: async has already launched one
    more step with that request in the batch (its extra token is dropped). The guarantee on
    the GPU: every request's tokens equal sync's in fp32; in bf16 a near-tie of another
    request in that one differently shaped step may flip (docs/async-scheduling.md)."""
    from tandem import SamplingParams

    prompts = _prompts(96, 8, 64, seed=4)
    sp = SamplingParams(temperature=0, max_tokens=64)  # EOS (token 1) may come at any step
    for dtype in ("float32", "bfloat16"):
        with _llm(sharp_model, dtype=dtype, async_scheduling=False) as s:
            sync = _tokens(s, prompts, sp)
        with _llm(sharp_model, dtype=dtype, async_scheduling=True) as a:
            asyn = _tokens(a, prompts, sp)
        same = sum(x == y for x, y in zip(sync, asyn))
        eos = sum(len(t) < 64 for t in sync)
        print(f"{dtype}: {same}/{len(prompts)} identical, {eos} finished by EOS")
        if dtype == "float32":
            assert asyn == sync


CONSTRAINED_REGEX = r"(t2[0-9]?|t3[0-9]?)+"


def _constrained_params(n: int) -> list:
    """Every other request constrained (greedy or seeded), the rest free; no EOS finishes
    in the free ones, so async and sync run the same batches."""
    from tandem import SamplingParams
    from tandem.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(regex=CONSTRAINED_REGEX)
    out = []
    for i in range(n):
        if i % 2:
            out.append(SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        else:
            out.append(SamplingParams(temperature=0.0 if i % 4 else 0.9, seed=i, max_tokens=32,
                                      structured_outputs=so))
    return out


@pytest.mark.parametrize("mode", ["gated", "split"])
def test_constrained_decoding_on_the_gpu_async_equals_sync(sharp_model, mode):
    """Constrained steps on CUDA: decode graphs run the forward, the bitmask (pinned, copied
    without a sync) masks the logits. Split: sampling deferred behind the next forward in
    async mode. Gated (the default): the sampling queued with the forward behind a wait on
    the device for the fill thread's flag. fp32: async == sync exactly (the sync engine
    gated either way); every constrained output that ended with EOS matches its regex."""
    import re

    prompts = _prompts(32, 5, 80, seed=5)
    params = _constrained_params(len(prompts))
    with _llm(sharp_model, dtype="float32", async_scheduling=False) as s:
        sync = _tokens(s, prompts, params)
    with _llm(sharp_model, dtype="float32", async_scheduling=True, structured_outputs_sampling=mode) as a:
        asyn = _tokens(a, prompts, params)
        core, runner = a.engine.core, a.engine.core.executor.worker.runner
        assert runner.stats_graph_steps > 0
        if mode == "split":
            assert core.stats.num_sampling_deferred > 0
        else:
            assert core.stats.num_gated == core.stats.num_constrained > 0 and core.structured.gated.background
    assert asyn == sync
    for toks, sp in zip(sync, params):
        if sp.structured_outputs is not None and toks and toks[-1] == 1:
            assert re.fullmatch(CONSTRAINED_REGEX, "".join(f"t{t}" for t in toks[:-1]))


def test_gated_decode_graphs_equal_the_masked_graphs(sharp_model, monkeypatch):
    """``TANDEM_GATED_GRAPHS=1``: a gated greedy decode step runs whole in one graph (its
    wait on the flag, the mask read from the pinned bitmask the fill thread wrote, argmax).
    In fp32 the tokens equal the masked graphs' (the switch off), with every request
    constrained and with half of them, async and sync; most decode steps take the gated
    graph, and its launch hides no sync."""
    from tandem import SamplingParams
    from tandem.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(regex=CONSTRAINED_REGEX)
    prompts = _prompts(40, 5, 80, seed=9)
    every = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, structured_outputs=so)] * len(prompts)
    half = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, structured_outputs=so if i % 2 else None)
            for i in range(len(prompts))]
    results = {}
    for on in ("1", "0"):
        monkeypatch.setenv("TANDEM_GATED_GRAPHS", on)
        for async_scheduling in (True, False):
            with _llm(sharp_model, dtype="float32", async_scheduling=async_scheduling,
                      structured_outputs_sampling="gated") as llm:
                runner = llm.engine.core.executor.worker.runner
                assert bool(runner.gated_graphs) == (on == "1")
                errors: list[str] = []
                execute = runner.execute_model
                runner.execute_model = _sync_checked(execute, errors)
                results[on, async_scheduling] = [_tokens(llm, prompts, every), _tokens(llm, prompts, half)]
                runner.execute_model = execute
                assert not errors, errors[0]
                if on == "1":
                    assert runner.stats_gated_graph_steps > runner.stats_masked_graph_steps
                else:
                    assert runner.stats_gated_graph_steps == 0 < runner.stats_masked_graph_steps
    assert results["1", True] == results["0", True] == results["1", False] == results["0", False]


@pytest.mark.parametrize("mode", ["gated", "split"])
def test_masked_sampling_graphs_equal_eager_masked_sampling(sharp_model, mode):
    """Greedy constrained steps sample through a masked sampling graph (bitmask rows
    scattered by sampled row, mask, argmax, token-table write): a decode step through its
    decode graph's, a mixed prefill step through its bucket's (logits copied in). In fp32
    the tokens equal the eager masked path's (graphs cleared), with every request
    constrained and with half of them, async and sync; and the replay hides no sync."""
    from tandem import SamplingParams
    from tandem.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(regex=CONSTRAINED_REGEX)
    prompts = _prompts(40, 5, 80, seed=8)
    every = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, structured_outputs=so)] * len(prompts)
    half = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, structured_outputs=so if i % 2 else None)
            for i in range(len(prompts))]
    for async_scheduling in (True, False):
        with _llm(sharp_model, dtype="float32", async_scheduling=async_scheduling,
                  structured_outputs_sampling=mode) as llm:
            runner = llm.engine.core.executor.worker.runner
            assert runner.masked_graphs and runner.masked_eager_graphs, "no masked sampling graph was captured"
            errors: list[str] = []
            sample_tokens, masked_eager = runner.sample_tokens, runner._masked_eager
            runner.sample_tokens = _sync_checked(sample_tokens, errors)
            eager_steps: list[int] = []

            def counted(*a):
                out = masked_eager(*a)
                eager_steps.append(out is not None)
                return out

            runner._masked_eager = counted
            graphed = [_tokens(llm, prompts, every), _tokens(llm, prompts, half)]
            assert not errors, errors[0]
            assert runner.stats_masked_graph_steps > sum(eager_steps) > 0  # decode and mixed steps
            runner.sample_tokens, runner._masked_eager = sample_tokens, masked_eager
            runner.masked_graphs.clear()
            runner.masked_eager_graphs.clear()
            steps = runner.stats_masked_graph_steps
            eager = [_tokens(llm, prompts, every), _tokens(llm, prompts, half)]
            assert runner.stats_masked_graph_steps == steps
        assert graphed == eager, f"async={async_scheduling}"


@pytest.mark.parametrize("mode", ["gated", "split"])
def test_constrained_steps_launch_without_hidden_synchronization(sharp_model, mode):
    """Both calls of a split constrained step (forward; bitmask upload, mask, sample), and
    the one call of a gated step, run under sync-debug mode "error"."""
    with _llm(sharp_model, dtype="bfloat16", structured_outputs_sampling=mode) as llm:
        runner = llm.engine.core.executor.worker.runner
        prompts = _prompts(8, 5, 40, seed=6)
        llm.generate(prompts, _constrained_params(len(prompts)), use_tqdm=False)  # warm: imports, Triton
        errors: list[str] = []
        runner.execute_model = _sync_checked(runner.execute_model, errors)
        runner.sample_tokens = _sync_checked(runner.sample_tokens, errors)
        try:
            outs = llm.generate(_prompts(16, 5, 60, seed=7), _constrained_params(16), use_tqdm=False)
        finally:
            assert not errors, errors[0]
        assert all(o.error is None for o in outs)
