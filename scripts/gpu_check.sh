#!/usr/bin/env bash
# One call on the GPU machine: build the package from this tree, then run the
# multi-process GPU checks and/or the benchmarks; logs and JSON go to $OUT.
#   bash scripts/gpu_check.sh [check|verify|verify2|sanitize|bench|bench2|autobench|fold|tune|all]
#   4/8 GPUs (issue 6): multigpu_check | multigpu_bench | multigpu_fused (multigpu: all three)
#   fused ops (issue 4): ovcheck (all sections) | ovquick | ovgraphs | ovsanitize | ovbench | ovbenchfull
#   issue 5: ovcalibrate (CAL_PART=ag_rs or ar) | train | profile | ovprofilegraphs | decode
#   (several steps in one call: bash scripts/gpu_check.sh verify bench)
# Uses the machine's preinstalled packages (nothing is downloaded). Needs 2
# GPUs for NCCL-based references (psum); with 1 GPU the checks run as 2
# processes on it (--share_gpu) and skip what needs NCCL.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jaxoverlap-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHAT=${1:-all}
if [ $# -gt 1 ]; then  # several steps in one call: gpu_check.sh rest sanitize quickbench
  rc=0; for w in "$@"; do SKIP_BUILD=${SKIP_BUILD:-} bash "$0" "$w" || rc=1; SKIP_BUILD=1; done; exit $rc
fi
status=0
FILTER='GRPC|WatchTasks|coordination_service|Connection refused|CANCELLED|Source Location|grpc_util|^\[rank .\] $|^\[rank .\] [WI][0-9]{4}'

nvidia-smi -L | tee "$OUT/gpus.txt"
NGPU=$(nvidia-smi -L | wc -l)
if [ -z "${SKIP_BUILD:-}" ]; then
  echo "== build ($NGPU GPUs)"
  start=$(date +%s)
  SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90" \
    $PY -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  echo "built in $(( $(date +%s) - start )) s"
fi
if [ "$NGPU" -ge 2 ]; then LAUNCH="--nproc 2"; else LAUNCH="--nproc 2 --share_gpu"; export JAXOVERLAP_NO_NCCL=1; fi

run() {  # run <log name> <timeout s> <env...> -- <launcher args...>
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" env "$@" 2>&1 | tee "$OUT/$name.log" | grep -vE "$FILTER" | tail -25
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "!! $name exited with $rc"; status=1; }
}

if [ "$WHAT" = check ] || [ "$WHAT" = all ]; then
  run check_1x2 280 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 270 tests/multiprocess/check_all_reduce.py
  run check_2x1 150 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 140 \
    tests/multiprocess/check_all_reduce.py sweep stress late
  run errors_heap 45 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 40 tests/multiprocess/check_errors.py heap
  run errors_timeout 60 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 50 tests/multiprocess/check_errors.py timeout
fi

if [ "$WHAT" = sanitize ] || [ "$WHAT" = all ]; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    run "sanitize_$tool" 150 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 140 \
      --wrapper "compute-sanitizer --tool $tool --kernel-name kns=jaxoverlap --report-api-errors no --error-exitcode 3" \
      tests/multiprocess/check_all_reduce.py quick
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race" "$OUT/sanitize_$tool.log" | sort | uniq -c | head
  done
fi

if [ "$WHAT" = verify ]; then  # short re-check after a kernel change
  run verify_1x2 200 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 190 tests/multiprocess/check_all_reduce.py \
    quick stress grads axes late
  run verify_2x1 150 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 140 \
    tests/multiprocess/check_all_reduce.py quick stress
  run verify_2x1_put 150 JAXOVERLAP_RANKS_PER_NODE=1 JAXOVERLAP_FORCE_NVSHMEM_PUT=1 $PY -m jaxoverlap.launch \
    $LAUNCH --timeout_s 140 tests/multiprocess/check_all_reduce.py quick stress
fi

if [ "$WHAT" = rest ]; then  # the sections a failed run did not reach
  run check_1x2_rest 120 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 110 tests/multiprocess/check_all_reduce.py grads axes late
  run errors_timeout 60 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 50 tests/multiprocess/check_errors.py timeout
fi

if [ "$WHAT" = quickbench ]; then
  run quickbench_1x2 120 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 110 benchmarks/all_reduce.py \
    --out "$OUT/quick" --sizes 8K,64K,256K,512K,1M,2M,4M --reps 20
fi

if [ "$WHAT" = verify2 ]; then  # the 2-"node" paths only
  run verify_2x1 150 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 140 \
    tests/multiprocess/check_all_reduce.py quick stress
  run verify_2x1_put 150 JAXOVERLAP_RANKS_PER_NODE=1 JAXOVERLAP_FORCE_NVSHMEM_PUT=1 $PY -m jaxoverlap.launch \
    $LAUNCH --timeout_s 140 tests/multiprocess/check_all_reduce.py quick stress
fi

if [ "$WHAT" = bench2 ] && [ "$NGPU" -ge 2 ]; then
  run bench_2x1 280 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 270 \
    benchmarks/all_reduce.py --out "$OUT"
  run bench_2x1_put 280 JAXOVERLAP_RANKS_PER_NODE=1 JAXOVERLAP_FORCE_NVSHMEM_PUT=1 $PY -m jaxoverlap.launch \
    --nproc 2 --timeout_s 270 benchmarks/all_reduce.py --out "$OUT/put" --sizes 8K,64K,256K,1M,4M
fi

if [ "$WHAT" = fold ]; then  # 3 "nodes" (not a power of two): 3 processes on 2 GPUs, no NCCL
  run fold_3x1 150 JAXOVERLAP_RANKS_PER_NODE=1 JAXOVERLAP_NO_NCCL=1 $PY -m jaxoverlap.launch --nproc 3 \
    --num_gpus "$NGPU" --timeout_s 140 tests/multiprocess/check_all_reduce.py quick late
  run fold_3x1_put 120 JAXOVERLAP_RANKS_PER_NODE=1 JAXOVERLAP_NO_NCCL=1 JAXOVERLAP_FORCE_NVSHMEM_PUT=1 \
    $PY -m jaxoverlap.launch --nproc 3 --num_gpus "$NGPU" --timeout_s 110 \
    tests/multiprocess/check_all_reduce.py quick
fi

if [ "$WHAT" = tune ] && [ "$NGPU" -ge 2 ]; then
  run tune 120 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 110 \
    -m jaxoverlap.tune --out "$OUT/tuning.json" --sizes 8K,256K --reps 10
fi

# issue 6: 4 or 8 GPUs, every topology; in three parts of under 10 minutes each
# (multigpu = all three, for a machine without that limit).
if { [ "$WHAT" = multigpu ] || [ "$WHAT" = multigpu_check ]; } && [ "$NGPU" -ge 4 ]; then
  # ranks per node: all on one node, then 2-GPU and 1-GPU "nodes"; 3 "nodes" for the fold.
  for rpn in "$NGPU" 2 1; do
    run "check_${NGPU}gpu_rpn${rpn}" 300 JAXOVERLAP_RANKS_PER_NODE=$rpn $PY -m jaxoverlap.launch \
      --nproc "$NGPU" --timeout_s 290 tests/multiprocess/check_all_reduce.py quick grads axes late
  done
  [ "$NGPU" -ge 8 ] && run check_8gpu_rpn4 300 JAXOVERLAP_RANKS_PER_NODE=4 $PY -m jaxoverlap.launch \
    --nproc 8 --timeout_s 290 tests/multiprocess/check_all_reduce.py quick grads axes late
  run check_3x1 200 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch --nproc 3 --timeout_s 190 \
    tests/multiprocess/check_all_reduce.py quick late
  [ "$NGPU" -ge 6 ] && run check_3x2 200 JAXOVERLAP_RANKS_PER_NODE=2 $PY -m jaxoverlap.launch --nproc 6 --timeout_s 190 \
    tests/multiprocess/check_all_reduce.py quick late
fi
if { [ "$WHAT" = multigpu ] || [ "$WHAT" = multigpu_bench ]; } && [ "$NGPU" -ge 4 ]; then
  for rpn in "$NGPU" 2 1; do
    run "bench_${NGPU}gpu_rpn${rpn}" 280 JAXOVERLAP_RANKS_PER_NODE=$rpn $PY -m jaxoverlap.launch \
      --nproc "$NGPU" --timeout_s 270 benchmarks/all_reduce.py --out "$OUT" --machine "${NGPU}x H200"
  done
fi
if { [ "$WHAT" = multigpu ] || [ "$WHAT" = multigpu_fused ]; } && [ "$NGPU" -ge 4 ]; then
  # the fused ops at 4/8 ranks (rank-adaptive order over more than 2 ranks)
  run "ovcheck_${NGPU}gpu" 300 $PY -m jaxoverlap.launch --nproc "$NGPU" --timeout_s 290 \
    tests/multiprocess/check_overlap.py quick grads rotation multi
  run "ovbench_${NGPU}gpu" 280 $PY -m jaxoverlap.launch --nproc "$NGPU" --timeout_s 270 \
    benchmarks/overlap.py --out "$OUT" --quick --machine "${NGPU}x H200"
fi

if [ "$WHAT" = autobench ] && [ "$NGPU" -ge 2 ]; then  # auto (with the shipped table) vs psum
  run autobench_1x2 150 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 140 benchmarks/all_reduce.py \
    --out "$OUT/auto" --impls jaxoverlap:auto,xla:psum,floor:launch --reps 20
  run autobench_2x1 150 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 140 \
    benchmarks/all_reduce.py --out "$OUT/auto" --impls jaxoverlap:auto,xla:psum,floor:launch --reps 20
fi

if { [ "$WHAT" = bench ] || [ "$WHAT" = all ]; } && [ "$NGPU" -ge 2 ]; then
  run bench_1x2 280 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 270 benchmarks/all_reduce.py --out "$OUT"
  run bench_2x1 280 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 270 \
    benchmarks/all_reduce.py --out "$OUT"
fi
# ---- fused ops: AG+GEMM, GEMM+RS, GEMM+AR
if [ "$WHAT" = ovcheck ]; then
  run ovcheck 400 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 390 tests/multiprocess/check_overlap.py
fi
if [ "$WHAT" = ovquick ]; then
  run ovquick 200 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 190 tests/multiprocess/check_overlap.py \
    quick rotation multi errors
fi
if [ "$WHAT" = ovgraphs ]; then  # the CUDA-graph question (NOTES.md): plain handlers, then captured ones
  run ovgraphs 150 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 140 tests/multiprocess/check_overlap.py graphs
  run ovgraphs_cmdbuf 150 JAXOVERLAP_FUSED_CMD_BUFFER=1 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 140 \
    tests/multiprocess/check_overlap.py graphs rotation
fi
if [ "$WHAT" = ovsanitize ]; then
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    run "ovsanitize_$tool" 240 $PY -m jaxoverlap.launch $LAUNCH --timeout_s 230 \
      --wrapper "compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 3" \
      tests/multiprocess/check_overlap.py quick
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race" "$OUT/ovsanitize_$tool.log" | sort | uniq -c | head
  done
fi
if [ "$WHAT" = ovbench ] && [ "$NGPU" -ge 2 ]; then
  run ovbench 400 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 390 benchmarks/overlap.py \
    --out "$OUT" --quick ${OVBENCH_FLAGS:-}
fi
if [ "$WHAT" = ovbenchfull ] && [ "$NGPU" -ge 2 ]; then
  run ovbench_full 560 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 550 benchmarks/overlap.py \
    --out "$OUT" ${OVBENCH_FLAGS:-}
  run ovbench_windowed 300 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 290 benchmarks/overlap.py \
    --out "$OUT" --windowed_einsum ${OVBENCH_FLAGS:-}
fi
if [ "$WHAT" = ovwindowed ] && [ "$NGPU" -ge 2 ]; then
  run ovbench_windowed 200 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 190 benchmarks/overlap.py \
    --out "$OUT" --windowed_einsum
fi
# ---- issue 5: the fused ops' auto choices against a chunk sweep (two parts, one call each)
if [ "$WHAT" = ovcalibrate ] && [ "$NGPU" -ge 2 ]; then
  PART=${CAL_PART:-ag_rs}
  if [ "$PART" = ar ]; then
    SHAPES="ar:2048,14336,4096;ar:8192,14336,4096;ar:32768,14336,4096;ar:2048,28672,8192"
    SHAPES="$SHAPES;ar:128,4096,4096;ar:256,4096,4096;ar:512,4096,4096;ar:1024,4096,4096"
    SHAPES="$SHAPES;ar:4096,4096,4096;ar:512,14336,4096;ar:1024,14336,4096"
    IMPLS=xla:local_gemm,jaxoverlap:copy_engine,jaxoverlap:gemm_all_reduce,jaxoverlap:copy_engine/c1,jaxoverlap:copy_engine/c2,jaxoverlap:copy_engine/c4
  else
    SHAPES="ag:16384,4096,4096;rs:16384,4096,4096;ag:8192,8192,28672;rs:8192,8192,28672"
    for m in 2048 8192 32768; do SHAPES="$SHAPES;ag:$m,4096,14336;rs:$m,14336,4096"; done
    SHAPES="$SHAPES;ag:2048,8192,28672;rs:2048,28672,8192"
    # AG at transfer/GEMM ratios 0.47, 0.63, 0.95 (two shapes) and 1.90: where chunks start to pay
    SHAPES="$SHAPES;ag:16384,4096,8192;ag:16384,4096,6144;ag:8192,4096,4096;ag:16384,4096,2048"
    IMPLS=xla:local_gemm,jaxoverlap:copy_engine,jaxoverlap:copy_engine/c1,jaxoverlap:copy_engine/c2,jaxoverlap:copy_engine/c3,jaxoverlap:copy_engine/c4,jaxoverlap:copy_engine/c8
  fi
  run "ovcalibrate_$PART" 560 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 550 benchmarks/overlap.py \
    --out "$OUT/calibrate_$PART" --shapes "$SHAPES" --impls "$IMPLS"
  # This sweep alone (noisy: pool it with others before changing a constant, README).
  $PY benchmarks/calibrate_fused.py --results "$(ls "$OUT/calibrate_$PART"/overlap-*.json | paste -sd,)" \
    --out "$OUT/calibrate_$PART" | tee "$OUT/calibrate_$PART.txt" \
    || { echo "!! calibrate_fused: this sweep contradicts a constant of jaxoverlap/_cuda.py (or it failed)"; status=1; }
fi
# ---- issue 5: the training example (xla vs cuda), a step profile, decode
if [ "$WHAT" = train ] && [ "$NGPU" -ge 2 ]; then
  T=${TRAIN_TIMEOUT:-300}
  run train_step "$T" $PY -m jaxoverlap.launch --nproc 2 --timeout_s $((T - 10)) benchmarks/train_step.py \
    --out "$OUT" --presets ${TRAIN_PRESETS:-gpu_small} ${TRAIN_FLAGS:-}
fi
if [ "$WHAT" = profile ] && [ "$NGPU" -ge 2 ]; then
  for b in ${PROFILE_BACKENDS:-cuda}; do
    run "profile_$b" 100 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 90 benchmarks/profile_step.py \
      --out "$OUT" --backend "$b"
  done
fi
if [ "$WHAT" = ovprofilegraphs ] && [ "$NGPU" -ge 2 ]; then  # NOTES.md "CUDA graphs": profiler or addresses?
  run profile_cmdbuf_notrace 100 JAXOVERLAP_FUSED_CMD_BUFFER=1 $PY -m jaxoverlap.launch --nproc 2 \
    --timeout_s 90 benchmarks/profile_step.py --out "$OUT/notrace" --backend cuda --notrace
  run profile_cmdbuf 100 JAXOVERLAP_FUSED_CMD_BUFFER=1 $PY -m jaxoverlap.launch --nproc 2 \
    --timeout_s 90 benchmarks/profile_step.py --out "$OUT/cmdbuf" --backend cuda
fi
if [ "$WHAT" = decode ] && [ "$NGPU" -ge 2 ]; then
  run decode 150 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 140 benchmarks/decode.py \
    --out "$OUT" ${DECODE_FLAGS:---batches 1,4,16,64 --reps 10}
fi
exit $status
