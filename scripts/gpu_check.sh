#!/usr/bin/env bash
# One call on the GPU machine: build the package from this tree, run the
# multi-process GPU checks and the benchmarks; logs and JSON go under $OUT.
#   bash scripts/gpu_check.sh [check|bench|all]
# Uses the machine's preinstalled packages (nothing is downloaded).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jaxoverlap-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHAT=${1:-all}
status=0

nvidia-smi -L | tee "$OUT/gpus.txt"
NGPU=$(nvidia-smi -L | wc -l)
echo "== build ($NGPU GPUs)"
start=$(date +%s)
SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90" \
  $PY -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
$PY -c "from jaxoverlap import _ffi; _ffi.load(); print('extension loaded, targets registered')" || exit 1

if [ "$NGPU" -ge 2 ]; then LAUNCH="--nproc 2"; else LAUNCH="--nproc 2 --share_gpu"; fi

if [ "$WHAT" = check ] || [ "$WHAT" = all ]; then
  echo "== multi-process checks ($LAUNCH)"
  timeout 300 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 280 tests/multiprocess/check_all_reduce.py \
    2>&1 | tee "$OUT/check_all_reduce.log" | grep -vE "^\[rank [0-9]+\] (W|I)[0-9]{4}" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if { [ "$WHAT" = bench ] || [ "$WHAT" = all ]; } && [ "$NGPU" -ge 2 ]; then
  echo "== all_reduce benchmark"
  timeout 240 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 230 benchmarks/all_reduce.py \
    --out "$OUT" 2>&1 | tee "$OUT/bench_all_reduce.log" | grep -E "rank 0\] +[0-9]+ B|wrote|Error|error" | tail -20
fi
exit $status
