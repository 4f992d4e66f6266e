#!/usr/bin/env bash
# The GPU check of the CUDA backend, for one GPU in under 8 minutes. Expects mha_ext built
# with CUDA (pip install --no-build-isolation .) and a visible GPU; prints one summary.
#   1. every test's CUDA variant plus tests/test_cuda.py, then the accuracy tests again
#      with MHA_EXT_CUDA_KERNELS=simt (the generic kernels instead of the tensor cores);
#   2. compute-sanitizer's memcheck, racecheck and synccheck over a small CUDA subset
#      (attention forward and backward of both kernel families, paged attention, append);
#   3. the benchmark suite on the issue's target shapes against torch SDPA's flash, cuDNN
#      and efficient backends (bf16, D 128, S 4096; decode batch 64 at 4k; append batch 256).
# Step 2 has not yet run on a GPU: its time is a guess (each tool slows kernels 10-100x).
# Usage: bash benchmarks/gpu_check.sh [output folder, default benchmarks/results/gpu]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu}"
mkdir -p "$out"
python - <<'PY' || exit 1
import torch, mha_ext
assert torch.cuda.is_available(), "no CUDA device visible"
info = mha_ext.build_info()
assert info["cuda_version"], "mha_ext was built without CUDA"
print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, mha_ext CUDA {info['cuda_version']}")
PY

status=0
step() {  # step NAME COMMAND...: runs it, keeps the log, records pass/fail
  local name="$1"; shift
  local started=$SECONDS
  if "$@" > "$out/$name.log" 2>&1; then result=pass; else result=FAIL; status=1; fi
  echo "$name: $result ($((SECONDS - started)) s), $(tail -n 1 "$out/$name.log")" | tee -a "$out/summary.txt"
}
: > "$out/summary.txt"
step tests_cuda bash -c "cd tests && python -m pytest -q -p no:cacheprovider -k cuda ."
step tests_cuda_simt bash -c "cd tests && MHA_EXT_CUDA_KERNELS=simt python -m pytest -q -p no:cacheprovider -k cuda \
  test_attention.py test_dropout.py test_sdpa.py test_modules.py"
# memcheck: out-of-bounds and misaligned accesses, with torch's caching allocator off so that
# every tensor is an allocation of its own (a read past a tensor inside a cached block would
# go unseen); racecheck: shared-memory hazards between a block's threads; synccheck: barriers
# that not all threads of a block reach. --error-exitcode makes any report fail the step.
sanitizer=compute-sanitizer
command -v "$sanitizer" > /dev/null || sanitizer="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
sanitizer_subset="cuda and ((test_both_kernel_families_match_the_reference and causal_bottom_right \
  and bfloat16) or (test_paged_attention_matches_reference and gqa) \
  or (test_append_writes_exactly_the_addressed_slots and bfloat16))"
for tool in memcheck racecheck synccheck; do
  step "sanitizer_$tool" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 bash -c "cd tests && \
    $sanitizer --tool $tool --error-exitcode 1 --target-processes all \
    python -m pytest -q -p no:cacheprovider -k '$sanitizer_subset' test_cuda.py test_paged.py"
done
bench="python -m mha_ext.bench --device cuda --repeats 10 --no-plots"
step bench_attention $bench --suite forward forward_backward --models llama2-7b --seq 4096 --dtype bfloat16 \
  --out "$out/attention"
step bench_decode $bench --suite paged_decode --context 4096 --decode-batch 64 --dtype bfloat16 --out "$out/decode"
step bench_append $bench --suite cache_append --append-context 512 --append-batch 256 --out "$out/append"

python - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
HBM_GBPS = 4800.0  # H200 HBM3e, published peak

def results(name):
    path = out / name / "results.json"
    return json.loads(path.read_text())["results"] if path.exists() else []

print("\ntarget                                              measured")
for r in results("attention"):
    flash = r["results"].get("torch_sdpa_flash")
    ours = r["results"].get("mha_ext")
    if flash and ours:
        target = 0.7 if r["params"]["backward"] else 0.8
        ratio = flash["seconds_per_call"] / ours["seconds_per_call"]
        verdict = "ok" if ratio >= target else "BELOW"
        print(f"{r['suite']:17} {r['label']:28} >= {target}x flash: {ratio:.2f}x {verdict}")
for r in results("decode"):
    if r["params"]["model"] == "llama2-70b" and "mha_ext" in r["results"]:
        gbps = r["results"]["mha_ext"]["throughput"]
        print(f"paged decode {r['label']:38} >= 70% HBM: {gbps:.0f} GB/s = {gbps / HBM_GBPS:.0%} "
              f"{'ok' if gbps >= 0.7 * HBM_GBPS else 'BELOW'}")
for r in results("append"):
    if "mha_ext" in r["results"]:
        # An append reads and writes each byte: twice the K/V bytes of the tokens move.
        gbps = 2 * r["results"]["mha_ext"]["throughput"]
        print(f"append {r['label']:44} >= 60% HBM: {gbps:.0f} GB/s = {gbps / HBM_GBPS:.0%} "
              f"{'ok' if gbps >= 0.6 * HBM_GBPS else 'BELOW'}")
PY
exit $status
