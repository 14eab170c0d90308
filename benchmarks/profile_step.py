"""Where a decode step's time goes on the GPU machine: host (cProfile of the engine loop)
and device (torch.profiler kernel table), for batch 256 and batch 1 on a random model.

    python benchmarks/profile_step.py --shape qwen2.5-0.5b
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import SHAPES, build_model, prompts_of, tandem_llm  # noqa: E402


def profile(llm, prompts, max_tokens: int, skip: int, steps: int, label: str) -> None:
    from tandem import SamplingParams

    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{label}{i}", p, sp)
    for _ in range(skip):
        engine.step(final_only=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        engine.step(final_only=True)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"==== host profile, {label}: {steps} steps\n" + s.getvalue()[-6000:])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step(final_only=True)
        torch.cuda.synchronize()
    print(f"==== device kernels, {label}: 10 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    while engine.has_unfinished_requests():
        engine.step(final_only=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    a = ap.parse_args()
    shape = SHAPES[a.shape]
    folder = build_model(tempfile.mkdtemp(), shape)
    llm = tandem_llm(folder)
    from tandem import SamplingParams

    llm.generate(prompts_of(16, 128, shape["vocab_size"], 9), SamplingParams(temperature=0, max_tokens=8),
                 use_tqdm=False)
    profile(llm, prompts_of(256, 128, shape["vocab_size"], 1), 128, skip=40, steps=40, label="b256_")
    profile(llm, prompts_of(1, 128, shape["vocab_size"], 2), 300, skip=20, steps=200, label="b1_")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
