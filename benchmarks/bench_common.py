"""Shared helpers of the CPU/GPU benchmarks in this folder (prompts, timing, tables).

Kept free of heavy imports at module level so that ``--help`` of every script is instant.
Nothing here downloads anything: the model is a local folder / .gguf file, and the prompt
text comes from the docstrings of Python's own standard library.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import inspect
import os
import platform
import random
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

# Standard-library modules whose docstrings make the prompt corpus: varied English prose,
# reference text and code snippets, identical on every machine with the same Python.
_CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "fractions", "functools", "heapq", "http.client",
    "inspect", "itertools", "json", "logging", "pathlib", "pickle", "random", "re", "shutil",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "zipfile",
)


def parse_range(text: str) -> tuple[int, int]:
    """``"16-128"`` / ``"16:128"`` / ``"64"`` -> inclusive ``(lo, hi)``."""
    for sep in ("-", ":", ","):
        if sep in text:
            lo, hi = (int(x) for x in text.split(sep, 1))
            break
    else:
        lo = hi = int(text)
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: need 1 <= lo <= hi")
    return lo, hi


def corpus_text() -> str:
    parts: list[str] = []
    for name in _CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if mod.__doc__:
            parts.append(mod.__doc__)
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 80:
                    parts.append(doc)
    return "\n\n".join(parts)


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids
    output_lens: list[int]  # max_tokens of each prompt (generated with ignore_eos)
    source: str

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def build_workload(tokenizer: Any, num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   seed: int, source: str = "text", vocab_size: Optional[int] = None) -> Workload:
    """Per prompt: input length and output length drawn uniformly from the ranges (fixed seed).

    ``source="text"``: each prompt is a window of the tokenized corpus at a random offset
    (real text, so the model sees natural inputs). ``source="random"``: uniform random token
    ids (no special tokens).
    """
    rng = random.Random(seed)
    lens = [(rng.randint(*input_range), rng.randint(*output_range)) for _ in range(num_prompts)]
    prompts: list[list[int]] = []
    if source == "text":
        ids = tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]
        need = input_range[1] + 1
        if len(ids) < need:
            raise RuntimeError(f"corpus has only {len(ids)} tokens; need {need}")
        for n, _ in lens:
            off = rng.randrange(len(ids) - n)
            prompts.append(list(ids[off:off + n]))
    elif source == "random":
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = vocab_size or len(tokenizer)
        for n, _ in lens:
            p: list[int] = []
            while len(p) < n:
                t = rng.randrange(vocab)
                if t not in special:
                    p.append(t)
            prompts.append(p)
    else:
        raise ValueError(f"unknown prompt source {source!r}")
    return Workload(prompts, [o for _, o in lens], source)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    info["tandem_commit"] = _git_describe()
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def _git_describe() -> Optional[str]:
    """Commit of the tandem checkout these benchmarks run against (+ "-dirty" if tandem/ has edits)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "tandem"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if dirty else "")) if head else None


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark script's parser: the docstring's first line as its description, the rest
    (usage examples) as its epilog, and the shared model and prompt flags."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.splitlines()[1:]))
    common_prompt_args(ap)
    return ap


def load_workload(a: argparse.Namespace) -> tuple[str, Any, "Workload"]:
    """(model folder, its tokenizer, the prompts) that the shared flags in ``a`` describe."""
    from transformers import AutoTokenizer

    folder = resolve_folder(a.model)
    tok = AutoTokenizer.from_pretrained(folder)
    return folder, tok, build_workload(tok, a.num_prompts, a.input_len_range, a.output_len_range, a.seed,
                                       a.prompt_source)


def common_prompt_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None,
                    help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len-range", type=parse_range, default=(16, 128), metavar="LO-HI",
                    help="prompt length in tokens, uniform per prompt (default 16-128)")
    ap.add_argument("--output-len-range", type=parse_range, default=(16, 128), metavar="LO-HI",
                    help="max_tokens per prompt, uniform per prompt, generated with ignore_eos (default 16-128)")
    ap.add_argument("--prompt-source", choices=("text", "random"), default="text",
                    help="text: windows of tokenized stdlib docstrings; random: random token ids")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workload (lengths, offsets)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    ap.add_argument("--max-num-seqs", type=int, default=64, help="tandem: most requests in one step")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tandem: token budget of one step")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="tandem: reuse KV of identical prefixes. Off by default: every round reruns the same "
                         "prompts, so rounds 2+ would otherwise skip their prefill")
    ap.add_argument("--no-detokenize", action="store_true",
                    help="tandem: skip incremental detokenization (HF generate never detokenizes)")
    ap.add_argument("--json-out", default=None, help="write all raw numbers here")


def resolve_folder(model: Optional[str]) -> str:
    from tandem.models.loader import default_model_path, resolve_model

    return resolve_model(model or default_model_path())


def torch_dtype(name: str, device: str) -> Any:
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolved_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def sync_device(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
