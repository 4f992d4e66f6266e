#!/usr/bin/env bash
# The CPU performance targets' shapes, each suite against torch SDPA in one run, for the
# README's results table and the performance issue's notes (about 10 minutes on 2 cores,
# and 1-3 more for the flex suite, its FlexAttention compiles included):
#   forward          gpt2-small (D 64) and llama2-70b (D 128), S 1024 and 4096, fp32 and bf16
#   forward_backward the same models at S 1024
#   gqa_prefill      32 query / 8 kv heads, D 128, S 2048
#   paged_decode     batch 8, context 4096 (llama2-7b, 32q/8kv and llama2-70b heads)
#   cache_append     one token at 512, 4k and 32k context
#   call_overhead    per-call times at B 1, H 12, S 128, D 64 and decode-loop shapes, fp32 and bf16
#   flex             against FlexAttention (torch.compile), not torch SDPA: causal, window and
#                    softcap prefill at S 2048, paged decode at context 4096, fp32 and bf16
# Usage: bash benchmarks/cpu_targets.sh [output folder, default benchmarks/results/cpu]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/cpu}"
bench() {  # bench SUITE ARGS...: one suite's run, its results.json kept in $out/SUITE
  local suite="$1"; shift
  echo "== python -m mha_ext.bench --suite $suite $*"
  python -m mha_ext.bench --suite "$suite" "$@" --no-plots --out "$out/$suite"
}
both="--models gpt2-small llama2-70b --dtype float32 bfloat16"
bench forward $both --seq 1024 4096
bench forward_backward $both --seq 1024
bench gqa_prefill --dtype float32 bfloat16 --seq 2048
bench paged_decode --dtype float32 bfloat16 --context 4096
bench cache_append --append-context 512 4096 32768
bench call_overhead --dtype float32 bfloat16 --repeats 15
bench flex --dtype float32 bfloat16 --seq 2048 --context 4096
