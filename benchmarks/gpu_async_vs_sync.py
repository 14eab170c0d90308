"""GPU check and benchmark: async vs sync (and HF generate) on random models of real shapes.

Runs where no weights can be downloaded: models are built from a config with random
weights (shapes of SmolLM2-135M and Qwen2.5-0.5B) and saved as safetensors. Verifies that
async and sync produce identical greedy tokens on CUDA, then times both, interleaved.

    python benchmarks/gpu_async_vs_sync.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

SHAPES = {
    "smollm2-135m": dict(arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "qwen2-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def build(folder: str, shape: dict) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

    shape = dict(shape)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[shape.pop("arch")]
    cfg = cls(max_position_embeddings=4096, eos_token_id=1, bos_token_id=0, **shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(min(cfg.vocab_size, 1000))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1", bos_token="t0", unk_token="t0").save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def run_tandem(llm, prompts, sp):
    core = llm.engine.core
    s0 = (core.stats.num_launched, core.stats.num_launched_ahead)
    c0 = time.process_time()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    steps = core.stats.num_launched - s0[0]
    ahead = core.stats.num_launched_ahead - s0[1]
    toks = [o.outputs[0].token_ids for o in outs]
    return dict(wall=dt, cpu=cpu, steps=steps, ahead=ahead, tokens=sum(map(len, toks))), toks


def _run_executor(LLM, folder, prompts, sp, a, executor):
    """Async and sync engines on one executor, interleaved rounds; returns (row, tokens)."""
    from tandem import SamplingParams

    llms = {m: LLM(folder, async_scheduling=m, max_num_seqs=a.num_prompts, gpu_memory_utilization=0.4,
                   executor=executor) for m in (False, True)}
    for m in llms.values():  # warm-up
        m.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    runs: dict[bool, list] = {False: [], True: []}
    same = True
    for _ in range(a.rounds):
        toks = {}
        for mode in (False, True):
            r, toks[mode] = run_tandem(llms[mode], prompts, sp)
            runs[mode].append(r)
        same &= toks[False] == toks[True]
    row = {"identical_tokens": same}
    for mode, key in ((False, "sync"), (True, "async")):
        w = statistics.median(r["wall"] for r in runs[mode])
        rr = runs[mode][-1]
        row[key] = dict(tok_s=rr["tokens"] / w, wall_s=w, ms_per_step=1000 * w / rr["steps"],
                        cpu_ms_per_step=1000 * statistics.median(r["cpu"] / r["steps"] for r in runs[mode]),
                        launched_ahead=rr["ahead"] / max(rr["steps"], 1))
    row["async_over_sync"] = row["async"]["tok_s"] / row["sync"]["tok_s"]
    for m in llms.values():
        m.shutdown()
    del llms
    torch.cuda.empty_cache()
    return row, toks[True]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="smollm2-135m,qwen2-0.5b")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hf", action="store_true", help="also time HF generate (batched) on the same prompts")
    ap.add_argument("--executors", default="uniproc",
                    help="comma list of tandem executors to run (each async and sync); tokens are compared "
                         "across all of them")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from tandem import LLM, SamplingParams

    results = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    g = torch.Generator().manual_seed(0)
    for name in a.shapes.split(","):
        folder = build(tempfile.mkdtemp(prefix=name), SHAPES[name])
        prompts = [torch.randint(2, 1000, (a.prompt_len,), generator=g).tolist() for _ in range(a.num_prompts)]
        sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
        row: dict = {}
        ref_toks = None
        for executor in a.executors.split(","):
            sub, toks_ex = _run_executor(LLM, folder, prompts, sp, a, executor)
            if ref_toks is None:
                ref_toks = toks_ex
            sub["identical_tokens_to_" + a.executors.split(",")[0]] = toks_ex == ref_toks
            row[executor] = sub
            print(name, executor, json.dumps(sub), flush=True)
        first = row[a.executors.split(",")[0]]
        row.update({k: first[k] for k in ("sync", "async", "async_over_sync", "identical_tokens")})
        if a.hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
            ids = torch.tensor(prompts, device="cuda")
            hf.generate(ids[:4], max_new_tokens=8, do_sample=False, pad_token_id=0)
            times = []
            for _ in range(a.rounds):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.output_len,
                            min_new_tokens=a.output_len, do_sample=False, pad_token_id=0)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            hw = statistics.median(times)
            row["hf"] = dict(tok_s=a.num_prompts * a.output_len / hw, wall_s=hw)
            row["tandem_async_over_hf"] = row["async"]["tok_s"] / row["hf"]["tok_s"]
            del hf
        torch.cuda.empty_cache()
        results[name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
