#!/usr/bin/env bash
# GPU acceptance: the first thing to run on a CUDA machine (the CUDA path is otherwise tested only through fakes).
#
#   scripts/gpu_acceptance.sh [--quick]      # --quick: the bench on the small shape only (no 7.5 GB build)
#   scripts/gpu_acceptance.sh --hybrid-only  # step 5 alone (about 5 minutes on the small shape, rerunnable warm)
#
# Steps, each PASS / FAIL in the table printed at the end (exit status 1 if any failed):
#   1. gpu tests         every test marked gpu (pytest -m gpu): the CUDA store, quantized formats on CUDA, ...
#   2. cuda == resident  a whole model through GPU slots + pinned host tier + disk, every architecture, equal to
#                        the all-resident CUDA run bit for bit (tests/experts/test_three_tiers.py -k cuda)
#   3. memory            peak GPU and host memory while loading and serving a model larger than the GPU budget
#                        (scripts/gpu_memory_check.py: memory_gb below the model's size makes that true on any GPU)
#   4. bench small/large `moeserve bench --device cuda --peers none` on the small and large shapes (tokens/s per
#                        case, moeserve on the GPU: its experts in GPU slots <- pinned RAM <- disk)
#   5. hybrid            the hybrid placement (scripts/gpu_hybrid_check.py, under `timeout`): CPU- vs GPU-computed
#                        experts bit for bit (bf16, int8 units), then decode b1 / b8
#                        and prefill 512 with memory_gb a third of the small shape (a GPU holding a small share of
#                        the experts), each with the HBM, PCIe H2D and host DRAM ceilings probed beside it and every
#                        path's bytes/s as a fraction of its ceiling; peak GPU memory <= memory_gb; placement=hybrid
#                        and placement=cpu give the same logits every step
# Environment: PYTHON (default .venv/bin/python), OUT (logs and JSON; default a new temporary folder).
# Without CUDA it says so in one line and exits 2, running nothing.
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-.venv/bin/python}
QUICK=0
HYBRID_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    --hybrid-only) HYBRID_ONLY=1 ;;
    *) echo "gpu_acceptance: unknown argument '$arg' (valid: --quick, --hybrid-only)" >&2; exit 2 ;;
  esac
done
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_acceptance: no CUDA device here (torch.cuda.is_available() is False in $PY): nothing was run; run it on a machine with an NVIDIA GPU and a CUDA build of torch" >&2
  exit 2
fi
OUT=${OUT:-$(mktemp -d -t moeserve-gpu-acceptance.XXXXXX)}
mkdir -p "$OUT"
MOESERVE=(env PYTHONPATH="$PWD" "$PY" -c "import sys; from moeserve.cli import main; sys.exit(main())")
"$PY" -c "import torch; p = torch.cuda.get_device_properties(0); print(f'device: {p.name}, {p.total_memory / 2**30:.1f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}')" | tee "$OUT/device.txt"

ROWS=()
FAILED=0
bench_detail() {  # "case: tokens/s" for each row of a bench JSON
  "$PY" -c "import json, sys; rows = json.load(open(sys.argv[1]))['rows']; print(', '.join(f\"{r['case']} {r['tokens_per_s']:.1f} tok/s\" for r in rows))" "$1"
}
step() {  # step NAME LOGFILE DETAIL-COMMAND -- COMMAND...
  local name=$1 log=$2 detail=$3
  shift 4
  echo "== $name (log: $log)"
  "$@" >"$log" 2>&1
  local rc=$?
  local result=PASS
  [ "$rc" -eq 0 ] || { result="FAIL (exit $rc)"; FAILED=1; }
  ROWS+=("$(printf '%-18s %-14s %s' "$name" "$result" "$(eval "$detail" 2>/dev/null)")")
  tail -n 3 "$log"
}

hybrid_step() {
  step "hybrid" "$OUT/hybrid.log" "grep -E '^hybrid check' '$OUT/hybrid.log'" -- \
    timeout 420 env PYTHONPATH="$PWD" "$PY" scripts/gpu_hybrid_check.py --shape small
  echo; echo "hybrid (scripts/gpu_hybrid_check.py):"; grep -vE '^(W[0-9]|WARNING|Failed to load)' "$OUT/hybrid.log" | tail -n 20
}
if [ "$HYBRID_ONLY" -eq 1 ]; then
  hybrid_step
  echo; echo "GPU acceptance, hybrid only ($(cat "$OUT/device.txt"))"
  for row in "${ROWS[@]}"; do echo "$row"; done
  echo "logs: $OUT"
  exit "$FAILED"
fi

step "gpu tests" "$OUT/gpu_tests.log" "tail -n 1 '$OUT/gpu_tests.log'" -- \
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests
step "cuda == resident" "$OUT/three_tiers.log" "tail -n 1 '$OUT/three_tiers.log'" -- \
  "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/experts/test_three_tiers.py
step "memory" "$OUT/memory.log" "grep -E '^peak' '$OUT/memory.log' | tr '\n' ';'" -- \
  "$PY" scripts/gpu_memory_check.py --shape small
SHAPES=(small large)
[ "$QUICK" -eq 1 ] && SHAPES=(small)
for shape in "${SHAPES[@]}"; do
  step "bench $shape" "$OUT/bench_$shape.log" "bench_detail '$OUT/bench_$shape.json'" -- \
    "${MOESERVE[@]}" bench --shape "$shape" --device cuda --peers none --json "$OUT/bench_$shape.json"
done
for shape in "${SHAPES[@]}"; do
  echo; echo "moeserve bench --shape $shape --device cuda (its own table):"
  tail -n 25 "$OUT/bench_$shape.log"
done
hybrid_step

echo
echo "GPU acceptance ($(cat "$OUT/device.txt"))"
printf '%-18s %-14s %s\n' "step" "result" "detail"
for row in "${ROWS[@]}"; do echo "$row"; done
echo "logs: $OUT"
exit "$FAILED"
