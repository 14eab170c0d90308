"""``tandem`` command line: ``tandem generate ...`` (engine flags mirror ``EngineConfig``)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any, Optional

from tandem.config import EngineConfig
from tandem.sampling_params import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_from_args(a: argparse.Namespace, overrides: Optional[dict[str, Any]] = None) -> SamplingParams:
    kw: dict[str, Any] = dict(
        max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, frequency_penalty=a.frequency_penalty,
        presence_penalty=a.presence_penalty, seed=a.sample_seed, n=a.n, stop=list(a.stop),
        ignore_eos=a.ignore_eos,
    )
    kw.update(overrides or {})
    return SamplingParams(**kw)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{i}: not valid JSON ({e})")
            if isinstance(row, str):
                row = {"prompt": row}
            if "prompt" not in row and "messages" not in row:
                raise SystemExit(f"{path}:{i}: each line needs a 'prompt' or 'messages' field")
            rows.append(row)
    return rows


def cmd_generate(a: argparse.Namespace) -> int:
    from tandem.entrypoints.llm import LLM

    rows: list[dict[str, Any]] = [{"prompt": p} for p in a.prompt]
    if a.input:
        rows += _read_jsonl(a.input)
    if not rows:
        rows = [{"messages": [{"role": "user", "content": "What is the capital of France?"}]}]
    try:
        config = EngineConfig.from_cli_args(a)
        sampling = [_sampling_from_args(a, r.get("sampling_params")) for r in rows]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        llm = LLM(**{k: v for k, v in vars(config).items()})
    except ValueError as e:  # e.g. a model that cannot split over --tensor-parallel-size
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts: list[Any] = []
    for r in rows:
        if "messages" in r:
            prompts.append(llm.engine.apply_chat_template(r["messages"]))
        elif a.chat:
            prompts.append(llm.engine.apply_chat_template([{"role": "user", "content": r["prompt"]}]))
        else:
            prompts.append(r["prompt"])
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=not a.quiet)
    dt = time.perf_counter() - t0
    sink = open(a.output, "w", encoding="utf-8") if a.output else None
    for r, out in zip(rows, outputs):
        for c in out.outputs:
            if sink is not None:
                sink.write(json.dumps({"prompt": r.get("prompt"), "messages": r.get("messages"), "index": c.index,
                                       "text": c.text, "token_ids": c.token_ids,
                                       "finish_reason": c.finish_reason}) + "\n")
            else:
                print(c.text if not a.json else json.dumps({"text": c.text, "finish_reason": c.finish_reason}))
    if sink is not None:
        sink.close()
    n_tok = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    if not a.quiet:
        print(f"[tandem] {len(outputs)} request(s), {n_tok} tokens in {dt:.2f}s ({n_tok / dt:.1f} tok/s)",
              file=sys.stderr)
    llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="tandem LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="offline generation from prompts or a JSONL file")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--input", help="JSONL file: one {'prompt': ...} or {'messages': [...]} per line")
    g.add_argument("--output", help="write JSONL results here instead of printing text")
    g.add_argument("--chat", action="store_true", help="wrap --prompt/--input prompts in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per completion")
    g.add_argument("--quiet", action="store_true")
    _add_sampling_args(g)
    EngineConfig.add_cli_args(g)
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
