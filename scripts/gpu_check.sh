#!/usr/bin/env bash
# One call on the GPU machine: build the package from this tree, then run the GPU test
# suite or a benchmark; logs and JSON go to $OUT (few files: one log per verb).
#   bash scripts/gpu_check.sh build
#   bash scripts/gpu_check.sh suite [extra pytest args]   # pytest -m gpu tests/gpu
#       SKIP_BUILD=1: no build first. SANITIZE=memcheck,racecheck: also the compute-sanitizer
#       runs (tests/gpu/test_gpu_sanitize.py, e.g. suite -k sanitize).
#       On 2 GPUs, four parts of under 10 minutes each (the ids: tests/gpu/test_gpu_*.py):
#         bash scripts/gpu_check.sh suite -k "fused or norm"   (build; the fused ops: w2, 4, 8; norm)
#         SKIP_BUILD=1 bash scripts/gpu_check.sh suite -k "errors or flag_wrap or (all_reduce and w2-)"
#         SKIP_BUILD=1 bash scripts/gpu_check.sh suite -k "all_reduce and not w2-"
#         SKIP_BUILD=1 bash scripts/gpu_check.sh suite -k "models or attention or harness"
#   benchmarks: bench | bench2 | autobench | quickbench | tune | ovbench | ovbenchfull
#       | ovwindowed | ovcalibrate (CAL_PART=ag_rs or ar) | train | cmdbufcost (train steps with the
#       fused ops outside, then inside, XLA's CUDA graphs, twice) | normbench (all-reduce +
#       residual + RMSNorm: the fused kernel against psum + norm and all_reduce + norm;
#       NORM_CLUSTERS="0 1" also with every row on one block)
#       | profile | ovprofilegraphs
#       | decode | decodefloor (one GPU: the TP=2 rank's decode step against its weights-read
#       roofline, with and without XLA's CUDA graphs; a profile)
#       | procbench (one process driving both GPUs beside two processes)
#       | procrepeat (auto and psum from 8 KiB to 1 MiB in one process driving both GPUs, then in
#       two processes, alternating, four times; PROC_REPEATS)
#       | pallasbench (AG+GEMM: ours against JAX's Pallas collective matmul, one process)
#       | contention (how much the fused ops' transfers slow their concurrent GEMMs, from
#       profiler traces) | ovrepeat (AG and RS at 16384x4096x4096 three times, one process, auto's
#       chunks and four, beside the local GEMM and the Pallas collective matmul) | ovrepeat2 (the
#       same in two processes, without Pallas)
#       | lamportab (the Lamport grid variants side by side; AB_CONFIGS, AB_SIZES)
#       | epochab (the one-shot LL all-reduce advancing its epochs at the start,
#       JAXOVERLAP_EPOCH_AT_START=1, against the default, in one and in two processes, each way
#       twice) | epochab2 (the norm kernel the same way, then the bookkeeping probe)
#       | hierab (2 emulated nodes x 1 GPU: the hierarchical LL all-reduce's v4 kernel against
#       v3, JAXOVERLAP_HIERARCHICAL_LL=v3, each twice, with direct stores and with puts)
#       | pdlfloor (one GPU: the custom-call launch floor with and without programmatic
#       dependent launch, and with the all-reduce kernels' per-call bookkeeping; PDL_FLAGS)
#       | childgraph (one GPU, CUDA alone: a copy kernel's cost as a kernel node, as a
#       child-graph node (how XLA records a custom call) and captured into the graph;
#       CHILD_SIZES, CHILD_THREADS (threads a block), CHILD_BUILDS, CHILD_PADS (bytes of
#       extra kernel parameters); benchmarks/child_graph_probe.cu)
#       | hbmprobe (one GPU, CUDA and cuBLASLt alone: how much a copy-engine copy of a fused
#       op's bytes slows the concurrent shard GEMM (HBM contention), and the GEMM the copy;
#       HBM_SHAPES "M,K,N,BYTES ...", HBM_MODES "ce plain"; benchmarks/hbm_contention_probe.cu)
#       | localcost (one GPU: the all-reduce and norm kernels for a group of one, so without
#       communication, beside a copy and XLA's add + norm; LOCAL_CLUSTERS="0 1" also with every
#       row on one block; LOCAL_FLAGS)
#       | l2prefetch (one GPU: a custom call that waits while it prefetches the next GEMM's
#       weight into L2, and what the GEMM after it saves; L2_FLAGS)
#       | tune1process (every kernel timed in one process driving both GPUs, a tuning table
#       with those records beside the committed two-process ones, then auto with it, in one
#       and in two processes)
#       | retune (1 x 2 bench of every kernel, a tuning table built from it and the committed
#       2 x 1 run, then auto with that table beside psum, in two and in one process); 4/8 GPUs:
#       multigpu_bench | multigpu_fused
#   (several benchmark verbs in one call: bash scripts/gpu_check.sh bench autobench)
# Uses the machine's preinstalled packages (nothing is downloaded). Every verb named is checked
# before anything is built or run: an unknown one prints the usage, and one that needs more GPUs
# than the machine has (most benchmarks need 2, the one-GPU probes 1) says so; both exit 2.
# build and suite run on any machine (without a GPU the suite skips).
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.." || exit 1
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jaxoverlap-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHAT=${1:-}
VERBS=" build suite bench bench2 autobench quickbench tune ovbench ovbenchfull ovwindowed"
VERBS="$VERBS ovcalibrate train cmdbufcost profile ovprofilegraphs decode procbench procrepeat"
VERBS="$VERBS multigpu_bench"
VERBS="$VERBS multigpu_fused normbench decodefloor pallasbench retune lamportab contention"
VERBS="$VERBS ovrepeat ovrepeat2 pdlfloor epochab epochab2 tune1process localcost l2prefetch"
VERBS="$VERBS childgraph hierab hbmprobe "
# The verbs of this call: the first, and with several (not suite, whose further arguments are
# pytest's) every one, each checked against VERBS before anything is built or run.
named=("$WHAT"); [ "$WHAT" = suite ] || [ $# -le 1 ] || named=("$@")
for w in "${named[@]}"; do
  if [ -z "$w" ] || [[ "$w" = *[[:space:]]* ]] || [[ "$VERBS" != *" $w "* ]]; then
    [ -z "$w" ] || echo "gpu_check.sh: unknown verb '$w'" >&2
    echo "usage: bash scripts/gpu_check.sh <verb> (verbs:$VERBS)" >&2
    exit 2
  fi
done
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
# The GPUs a verb needs: the N of its `if [ "$WHAT" = <verb> ] && [ "$NGPU" -ge N ]` below
# (2 or 4 for the benchmarks, 1 for the one-GPU probes; none where it has no such line: build
# and suite run on any machine).
too_few() {  # too_few <verb>: says so and succeeds where the machine has fewer GPUs than it needs
  local need
  need=$(grep -oE "\"\\\$WHAT\" = $1 \\] && \\[ \"\\\$NGPU\" -ge [0-9]+" "$SELF" \
    | grep -oE '[0-9]+$' | sort -n | tail -1)
  [ -n "$need" ] && [ "$NGPU" -lt "$need" ] || return 1
  echo "gpu_check.sh: $1 needs $need GPU$([ "$need" = 1 ] || echo s); this machine has $NGPU" \
    | tee -a "$OUT/too-few-gpus.txt" >&2
}
if [ "$WHAT" != suite ] && [ $# -gt 1 ]; then  # several benchmark verbs in one call
  # Every verb checked first (its name above, its GPUs here): one that cannot run stops the call
  # before anything is built.
  few=0; for w in "$@"; do too_few "$w" && few=1; done; [ $few = 0 ] || exit 2
  rc=0; for w in "$@"; do SKIP_BUILD=${SKIP_BUILD:-} bash "$SELF" "$w" || rc=1; SKIP_BUILD=1; done; exit $rc
fi
shift
status=0
FILTER='GRPC|WatchTasks|coordination_service|Connection refused|CANCELLED|Source Location|grpc_util|^\[rank .\] $|^\[rank .\] [WI][0-9]{4}'

too_few "$WHAT" && exit 2  # before the build, rather than build and then run nothing
if [ "$WHAT" = procrepeat ] && ! [[ "${PROC_REPEATS:-4}" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu_check.sh: PROC_REPEATS='${PROC_REPEATS}' is not a positive whole number" >&2
  exit 2
fi
nvidia-smi -L | tee "$OUT/gpus.txt"
# The files that run, as git's tree hash: the machine's .git may lag behind its copied files;
# their commit is the one `git log --all --format='%H %T' | grep <hash>` prints.
idx=$(mktemp -u); { GIT_INDEX_FILE=$idx git add -A && GIT_INDEX_FILE=$idx git write-tree; } \
  >"$OUT/tree.txt" 2>/dev/null || echo "unknown (no git checkout)" >"$OUT/tree.txt"; rm -f "$idx"
if [ -z "${SKIP_BUILD:-}" ] || [ "$WHAT" = build ]; then
  echo "== build ($NGPU GPUs)"
  start=$(date +%s)
  SKBUILD_CMAKE_DEFINE="CMAKE_CUDA_ARCHITECTURES=90" \
    $PY -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  echo "built in $(( $(date +%s) - start )) s"
fi

ab_summary() {  # ab_summary <impl> <group>...: per group and size, <impl>'s us by knob, medians
  # Reads $OUT/<group>_knob<k>_<i>/all_reduce-*.json (k: 0 the default, 1 the knob set).
  local impl=$1; shift
  $PY - "$OUT" "$impl" "$@" <<'PYEOF'
import glob, json, statistics, sys
out, impl, groups = sys.argv[1], sys.argv[2], sys.argv[3:]
for group in groups:
  runs = {0: {}, 1: {}}
  for knob in (0, 1):
    for f in sorted(glob.glob(f"{out}/{group}_knob{knob}_*/all_reduce-*.json")):
      for r in json.load(open(f))["records"]:
        if r["impl"] == impl:
          runs[knob].setdefault(r["bytes"], []).append(r["time_us"])
  for b in sorted(runs[0]):
    a, c = runs[0][b], runs[1].get(b, [])
    if a and c:
      print(f"{group} {b:>8} B: knob 0 {a} -> median {statistics.median(a):.2f} us; "
            f"knob 1 {c} -> median {statistics.median(c):.2f} us")
PYEOF
}

run() {  # run <log name> <timeout s> <env...> -- <launcher args...>
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" env "$@" 2>&1 | tee "$OUT/$name.log" | grep -vE "$FILTER" | tail -25
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "!! $name exited with $rc"; status=1; }
}

# ---- the GPU test suite: tests/gpu (each test launches its ranks, bounded by --timeout_s).
# gpu-suite.log: pytest's output; gpu-ranks.log: every launch's output; gpu-suite.xml: JUnit.
if [ "$WHAT" = suite ]; then
  export JAXOVERLAP_GPU_TEST_LOG="$OUT/gpu-ranks.log"
  : >"$JAXOVERLAP_GPU_TEST_LOG"
  if [ -n "${SANITIZE:-}" ]; then export JAXOVERLAP_SANITIZE="$SANITIZE"; fi
  echo "== suite: pytest -m gpu tests/gpu $*"
  $PY -m pytest -m gpu tests/gpu -rA -p no:cacheprovider --junitxml="$OUT/gpu-suite.xml" "$@" 2>&1 \
    | tee "$OUT/gpu-suite.log" | grep -vE "$FILTER" | tail -n "${SUITE_TAIL:-60}"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "!! suite exited with $rc (details: $OUT/gpu-suite.log)"; status=1; }
fi

# ---- benchmarks (command lines and JSON unchanged)
if [ "$WHAT" = quickbench ] && [ "$NGPU" -ge 2 ]; then
  run quickbench_1x2 120 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 110 benchmarks/all_reduce.py \
    --out "$OUT/quick" --sizes 8K,64K,256K,512K,1M,2M,4M --reps 20
fi

if [ "$WHAT" = bench2 ] && [ "$NGPU" -ge 2 ]; then
  run bench_2x1 280 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 270 \
    benchmarks/all_reduce.py --out "$OUT"
  run bench_2x1_put 280 JAXOVERLAP_RANKS_PER_NODE=1 JAXOVERLAP_FORCE_NVSHMEM_PUT=1 $PY -m jaxoverlap.launch \
    --nproc 2 --timeout_s 270 benchmarks/all_reduce.py --out "$OUT/put" --sizes 8K,64K,256K,1M,4M
fi

if [ "$WHAT" = procbench ] && [ "$NGPU" -ge 2 ]; then
  # The process models side by side: one process driving both GPUs (the in-process runtime,
  # no launcher) and one process per GPU (NVSHMEM); records carry "processes".
  AR_ARGS=(--impls jaxoverlap:auto,xla:psum --sizes 8K,64K,256K,1M,4M --reps 50)
  run procbench_ar_1process 200 $PY benchmarks/all_reduce.py --out "$OUT/processes1" "${AR_ARGS[@]}"
  run procbench_ar_2processes 200 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 190 \
    benchmarks/all_reduce.py --out "$OUT/processes2" "${AR_ARGS[@]}"
  run procbench_fused_1process 240 $PY benchmarks/overlap.py --out "$OUT/processes1" --quick
  run procbench_fused_2processes 240 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 230 \
    benchmarks/overlap.py --out "$OUT/processes2" --quick
fi

if [ "$WHAT" = procrepeat ] && [ "$NGPU" -ge 2 ]; then
  # The process models' repeats of results.md ("With the retuned table"): one process, then
  # two, PROC_REPEATS times, so that a slow spell of the machine falls on both alike.
  AR_ARGS=(--impls jaxoverlap:auto,xla:psum --sizes 8K,64K,256K,512K,1M --reps 50)
  for i in $(seq "${PROC_REPEATS:-4}"); do
    run "procrepeat_1process_run$i" 120 $PY benchmarks/all_reduce.py --out "$OUT/p1_run$i" \
      "${AR_ARGS[@]}"
    run "procrepeat_2processes_run$i" 120 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 110 \
      benchmarks/all_reduce.py --out "$OUT/p2_run$i" "${AR_ARGS[@]}"
  done
fi

if [ "$WHAT" = pallasbench ] && [ "$NGPU" -ge 2 ]; then
  # One process drives both GPUs (the Pallas kernel's condition); its tile configurations
  # beside the fused op and the local GEMM (benchmarks/overlap.py, PALLAS_CONFIGS).
  run pallasbench 300 $PY benchmarks/overlap.py --out "$OUT/pallas" \
    --shapes "${PALLAS_SHAPES:-ag:16384,4096,4096;ag:4096,8192,28672}" \
    --impls "xla:local_gemm,xla:collective,jaxoverlap:copy_engine,$($PY -c 'import sys; sys.path.insert(0, "benchmarks"); import overlap; print(",".join(overlap.pallas_impls()))')"
fi

if [ "$WHAT" = retune ] && [ "$NGPU" -ge 2 ]; then
  run bench_1x2 330 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 320 benchmarks/all_reduce.py --out "$OUT"
  TABLE="$OUT/all_reduce-NVIDIA_H200.json"
  $PY -m jaxoverlap.tune --out "$TABLE" \
    --from_results "$OUT/all_reduce-2x_H200_NV18-1x2.json,benchmarks/results/all_reduce-2x_H200_NV18-2x1.json" \
    || { echo "!! table not built"; status=1; }
  run autobench_1x2 120 JAXOVERLAP_TUNING_FILE="$TABLE" $PY -m jaxoverlap.launch --nproc 2 --timeout_s 110 \
    benchmarks/all_reduce.py --out "$OUT/auto" --impls jaxoverlap:auto,xla:psum,floor:launch \
    --sizes 8K,64K,256K,512K,1M,2M,4M,16M,64M --reps 20
  run autobench_1process 120 JAXOVERLAP_TUNING_FILE="$TABLE" $PY benchmarks/all_reduce.py \
    --out "$OUT/processes1" --impls jaxoverlap:auto,xla:psum --sizes 8K,64K,256K,1M,4M --reps 30
fi

if [ "$WHAT" = tune1process ] && [ "$NGPU" -ge 2 ]; then
  # The single-process model's own records (transport "peer") beside the committed
  # two-process ones: every kernel timed in one process driving both GPUs, a table of the
  # three files (the policy prefers the records of the caller's transport), then auto with
  # that table beside psum, in one process and in two.
  run bench_1process 330 $PY benchmarks/all_reduce.py --out "$OUT/processes1_all"
  TABLE="$OUT/all_reduce-NVIDIA_H200.json"
  $PY -m jaxoverlap.tune --out "$TABLE" --from_results \
    "benchmarks/results/all_reduce-2x_H200_NV18-1x2.json,benchmarks/results/all_reduce-2x_H200_NV18-2x1.json,$OUT/processes1_all/all_reduce-2x_H200_NV18-1x2.json" \
    || { echo "!! table not built"; status=1; }
  run autobench_1process 100 JAXOVERLAP_TUNING_FILE="$TABLE" $PY benchmarks/all_reduce.py \
    --out "$OUT/processes1" --impls jaxoverlap:auto,xla:psum --sizes 8K,64K,256K,512K,1M --reps 30
  run autobench_2processes 100 JAXOVERLAP_TUNING_FILE="$TABLE" $PY -m jaxoverlap.launch \
    --nproc 2 --timeout_s 90 benchmarks/all_reduce.py --out "$OUT/processes2" \
    --impls jaxoverlap:auto,xla:psum --sizes 8K,64K,256K,512K,1M --reps 30
fi

if [ "$WHAT" = lamportab ] && [ "$NGPU" -ge 2 ]; then
  # The Lamport kernels' grid variants (the measurement knobs of ffi/all_reduce/all_reduce.cu,
  # LamportKnobs), one bench each, beside psum. A config: blocks_per_sm:max_blocks:block_bytes:
  # poll_ns; the default list: v5's grid (1 block an SM, 528 blocks in 4 waves), v6's (2 an SM,
  # one wave), 4 an SM (registers spilled), 2 an SM in 2 waves.
  for cfg in ${AB_CONFIGS:-1:528:4096:0 2:0:4096:0 4:0:4096:0 2:528:4096:0}; do
    IFS=: read -r bps maxb bb poll <<<"$cfg"
    run "lamportab_${bps}_${maxb}_${bb}_${poll}" 110 JAXOVERLAP_LAMPORT_BLOCKS_PER_SM="$bps" \
      JAXOVERLAP_LAMPORT_MAX_BLOCKS="$maxb" JAXOVERLAP_LAMPORT_BLOCK_BYTES="$bb" \
      JAXOVERLAP_LAMPORT_POLL_NS="$poll" $PY -m jaxoverlap.launch --nproc 2 --timeout_s 100 \
      benchmarks/all_reduce.py --out "$OUT/ab_${bps}_${maxb}_${bb}_${poll}" \
      --sizes "${AB_SIZES:-8K,256K,1M,2M,4M,16M,64M}" --reps 20 \
      --impls jaxoverlap:one_shot_lamport,xla:psum
  done
fi

if [ "$WHAT" = epochab ] && [ "$NGPU" -ge 2 ]; then
  # The one-shot LL all-reduce with the epochs advanced at its start (JAXOVERLAP_EPOCH_AT_START=1)
  # against the default (Finish at the end), in the order 0 1 1 0: in one process, then in two
  # (at most 8 minutes; epochab2 times the norm kernel and reruns the probe).
  EA_ARGS=(--impls jaxoverlap:one_shot_ll,xla:psum --sizes "${EA_SIZES:-8K,64K,256K,512K}" --reps 30)
  i=0
  for knob in 0 1 1 0; do
    i=$((i + 1))
    run "epochab_1process_knob${knob}_$i" 80 JAXOVERLAP_EPOCH_AT_START=$knob $PY \
      benchmarks/all_reduce.py --out "$OUT/epoch_1process_knob${knob}_$i" "${EA_ARGS[@]}"
  done
  for knob in 0 1 1 0; do
    i=$((i + 1))
    run "epochab_2processes_knob${knob}_$i" 80 JAXOVERLAP_EPOCH_AT_START=$knob $PY \
      -m jaxoverlap.launch --nproc 2 --timeout_s 75 benchmarks/all_reduce.py \
      --out "$OUT/epoch_2processes_knob${knob}_$i" "${EA_ARGS[@]}"
  done
  # One line per process model and size: one_shot_ll's us in each run, by knob, and the medians.
  ab_summary jaxoverlap:one_shot_ll epoch_1process epoch_2processes | tee "$OUT/epochab_summary.txt"
fi
if [ "$WHAT" = hierab ] && [ "$NGPU" -ge 2 ]; then
  # The hierarchical LL all-reduce over 2 emulated nodes of 1 GPU (the inter-node step over
  # NVLink): the v4 kernel (HierarchicalLLKernel) against v3 (JAXOVERLAP_HIERARCHICAL_LL=v3,
  # knob 1), in the order 0 1 1 0, with direct stores, then with NVSHMEM puts forced
  # (JAXOVERLAP_FORCE_NVSHMEM_PUT=1; HA_PUT="0" or "1" runs one of the two). About 8 minutes.
  HA_ARGS=(--impls jaxoverlap:hierarchical_ll,xla:psum --sizes "${HA_SIZES:-8K,64K,256K,512K}" --reps 30)
  i=0
  for put in ${HA_PUT:-0 1}; do
    for knob in 0 1 1 0; do
      i=$((i + 1))
      v=$([ $knob = 1 ] && echo v3 || echo "")
      run "hierab_put${put}_knob${knob}_$i" 110 JAXOVERLAP_RANKS_PER_NODE=1 \
        JAXOVERLAP_FORCE_NVSHMEM_PUT=$put JAXOVERLAP_HIERARCHICAL_LL=$v $PY -m jaxoverlap.launch \
        --nproc 2 --timeout_s 100 benchmarks/all_reduce.py --out "$OUT/hier_put${put}_knob${knob}_$i" \
        "${HA_ARGS[@]}"
    done
  done
  ab_summary jaxoverlap:hierarchical_ll hier_put0 hier_put1 | tee "$OUT/hierab_summary.txt"
fi
if [ "$WHAT" = epochab2 ] && [ "$NGPU" -ge 2 ]; then
  # The norm kernel the same way (0 1 1 0), then the one-GPU bookkeeping probe
  # (docs/kernels.md, "The per-call bookkeeping"). At most 8 minutes.
  i=0
  for knob in 0 1 1 0; do
    i=$((i + 1))
    run "epochab_norm_knob${knob}_$i" 95 JAXOVERLAP_EPOCH_AT_START=$knob $PY -m jaxoverlap.launch \
      --nproc 2 --timeout_s 90 benchmarks/all_reduce_rms_norm.py --out "$OUT/epoch${knob}_norm_$i" \
      --rows 1,2,4 --hidden 4096
  done
  run launch_floor_bookkeeping 100 $PY benchmarks/launch_floor_pdl.py --out "$OUT" \
    --sizes 8K,64K,256K,1M
fi

if [ "$WHAT" = contention ] && [ "$NGPU" -ge 2 ]; then
  run contention 300 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 290 \
    benchmarks/fused_contention.py --out "$OUT" --logdir /tmp/jaxoverlap-contention
fi

if [ "$WHAT" = ovrepeat2 ] && [ "$NGPU" -ge 2 ]; then  # the same in two processes (no Pallas)
  for i in 1 2 3; do
    run "ovrepeat2_$i" 180 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 170 benchmarks/overlap.py \
      --out "$OUT/repeat2proc$i" --shapes "ag:16384,4096,4096;rs:16384,4096,4096" --reps 20 \
      --impls "xla:local_gemm,xla:collective,jaxoverlap:copy_engine,jaxoverlap:copy_engine/c4"
  done
fi

if [ "$WHAT" = ovrepeat ] && [ "$NGPU" -ge 2 ]; then
  for i in 1 2 3; do
    run "ovrepeat_$i" 200 $PY benchmarks/overlap.py --out "$OUT/repeat$i" \
      --shapes "ag:16384,4096,4096;rs:16384,4096,4096" --reps 20 \
      --impls "xla:local_gemm,xla:collective,jaxoverlap:copy_engine,jaxoverlap:copy_engine/c4,pallas:all_gather_lhs_matmul/m128n128"
  done
fi

if [ "$WHAT" = tune ] && [ "$NGPU" -ge 2 ]; then
  run tune 120 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 110 \
    -m jaxoverlap.tune --out "$OUT/tuning.json" --sizes 8K,256K --reps 10
fi

if [ "$WHAT" = multigpu_bench ] && [ "$NGPU" -ge 4 ]; then
  for rpn in "$NGPU" 2 1; do
    run "bench_${NGPU}gpu_rpn${rpn}" 280 JAXOVERLAP_RANKS_PER_NODE=$rpn $PY -m jaxoverlap.launch \
      --nproc "$NGPU" --timeout_s 270 benchmarks/all_reduce.py --out "$OUT" --machine "${NGPU}x H200"
  done
fi

if [ "$WHAT" = multigpu_fused ] && [ "$NGPU" -ge 4 ]; then
  # the fused ops' benchmark at 4/8 ranks (their checks: suite -k "w4-rpn4 or w8-rpn8")
  run "ovbench_${NGPU}gpu" 280 $PY -m jaxoverlap.launch --nproc "$NGPU" --timeout_s 270 \
    benchmarks/overlap.py --out "$OUT" --quick --machine "${NGPU}x H200"
fi

if [ "$WHAT" = autobench ] && [ "$NGPU" -ge 2 ]; then  # auto (with the shipped table) vs psum
  run autobench_1x2 150 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 140 benchmarks/all_reduce.py \
    --out "$OUT/auto" --impls jaxoverlap:auto,xla:psum,floor:launch --reps 20
  run autobench_2x1 150 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 140 \
    benchmarks/all_reduce.py --out "$OUT/auto" --impls jaxoverlap:auto,xla:psum,floor:launch --reps 20
fi

if [ "$WHAT" = bench ] && [ "$NGPU" -ge 2 ]; then
  run bench_1x2 280 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 270 benchmarks/all_reduce.py --out "$OUT"
  run bench_2x1 280 JAXOVERLAP_RANKS_PER_NODE=1 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 270 \
    benchmarks/all_reduce.py --out "$OUT"
fi
# ---- fused ops: AG+GEMM, GEMM+RS, GEMM+AR
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
  # This sweep alone (noisy: pool it with others before changing a constant, docs/results.md
  # "Calibration of the automatic choices").
  $PY benchmarks/calibrate_fused.py --results "$(ls "$OUT/calibrate_$PART"/overlap-*.json | paste -sd,)" \
    --out "$OUT/calibrate_$PART" | tee "$OUT/calibrate_$PART.txt" \
    || { echo "!! calibrate_fused: this sweep contradicts a constant of jaxoverlap/tuning/policy.py (or it failed)"; status=1; }
fi
# ---- issue 5: the training example (xla vs cuda), a step profile, decode
if [ "$WHAT" = train ] && [ "$NGPU" -ge 2 ]; then
  T=${TRAIN_TIMEOUT:-300}
  run train_step "$T" $PY -m jaxoverlap.launch --nproc 2 --timeout_s $((T - 10)) benchmarks/train_step.py \
    --out "$OUT" --presets ${TRAIN_PRESETS:-gpu_small} ${TRAIN_FLAGS:-}
fi
# one GPU: what PDL saves a one-kernel custom call in XLA's graphs
if [ "$WHAT" = pdlfloor ] && [ "$NGPU" -ge 1 ]; then
  run launch_floor_pdl 200 $PY benchmarks/launch_floor_pdl.py --out "$OUT" ${PDL_FLAGS:-}
fi
# one GPU: a kernel as a kernel node and as a child graph
if [ "$WHAT" = childgraph ] && [ "$NGPU" -ge 1 ]; then
  # Built three ways: whole-program, -rdc=true (as the extension's code), and -rdc=true with
  # NVSHMEM's device library linked into the module (as the extension's).
  NV=$($PY -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])")
  SRC=benchmarks/child_graph_probe.cu
  NVCC="nvcc -O2 -std=c++17 -arch=sm_90"
  $NVCC -o "$OUT/probe_whole" $SRC && $NVCC -rdc=true -o "$OUT/probe_rdc" $SRC \
    && $NVCC -rdc=true -DPROBE_WITH_NVSHMEM -I"$NV/include" -o "$OUT/probe_nvshmem" $SRC \
      "$NV/lib/libnvshmem_device.a" -Xlinker "$NV/lib/libnvshmem_host.so.3" \
      -Xlinker -rpath,"$NV/lib" 2>"$OUT/probe_build.log" \
    || { echo "!! child_graph_probe did not build"; tail -5 "$OUT/probe_build.log"; status=1; }
  for t in ${CHILD_THREADS:-256}; do
    for b in ${CHILD_SIZES:-8192 65536 262144 1048576}; do
      for build in ${CHILD_BUILDS:-whole rdc nvshmem}; do
        for pad in ${CHILD_PADS:-8}; do
          "$OUT/probe_$build" "$b" 200 50 "$t" "$pad" | tee -a "$OUT/child_graph_probe.jsonl" \
            || status=1
        done
      done
    done
  done
  rm -f "$OUT"/probe_whole "$OUT"/probe_rdc "$OUT"/probe_nvshmem "$OUT/probe_build.log"
fi
# one GPU: HBM contention between a shard GEMM and a copy of the bytes its fused op moves
if [ "$WHAT" = hbmprobe ] && [ "$NGPU" -ge 1 ]; then
  CU=$($PY -c "import importlib.util as u; print(list(u.find_spec('nvidia.cu13').submodule_search_locations)[0])")
  # Default shapes: one rank of 2 at (16384, 4096, 4096): all_gather_matmul's own-shard GEMM and
  # matmul_reduce_scatter's own-block GEMM, each beside its 64 MiB; at (4096, 8192, 28672): the
  # all-gather's own-shard GEMM beside its 32 MiB shard.
  nvcc -O2 -std=c++17 -arch=sm_90 -I"$CU/include" -o "$OUT/hbm_probe" \
      benchmarks/hbm_contention_probe.cu -Xlinker "$CU/lib/libcublasLt.so.13" \
      -Xlinker -rpath,"$CU/lib" 2>"$OUT/hbm_probe_build.log" \
    || { echo "!! hbm_contention_probe did not build"; tail -5 "$OUT/hbm_probe_build.log"; status=1; }
  for shape in ${HBM_SHAPES:-8192,4096,2048,67108864 8192,2048,4096,67108864 2048,8192,14336,33554432}; do
    # shellcheck disable=SC2086
    for mode in ${HBM_MODES:-ce plain}; do
      timeout 120 "$OUT/hbm_probe" ${shape//,/ } 30 5 "$mode" \
        | tee -a "$OUT/hbm_contention_probe.jsonl" \
        || { echo "!! hbm_probe $shape $mode failed"; status=1; }
    done
  done
  rm -f "$OUT/hbm_probe"
fi
# one GPU: the kernels' cost without communication
if [ "$WHAT" = localcost ] && [ "$NGPU" -ge 1 ]; then
  for c in ${LOCAL_CLUSTERS:-0 1}; do  # 0: the kernel's own split of a row over blocks
    run "local_cost_cluster$c" 200 JAXOVERLAP_NORM_CLUSTER=$c $PY benchmarks/local_cost.py \
      --out "$OUT/cluster$c" ${LOCAL_FLAGS:-}
  done
fi
# one GPU: prefetching the next GEMM's weight during a wait
if [ "$WHAT" = l2prefetch ] && [ "$NGPU" -ge 1 ]; then
  run l2_prefetch 400 $PY benchmarks/l2_prefetch.py --out "$OUT" ${L2_FLAGS:-}
fi
if [ "$WHAT" = decodefloor ] && [ "$NGPU" -ge 1 ]; then  # one GPU is enough: no communication
  run decode_floor 400 $PY benchmarks/decode_floor.py --out "$OUT" --batches ${FLOOR_BATCHES:-1,16} \
    ${FLOOR_FLAGS:-}
fi
if [ "$WHAT" = normbench ] && [ "$NGPU" -ge 2 ]; then  # all-reduce + residual + RMSNorm per call
  # NORM_CLUSTERS="0 1": the default split, then every row on one block (v1), each into its folder.
  for c in ${NORM_CLUSTERS:-0}; do
    run "normbench_c$c" 170 JAXOVERLAP_NORM_CLUSTER=$c $PY -m jaxoverlap.launch --nproc 2 \
      --timeout_s 160 benchmarks/all_reduce_rms_norm.py --out "$OUT/norm_c$c" ${NORM_FLAGS:-}
  done
fi
if [ "$WHAT" = cmdbufcost ] && [ "$NGPU" -ge 2 ]; then  # fused ops outside vs inside XLA's graphs
  for v in plain cmdbuf plain cmdbuf; do
    flag=$([ $v = cmdbuf ] && echo 1 || echo 0)
    run "train_$v" 200 JAXOVERLAP_FUSED_CMD_BUFFER=$flag $PY -m jaxoverlap.launch --nproc 2 \
      --timeout_s 190 benchmarks/train_step.py --out "$OUT/$v" --presets gpu_small --backends cuda \
      --steps ${CMDBUF_STEPS:-60}
  done
fi
if [ "$WHAT" = profile ] && [ "$NGPU" -ge 2 ]; then
  for b in ${PROFILE_BACKENDS:-cuda}; do
    run "profile_$b" 100 $PY -m jaxoverlap.launch --nproc 2 --timeout_s 90 benchmarks/profile_step.py \
      --out "$OUT" --backend "$b"
  done
fi
if [ "$WHAT" = ovprofilegraphs ] && [ "$NGPU" -ge 2 ]; then  # profiler or addresses? (docs/kernels.md)
  run profile_cmdbuf_notrace 100 JAXOVERLAP_FUSED_CMD_BUFFER=1 $PY -m jaxoverlap.launch --nproc 2 \
    --timeout_s 90 benchmarks/profile_step.py --out "$OUT/notrace" --backend cuda --notrace
  run profile_cmdbuf 100 JAXOVERLAP_FUSED_CMD_BUFFER=1 $PY -m jaxoverlap.launch --nproc 2 \
    --timeout_s 90 benchmarks/profile_step.py --out "$OUT/cmdbuf" --backend cuda
  # The graphs first recorded under the profiler too: does mixing recordings break the update?
  run profile_cmdbuf_from_start 100 JAXOVERLAP_FUSED_CMD_BUFFER=1 $PY -m jaxoverlap.launch --nproc 2 \
    --timeout_s 90 benchmarks/profile_step.py --out "$OUT/cmdbuf_from_start" --backend cuda \
    --trace_from_start
fi
if [ "$WHAT" = decode ] && [ "$NGPU" -ge 2 ]; then
  T=${DECODE_TIMEOUT:-150}
  run decode "$T" $PY -m jaxoverlap.launch --nproc 2 --timeout_s $((T - 10)) benchmarks/decode.py \
    --out "$OUT" ${DECODE_FLAGS:---batches 1,4,16,64 --reps 10}
fi
exit $status
