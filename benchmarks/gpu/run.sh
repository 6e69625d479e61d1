#!/bin/bash
# The CUDA check: parity, kernels and graph replay, the issue's two speed measures, serve, warm restart;
# ends with one table. Steps 2, 3, 5, 6 run side by side (tiny models); step 4 runs alone for clean timings.
# Usage (project root, on the CUDA machine): bash benchmarks/gpu/run.sh   [STEPS="1 2 3 4 5 6"] [OUT=folder]
# With .gpu/whl present (prepare.sh) the wheels are installed into /tmp/site first; SKIP_INSTALL=1 skips that.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
HERE=$PWD/benchmarks/gpu
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; rm -f "$OUT/summary.txt"; export OUT
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
STEPS=${STEPS:-"1 2 3 4 5 6"}
has() { [[ " $STEPS " == *" $1 "* ]]; }
PY=${PY:-python3}
PROJ=$PWD; export PROJ

{
  el "install wheels"
  if [ -z "$SKIP_INSTALL" ] && ls .gpu/whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl 2>&1 | tail -5
    echo "pip rc=${PIPESTATUS[0]}"
  fi
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  nproc; free -g | head -2
} 2>&1 | tee "$OUT/01_setup.log"
export PYTHONPATH=/tmp/site:$PROJ:$HERE${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false

step_env() {  # separate compile caches per step: each step's compile time is a cold one
  export VLLM_CACHE_ROOT=/tmp/vc_$1 TRITON_CACHE_DIR=/tmp/triton_$1 VLLM_NEURON_TEST_CACHE=/tmp/vnt_$1
}

if has 1; then
  (step_env 1; el "step 1"; timeout -k 5 90 $PY $HERE/s01_setup.py) 2>&1 | tee -a "$OUT/01_setup.log"
  el "step 1 done" | tee -a "$OUT/01_setup.log"
fi

pids=()
if has 2; then
  ( step_env 2; el "step 2 start"
    timeout -k 10 ${T2:-60} $PY $HERE/s02_kernels.py
    timeout -k 10 ${T2:-180} $PY -m pytest -q -m gpu -p gpuplug --continue-on-collection-errors -rfEs --tb=short \
      -p no:cacheprovider $PROJ/tests
    rc=$?
    el "step 2 rc=$rc"
    if [ $rc -eq 0 ]; then r=PASS; else r=FAIL; fi
    echo "RESULT 2 pytest -m gpu: $r rc=$rc" >> "$OUT/summary.txt"
  ) > "$OUT/02_pytest.log" 2>&1 &
  pids+=($!)
fi
if has 3; then
  ( step_env 3; el "step 3 start"; timeout -k 10 ${T3:-170} $PY $HERE/s03_parity.py; el "step 3 rc=$?" ) > "$OUT/03_parity.log" 2>&1 &
  pids+=($!)
fi
if has 5; then
  ( step_env 5; el "step 5 start"; timeout -k 10 ${T5:-170} $PY $HERE/s05_serve.py; el "step 5 rc=$?" ) > "$OUT/05_serve.log" 2>&1 &
  pids+=($!)
fi
if has 6; then
  ( step_env 6; el "step 6 start"; timeout -k 10 ${T6:-420} $PY $HERE/s06_warm_restart.py; el "step 6 rc=$?" ) > "$OUT/06_warm.log" 2>&1 &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done
el "phase A done"

if has 4; then
  (step_env 4; el "step 4 start"; timeout -k 10 ${T4:-300} $PY $HERE/s04_speed.py; el "step 4 rc=$?") 2>&1 | tee "$OUT/04_speed.log"
fi
el "all done"
for f in 02_pytest 03_parity 05_serve 06_warm; do
  echo "================ $f (tail)"; grep -v '"GET /health' "$OUT/$f.log" 2>/dev/null | tail -n 25
done
echo "================ SUMMARY"; cat "$OUT/summary.txt" 2>/dev/null
$PY $HERE/s09_table.py
