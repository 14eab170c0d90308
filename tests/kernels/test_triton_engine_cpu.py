"""The whole Triton path of the engine (paged attention, KV writes, fused norm/rotary/SiLU,
the kernel warm-up) on the CPU under the Triton interpreter: greedy tokens equal the SDPA
backend's in fp32. CUDA graphs need a GPU and are covered by tests/gpu."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tandem import LLM, SamplingParams  # noqa: E402


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_matches_sdpa_and_warms_up(tiny_factory, arch, monkeypatch):
    """Also covers rotary fused into the KV write (Qwen3: with its per-head q/k norms in the
    same kernel), split-KV counts that follow the context, and the fused GEMV path of
    batches of up to 8 tokens (every decode step here; by default only batch 1 takes it),
    whose QKV launch also rotates and caches k/v where there are no per-head norms."""
    from tandem.kernels import fused, gemv

    tiny_model = tiny_factory(arch)

    if not torch.cuda.is_available() and type(fused._rms_norm_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")
    prompts = [[5, 9, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7]]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, dtype="float32",
              enforce_eager=True)
    with LLM(tiny_model, attention_backend="sdpa", **kw) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setenv("TANDEM_GEMV_MAX_ROWS", "8")
    with LLM(tiny_model, attention_backend="triton", **kw) as llm:
        runner = llm.engine.core.executor.worker.runner
        assert runner.backend == "triton"
        # Scale split-KV down to these contexts (a GPU of 64 SMs, 7-key chunks) so decode
        # steps pick one split at short contexts and more as they grow, as on a GPU.
        runner.num_sms, runner.min_split_tokens = 64, 7
        picked: list[int] = []
        pick = runner._decode_splits

        def spy(num_seqs: int, max_seq_len: int) -> int:
            picked.append(pick(num_seqs, max_seq_len))
            return picked[-1]

        runner._decode_splits = spy
        runner.warmup_kernels()  # on CUDA this runs at start-up; here it must at least run
        picked.clear()
        launches = []
        fused_write = fused.rotary_write_kv_cache_
        monkey = pytest.MonkeyPatch()

        def fused_spy(*args, qk_norm=None):
            launches.append(qk_norm is not None)
            return fused_write(*args, qk_norm=qk_norm)

        monkey.setattr(fused, "rotary_write_kv_cache_", fused_spy)
        gemv_rows: list[int] = []
        rope_rows: list[int] = []
        gemv_call = gemv.gemv

        def gemv_spy(x, *args, **kw):
            gemv_rows.append(x.shape[0])
            if kw.get("rope") is not None:
                rope_rows.append(x.shape[0])
            return gemv_call(x, *args, **kw)

        monkey.setattr(gemv, "gemv", gemv_spy)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        finally:
            monkey.undo()
    assert got == want
    assert launches, "rotary was not fused into the KV write"
    assert all(launches) == (arch == "qwen3"), "Qwen3's q/k norms belong in the same kernel"
    assert 1 in picked and max(picked) > 1, f"split counts picked: {picked}"
    assert gemv_rows and max(gemv_rows) <= gemv.MAX_ROWS, "small batches did not take the fused GEMV path"
    # Small batches rotate and cache k/v in the QKV launch, except under Qwen3's q/k norms.
    assert bool(rope_rows) == (arch != "qwen3"), f"QKV launches with rotary: {rope_rows}"


class _EagerGraph:
    """Stands in for a captured mixed-batch graph on the CPU: ``replay`` runs the body again
    on the capture's staging segments and writes into the captured outputs, as a replay
    would."""

    def __init__(self, body, segs, outputs) -> None:
        self.body, self.segs, self.outputs = body, segs, outputs
        self.replays = 0

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.body(self.segs)):
            out.copy_(new)
        self.replays += 1

    def pool(self) -> None:
        return None


def _capture_eagerly(runner) -> list[_EagerGraph]:
    """Make ``runner`` "capture" its graphs as ``_EagerGraph``s (its staging segments read as
    a capture would stage them); returns the list they are added to, in capture order."""
    graphs: list[_EagerGraph] = []

    def capture(size, q, body, pool):
        segs = runner._capture_batch(size, q)
        graph = _EagerGraph(body, segs, body(segs))
        graphs.append(graph)
        return graph, graph.outputs

    runner._capture = capture
    return graphs


@pytest.mark.timeout(600)
def test_mixed_batches_through_the_mixed_graph_path_match_sdpa(tiny_factory):
    """The mixed-batch graph path without the graph (CUDA only; tests/gpu captures it): each
    step with prefill tokens is padded to a token bucket over every sequence slot, attention
    takes the bucket as every query length's bound and no host metadata, and only the
    real rows are read back. Chunked prompts beside decodes, greedy fp32: the tokens equal
    the SDPA backend's, and the padded path ran."""
    from tandem.config.model import EnvSwitches

    assert EnvSwitches.from_environ({}).mixed_graph_max_tokens == 0  # off: served on a GPU it gave no gain
    assert EnvSwitches.from_environ({"TANDEM_MIXED_GRAPH_MAX_TOKENS": "512"}).mixed_graph_max_tokens == 512
    tiny_model = tiny_factory("llama")
    if not torch.cuda.is_available():
        from tandem.kernels import attention
        if type(attention._paged_attn_kernel).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")
    prompts = [[5, 9, 17, 33, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7], [60, 61, 62]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, dtype="float32",
              enforce_eager=True)
    with LLM(tiny_model, attention_backend="sdpa", **kw) as ref:
        want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
    with LLM(tiny_model, attention_backend="triton", **kw) as llm:
        runner = llm.engine.core.executor.worker.runner
        graphs = _capture_eagerly(runner)
        runner.graph_sizes = [4]  # the sequence slots of a mixed graph: the largest decode bucket
        runner.mixed_graph_sizes = [8, 16]
        runner._capture_mixed_graphs(None)
        assert sorted(runner.mixed_graphs) == [8, 16]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert runner.stats_mixed_graph_steps > 0 and sum(g.replays for g in graphs) == runner.stats_mixed_graph_steps
    assert got == want


@pytest.mark.timeout(600)
def test_gated_decode_steps_through_the_gated_graph_path_match_eager_masking(tiny_factory, monkeypatch):
    """The gated decode graph path (``TANDEM_GATED_GRAPHS=1``) without the graph (CUDA
    only; tests/gpu captures it): each gated greedy decode step replays, on the capture's
    staging segments, the forward, the wait on the staged flag, the mask read at the staged
    bitmask address by ``mask_rows`` and the argmax, with this step's values written where
    the capture read them. Constrained requests (regexes, a choice) beside free ones, async
    and sync: the tokens equal the eager masked path's (the switch off), the constrained
    ones follow their patterns, and the gated path ran."""
    import re
    from functools import partial

    from tandem.sampling_params import StructuredOutputsParams

    tiny_model = tiny_factory("llama")
    if not torch.cuda.is_available():
        from tandem.kernels import bitmask
        if type(bitmask._apply_host_bitmask_kernel).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")
    patterns = [r"(t2[0-9]?|t3[0-9]?)+", None, r"t4(t5[0-9]?)*t6", None, r"(t7[0-9]?t8[0-9]?){1,3}"]
    prompts = [[5, 9, 17, 33, 2], [40, 41, 42, 43, 44, 45], [7], [60, 61, 62], [11, 12, 13, 14]]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=p is None,
                             structured_outputs=StructuredOutputsParams(regex=p) if p else None) for p in patterns]
    params.append(SamplingParams(temperature=0, max_tokens=8,
                                 structured_outputs=StructuredOutputsParams(choice=["t2t3", "t4t5t6", "t7"])))
    prompts.append([20, 21])
    kw = dict(block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, dtype="float32",
              enforce_eager=True, attention_backend="triton", structured_outputs_sampling="gated")
    got: dict[bool, list[list[int]]] = {}
    for async_scheduling in (True, False):
        monkeypatch.delenv("TANDEM_GATED_GRAPHS", raising=False)
        with LLM(tiny_model, async_scheduling=async_scheduling, **kw) as ref:
            want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
        monkeypatch.setenv("TANDEM_GATED_GRAPHS", "1")
        with LLM(tiny_model, async_scheduling=async_scheduling, **kw) as llm:
            runner = llm.engine.core.executor.worker.runner
            assert runner.use_gated_graphs and llm.engine.core.gated_sampling
            graphs = _capture_eagerly(runner)
            runner.graph_sizes = [4]
            for splits in runner._split_variants(4):
                runner.graphs[(4, splits)] = runner._capture(4, 1, partial(runner._graph_body, num_kv_splits=splits),
                                                             None)
            decode_graphs = len(graphs)
            runner._capture_gated_graphs(None)
            assert sorted(runner.gated_graphs) == sorted(runner.graphs)
            got[async_scheduling] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            gated_replays = sum(g.replays for g in graphs[decode_graphs:])
            assert runner.stats_gated_graph_steps == gated_replays > 0
        assert got[async_scheduling] == want, f"async={async_scheduling}"
    assert got[True] == got[False]
    for toks, p in zip(got[True], patterns):
        if p is not None and toks and toks[-1] == 1:  # ended by EOS: the whole pattern
            assert re.fullmatch(p, "".join(f"t{t}" for t in toks[:-1]))
