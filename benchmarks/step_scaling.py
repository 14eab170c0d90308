"""Cost of one decode step vs batch size: tandem and HF transformers, same prompts, one process.

For each batch size B, B prompts (windows of tokenized text, ``--prompt-len`` tokens) are
run twice per system: with ``max_tokens=1`` (prefill + first token) and with
``max_tokens=1+--decode-steps``; the difference divided by ``--decode-steps`` is the wall
time of one decode step at batch B (greedy, ignore EOS; tandem with async scheduling, its
default). Rounds are interleaved (system order rotated), medians reported. This says how
far from "a step costs the same at any batch" the machine is, which bounds what continuous
batching can gain over a padded batch.

    python benchmarks/step_scaling.py --batch-sizes 1,4,8,16,32 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--batch-sizes", default="1,4,8,16,32")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from transformers import AutoTokenizer

    from offline_throughput import HFRunner
    from tandem import LLM, SamplingParams

    device = bc.resolved_device(a.device)
    dtype = bc.torch_dtype(a.dtype, device)
    folder = bc.resolve_folder(a.model)
    tok = AutoTokenizer.from_pretrained(folder)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    wl = bc.build_workload(tok, max(sizes), (a.prompt_len, a.prompt_len), (1, 1), a.seed)
    info = bc.machine_info()
    print(f"# step scaling  {info['date']}  device={device} dtype={dtype} threads={info['torch_threads']} "
          f"cpus={info['cpu_count']} tandem@{info['tandem_commit']}", flush=True)
    llm = LLM(model=a.model, device=device, dtype=a.dtype, enable_prefix_caching=False,
              max_num_seqs=max(64, max(sizes)))
    hf = HFRunner(folder, device, dtype, tok.eos_token_id if tok.eos_token_id is not None else 0)
    n_long = 1 + a.decode_steps

    def tandem(prompts: list[list[int]], n: int) -> None:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    def hf_batched(prompts: list[list[int]], n: int) -> None:
        hf.generate_batch(prompts, n)

    systems = {"tandem": tandem, "hf-batched": hf_batched}
    for fn in systems.values():  # warm-up
        fn(wl.prompts[:2], 4)
    raw: dict[str, dict[int, list[float]]] = {s: {b: [] for b in sizes} for s in systems}
    names = list(systems)
    for r in range(a.rounds):
        order = names[r % 2:] + names[:r % 2]
        for b in sizes:
            prompts = wl.prompts[:b]
            for name in order:
                fn = systems[name]
                walls = {}
                for n in (1, n_long):
                    bc.sync_device(device)
                    t0 = time.perf_counter()
                    fn(prompts, n)
                    bc.sync_device(device)
                    walls[n] = time.perf_counter() - t0
                step = (walls[n_long] - walls[1]) / a.decode_steps
                raw[name][b].append(step)
                print(f"round {r + 1}/{a.rounds} B={b:3d} {name:>10}: {1e3 * step:7.1f} ms/decode step "
                      f"(prefill+1: {walls[1]:.2f} s)", flush=True)
    llm.shutdown()
    rows = []
    med = {s: {b: bc.median(raw[s][b]) for b in sizes} for s in systems}
    for b in sizes:
        t, h = med["tandem"][b], med["hf-batched"][b]
        rows.append([b, 1e3 * t, 1e3 * t / b, t / med["tandem"][sizes[0]], 1e3 * h, 1e3 * h / b, h / t])
    print()
    print(bc.markdown_table(["batch", "tandem ms/step", "tandem ms/token", f"tandem step vs B={sizes[0]}",
                             "HF ms/step", "HF ms/token", "HF / tandem"], rows))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": vars(a), "machine": info, "raw": raw, "median_s_per_step": med}, f, indent=1,
                      default=str)
        print(f"wrote {a.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
