"""lm-eval's ``local-completions`` against the real server (when lm-eval is installed): a small
multiple-choice task over a local jsonl file must give, item by item, the log-likelihoods
lm-eval's own ``hf`` backend computes from the same weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.timeout(900)

TASK = """task: tiny_words_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def run_lm_eval(model: str, model_args: str, task_dir: Path, out: Path) -> dict[int, list[float]]:
    """lm_eval's per-item log-likelihoods of each choice."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--include_path",
           str(task_dir), "--tasks", "tiny_words_mc", "--output_path", str(out), "--log_samples"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=800, env=env, cwd=task_dir)
    assert p.returncode == 0, p.stderr[-4000:]
    (samples,) = out.rglob("samples_tiny_words_mc_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return {r["doc_id"]: [float(resp[0][0]) for resp in r["resps"]] for r in rows}


def test_local_completions_gives_hf_log_likelihoods(server, tiny_llama, tmp_path):
    data = tmp_path / "items.jsonl"
    with data.open("w") as f:
        for i in range(12):
            question = " ".join(f"t{5 + (i * 7 + j * 11) % 90}" for j in range(3 + i % 5))
            choices = [" ".join(f"t{10 + (i + 3 * k + m) % 100}" for m in range(1 + k % 3)) for k in range(4)]
            f.write(json.dumps({"question": question, "choices": choices, "answer": i % 4}) + "\n")
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    served = run_lm_eval("local-completions",
                         f"model={tiny_llama},base_url={server.url}/v1/completions,tokenizer={tiny_llama},"
                         "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1", tmp_path, tmp_path / "served")
    hf = run_lm_eval("hf", f"pretrained={tiny_llama},dtype=float32", tmp_path, tmp_path / "hf")
    assert served.keys() == hf.keys() and len(served) == 12
    for doc in served:
        assert served[doc] == pytest.approx(hf[doc], abs=1e-3), doc
