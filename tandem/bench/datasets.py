"""Benchmark workloads: what each request sends and how many tokens it asks for.

Two sources, as in ``vllm bench serve``:

- **random**: prompts of random token ids with lengths drawn uniformly around a target,
  optionally behind one shared prefix (to exercise prefix caching). Token-id prompts give
  exact input lengths without any tokenizer, which ``/v1/completions`` accepts (a vLLM
  extension tandem also serves); the chat endpoint needs text, so the ids are decoded first.
- **file** (``--dataset-path``): a JSON list or JSON Lines of either ShareGPT conversations
  (prompt = first human turn, output length = tokens of the reply that follows) or
  ``{"prompt": ..., "output_len": N}`` records.

Everything is seeded, so two runs with the same flags send the same requests. Dataset
problems raise :class:`DatasetError` with a one-line message naming the file and line.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from tandem.bench.tokenizers import BenchTokenizer

logger = logging.getLogger(__name__)

# ShareGPT pairs outside these bounds are skipped, as vLLM's benchmark does, so that results
# stay comparable and one huge conversation cannot dominate a run.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048

# Token ids for random prompts are drawn from [0, DEFAULT_RANDOM_VOCAB) unless the vocabulary
# size is known: every real vocabulary is at least this large, so any id is valid anywhere.
DEFAULT_RANDOM_VOCAB = 128

_HUMAN = ("human", "user")
_ASSISTANT = ("gpt", "assistant", "chatgpt", "bard", "model")

Prompt = Union[str, list[int]]


@dataclass(frozen=True)
class SampleRequest:
    """One request of the workload: its prompt, its length in tokens and the output length
    to ask for (``max_tokens``; with ``ignore_eos`` the server produces exactly that many);
    ``schema``: a JSON schema the output is constrained to (``bench/structured.py``)."""

    prompt: Prompt
    prompt_len: int
    expected_output_len: int
    schema: Optional[dict[str, Any]] = None


class DatasetError(ValueError):
    """The workload could not be built; the message is one line meant for the user."""


# ----------------------------------------------------------------------------- random


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float,
                   minimum: int = 0) -> list[int]:
    """``n`` integers uniform in ``[length*(1-r), length*(1+r)]`` (inclusive), at least ``minimum``."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if length < 0:
        raise DatasetError(f"random lengths must be >= 0, got {length}")
    lo = math.ceil(length * (1.0 - range_ratio) - 1e-9)
    hi = math.floor(length * (1.0 + range_ratio) + 1e-9)
    if lo > hi:  # a tiny length whose interval holds no integer
        lo = hi = length
    lo, hi = max(lo, minimum), max(hi, minimum)
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, vocab_size: Optional[int] = None,
                    seed: int = 0) -> list[SampleRequest]:
    """Token-id prompts: ``prefix_len`` shared ids followed by a random-length random tail.

    ``prompt_len`` is exact (prefix + tail) and ``expected_output_len`` is at least 1.
    """
    if num_prompts <= 0:
        raise DatasetError(f"--num-prompts must be positive, got {num_prompts}")
    if prefix_len < 0:
        raise DatasetError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    if output_len <= 0:
        raise DatasetError(f"--random-output-len must be positive, got {output_len}")
    vocab = vocab_size or DEFAULT_RANDOM_VOCAB
    if vocab <= 0:
        raise DatasetError(f"vocabulary size must be positive, got {vocab}")
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio, minimum=0 if prefix_len else 1)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio, minimum=1)
    prefix = [int(t) for t in rng.integers(0, vocab, size=prefix_len)]
    out: list[SampleRequest] = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = prefix + [int(t) for t in rng.integers(0, vocab, size=n_in)]
        out.append(SampleRequest(prompt=ids, prompt_len=len(ids), expected_output_len=n_out))
    return out


async def to_text_prompts(requests: Sequence[SampleRequest],
                          tokenizer: Optional[BenchTokenizer]) -> list[SampleRequest]:
    """Decode token-id prompts to text (for the chat endpoint, which takes only text).

    ``prompt_len`` keeps the id count: decoding and re-encoding need not round-trip, and the
    server's ``usage.prompt_tokens`` replaces it in the records anyway.
    """
    need = [i for i, r in enumerate(requests) if not isinstance(r.prompt, str)]
    if not need:
        return list(requests)
    if tokenizer is None:
        raise DatasetError("text prompts are needed (chat endpoint) but no tokenizer is available")
    texts = await tokenizer.decode([requests[i].prompt for i in need])  # type: ignore[misc]
    out = list(requests)
    for i, text in zip(need, texts):
        r = out[i]
        out[i] = SampleRequest(prompt=text, prompt_len=r.prompt_len, expected_output_len=r.expected_output_len,
                               schema=r.schema)
    return out


# ------------------------------------------------------------------------------- files


@dataclass
class _Row:
    where: str  # "path:line" (JSONL) or "path: record i" (JSON list), for messages
    prompt: Prompt
    completion: Optional[str] = None  # ShareGPT reply, counted for the output length
    output_len: Optional[int] = None  # given directly by a prompt record
    sharegpt: bool = False


def _read_json_records(path: str) -> list[tuple[str, Any]]:
    """The records of a JSON list or JSON Lines file, each with where it came from."""
    if not os.path.exists(path):
        raise DatasetError(f"dataset file not found: {path}")
    if os.path.isdir(path):
        raise DatasetError(f"dataset path is a directory, not a file: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read dataset {path}: {e}") from None
    if not text.strip():
        raise DatasetError(f"dataset {path} is empty")
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        return [(f"{path}: record {i}", rec) for i, rec in enumerate(data)]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return rows


def _sharegpt_pair(turns: Any) -> Optional[tuple[str, str]]:
    """First human turn and the assistant reply right after it, or None."""
    if not isinstance(turns, list):
        return None
    for a, b in zip(turns, turns[1:]):
        if (isinstance(a, dict) and isinstance(b, dict) and a.get("from") in _HUMAN
                and b.get("from") in _ASSISTANT and isinstance(a.get("value"), str)
                and isinstance(b.get("value"), str)):
            return a["value"], b["value"]
    return None


def parse_records(path: str) -> tuple[list[_Row], int]:
    """Rows of a dataset file and the number of ShareGPT records without a usable pair."""
    records = _read_json_records(path)
    if not records:
        raise DatasetError(f"dataset {path} is empty")
    rows: list[_Row] = []
    unusable = 0
    for where, rec in records:
        if not isinstance(rec, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        if "conversations" in rec:
            pair = _sharegpt_pair(rec["conversations"])
            if pair is None:
                unusable += 1
                continue
            rows.append(_Row(where, pair[0], completion=pair[1], sharegpt=True))
        elif "prompt" in rec:
            prompt = rec["prompt"]
            ok_ids = isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
            if not ((isinstance(prompt, str) and prompt) or ok_ids):
                raise DatasetError(f"{where}: 'prompt' must be a non-empty string or list of token ids")
            n = rec.get("output_len")
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n <= 0):
                raise DatasetError(f"{where}: 'output_len' must be a positive integer, got {n!r}")
            rows.append(_Row(where, prompt, output_len=n))
        else:
            raise DatasetError(f"{where}: record has neither 'conversations' (ShareGPT) nor 'prompt'")
    return rows, unusable


def _sharegpt_ok(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    if prompt_len < SHAREGPT_MIN_LEN or (not fixed_output and output_len < SHAREGPT_MIN_LEN):
        return False
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN


async def load_file_dataset(path: str, num_prompts: int, tokenizer: Optional[BenchTokenizer],
                            seed: int = 0, output_len: Optional[int] = None) -> list[SampleRequest]:
    """Up to ``num_prompts`` requests from a dataset file.

    ShareGPT records are shuffled with ``seed`` and tokenized lazily, in batches, until
    enough pass the length filter; prompt records keep file order. ``output_len`` (the
    ``--sharegpt-output-len`` flag) replaces every record's output length.
    """
    if num_prompts <= 0:
        raise DatasetError(f"--num-prompts must be positive, got {num_prompts}")
    if output_len is not None and output_len <= 0:
        raise DatasetError(f"--sharegpt-output-len must be positive, got {output_len}")
    rows, unusable = parse_records(path)
    if any(r.sharegpt for r in rows):
        order = np.random.default_rng(seed).permutation(len(rows))
        rows = [rows[i] for i in order]
    missing = next((r for r in rows if not r.sharegpt and r.output_len is None), None)
    if missing is not None and output_len is None:
        raise DatasetError(f"{missing.where}: record has no 'output_len' (or pass --sharegpt-output-len)")
    if tokenizer is None and any(isinstance(r.prompt, str) or r.sharegpt for r in rows):
        raise DatasetError(f"dataset {path} has text that must be counted in tokens, but no tokenizer is available")

    out: list[SampleRequest] = []
    skipped = 0
    pos = 0
    while len(out) < num_prompts and pos < len(rows):
        batch = rows[pos:pos + max(64, 2 * (num_prompts - len(out)))]
        pos += len(batch)
        texts = [r.prompt for r in batch if isinstance(r.prompt, str)]
        texts += [r.completion for r in batch if r.sharegpt and output_len is None]  # type: ignore[misc]
        counted = iter(await tokenizer.encode(texts)) if texts else iter(())  # type: ignore[union-attr]
        prompt_lens = [len(next(counted)) if isinstance(r.prompt, str) else len(r.prompt) for r in batch]
        for r, p_len in zip(batch, prompt_lens):
            if r.sharegpt:
                o_len = output_len if output_len is not None else len(next(counted))
                if not _sharegpt_ok(p_len, o_len, output_len is not None):
                    skipped += 1
                    continue
            else:
                o_len = output_len if output_len is not None else r.output_len  # type: ignore[assignment]
            if len(out) < num_prompts:
                out.append(SampleRequest(prompt=r.prompt, prompt_len=p_len, expected_output_len=o_len))
    if skipped or unusable:
        logger.info("dataset %s: skipped %d pairs outside the length limits and %d records without a "
                    "human->assistant pair", path, skipped, unusable)
    if not out:
        raise DatasetError(f"dataset {path} has no usable requests ({skipped} too short or too long, "
                           f"{unusable} without a human->assistant pair)")
    if len(out) < num_prompts:
        logger.warning("dataset %s has only %d usable requests; --num-prompts asked for %d",
                       path, len(out), num_prompts)
    return out
