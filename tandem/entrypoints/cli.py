"""``tandem`` command line: ``tandem generate ...``.

The engine flags are generated from ``EngineConfig``'s fields and the sampling flags from
``SamplingParams``' fields, so each has the Python API's default and the field's
description as its help. The per-request ``SamplingParams.seed`` is ``--sampling-seed``;
``--seed`` is the engine's.

A user's mistake never shows a traceback: it prints one ``error: ...`` line on stderr and
exits with status 2 (``--debug`` or ``--log-level debug`` adds the traceback). Everything
that can be checked without the weights (flags, the input file, the output path, the model
files, each prompt against the tokenizer and the context length) is checked before they
load. Ctrl-C exits with status 130.
"""
from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import struct
import sys
import time
import traceback
from typing import Any, Optional

import tandem
from tandem.config import EngineConfig
from tandem.sampling_params import SamplingParams
from tandem.types.errors import WorkerError
from tandem.validation import show, unknown_field_message

EXIT_INTERNAL, EXIT_USER_ERROR, EXIT_INTERRUPTED = 1, 2, 130
# SamplingParams fields whose flag would clash with (or read like) an engine flag.
SAMPLING_DESTS = {"seed": "sampling_seed"}
_DEFAULT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
_ROW_KEYS = ["prompt", "messages", "sampling_params"]
# Exceptions that mean the user asked for something wrong, not that tandem is broken.
# (worker_cls import failures are turned into ValueError before the engine starts; any other
# ImportError is tandem's own fault.)
_USER_ERRORS = (ValueError, OSError, struct.error)
_USER_ERROR_NAMES = {"ValueError", "FileNotFoundError", "OSError", "PermissionError", "error"}


class CliError(Exception):
    """A mistake in how tandem was called (a flag, the input file, the output path)."""


class _Parser(argparse.ArgumentParser):
    """Raises ``CliError`` instead of printing the whole usage and exiting; no abbreviated
    flags (``--max-num-seq`` is a mistake to point out, not a prefix to guess from)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> Any:
        if message.startswith("unrecognized arguments:"):
            unknown = [w for w in message.split(":", 1)[1].split() if w.startswith("--")]
            if unknown:
                flag = unknown[0].split("=", 1)[0]
                close = difflib.get_close_matches(flag, _option_strings(self), n=1)
                hint = f"did you mean {close[0]!r}?" if close else "see --help"
                raise CliError(f"unknown flag {flag!r} ({hint})")
        raise CliError(f"{message} (see '{self.prog} --help')")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--flag`` of the parser and its subcommands (unknown flags are reported by the top parser)."""
    names = [o for o in parser._option_string_actions if o.startswith("--")]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names += _option_strings(sub)
    return sorted(set(names))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tandem", description="tandem LLM engine")
    parser.add_argument("--version", action="version", version=f"tandem {tandem.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="offline generation from prompts or a JSONL file",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Generate completions. Mistakes print one 'error:' line and exit with "
                                   "status 2; Ctrl-C exits with 130.")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--input", help="JSONL file: one {'prompt': ...} or {'messages': [...]} per line, "
                                   "optionally with 'sampling_params': {...} overriding the sampling flags")
    g.add_argument("--output", help="write JSONL results here instead of printing text (checked before generating)")
    g.add_argument("--chat", action="store_true", help="wrap --prompt/--input prompts in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per completion")
    g.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    _add_log_args(g)
    SamplingParams.add_cli_args(g.add_argument_group("sampling (per request, as SamplingParams)"), SAMPLING_DESTS)
    EngineConfig.add_cli_args(g.add_argument_group("engine (as EngineConfig)"))
    g.set_defaults(func=cmd_generate)

    from tandem.entrypoints.openai.serve import add_serve_args, serve_main

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Serve a model over the OpenAI API until SIGINT/SIGTERM.")
    add_serve_args(s)
    _add_log_args(s)
    s.set_defaults(func=serve_main)

    from tandem.bench import serve as bench_serve

    b = sub.add_parser("bench", help="benchmarks")
    bench_sub = b.add_subparsers(dest="bench_command", required=True)
    bs = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server (like vllm bench serve)",
                              description=bench_serve.DESCRIPTION)
    bench_serve.add_cli_args(bs)
    _add_log_args(bs)
    bs.set_defaults(func=bench_serve.main)
    return parser


def _add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show the traceback of an error (and debug logs)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="warning",
                   help="log level of tandem's messages ('debug' also shows tracebacks)")


# -- requests: --prompt and --input rows ------------------------------------------------------------
def _read_jsonl(path: str) -> list[tuple[str, dict[str, Any]]]:
    """``(where, row)`` per non-blank line; every shape mistake names the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise CliError(f"--input {path!r} does not exist") from None
    except IsADirectoryError:
        raise CliError(f"--input {path!r} is a folder, not a JSONL file") from None
    except UnicodeDecodeError as e:
        raise CliError(f"--input {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise CliError(f"--input {path!r} cannot be read: {e.strerror or e}") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            where = f"{path}:{i}"
            rows.append((where, _parse_row(line, where)))
    if not rows:
        raise CliError(f"--input {path!r} holds no requests")
    return rows


def _parse_row(line: str, where: str) -> dict[str, Any]:
    from tandem.entrypoints.llm import check_messages

    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise CliError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(row, str):
        row = {"prompt": row}
    if not isinstance(row, dict):
        raise CliError(f"{where}: each line must be a JSON object with 'prompt' or 'messages', "
                       f"got {type(row).__name__} {show(row)}")
    for key in row:
        if key not in _ROW_KEYS:
            raise CliError(f"{where}: {unknown_field_message(key, _ROW_KEYS, noun='key')}")
    if ("prompt" in row) == ("messages" in row):
        raise CliError(f"{where}: each line needs exactly one of 'prompt' or 'messages'")
    prompt = row.get("prompt")
    if "prompt" in row and not (isinstance(prompt, str) or _is_token_list(prompt)):
        raise CliError(f"{where}: 'prompt' must be a string or a list of token ids, "
                       f"got {type(prompt).__name__} {show(prompt)}")
    if "messages" in row:
        try:
            check_messages(row["messages"])
        except ValueError as e:
            raise CliError(f"{where}: {e}") from None
    if not isinstance(row.get("sampling_params", {}), dict):
        raise CliError(f"{where}: 'sampling_params' must be an object, got {show(row['sampling_params'])}")
    return row


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _collect_rows(a: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    rows = [(f"--prompt #{i}", {"prompt": p}) for i, p in enumerate(a.prompt, 1)]
    if a.input:
        rows += _read_jsonl(a.input)
    return rows or [("default prompt", {"messages": _DEFAULT_MESSAGES})]


def _sampling_for(a: argparse.Namespace, where: str, row: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams.from_cli_args(a, SAMPLING_DESTS, **row.get("sampling_params", {}))
    except ValueError as e:
        raise CliError(f"{where}: {e}" if "sampling_params" in row else str(e)) from None


def _check_output_path(path: Optional[str]) -> None:
    """Refuse an output we could not write before generating, not after (results would be lost)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"--output {path!r}: {folder!r} is not an existing folder")
    if os.path.isdir(path):
        raise CliError(f"--output {path!r} is a folder; give a file path")
    existed = os.path.exists(path)
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise CliError(f"--output {path!r} cannot be written: {e.strerror or e}") from None
    if not existed:
        os.remove(path)


# -- the command ----------------------------------------------------------------------------------
def _prompt_token_ids(a: argparse.Namespace, config: EngineConfig, model_config: Any,
                      rows: list[tuple[str, dict[str, Any]]], params: list[SamplingParams]) -> list[list[int]]:
    """Tokenize every prompt and check it with the engine's own rules, before the weights load."""
    from tandem.engine.input_processor import InputProcessor
    from tandem.tokenizer import load_tokenizer

    inputs = InputProcessor(config, model_config.info, load_tokenizer(model_config.tokenizer))
    ids = []
    for k, ((where, row), sp) in enumerate(zip(rows, params)):
        try:
            if "messages" in row:
                prompt: Any = inputs.apply_chat_template(row["messages"])
            elif a.chat:
                prompt = inputs.apply_chat_template([{"role": "user", "content": row["prompt"]}])
            else:
                prompt = row["prompt"]
            ids.append(inputs.process(f"check-{k}", prompt, sp).prompt_token_ids)
        except ValueError as e:
            raise CliError(f"{where}: {e}") from None
    return ids


def cmd_generate(a: argparse.Namespace) -> int:
    from tandem.engine.prepare import prepare_model
    from tandem.entrypoints.llm import LLM

    config = EngineConfig.from_cli_args(a)
    rows = _collect_rows(a)
    params = [_sampling_for(a, where, row) for where, row in rows]
    _check_output_path(a.output)
    model_config = prepare_model(config)
    prompts = _prompt_token_ids(a, config, model_config, rows, params)
    with LLM.from_config(config, model_config) as llm:
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not a.quiet)
        dt = time.perf_counter() - t0
    _write_outputs(a, [row for _, row in rows], outputs)
    if not a.quiet:
        n_tok = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        print(f"[tandem] {len(outputs)} request(s), {n_tok} tokens in {dt:.2f}s ({n_tok / dt:.1f} tok/s)",
              file=sys.stderr)
    return 0


def _write_outputs(a: argparse.Namespace, rows: list[dict[str, Any]], outputs: list[Any]) -> None:
    if a.output:
        with open(a.output, "w", encoding="utf-8") as sink:
            for r, out in zip(rows, outputs):
                for c in out.outputs:
                    sink.write(json.dumps({"prompt": r.get("prompt"), "messages": r.get("messages"),
                                           "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                           "finish_reason": c.finish_reason}) + "\n")
        return
    for out in outputs:
        for c in out.outputs:
            print(c.text if not a.json else json.dumps({"text": c.text, "finish_reason": c.finish_reason}))


# -- entry point ------------------------------------------------------------------------------------
def _is_user_error(e: BaseException) -> bool:
    if isinstance(e, WorkerError):  # a worker's own exception, e.g. missing weights in a worker process
        return e.exc_type in _USER_ERROR_NAMES
    return isinstance(e, (CliError, *_USER_ERRORS))


def _one_line(e: BaseException) -> str:
    """The message on one line; a worker's traceback (after its first line) is left out."""
    text = str(e).splitlines()[0] if isinstance(e, WorkerError) else str(e)
    return " ".join(text.split()) or type(e).__name__


def _configure_logging(a: argparse.Namespace) -> None:
    level = logging.DEBUG if a.debug else getattr(logging, a.log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tandem").setLevel(level)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the CLI; returns the exit status (0, 1 internal error, 2 user error, 130 interrupted)."""
    try:
        args = build_parser().parse_args(argv)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except SystemExit as e:  # --help, --version
        return int(e.code or 0)
    _configure_logging(args)
    debug = args.debug or args.log_level == "debug"
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if debug:
            traceback.print_exc()
        if _is_user_error(e):
            print(f"error: {_one_line(e)}", file=sys.stderr)
            return EXIT_USER_ERROR
        print(f"error: internal error ({type(e).__name__}): {_one_line(e)} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
