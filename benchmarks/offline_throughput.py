"""Offline throughput: tandem (async scheduling) vs HF transformers ``generate``, same prompts.

Workload: ``--num-prompts`` prompts whose input and output lengths are drawn uniformly per
prompt from ``--input-len-range`` / ``--output-len-range`` with a fixed seed, so requests
finish at different times, as in a real offline batch. Prompts are windows of tokenized
text (docstrings of Python's standard library; ``--prompt-source random`` for random ids).
Every system generates greedily and ignores EOS, so each prompt gets exactly its length.

Systems, all in this process, timed in interleaved rounds (order rotated every round):

* ``tandem``: ``LLM.generate`` on all prompts at once, async scheduling on, per-prompt
  ``max_tokens``; continuous batching retires short requests as they finish.
* ``hf-batched``: ``model.generate`` in batches of ``--hf-batch-size`` prompts (default: all
  in one batch), left padding with pad = eos. ``generate`` has one ``max_new_tokens`` per
  batch, so each batch runs to the longest request it holds, and only the tokens each
  prompt asked for are counted as useful (the rest is waste): this is how HF ``generate``
  would serve this workload.
* ``hf-single``: ``model.generate`` one prompt at a time with its own ``max_new_tokens``
  (no padding, no waste, no batching).

Reported: generated (useful) tokens/s, requests/s, wall time (median of the rounds), and the
ratio tandem / baseline. Greedy outputs are also compared with ``hf-single`` (fp32 kernels
differ, so a rare late divergence on a near-tie is possible; the match rate is printed).

    python benchmarks/offline_throughput.py --num-prompts 32 --rounds 3 --json-out out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = bc.script_parser(__doc__)
    ap.add_argument("--hf-batch-size", type=int, default=None,
                    help="prompts per HF generate call (default: all prompts in one batch)")
    ap.add_argument("--skip-hf-single", action="store_true", help="do not run the one-prompt-at-a-time baseline")
    return ap


# -- HF baseline -----------------------------------------------------------------------------
class HFRunner:
    def __init__(self, folder: str, device: str, dtype: Any, pad_id: int) -> None:
        import copy

        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        gc = copy.deepcopy(self.model.generation_config)
        # Greedy, never stop on EOS (same as tandem's ignore_eos): every row runs max_new_tokens.
        gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
        gc.eos_token_id = None
        gc.pad_token_id = pad_id
        gc.use_cache = True
        self.gen_config = gc
        # generate() fills fields left None in the passed config from the model's own
        # generation_config, so EOS has to be cleared there too (otherwise a single prompt stops
        # at EOS and a batch replaces everything after a row's EOS with padding).
        self.model.generation_config.eos_token_id = None
        self.pad_id = pad_id

    def generate_batch(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        torch = self.torch
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        gc = self.gen_config
        gc.max_new_tokens = max_new
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=gc)
        new = out[:, width:].tolist()
        assert all(len(r) == max_new for r in new), "HF stopped early (EOS handling changed?)"
        return new

    def run_batched(self, prompts: list[list[int]], out_lens: list[int], batch_size: int) -> list[list[int]]:
        res: list[list[int]] = []
        for s in range(0, len(prompts), batch_size):
            chunk, lens = prompts[s:s + batch_size], out_lens[s:s + batch_size]
            gen = self.generate_batch(chunk, max(lens))
            res += [g[:n] for g, n in zip(gen, lens)]  # only the requested tokens are useful
        return res

    def run_single(self, prompts: list[list[int]], out_lens: list[int]) -> list[list[int]]:
        return [self.generate_batch([p], n)[0] for p, n in zip(prompts, out_lens)]


def _match(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    exact = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k / max(len(y), 1))
    return {"exact": exact, "of": len(b), "mean_prefix_frac": sum(prefix) / len(prefix)}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    from tandem import LLM, SamplingParams

    device = bc.resolved_device(a.device)
    dtype = bc.torch_dtype(a.dtype, device)
    folder, tok, wl = bc.load_workload(a)
    hf_bs = a.hf_batch_size or len(wl.prompts)
    info = bc.machine_info()
    print(f"# offline throughput  {info['date']}  device={device} dtype={dtype} torch={info['torch']} "
          f"threads={info['torch_threads']} cpus={info['cpu_count']} tandem@{info['tandem_commit']}", flush=True)
    print(f"# workload: {len(wl.prompts)} prompts ({wl.source}), input {a.input_len_range}, output "
          f"{a.output_len_range}; {wl.num_prompt_tokens} prompt tokens, {wl.num_output_tokens} output tokens; "
          f"hf batch size {hf_bs}", flush=True)

    llm = LLM(model=a.model, device=device, dtype=a.dtype, async_scheduling=True,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              enable_prefix_caching=a.enable_prefix_caching)
    pad_id = tok.eos_token_id if tok.eos_token_id is not None else 0
    hf = HFRunner(folder, device, dtype, pad_id)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=not a.no_detokenize)
              for n in wl.output_lens]

    def run_tandem() -> list[list[int]]:
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    systems = {"tandem": run_tandem,
               "hf-batched": lambda: hf.run_batched(wl.prompts, wl.output_lens, hf_bs)}
    if not a.skip_hf_single:
        systems["hf-single"] = lambda: hf.run_single(wl.prompts, wl.output_lens)

    # Warm-up (first-call allocations, oneDNN primitive caches): a few short prompts each.
    w_prompts, w_lens = wl.prompts[:4], [8] * min(4, len(wl.prompts))
    llm.generate(w_prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    hf.run_batched(w_prompts, w_lens, len(w_prompts))
    hf.run_single(w_prompts[:1], w_lens[:1])

    names = list(systems)
    raw: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            bc.sync_device(device)
            c0, t0 = time.process_time(), time.perf_counter()
            toks = systems[name]()
            bc.sync_device(device)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            got = [len(t) for t in toks]
            assert got == wl.output_lens, f"{name}: wrong output lengths"
            raw[name].append({"wall_s": wall, "cpu_s": cpu})
            if name not in tokens:
                tokens[name] = toks
            elif tokens[name] != toks:
                print(f"WARNING: {name} output differs between rounds", flush=True)
            print(f"round {r + 1}/{a.rounds} {name:>10}: {wall:7.2f} s  {wl.num_output_tokens / wall:8.1f} tok/s  "
                  f"(cpu {cpu:.1f} s)", flush=True)
    llm.shutdown()

    n_out, n_req = wl.num_output_tokens, len(wl.prompts)
    summary: dict[str, dict[str, float]] = {}
    for name in names:
        wall = bc.median([x["wall_s"] for x in raw[name]])
        summary[name] = {"wall_s": wall, "tok_s": n_out / wall, "req_s": n_req / wall,
                         "total_tok_s": (n_out + wl.num_prompt_tokens) / wall,
                         "walls": [x["wall_s"] for x in raw[name]]}
    hf_computed = sum(max(wl.output_lens[s:s + hf_bs]) * len(wl.output_lens[s:s + hf_bs])
                      for s in range(0, n_req, hf_bs))
    rows = []
    for name in names:
        s = summary[name]
        ratio = summary["tandem"]["wall_s"] / s["wall_s"]
        rows.append([name, s["wall_s"], s["tok_s"], s["req_s"],
                     "1.00" if name == "tandem" else f"{1 / ratio:.2f}x",
                     " / ".join(f"{w:.2f}" for w in s["walls"])])
    table = bc.markdown_table(
        ["system", "wall s (median)", "gen tok/s", "req/s", "tandem / system", "walls per round"], rows)
    print()
    print(table)
    print()
    print(f"HF batched computed {hf_computed} tokens for {n_out} useful ({n_out / hf_computed:.0%} useful).")
    checks = {}
    ref = "hf-single" if "hf-single" in tokens else "hf-batched"
    for name in names:
        if name != ref:
            checks[f"{name}_vs_{ref}"] = m = _match(tokens[name], tokens[ref])
            print(f"greedy match {name} vs {ref}: {m['exact']}/{m['of']} identical, "
                  f"mean matching prefix {m['mean_prefix_frac']:.1%}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items()}, "machine": info,
                       "workload": {"num_prompts": n_req, "prompt_tokens": wl.num_prompt_tokens,
                                    "output_tokens": n_out, "output_lens": wl.output_lens,
                                    "prompt_lens": [len(p) for p in wl.prompts], "source": wl.source,
                                    "hf_batch_size": hf_bs, "hf_batched_computed_tokens": hf_computed},
                       "raw": raw, "summary": summary, "token_match": checks,
                       "tandem_stats": {"loop": vars(llm.engine.core.stats),
                                        "scheduler": vars(llm.engine.core.scheduler.stats)}},
                      f, indent=1, default=str)
        print(f"wrote {a.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
