"""Speculative decoding on the CPU (issue 20): plain vs n-gram k=4 at batch 1, interleaved
in one run, on copy-heavy prompts; and the draft-model method with the model as its own
draft (a correctness check: acceptance near 1).

The embedded SmolLM2-135M-Instruct (real weights), greedy, one request at a time, chat
template applied. Copy-heavy prompts: repeat a passage, edit code (rename a variable in a
function and print it back), continue a numbered list. For each round, each prompt runs
once per engine, the engines alternating, so both see the same machine load; tok/s is
generated tokens over wall time, summed over the round, median over rounds. Outputs are
checked token-identical between engines.

    python benchmarks/spec_decode_bench.py --json benchmarks/results/cpu_spec_decode.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

PASSAGE = ("The river rose slowly through the night, and by morning the low fields along the valley were under "
           "water. Farmers moved their animals to the hills, the school closed its doors, and the old bridge, "
           "built of stone two hundred years ago, stood alone above the brown current.")

CODE = '''def summarize(records):
    total = 0
    count = 0
    for record in records:
        if record.valid:
            total += record.amount
            count += 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}
'''

PROMPTS = {
    "repeat a passage": f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    "edit code": f"Rename the variable `records` to `entries` in this function and print the whole function:\n\n"
                 f"```python\n{CODE}```",
    "numbered list": "Continue this list up to 30, same format:\n1. item one\n2. item two\n3. item three\n"
                     "4. item four\n5. item five\n6. item six",
}


def run_one(llm: Any, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[int], float]:
    from tandem import SamplingParams

    t0 = time.perf_counter()
    out = llm.chat([messages], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the n-gram engine")
    ap.add_argument("--draft-max-tokens", type=int, default=48, help="tokens per prompt of the self-draft check")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import torch

    from tandem import LLM
    from tandem.models.loader import default_model_path

    model = default_model_path()
    common = dict(max_model_len=1024, num_kv_blocks=256)
    engines = {
        "plain": LLM(model, **common),
        f"ngram k={args.k}": LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": args.k},
                                 **common),
    }
    prompts = {name: [{"role": "user", "content": text}] for name, text in PROMPTS.items()}
    for llm in engines.values():  # warm-up (first-step costs), not measured
        run_one(llm, prompts["numbered list"], 8)
    before = engines[f"ngram k={args.k}"].spec_decode_stats()

    per_round: dict[str, list[float]] = {name: [] for name in engines}
    per_prompt: dict[str, dict[str, list[float]]] = {p: {name: [] for name in engines} for p in prompts}
    tokens: dict[str, dict[str, list[int]]] = {p: {} for p in prompts}
    for r in range(args.rounds):
        totals = {name: [0, 0.0] for name in engines}
        for pname, msgs in prompts.items():
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                ids, secs = run_one(engines[name], msgs, args.max_tokens)
                totals[name][0] += len(ids)
                totals[name][1] += secs
                per_prompt[pname][name].append(len(ids) / secs)
                prev = tokens[pname].setdefault(name, ids)
                assert prev == ids, f"{name}: {pname} differs between rounds"
        for name, (n, secs) in totals.items():
            per_round[name].append(n / secs)
        print(f"round {r + 1}: " + ", ".join(f"{name} {v[-1]:.1f} tok/s" for name, v in per_round.items()), flush=True)
    spec_name = f"ngram k={args.k}"
    after = engines[spec_name].spec_decode_stats()
    identical = all(t["plain"] == t[spec_name] for t in tokens.values())
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
    for llm in engines.values():
        llm.shutdown()

    # The draft-model method, the model as its own draft: every greedy draft should be accepted.
    with LLM(model, speculative_config={"method": "draft_model", "model": model, "num_speculative_tokens": 3},
             **common) as self_draft:
        sd_tokens, sd_secs = 0, 0.0
        for msgs in prompts.values():
            ids, secs = run_one(self_draft, msgs, args.draft_max_tokens)
            sd_tokens += len(ids)
            sd_secs += secs
        sd = self_draft.spec_decode_stats()

    med = {name: statistics.median(v) for name, v in per_round.items()}
    result = {
        "model": os.path.basename(model), "threads": torch.get_num_threads(), "python": platform.python_version(),
        "rounds": args.rounds, "max_tokens": args.max_tokens, "k": args.k,
        "tok_s_median": med, "speedup": med[spec_name] / med["plain"],
        "per_prompt_tok_s_median": {p: {n: statistics.median(v) for n, v in d.items()} for p, d in per_prompt.items()},
        "output_tokens": {p: len(t["plain"]) for p, t in tokens.items()},
        "identical_outputs": identical,
        "ngram": {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
                  "acceptance_rate": accepted / drafted if drafted else 0.0,
                  "tokens_per_verify_step": 1 + accepted / drafts if drafts else 0.0},
        "self_draft": {"k": 3, "tok_s": sd_tokens / sd_secs, "acceptance_rate": sd["acceptance_rate"],
                       "draft_tokens": sd["spec_num_draft_tokens"], "accepted_tokens": sd["spec_num_accepted_tokens"]},
    }
    print(json.dumps(result, indent=2))
    print(f"\n| engine | tok/s (median of {args.rounds} rounds) |\n|---|---|")
    for name, v in med.items():
        print(f"| {name} | {v:.1f} |")
    print(f"\nspeedup {result['speedup']:.2f}x, identical outputs: {identical}, n-gram acceptance "
          f"{result['ngram']['acceptance_rate']:.2%} ({result['ngram']['tokens_per_verify_step']:.2f} tokens per "
          f"verify step); self-draft acceptance {sd['acceptance_rate']:.2%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
