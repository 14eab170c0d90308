"""The engine core's host work per decode step, on the CPU, with a null device (issue 19).

Runs ``LLM.generate`` as a user would (async scheduling on, the default) on the embedded
SmolLM2 config and tokenizer, but with a worker whose "device" returns the next token at
once: no weights, no KV cache memory, no forward pass. Everything else is the engine's own
code: the scheduler, the model runner's state update and staging, the sampled ids written
into (and the next inputs gathered from) the token table, the output copy, the scheduler's
update, the output processor and detokenization. What is left per step is the host time
that, on a GPU, must hide behind the device step.

The null model maps each input token to the next one (a fixed random permutation of the
ordinary vocabulary, so detokenization decodes real text pieces) and hands that id to the
sampler through a one-column "logits" tensor; the null sampler reads it back.

    python benchmarks/host_step.py                 # --batch-size 256, 128/128 tokens
    python benchmarks/host_step.py --profile       # where the time goes (cProfile)
    TANDEM_STEP_TRACE=/tmp/t python benchmarks/host_step.py --structured-ratio 1 --gated-thread [--fake-grammar]
    python benchmarks/step_trace_summary.py /tmp/t.*.jsonl    # each phase's wall and CPU time

Steady decode: the step calls that launched a full decode batch (one token for every
request), after ``--warmup`` of them; prefill and the drain at the end are left out. The
last line is ``host step: X ms``: the median steady step of a run (robust to a busy
neighbour on a shared machine), the median over ``--repeat`` runs. Each run also prints the
mean step and the time of the calls left out (prefill, the final step that finishes every
request), so work moved out of the steady steps stays visible. "CPU" is this thread's CPU
time (``time.thread_time``): a neighbour that takes the core away inflates the wall time
of a step, not its CPU time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import statistics
import sys
import time
from typing import Any, Optional

import torch

# Run as a script, this module is ``__main__``; the engine imports the worker class by its
# dotted path, so it must be importable by name from the benchmarks folder.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tandem.config import EngineConfig, ModelConfig  # noqa: E402
from tandem.distributed import init_tensor_parallel  # noqa: E402
from tandem.layers.sampler import SamplerOutput, SamplingMetadata  # noqa: E402
from tandem.worker.model_runner import ModelRunner  # noqa: E402
from tandem.worker.worker import Worker  # noqa: E402

# Next tokens are drawn from ordinary (non-special) ids of the SmolLM2 vocabulary.
_FIRST_ID = 1000
_SPAN = 30000


class NullModel(torch.nn.Module):
    """No forward pass: the "hidden state" of a token is already its successor's id, from a
    fixed random permutation of the ordinary ids (one gather: the null device's whole step)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        nxt = torch.arange(vocab_size, dtype=torch.int64)
        perm = torch.randperm(_SPAN, generator=torch.Generator().manual_seed(0)) + _FIRST_ID
        nxt[_FIRST_ID:_FIRST_ID + _SPAN] = perm
        nxt[:_FIRST_ID] = perm[:_FIRST_ID]  # specials and bytes lead back into ordinary ids
        nxt[_FIRST_ID + _SPAN:] = perm[: vocab_size - _FIRST_ID - _SPAN]
        self.next_id = nxt

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.next_id[input_ids].unsqueeze(1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def null_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: Optional[list[int]] = None) -> None:
    """The null device's masking (``--structured-ratio``): a row whose id the grammar refuses
    takes the lowest id it allows (the "logits" are the ids themselves, one column)."""
    ids = logits[:, 0]
    rows = torch.arange(ids.numel()) if indices is None else torch.as_tensor(indices, dtype=torch.int64)
    words = bitmask[rows, ids[rows] >> 5]
    bad = rows[(words >> (ids[rows] & 31)) & 1 == 0]
    if bad.numel():
        sub = bitmask[bad]
        w = (sub != 0).to(torch.int32).argmax(1)
        x = sub[torch.arange(bad.numel()), w].to(torch.int64) & 0xFFFFFFFF
        ids[bad] = w * 32 + torch.log2((x & -x).to(torch.float64)).to(torch.int64)


class NullSampler(torch.nn.Module):
    """Reads the id the null model put in its one-column "logits" (greedy, no logprobs)."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return SamplerOutput(sampled_token_ids=logits[:, 0], logprobs=None)


class NullWorker(Worker):
    """A worker on a null device: the real ``ModelRunner`` around a model that does nothing."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, rank: int = 0,
                 distributed_init_method: Optional[str] = None, local_rank: Optional[int] = None) -> None:
        self.config = config
        self.model_config = model_config
        self.rank = rank
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        init_tensor_parallel(rank, 1, None, self.device)
        self.model = NullModel(model_config.vocab_size)  # type: ignore[assignment]
        self.runner = ModelRunner(self.model, model_config.vocab_size, config.block_size, model_config.max_model_len,
                                  model_config.max_num_seqs, model_config.max_num_batched_tokens, self.device,
                                  self.dtype)
        self.runner.sampler = NullSampler()  # type: ignore[assignment]

    def init_kv_cache(self, num_blocks: int) -> None:
        """No KV memory on a null device (the block ids still flow through staging)."""
        self.runner.init_kv_cache(num_blocks, 0, 1, 1)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(_FIRST_ID, _FIRST_ID + _SPAN) for _ in range(length)] for _ in range(n)]


class StepTimer:
    """Wraps ``LLMEngine.step``: each call's wall time and the tokens it scheduled."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inner = engine.step
        self.calls: list[tuple[float, int]] = []  # (seconds, tokens scheduled by the call)
        self.cpu: list[float] = []  # this thread's CPU seconds in each call
        self.profiler: Optional[cProfile.Profile] = None
        self.profile_after = 0
        self.profile_steps = 0
        engine.step = self

    def __call__(self, final_only: bool = False) -> Any:
        stats = self.engine.core.scheduler.stats
        before = stats.num_scheduled_tokens
        prof = self.profiler if self.profile_after <= len(self.calls) < self.profile_after + self.profile_steps \
            else None
        c0 = time.thread_time()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        out = self.inner(final_only)
        if prof is not None:
            prof.disable()
        self.calls.append((time.perf_counter() - t0, stats.num_scheduled_tokens - before))
        self.cpu.append(time.thread_time() - c0)
        return out

    def steady(self, batch_size: int, warmup: int) -> tuple[list[float], list[float]]:
        """Wall and CPU times of the calls that launched a full decode batch, less the first ``warmup``."""
        keep = [i for i, (_, n) in enumerate(self.calls) if n == batch_size][warmup:]
        return [self.calls[i][0] for i in keep], [self.cpu[i] for i in keep]


def run(args: argparse.Namespace, profile: bool
        ) -> tuple[tuple[list[float], list[float]], float, float, Optional[cProfile.Profile], list[Any]]:
    from tandem import LLM, SamplingParams

    bs = args.batch_size
    blocks_per_req = -(-(args.input_len + args.output_len) // 16) + 1
    llm = LLM(device="cpu", worker_cls=f"{NullWorker.__module__}.NullWorker", max_num_seqs=bs,
              max_num_batched_tokens=max(2048, args.prefill_chunk), num_kv_blocks=bs * blocks_per_req + 16,
              async_scheduling=not args.sync, block_size=16,
              structured_outputs_sampling=args.structured_sampling)
    if args.gated_thread:
        llm.engine.core.structured.set_gated_background(True)
    timer = StepTimer(llm.engine)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    n_constrained = round(args.structured_ratio * bs)
    if n_constrained:  # bench serve's schema: no request can close it within its max_tokens
        from tandem.bench.structured import DEFAULT_SCHEMA
        from tandem.sampling_params import StructuredOutputsParams

        constrained = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                                     structured_outputs=StructuredOutputsParams(json=DEFAULT_SCHEMA))
        # Compile (and build the backend) before the timed call.
        llm.generate(_prompts(1, 8, args.seed + 2), constrained.model_copy(update={"max_tokens": 4}), use_tqdm=False)
        timer.calls.clear()
        timer.cpu.clear()
    # A small first call: lazy imports and first-use costs stay out of the measured one.
    llm.generate(_prompts(4, args.input_len, args.seed + 1), SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    timer.calls.clear()
    timer.cpu.clear()
    if profile:
        timer.profiler = cProfile.Profile()
        timer.profile_after = -1  # set below, once prefill is known to be over
    prompts = _prompts(bs, args.input_len, args.seed)
    if profile:
        # Profile the step calls well inside steady decode: prefill takes a few calls.
        timer.profile_after = -(-bs * args.input_len // max(2048, args.prefill_chunk)) + 2 + args.warmup
        timer.profile_steps = max(1, args.output_len - 2 * timer.profile_after - 4)
    t0 = time.perf_counter()
    params = [sp] * (bs - n_constrained) + ([constrained] * n_constrained if n_constrained else [])
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t0
    llm.shutdown()
    other = sum(t for t, n in timer.calls if n != bs)
    return timer.steady(bs, args.warmup), total, other, timer.profiler, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8, help="steady decode steps left out at the start")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--repeat", type=int, default=1, help="runs; the median run's mean is reported")
    ap.add_argument("--sync", action="store_true", help="async_scheduling=False")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of steady decode steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--structured-ratio", type=float, default=0.0,
                    help="share of requests under bench serve's JSON schema (structured outputs)")
    ap.add_argument("--structured-sampling", choices=["auto", "gated", "split"], default="auto",
                    help="EngineConfig.structured_outputs_sampling (auto: gated here)")
    ap.add_argument("--gated-thread", action="store_true",
                    help="gated fills and accepts on their thread, as on CUDA (the null worker waits for "
                         "each bitmask on the host, so compare the engine thread's CPU time)")
    ap.add_argument("--fake-grammar", action="store_true",
                    help="replace xgrammar's batch fill and accept by their cheapest stand-ins (all tokens "
                         "allowed and accepted): the same engine code, threads and hand-offs without the "
                         "native grammar work")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.structured_ratio:
        import tandem.worker.model_runner as model_runner

        model_runner.apply_token_bitmask = null_apply_token_bitmask  # type: ignore[assignment]
    if args.fake_grammar:
        from fake_grammar.sitecustomize import use_fake_grammar

        use_fake_grammar()

    medians = []
    for r in range(args.repeat):
        (times, cpu), total, other, prof, outs = run(args, profile=args.profile and r == 0)
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        ms = [t * 1e3 for t in times]
        medians.append(statistics.median(ms))
        print(f"run {r}: {len(ms)} steady decode steps, median {medians[-1]:.3f} ms (CPU "
              f"{statistics.median(cpu) * 1e3:.3f} ms), mean {statistics.fmean(ms):.3f} ms (CPU "
              f"{statistics.fmean(cpu) * 1e3:.3f} ms), "
              f"p90 {sorted(ms)[int(0.9 * (len(ms) - 1))]:.3f} ms; generate {total * 1e3:.0f} ms, of which "
              f"{other * 1e3:.0f} ms in prefill and final calls; text of request 0: {outs[0].outputs[0].text[:30]!r}")
        if prof is not None:
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(40)
            print(s.getvalue())
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    print(f"host step: {statistics.median(medians):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
