"""Every bad input a new user tried (issue 11), CLI and API, and the message each gets.

Each case asserts what the user sees: for the CLI exit status 2 (130 for Ctrl-C), one
``error: ...`` line and no traceback; for the API a ``ValueError``/``TypeError`` with a
one-line message, after which the same ``LLM`` still answers. Every message must contain the
words that name the problem. Timeouts catch hangs.

The results make the table in ``docs/bad-inputs.md``. The last test checks that the doc
matches (paths and machine-specific numbers normalized); regenerate it with
``TANDEM_REGEN_DOCS=1 python3 -m pytest -q tests/entrypoints/test_bad_inputs.py``.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.sampling_params import StructuredOutputsParams
from tandem.entrypoints import cli

pytestmark = pytest.mark.timeout(300)

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"
TINY = ["--model", "{tiny}", "--num-kv-blocks", "256"]  # small cache: the default 1 GiB is not needed


@dataclass
class Case:
    what: str  # the input as the table shows it: CLI flags after `tandem generate`, or Python code
    must: str  # words the message must contain
    argv: Optional[list[str]] = None  # CLI cases
    code: Optional[str] = None  # API cases (run exactly as shown)
    setup: set[str] = field(default_factory=set)  # "no_cuda", "default_model", "process", "sigint", "serve"
    http: Optional[tuple[str, dict[str, Any], Optional[str]]] = None  # HTTP cases: (path, body, param)


def cli_case(what: str, must: str, *argv: str, setup: tuple[str, ...] = ()) -> Case:
    return Case(what, must, argv=list(argv), setup=set(setup))


def api_case(code: str, must: str, setup: tuple[str, ...] = ()) -> Case:
    return Case(code, must, code=code, setup=set(setup))


def http_case(what: str, must: str, path: str, body: dict[str, Any], param: Optional[str]) -> Case:
    """A request to the real server (``tandem serve`` on the tiny model with a test chat
    template): a 400 whose OpenAI error body names ``param``."""
    return Case(what, must, http=(path, body, param))


C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "t5"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
LONG = " ".join(["t5"] * 10)
CASES = [
    # -- prompts ---------------------------------------------------------------------------------
    cli_case("empty prompt", "the prompt is empty", *TINY, "--prompt", ""),
    cli_case("prompt over --max-model-len", "max_model_len is 8", *TINY, "--max-model-len", "8", "--prompt", LONG),
    cli_case("KV cache too small for one request", "KV blocks", "--model", "{tiny}", "--num-kv-blocks", "2",
             "--block-size", "4", "--prompt", "t5 t6", "--max-tokens", "20", "--ignore-eos"),
    cli_case("--chat on a tokenizer without a chat template", "no chat template", *TINY, "--chat", "--prompt", "t5"),
    # -- model files -----------------------------------------------------------------------------
    cli_case("model path that does not exist", "does not exist", "--model", "{tmp}/nope", "--prompt", "t5"),
    cli_case("folder without config.json", "neither config.json nor a .gguf", "--model", "{tmp}/empty",
             "--prompt", "t5"),
    cli_case("folder without weights", "no *.safetensors weights", "--model", "{tmp}/noweights",
             "--num-kv-blocks", "64", "--prompt", "t5"),
    cli_case("folder without weights, multiproc worker", "raised FileNotFoundError in start-up: no *.safetensors",
             "--model", "{tmp}/noweights", "--num-kv-blocks", "64", "--executor", "multiproc", "--prompt", "t5"),
    cli_case("config.json that is not JSON", "not a valid JSON file", "--model", "{tmp}/badjson", "--prompt", "t5"),
    cli_case("folder without tokenizer files", "cannot load a tokenizer", "--model", "{tmp}/notokenizer",
             "--prompt", "t5"),
    cli_case("model file that is not .gguf", "is a file but not a .gguf", "--model", "{tmp}/weights.bin",
             "--prompt", "t5"),
    cli_case("truncated GGUF (struct.error)", "truncated or corrupt", "--model", "{tmp}/truncated.gguf",
             "--prompt", "t5"),
    cli_case("empty GGUF file", "truncated or corrupt", "--model", "{tmp}/empty.gguf", "--prompt", "t5"),
    cli_case("--tokenizer that does not exist", "tokenizer path", *TINY, "--tokenizer", "{tmp}/nope"),
    # -- engine flags ----------------------------------------------------------------------------
    cli_case("--worker-cls that cannot be imported", "cannot be imported", *TINY, "--worker-cls", "nope.Worker"),
    cli_case("--worker-cls that is not a Worker", "is not a subclass", *TINY, "--worker-cls",
             "tandem.config.EngineConfig"),
    cli_case("--worker-cls without a module", "dotted path", *TINY, "--worker-cls", "Worker"),
    cli_case("--device cuda without a GPU", "no CUDA GPU", *TINY, "--device", "cuda", setup=("no_cuda",)),
    cli_case("--cpu-kv-cache-gib beyond the machine's memory", "of memory is available", "--model", "{tiny}",
             "--cpu-kv-cache-gib", "1000000"),
    cli_case("--num-kv-blocks beyond the machine's memory", "of memory is available", "--model", "{tiny}",
             "--num-kv-blocks", "1000000000"),
    cli_case("--block-size far too large", "block_size must be a power of two <= 256", *TINY,
             "--block-size", "1048576"),
    cli_case("--block-size not a power of two", "block_size must be a power of two", *TINY, "--block-size", "24"),
    cli_case("--gpu-memory-utilization above 1", "gpu_memory_utilization must be in (0, 1]", *TINY,
             "--gpu-memory-utilization", "1.5"),
    cli_case("--max-num-seqs 0", "max_num_seqs must be an integer >= 1", *TINY, "--max-num-seqs", "0"),
    cli_case("--max-num-seqs not a number", "invalid int value", *TINY, "--max-num-seqs", "many"),
    cli_case("--max-num-batched-tokens 0", "max_num_batched_tokens must be an integer >= 1", *TINY,
             "--max-num-batched-tokens", "0"),
    cli_case("--dtype not a dtype", "invalid choice", *TINY, "--dtype", "int8"),
    cli_case("--max-model-len beyond the model's context", "exceeds the model's context length", *TINY,
             "--max-model-len", "100000"),
    cli_case("--tensor-parallel-size that does not split the model", "does not fit this model", *TINY,
             "--tensor-parallel-size", "3"),
    cli_case("--executor uniproc with 2 ranks", "uniproc executor runs one rank", *TINY, "--executor", "uniproc",
             "--tensor-parallel-size", "2"),
    cli_case("misspelt flag", "did you mean '--max-num-seqs'", *TINY, "--max-num-seq", "3"),
    # -- server flags (tandem serve) -------------------------------------------------------------
    cli_case("--api-server-count 0", "--api-server-count must be >= 1", *TINY, "--api-server-count", "0",
             setup=("serve",)),
    cli_case("--api-server-count -1", "--api-server-count must be >= 1", *TINY, "--api-server-count", "-1",
             setup=("serve",)),
    cli_case("--api-server-count not a number", "--api-server-count must be a whole number >= 1 or 'auto'", *TINY,
             "--api-server-count", "x", setup=("serve",)),
    # -- sampling flags --------------------------------------------------------------------------
    cli_case("--temperature nan", "temperature must be a finite number", *TINY, "--temperature", "nan"),
    cli_case("--top-p inf", "top_p must be a finite number", *TINY, "--top-p", "inf"),
    cli_case("--repetition-penalty nan", "repetition_penalty must be a finite number", *TINY,
             "--repetition-penalty", "nan"),
    cli_case("--sampling-seed not a number", "invalid int value", *TINY, "--sampling-seed", "abc"),
    cli_case("--sampling-seed beyond 64 bits", "seed must be an integer in", *TINY, "--sampling-seed", str(2**65)),
    cli_case("--top-k below -1", "top_k must be an integer >= -1", *TINY, "--top-k", "-2"),
    cli_case("--max-tokens 0", "max_tokens must be an integer >= 1", *TINY, "--max-tokens", "0"),
    cli_case("--min-tokens above --max-tokens", "min_tokens (5) must be <= max_tokens (2)", *TINY,
             "--min-tokens", "5", "--max-tokens", "2"),
    cli_case("--logprobs above --max-logprobs", "exceeds max_logprobs", *TINY, "--logprobs", "5",
             "--max-logprobs", "2", "--prompt", "t5"),
    cli_case("empty --stop string", "stop strings must be non-empty", *TINY, "--stop", ""),
    cli_case("negative --stop-token-ids", "stop_token_ids[0] must be an integer >= 0", *TINY,
             "--stop-token-ids", "-1"),
    cli_case("--n 0", "n must be an integer >= 1", *TINY, "--n", "0"),
    cli_case("--logit-bias that is not a JSON object", "not a JSON object", *TINY, "--logit-bias", "[5]"),
    cli_case("--logit-bias value above 100", "logit_bias values must be in [-100, 100]", *TINY,
             "--logit-bias", '{{"5": 500}}'),
    cli_case("--logit-bias token beyond the vocabulary", "logit_bias token ids must be in [0, 128)", *TINY,
             "--prompt", "t5", "--logit-bias", '{{"999": 1}}'),
    # -- structured outputs ----------------------------------------------------------------------
    cli_case("--structured-outputs regex that does not compile", "the regex does not compile", *TINY,
             "--prompt", "t5", "--structured-outputs", '{{"regex": "(t2[0-9"}}'),
    cli_case("--structured-outputs JSON schema of an unknown type", "the JSON schema does not compile", *TINY,
             "--prompt", "t5", "--structured-outputs", '{{"json": {{"type": "objectx"}}}}'),
    cli_case("--structured-outputs grammar with an undefined rule", "the grammar does not compile", *TINY,
             "--prompt", "t5", "--structured-outputs", '{{"grammar": "root ::= x"}}'),
    cli_case("--structured-outputs json that is not JSON text", "json is not valid JSON text", *TINY,
             "--prompt", "t5", "--structured-outputs", '{{"json": "{{nope"}}'),
    cli_case("--structured-outputs with two constraints", "exactly one of json, regex, choice, grammar", *TINY,
             "--prompt", "t5", "--structured-outputs", '{{"regex": "a", "choice": ["b"]}}'),
    cli_case("--structured-outputs with an empty choice", "choice must list at least one string", *TINY,
             "--prompt", "t5", "--structured-outputs", '{{"choice": []}}'),
    cli_case("--structured-outputs misspelt key", "did you mean 'regex'", *TINY, "--prompt", "t5",
             "--structured-outputs", '{{"rgx": "a"}}'),
    cli_case("--structured-outputs the vocabulary cannot spell", "no token of the model's vocabulary", *TINY,
             "--prompt", "t5", "--structured-outputs", '{{"json_object": true}}'),
    cli_case("--structured-outputs choice shorter than --min-tokens", "min_tokens forbids it", *TINY,
             "--prompt", "t5", "--structured-outputs", '{{"choice": ["t2"]}}', "--min-tokens", "3",
             "--max-tokens", "4"),
    cli_case("--structured-outputs-backend guidance on a tokenizer llguidance cannot read",
             "guidance structured outputs backend could not start", *TINY, "--prompt", "t5",
             "--structured-outputs", '{{"regex": "t2"}}', "--structured-outputs-backend", "guidance"),
    cli_case("--structured-outputs-backend not a backend", "invalid choice", *TINY,
             "--structured-outputs-backend", "outlines"),
    # -- --input and --output --------------------------------------------------------------------
    cli_case("--input that does not exist", "does not exist", *TINY, "--input", "{tmp}/nope.jsonl"),
    cli_case("--input that is a folder", "is a folder", *TINY, "--input", "{tmp}"),
    cli_case("--input that is not UTF-8", "is not UTF-8 text", *TINY, "--input", "{tmp}/latin1.jsonl"),
    cli_case("--input without any request", "holds no requests", *TINY, "--input", "{tmp}/blank.jsonl"),
    cli_case('JSONL {"prompt": 42}', "'prompt' must be a string or a list of token ids", *TINY,
             "--input", "{tmp}/prompt_int.jsonl"),
    cli_case('JSONL {"prompt": [5, 999]} (id beyond the vocabulary)', "prompt token ids must be integers in [0, 128)",
             *TINY, "--input", "{tmp}/prompt_oov.jsonl"),
    cli_case('JSONL {"messages": "hi"}', "messages must be a non-empty list", *TINY,
             "--input", "{tmp}/messages_str.jsonl"),
    cli_case('JSONL {"messages": [{"role": "user"}]}', "needs a string 'content'", *TINY,
             "--input", "{tmp}/messages_nocontent.jsonl"),
    cli_case("JSONL line that is an array", "must be a JSON object", *TINY, "--input", "{tmp}/array.jsonl"),
    cli_case("JSONL line that is not JSON", "not valid JSON", *TINY, "--input", "{tmp}/notjson.jsonl"),
    cli_case('JSONL {"promt": ...} (misspelt key)', "did you mean 'prompt'", *TINY, "--input", "{tmp}/promt.jsonl"),
    cli_case("JSONL line with both prompt and messages", "exactly one of 'prompt' or 'messages'", *TINY,
             "--input", "{tmp}/both.jsonl"),
    cli_case('JSONL "sampling_params": {"temperature": "hot"}', "temperature must be a number", *TINY,
             "--input", "{tmp}/sp_hot.jsonl"),
    cli_case('JSONL "sampling_params": "greedy"', "'sampling_params' must be an object", *TINY,
             "--input", "{tmp}/sp_str.jsonl"),
    cli_case("--output into a missing folder", "is not an existing folder", *TINY, "--prompt", "t5",
             "--output", "{tmp}/missing/out.jsonl"),
    cli_case("--output that is a folder", "is a folder", *TINY, "--prompt", "t5", "--output", "{tmp}"),
    cli_case("--output under a file", "is not an existing folder", *TINY, "--prompt", "t5",
             "--output", "{tmp}/weights.bin/out.jsonl"),
    # -- the embedded default model (no --model) -------------------------------------------------
    cli_case("empty prompt, default model", "the prompt is empty", "--prompt", "", setup=("default_model",)),
    cli_case("chat prompt over --max-model-len, default model", "max_model_len is 16", "--chat", "--max-model-len",
             "16", "--prompt", "What is the capital of France?", setup=("default_model",)),
    cli_case("--tensor-parallel-size 2, default model (9 heads)", "num_attention_heads 9 is not divisible",
             "--tensor-parallel-size", "2", "--prompt", "Hello", setup=("default_model",)),
    cli_case("--no-enable-chunked-prefill with --max-model-len above the CPU's default budget, default model",
             "max_num_batched_tokens (2048, the cpu default) must be >= max_model_len (4096)",
             "--no-enable-chunked-prefill", "--max-model-len", "4096", "--prompt", "Hello",
             setup=("default_model", "no_cuda")),
    cli_case("--structured-outputs schema with an unknown type, default model", "the JSON schema does not compile",
             "--chat", "--prompt", "Hello", "--structured-outputs",
             '{{"json": {{"type": "object", "properties": {{"a": {{"type": "strin"}}}}}}}}', setup=("default_model",)),
    # -- as a separate process: the real exit status --------------------------------------------
    cli_case("empty prompt (process)", "the prompt is empty", *TINY, "--prompt", "", setup=("process",)),
    cli_case('JSONL {"prompt": 42} (process)', "'prompt' must be a string", *TINY,
             "--input", "{tmp}/prompt_int.jsonl", setup=("process",)),
    cli_case("Ctrl-C (SIGINT) while generating (process)", "interrupted", "--model", "{tiny}", "--prompt", "t5",
             "--n", "64", "--max-tokens", "400", "--ignore-eos", "--num-kv-blocks", "8000", "--block-size", "4",
             setup=("process", "sigint")),
    # -- the Python API ----------------------------------------------------------------------------
    api_case('llm.generate("")', "the prompt is empty"),
    api_case("llm.generate([])", "no prompts given"),
    api_case("llm.generate([[]])", "the prompt is empty"),
    api_case("llm.generate([[5, 6.5]])", "token ids must be integers, got float 6.5"),
    api_case("llm.generate([5.0, 6.0])", "token ids must be integers, got float 5.0"),
    api_case("llm.generate([[5, True]])", "token ids must be integers, got bool True"),
    api_case("llm.generate([[5, 100000]])", "prompt token ids must be integers in [0, 128)"),
    api_case("llm.generate([[-1]])", "prompt token ids must be integers in [0, 128)"),
    api_case("llm.generate([list(range(2, 80))])", "max_model_len is 64"),
    api_case('llm.generate(["t5", ""])', "prompt 1: the prompt is empty"),
    api_case("llm.generate(42)", "prompts must be a string, a list of token ids"),
    api_case('llm.generate([{"prompt": "t5"}])', "prompt 0 must be a string or a list of token ids"),
    api_case('llm.generate(["t5"], {"temperature": 0})',
             "sampling_params must be a SamplingParams (or a list of them), got dict"),
    api_case('llm.generate(["t5"], [{"temperature": 0}])', "got list holding dict"),
    api_case('llm.generate(["t5", "t6"], [SamplingParams()])', "got 2 prompts but 1 sampling params"),
    api_case("llm.generate([[5]], SamplingParams(logprobs=50))", "logprobs=50 exceeds max_logprobs=20"),
    api_case("small_cache_llm.generate([list(range(2, 30))], SamplingParams(max_tokens=20, ignore_eos=True))",
             "KV blocks"),
    api_case('llm.chat("hi")', "messages must be a non-empty list"),
    api_case('llm.chat([{"role": "user"}])', "needs a string 'content'"),
    api_case('llm.chat([{"role": "user", "content": "t5"}])', "no chat template"),
    api_case('SamplingParams(temperature=float("nan"))', "temperature must be a finite number"),
    api_case('SamplingParams(top_p=float("inf"))', "top_p must be a finite number"),
    api_case('SamplingParams(min_p=float("nan"))', "min_p must be a finite number"),
    api_case('SamplingParams(repetition_penalty=float("nan"))', "repetition_penalty must be a finite number"),
    api_case('SamplingParams(presence_penalty=float("-inf"))', "presence_penalty must be a finite number"),
    api_case('SamplingParams(seed="abc")', "seed must be an integer, got str"),
    api_case("SamplingParams(seed=1.5)", "seed must be an integer, got float"),
    api_case("SamplingParams(seed=2**70)", "seed must be an integer in"),
    api_case("SamplingParams(seed=True)", "seed must be an integer, got bool"),
    api_case("SamplingParams(top_k=-2)", "top_k must be an integer >= -1"),
    api_case('SamplingParams(logprobs="5")', "logprobs must be an integer, got str"),
    api_case('SamplingParams(temperature="hot")', "temperature must be a number, got str"),
    api_case("SamplingParams(stop=5)", "stop must be a string or a list of strings"),
    api_case('SamplingParams(stop=[""])', "stop strings must be non-empty"),
    api_case("SamplingParams(stop_token_ids=[-1])", "stop_token_ids[0] must be an integer >= 0"),
    api_case("SamplingParams(n=0)", "n must be an integer >= 1"),
    api_case("SamplingParams(max_tokens=0)", "max_tokens must be an integer >= 1"),
    api_case("SamplingParams(min_tokens=5, max_tokens=2)", "min_tokens (5) must be <= max_tokens (2)"),
    api_case("SamplingParams(temprature=0)", "did you mean 'temperature'"),
    api_case("LLM(tiny, max_num_seq=4)", "did you mean 'max_num_seqs'"),
    api_case('LLM("/nonexistent/model")', "does not exist"),
    api_case("LLM(tiny, block_size=1048576)", "block_size must be a power of two <= 256"),
    api_case("LLM(tiny, max_num_seqs=True)", "max_num_seqs must be an integer, got bool"),
    api_case("LLM(tiny, cpu_kv_cache_gib=1e6)", "of memory is available"),
    api_case('LLM(tiny, device="cuda")', "no CUDA GPU", setup=("no_cuda",)),
    api_case('LLM(tiny, worker_cls="nope.Worker")', "cannot be imported"),
    api_case("LLM(tiny, max_model_len=100000)", "exceeds the model's context length"),
    api_case("LLM(tiny, tensor_parallel_size=3)", "does not fit this model"),
    api_case('EngineConfig(max_num_seqs="8")', "max_num_seqs must be an integer, got str"),
    # -- the server (`tandem serve`): fields OpenAI or vLLM define that would change the output --
    http_case("a misspelt field", "Unrecognized request argument supplied: stor", CHAT,
              {"messages": MSG, "stor": True}, "stor"),
    http_case("use_beam_search: true", "beam search is not implemented", C,
              {"prompt": "t5", "use_beam_search": True}, "use_beam_search"),
    http_case("length_penalty other than 1", "beam search is not implemented", C,
              {"prompt": "t5", "length_penalty": 0.5}, "length_penalty"),
    http_case("priority other than 0", "first come, first served", CHAT, {"messages": MSG, "priority": 1},
              "priority"),
    http_case("cache_salt", "cannot be salted", C, {"prompt": "t5", "cache_salt": "s3cret"}, "cache_salt"),
    http_case("truncate_prompt_tokens", "never truncated", C, {"prompt": "t5 t6", "truncate_prompt_tokens": 1},
              "truncate_prompt_tokens"),
    http_case("allowed_token_ids", "logit_bias -100 bans tokens", CHAT,
              {"messages": MSG, "allowed_token_ids": [5]}, "allowed_token_ids"),
    http_case("bad_words", "not implemented", C, {"prompt": "t5", "bad_words": ["t6"]}, "bad_words"),
    http_case("thinking_token_budget", "not implemented", CHAT, {"messages": MSG, "thinking_token_budget": 64},
              "thinking_token_budget"),
    http_case("return_token_ids: true", "not implemented", C, {"prompt": "t5", "return_token_ids": True},
              "return_token_ids"),
    http_case("a per-request chat_template", "--chat-template", CHAT,
              {"messages": MSG, "chat_template": "{{ messages }}"}, "chat_template"),
    http_case('modalities: ["audio"]', "text only", CHAT, {"messages": MSG, "modalities": ["text", "audio"]},
              "modalities"),
    http_case("verbosity", "not implemented", CHAT, {"messages": MSG, "verbosity": "low"}, "verbosity"),
    http_case("continue_final_message with add_generation_prompt: true", "not both", CHAT,
              {"messages": MSG + [{"role": "assistant", "content": "t6"}], "continue_final_message": True,
               "add_generation_prompt": True}, "continue_final_message"),
    http_case("chat_template_kwargs that set the template call's own arguments", "cannot set 'tokenize'", CHAT,
              {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    http_case('reasoning_effort: "extreme"', "Input should be 'none', 'minimal'", CHAT,
              {"messages": MSG, "reasoning_effort": "extreme"}, "reasoning_effort"),
    http_case("an ignored field of the wrong type (metadata values are strings)", "valid string", CHAT,
              {"messages": MSG, "metadata": {"run": 1}}, "metadata.run"),
    http_case("stream_interval 0", "greater than or equal to 1", C, {"prompt": "t5", "stream_interval": 0},
              "stream_interval"),
    # -- the server: tools, output constraints, log-likelihoods (issue 18) --
    http_case("tool_choice without tools", "tool_choice needs tools", CHAT,
              {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    http_case("tool_choice naming a function that is not among the tools", "which is not among the tools", CHAT,
              {"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
              "tool_choice"),
    http_case("a tool whose parameters are not a valid JSON schema", "invalid JSON schema", CHAT,
              {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
               "tool_choice": "required"}, "tools[0].function.parameters"),
    http_case('tool_choice "auto" on a server without --enable-auto-tool-choice', "--enable-auto-tool-choice", CHAT,
              {"messages": MSG, "tools": TOOLS}, "tool_choice"),
    http_case('tool_choice "required" with response_format', "constrains the output already", CHAT,
              {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format"),
    http_case("the deprecated functions", "give tools instead", CHAT,
              {"messages": MSG, "functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    http_case("tools on /v1/completions", "tool calling is on /v1/chat/completions", C,
              {"prompt": "t5", "tools": TOOLS}, "tools"),
    http_case("response_format with an invalid JSON schema", "invalid JSON schema", CHAT,
              {"messages": MSG, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
              "response_format.json_schema.schema"),
    http_case("a regex that does not compile", "does not compile", C,
              {"prompt": "t5", "structured_outputs": {"regex": "t[5"}}, "structured_outputs"),
    http_case("a regex that does not compile, streamed (refused before the 200)", "does not compile", CHAT,
              {"messages": MSG, "structured_outputs": {"regex": "t[5"}, "stream": True}, "structured_outputs"),
    http_case("two output constraints", "at most one output constraint", C,
              {"prompt": "t5", "structured_outputs": {"regex": "t5"}, "guided_choice": ["t6"]}, "guided_choice"),
    http_case("max_tokens 0 without echo", "0 is allowed only with echo", C, {"prompt": "t5", "max_tokens": 0},
              "max_tokens"),
    http_case("prompt_logprobs with stream", "not available when stream is true", C,
              {"prompt": "t5", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    http_case("echo on chat completions", "echo is on /v1/completions", CHAT, {"messages": MSG, "echo": True},
              "echo"),
    api_case('llm.generate(["t5"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(t2")))',
             "the regex does not compile"),
    api_case('llm.generate(["t5", "t6"], [SamplingParams(), SamplingParams(structured_outputs={"grammar": "x"})])',
             "prompt 1: the grammar does not compile"),
    api_case('StructuredOutputsParams(regex="t2", json_object=True)', "exactly one of json, regex, choice"),
    api_case('SamplingParams(structured_outputs={"json": "[1]"})', "json must be a JSON schema object"),
    api_case('LLM(tiny, structured_outputs_backend="outlines")', "structured_outputs_backend must be"),
    # -- speculative decoding (issue 20) -----------------------------------------------------------
    # (JSON braces doubled: the flags go through str.format for the {tiny}/{tmp} paths.)
    cli_case("--speculative-config with an unknown method", "method must be one of 'ngram' or 'draft_model'", *TINY,
             "--speculative-config", '{{"method": "medusa", "num_speculative_tokens": 2}}', "--prompt", "t5"),
    cli_case("--speculative-config num_speculative_tokens out of range",
             "num_speculative_tokens must be an integer in [1, 16]", *TINY,
             "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 99}}', "--prompt", "t5"),
    cli_case("--speculative-config not JSON", "speculative-config", *TINY, "--speculative-config", "ngram",
             "--prompt", "t5"),
    cli_case("draft model with another vocabulary", "a draft must share the target's vocabulary", *TINY,
             "--speculative-config", '{{"method": "draft_model", "model": "{tmp}/vocab256", '
             '"num_speculative_tokens": 3}}', "--prompt", "t5"),
    api_case('LLM(tiny, speculative_config={"method": "draft_model", "model": tiny, "num_speculative_tokens": 3})',
             "is available; use a smaller draft model", setup=("low_memory",)),
]
RESULTS: dict[str, tuple[str, str]] = {}  # case id -> (result, message)


def case_id(case: Case) -> str:
    """Unique by position (several API cases differ only in punctuation)."""
    return f"{CASES.index(case) + 1:03d}-" + re.sub(r"\W+", "-", case.what).strip("-")[:50]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_llama) -> dict[str, str]:
    """The bad files the cases point at."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    (tmp / "empty").mkdir()
    for name, drop in (("noweights", "model.safetensors"), ("notokenizer", "tokenizer.json")):
        shutil.copytree(tiny_llama, tmp / name)
        (tmp / name / drop).unlink()
    shutil.copytree(tiny_llama, tmp / "badjson")
    shutil.copytree(tiny_llama, tmp / "vocab256")  # a draft model whose vocabulary differs from the target's
    cfg = json.loads((tmp / "vocab256" / "config.json").read_text())
    (tmp / "vocab256" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 256}))
    (tmp / "badjson" / "config.json").write_text("{oops")
    (tmp / "weights.bin").write_bytes(b"\0" * 16)
    # GGUF magic, version 3, then the file ends inside the tensor count: the reader's struct.unpack fails.
    (tmp / "truncated.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\x01\x00")
    (tmp / "empty.gguf").write_bytes(b"")
    (tmp / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    (tmp / "blank.jsonl").write_text("\n\n")
    rows = {
        "prompt_int": {"prompt": 42}, "prompt_oov": {"prompt": [5, 999]}, "messages_str": {"messages": "hi"},
        "messages_nocontent": {"messages": [{"role": "user"}]}, "array": [1, 2], "promt": {"promt": "t5"},
        "both": {"prompt": "t5", "messages": [{"role": "user", "content": "t5"}]},
        "sp_hot": {"prompt": "t5", "sampling_params": {"temperature": "hot"}},
        "sp_str": {"prompt": "t5", "sampling_params": "greedy"},
    }
    for name, row in rows.items():
        (tmp / f"{name}.jsonl").write_text(json.dumps({"prompt": "t5"}) + "\n" + json.dumps(row) + "\n")
    (tmp / "notjson.jsonl").write_text("not json\n")
    return {"tmp": str(tmp), "tiny": tiny_llama}


@pytest.fixture(scope="module")
def llms(tiny_llama):
    """The LLMs the API cases run against; the same instances must answer afterwards."""
    llm = LLM(tiny_llama, block_size=4, num_kv_blocks=64, max_model_len=64)
    small = LLM(tiny_llama, block_size=4, num_kv_blocks=4)
    yield {"llm": llm, "small_cache_llm": small}
    llm.shutdown()
    small.shutdown()


def _setup(case: Case, monkeypatch, tmp_path: Path) -> None:
    if "default_model" not in case.setup:  # GGUF conversion attempts: keep them out of ~/.cache
        monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    if "low_memory" in case.setup:  # a machine with 1 KiB free: no draft model fits
        import tandem.models.draft

        monkeypatch.setattr(tandem.models.draft, "available_memory_bytes", lambda: 1024)
    if "no_cuda" in case.setup:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if "default_model" in case.setup:
        from tandem.models.loader import default_model_path

        try:
            default_model_path()
        except FileNotFoundError as e:
            pytest.skip(str(e))


def _run_in_process(argv: list[str], capsys, command: str = "generate") -> tuple[int, str]:
    rc = cli.main([command, *argv] if command == "serve" else [command, "--quiet", *argv])
    return rc, capsys.readouterr().err


def _run_process(argv: list[str], sigint: bool) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "tandem.entrypoints.cli", "generate", *argv]
    if not sigint:
        p = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, timeout=240)
        return p.returncode, p.stderr
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    deadline = time.monotonic() + 240
    while b"Processed prompts" not in seen:  # the progress bar: generation has started
        assert time.monotonic() < deadline and p.poll() is None, seen
        seen += os.read(p.stderr.fileno(), 4096)
    time.sleep(0.1)  # mid-generation: a fast machine finishes the whole job in about 0.5 s
    p.send_signal(signal.SIGINT)
    _, rest = p.communicate(timeout=120)
    return p.returncode, (seen + rest).decode(errors="replace")


@pytest.mark.parametrize("case", [c for c in CASES if c.argv is not None], ids=case_id)
def test_cli_case(case, files, capsys, monkeypatch, tmp_path):
    _setup(case, monkeypatch, tmp_path)
    argv = [a.format(**files) for a in case.argv]
    if "process" in case.setup:
        rc, err = _run_process(argv, "sigint" in case.setup)
    else:
        rc, err = _run_in_process(argv, capsys, "serve" if "serve" in case.setup else "generate")
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and "Processed prompts" not in line]
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [lines[-1]], f"want exactly one error line, at the end: {err}"
    message = lines[-1][len("error: "):]
    assert rc == (130 if "sigint" in case.setup else 2), err
    assert case.must in message, message
    RESULTS[case_id(case)] = (f"exit {rc}", message)


@pytest.mark.parametrize("case", [c for c in CASES if c.code is not None], ids=case_id)
def test_api_case(case, files, llms, monkeypatch, tmp_path):
    _setup(case, monkeypatch, tmp_path)
    namespace: dict[str, Any] = {**llms, "tiny": files["tiny"], "SamplingParams": SamplingParams, "LLM": LLM,
                                 "EngineConfig": EngineConfig, "StructuredOutputsParams": StructuredOutputsParams,
                                 "math": math}
    with pytest.raises((ValueError, TypeError)) as ei:
        eval(case.code, namespace)  # noqa: S307 - the table shows exactly this code
    message = str(ei.value)
    assert "\n" not in message and case.must in message, message
    RESULTS[case_id(case)] = (type(ei.value).__name__, message)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """``tandem serve`` on the tiny model, with the test chat template (tests/server/server_utils.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from server_utils import ServerProcess

    s = ServerProcess(tiny_llama, "--max-model-len", "512", "--num-kv-blocks", "64",
                      tmp=tmp_path_factory.mktemp("bad_inputs_server"))
    yield s
    assert s.stop(signal.SIGTERM) == 0, s.log.read_text()


@pytest.mark.parametrize("case", [c for c in CASES if c.http is not None], ids=case_id)
def test_http_case(case, server):
    import httpx

    path, body, param = case.http
    r = httpx.post(server.url + path, json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and case.must in err["message"] and "\n" not in err["message"], err
    RESULTS[case_id(case)] = (f"400 (param {param})", err["message"])


def test_server_still_answers_after_the_http_cases(server):
    import httpx

    r = httpx.post(f"{server.url}{CHAT}", json={"messages": MSG, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def test_llms_still_answer_after_the_api_cases(llms):
    for name, llm in llms.items():
        assert not llm.engine.has_unfinished_requests(), name
        out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3, name


# -- docs/bad-inputs.md --------------------------------------------------------------------------
def _normalize(text: str, files: dict[str, str]) -> str:
    """Paths and machine-specific numbers out, so the doc is the same on every machine."""
    from tandem.models.loader import DEFAULT_GGUF_FILE

    text = text.replace(files["tmp"], "<tmp>").replace(files["tiny"], "<tiny-model>")
    text = re.sub(r"only [\d.]+ GiB of memory", "only <N> GiB of memory", text)
    # The GGUF readers' own wording varies with the transformers / gguf version; the error type is kept.
    text = re.sub(r"(truncated or corrupt \([\w.]+): .*\)$", r"\1: ...)", text)
    return re.sub(r"/\S*/" + re.escape(DEFAULT_GGUF_FILE), "<default-model>/" + DEFAULT_GGUF_FILE, text)


def _shell(argv: list[str]) -> str:
    """The flags as typed in a shell, placeholders for the test's paths."""
    argv = [a.format(tiny="<tiny-model>", tmp="<tmp>") for a in argv]
    return " ".join(a if a and not re.search(r"[\s'\"]", a) else shlex.quote(a) for a in argv)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(files: dict[str, str]) -> str:
    rows = []
    for i, case in enumerate(CASES, 1):
        result, message = RESULTS[case_id(case)]
        if case.argv is not None:
            where = "CLI (process)" if "process" in case.setup else "`tandem serve`" if "serve" in case.setup else "CLI"
            argv = case.argv[len(TINY):] if case.argv[:len(TINY)] == TINY else case.argv
            shown = f"{case.what}: `{_shell(argv)}`"
        elif case.http is not None:
            path, body, _ = case.http
            where, shown = "HTTP", f"{case.what}: `POST {path} {json.dumps(body)}`"
        else:
            where, shown = "API", f"`{case.what}`"
        if result not in ("ValueError", "TypeError") and not result.startswith(("exit", "400")):
            result += " (a ValueError)"
        rows.append(f"| {i} | {where} | {_cell(shown)} | {result} | {_cell(_normalize(message, files))} |")
    return "\n".join([
        "# Bad inputs and the messages they get",
        "",
        "Generated by `tests/entrypoints/test_bad_inputs.py`, which runs every case below and checks",
        "that the CLI exits with status 2 (130 for Ctrl-C) printing one `error:` line and no traceback,",
        "that the API raises `ValueError`/`TypeError` with a one-line message, that the same `LLM`",
        "still answers afterwards, and that each message names the problem. Regenerate with",
        "`TANDEM_REGEN_DOCS=1 python3 -m pytest -q tests/entrypoints/test_bad_inputs.py`.",
        "",
        "CLI inputs are the flags after `tandem generate --quiet` (`tandem serve` where the table says so),",
        "preceded by",
        "`--model <tiny-model> --num-kv-blocks 256` unless the case gives its own model flags.",
        "`<tiny-model>` is a tiny random Llama (word tokenizer `t0`..`t127`, context 512, no chat",
        "template); without `--model` the embedded SmolLM2-135M-Instruct is used.",
        "In the API cases `llm` is `LLM(<tiny-model>, block_size=4,",
        "num_kv_blocks=64, max_model_len=64)` and `small_cache_llm` the same with `num_kv_blocks=4`.",
        "`--debug` (or `--log-level debug`) adds the traceback to any CLI error.",
        "HTTP cases are sent to `tandem serve <tiny-model>` (with a test chat template); each gets a",
        "400 whose OpenAI error body names the field in `param`.",
        "",
        "| # | Where | Input | Result | Message |",
        "|---|---|---|---|---|",
        *rows,
        "",
        *_server_fields_section(),
    ])


def _server_fields_section() -> list[str]:
    """What the server still refuses, and what it accepts but ignores, from protocol.py's tables."""
    from tandem.entrypoints.openai import protocol as p

    def names(endpoint: str) -> set[str]:
        return set(p.UNSUPPORTED[endpoint])

    refused = []
    for name in sorted(names("completions") | names("chat")):
        where = ("both" if name in names("completions") and name in names("chat")
                 else "completions" if name in names("completions") else "chat")
        harmless = ", ".join(["null", *(f"`{json.dumps(v)}`" for v in p._HARMLESS.get(name, ()))])
        refused.append(f"| `{name}` | {where} | {p.WHY_UNSUPPORTED.get(name, 'not supported')} | {harmless} |")
    ignored = {**p.ChatCompletionRequest.IGNORED, **p.CompletionRequest.IGNORED,
               **{f"messages[].content[].{k}": v for k, v in p.TextPart.IGNORED.items()},
               **{f"stream_options.{k}": v for k, v in p.StreamOptions.IGNORED.items()}}
    return [
        "## Request fields the server refuses or ignores",
        "",
        "A field that neither OpenAI nor vLLM defines on an endpoint is refused by name (a typo must",
        "not pass silently). Of the fields they define, these are refused, because honouring them",
        "would change the output and tandem cannot; a value that asks for nothing (last column) is",
        "accepted and dropped. `null` for `n`, `stream`, `logprobs` and `echo` means their default.",
        "",
        "| Field | Endpoint | Why | Accepted values |",
        "|---|---|---|---|",
        *refused,
        "",
        "These are accepted, type-checked and ignored, because they change nothing tandem generates;",
        "the server logs a warning the first time it sees each one:",
        "",
        "| Field | Why it changes nothing |",
        "|---|---|",
        *(f"| `{name}` | {why} |" for name, why in sorted(ignored.items())),
        "",
    ]


def test_doc_is_up_to_date(files):
    missing = [case.what for case in CASES if case_id(case) not in RESULTS]
    if missing:
        pytest.skip(f"{len(missing)} cases did not run (deselected, skipped or failed): {missing[:3]}")
    assert len(CASES) >= 60 and len({case_id(c) for c in CASES}) == len(CASES)
    text = render(files)
    if os.environ.get("TANDEM_REGEN_DOCS") == "1":
        DOC.write_text(text, encoding="utf-8")
    assert DOC.exists() and DOC.read_text(encoding="utf-8") == text, (
        "docs/bad-inputs.md is out of date: rerun with TANDEM_REGEN_DOCS=1")
