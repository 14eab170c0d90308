"""Third-party clients (lm-eval, guidellm, aiperf) against ``tandem serve`` on the embedded
model, each finding the tokenizer the documented way (README, "Benchmark and evaluation
clients"): lm-eval through ``/tokenizer_info``, guidellm and aiperf through the folder that
``/v1/models`` names (the GGUF's conversion under ``~/.cache/tandem/gguf/``). The tools are
large and not test dependencies: each test runs only if its tool is installed, on PATH or in
``$TANDEM_CLIENT_TOOLS_BIN`` (e.g. the bin folder of a venv made for them)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import httpx
import pytest

from server_utils import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def tool(name: str) -> str:
    extra = os.environ.get("TANDEM_CLIENT_TOOLS_BIN")
    found: Optional[str] = shutil.which(name, path=extra) if extra else None
    found = found or shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (set TANDEM_CLIENT_TOOLS_BIN to the folder that holds it)")
    return found


def run(cmd: list[str], cwd: Path, timeout: float = 800, hub_offline: bool = True) -> str:
    """Run a tool; ``hub_offline``: tell Hugging Face libraries not to try the hub (aiperf 0.13
    must not be told: in offline mode it takes a tokenizer folder for a hub repo id)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    if hub_offline:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The embedded SmolLM2, as a user starts it (``tandem serve``), once for the module."""
    if not any(shutil.which(t, path=os.environ.get("TANDEM_CLIENT_TOOLS_BIN")) or shutil.which(t)
               for t in ("lm_eval", "guidellm", "aiperf")):
        pytest.skip("none of lm_eval, guidellm, aiperf is installed")
    s = ServerProcess("", "--max-model-len", "2048", tmp=tmp_path_factory.mktemp("tools"), chat_template=False)
    yield s
    assert s.stop() == 0


def served(server) -> tuple[str, str]:
    """The model name and tokenizer folder, as a client discovers them from /v1/models."""
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    return card["id"], card["tokenizer"]


def test_lm_eval_finds_the_remote_tokenizer(server, tmp_path):
    name, _ = served(server)
    out = run([tool("lm_eval"), "--model", "local-completions", "--model_args",
               f"model={name},base_url={server.url}/v1/completions,num_concurrent=4,max_retries=1",
               "--tasks", "tandem_capitals", "--include_path", "benchmarks/lm_eval_task",
               "--output_path", str(tmp_path / "out")], cwd=REPO)
    assert "Using remote tokenizer" in out, out[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert results["n-samples"]["tandem_capitals"]["effective"] == 16
    assert results["results"]["tandem_capitals"]["exact_match,strip"] >= 0.25  # greedy SmolLM2 knows some capitals


def test_guidellm_with_the_tokenizer_folder(server, tmp_path):
    name, folder = served(server)
    run([tool("guidellm"), "run", "--backend",
         f"kind=openai_http,target={server.url},model={name},request_format=/v1/completions",
         "--profile", "kind=concurrent,streams=8", "--tokenizer", f"kind=huggingface_auto,model={folder}",
         "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
         "--constraint", "kind=max_requests,count=16", "--output", f"kind=json,path={tmp_path / 'g.json'}",
         "--disable-console"], cwd=tmp_path)
    report = json.loads((tmp_path / "g.json").read_text())
    assert report["benchmarks"][0]["metrics"]["request_totals"] == {"successful": 16, "errored": 0,
                                                                     "incomplete": 0, "total": 16}


def test_aiperf_with_the_tokenizer_folder(server, tmp_path):
    name, folder = served(server)
    out = run([tool("aiperf"), "profile", "--model", name, "--url", server.url, "--endpoint-type", "completions",
               "--streaming", "--tokenizer", folder, "--concurrency", "8", "--request-count", "16",
               "--prompt-input-tokens-mean", "16", "--prompt-output-tokens-mean", "8", "--extra-inputs",
               "ignore_eos:true", "--output-artifact-dir", str(tmp_path / "a"), "--ui-type", "simple",
               "--no-gpu-telemetry"], cwd=tmp_path, hub_offline=False)
    export = json.loads(next((tmp_path / "a").rglob("profile_export_aiperf.json")).read_text())
    assert export["completed_request_count"]["avg"] == 16 and export["error_summary"] == [], out[-2000:]
    assert export["usage_completion_tokens"]["avg"] == 8  # ignore_eos: every request ran to its budget
