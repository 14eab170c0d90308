#!/usr/bin/env bash
# One device call: install the carried wheels, then run the named plans in order, each under
# its own time limit so that one call (600 s at most) returns what finished. Results and logs
# go to $OUT (the device tool brings them back); record them in benchmarks/RESULTS.md.
#
#   bash benchmarks/gpu/prepare.sh                       # here, once: .whl/ and .tok/
#   run(command="bash benchmarks/gpu/session.sh trace", carry=[".whl", ".tok"])   # then: ... mixed
# (one call runs at most 600 s: plans whose budgets add up to more go in calls of their own)
#
# Plans (seconds are the budget each gets):
#   mixed      (330) the mixed-batch CUDA graph tests, then served 0%/100% constrained with
#                    TANDEM_MIXED_GRAPH_MAX_TOKENS=1024 and =0 (2 rounds each, one host)
#   trace      (450) the engine core's step trace, one server at 0%, one at 100% constrained, and one at
#                    100% with the grammar work faked (--fake-grammar: the constrained path's own cost)
#   profile    (240) py-spy of the served engine core (all threads, idle samples too), one server
#                    each at 0%, 100% and 100% with the grammar faked; then
#                    pyspy_diff.py A B --root EngineCore._launch says what a gated launch adds
#   depth      (300) 0.5B batch 1 and batch 256, tandem async with TANDEM_ASYNC_DEPTH=2 and 3 (issue 19:
#                    batch 1's GPU idled 21% behind a 0.53 ms host step on the H100 host)
#   gatedgraph (560) the gated decode graph tests, then served 0%/100% constrained with
#                    TANDEM_GATED_GRAPHS=1 and =0, on one host, the order swapped in a second pair
#                    (issue 18: one replay per gated decode step instead of a wait launch, two
#                    copies and a second replay on the engine thread)
#   structured (300) served throughput at 0, 20, 80 and 100% constrained, 3 rounds (issue 18's table)
#   b1         (150) 0.5B batch 1, tandem async (issue 19)
#   tput       (400) 0.5B and 7B throughput + batch 1, tandem sync and async (issue 19's table)
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
S=$(date +%s)
el() { echo "[+$(( $(date +%s) - S ))s] $*"; }
if ! ls .whl/*.whl > /dev/null 2>&1 || [ ! -d .tok ]; then  # (a call that ran without them spent its start-up on nothing)
  echo "no .whl/ or .tok/ here: run benchmarks/gpu/prepare.sh in the checkout the device copies, and carry both"
  exit 2
fi
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"
SERVE="benchmarks/gpu_serve.py --shape qwen2.5-0.5b --skip-offline --api-server-counts= --num-prompts 3072 --tokenizer-from .tok"

plan_mixed() {
  timeout 150 python -m pytest -q -x tests/gpu/test_gpu_engine.py \
    -k "mixed_batches or masked_sampling or fp32_gpu_greedy" 2>&1 | tail -8
  for m in 1024 0; do
    el "serve, TANDEM_MIXED_GRAPH_MAX_TOKENS=$m"
    TANDEM_LOG_LEVEL=INFO TANDEM_MIXED_GRAPH_MAX_TOKENS=$m timeout 170 python $SERVE --structured-ratios 0,1 \
      --structured-rounds 2 --out "$OUT/serve_mixed$m.json" > "$OUT/serve_mixed$m.log" 2>&1
    grep -E "mixed|prefill steps|^\| [01] " "$OUT/serve_mixed$m.log" | tail -12
  done
}
plan_trace() {
  for run in 0 1 1fake; do
    el "step trace, constrained share $run"
    timeout 150 python $SERVE --structured-ratios ${run:0:1} --structured-rounds 1 --step-trace \
      $([ "$run" = 1fake ] && echo --fake-grammar) \
      --out "$OUT/serve_trace$run.json" > "$OUT/serve_trace$run.log" 2>&1
    grep -E "step trace|^\| [01] " "$OUT/serve_trace$run.log" | tail -24
  done
}
plan_profile() {
  for run in 0 1 1fake; do
    el "py-spy, constrained share $run"
    timeout 110 python $SERVE --structured-ratios ${run:0:1} --structured-rounds 1 --profile-core-ratio ${run:0:1} \
      $([ "$run" = 1fake ] && echo --fake-grammar) --out "$OUT/serve_profile$run.json" > "$OUT/serve_profile$run.log" 2>&1
    grep -E "^\| [01] " "$OUT/serve_profile$run.log" | tail -2
  done
  for run in 1 1fake; do
    echo "--- what a gated launch adds, $run against 0 (samples through EngineCore._launch) ---"
    python benchmarks/pyspy_diff.py "$OUT/serve_profile${run}_core_r1.pyspy" "$OUT/serve_profile0_core_r0.pyspy" \
      --root EngineCore._launch 2>&1 | head -40
  done
}
plan_depth() {
  for d in 2 3; do
    el "TANDEM_ASYNC_DEPTH=$d"
    TANDEM_ASYNC_DEPTH=$d timeout 150 python benchmarks/gpu_bench.py --shapes qwen2.5-0.5b --workloads batch1,throughput \
      --systems tandem --tandem-modes tandem_async --rounds 1 --out "$OUT/gpu_bench_depth$d.json" \
      > "$OUT/gpu_bench_depth$d.log" 2>&1
    grep -E "tok/s|idle" "$OUT/gpu_bench_depth$d.log" | head -6
  done
}
plan_gatedgraph() {
  timeout 150 python -m pytest -q -x tests/gpu/test_gpu_engine.py tests/kernels/test_host_flag.py \
    tests/kernels/test_bitmask_kernel.py -k "gated_decode_graphs or host_bitmask or staged_gate or stream_waits" \
    2>&1 | tail -6
  local k=0
  for g in 1 0 0 1; do
    k=$((k + 1))
    el "serve $k, TANDEM_GATED_GRAPHS=$g"
    TANDEM_LOG_LEVEL=INFO TANDEM_GATED_GRAPHS=$g timeout 100 python $SERVE --structured-ratios 0,1 \
      --structured-rounds 1 --out "$OUT/serve_gatedgraph${g}_$k.json" > "$OUT/serve_gatedgraph${g}_$k.log" 2>&1
    grep -E "gated decode|^\| [01] " "$OUT/serve_gatedgraph${g}_$k.log" | tail -4
  done
}
plan_structured() {
  timeout 300 python $SERVE --structured-ratios 0,0.2,0.8,1 --structured-rounds 3 \
    --out "$OUT/serve_structured.json" > "$OUT/serve_structured.log" 2>&1
  tail -8 "$OUT/serve_structured.log"
}
plan_b1() {
  timeout 150 python benchmarks/gpu_bench.py --shapes qwen2.5-0.5b --workloads batch1 --systems tandem \
    --tandem-modes tandem_async --rounds 1 --out "$OUT/gpu_bench_b1.json" > "$OUT/gpu_bench_b1.log" 2>&1
  tail -6 "$OUT/gpu_bench_b1.log"
}
plan_tput() {
  timeout 400 python benchmarks/gpu_bench.py --shapes qwen2.5-0.5b,qwen2.5-7b --workloads throughput,batch1 \
    --systems tandem --tandem-modes tandem_sync,tandem_async --rounds 3 \
    --out "$OUT/gpu_bench_tput.json" > "$OUT/gpu_bench_tput.log" 2>&1
  tail -12 "$OUT/gpu_bench_tput.log"
}
for plan in "$@"; do
  el "plan $plan"
  "plan_$plan" || echo "plan $plan failed: $?"
done
el done
