"""How much a fused op's transfers slow its concurrent GEMMs, and its GEMMs the transfers.

Run one process per GPU through the launcher:

  python -m jaxoverlap.launch --nproc 2 benchmarks/fused_contention.py
  # CPU smoke run (2 simulated devices; no GPU kernels, so nothing to pair):
  python benchmarks/fused_contention.py --host_devices 2 --shapes "ag:64,32,32" \\
      --impls xla:naive --out /tmp/contention

Problem: a fused op hides its communication under shard GEMMs (CommFuse,
arXiv 2604.24013, section 3), but the two share the GPU: a copy-engine
transfer reads and writes HBM beside the GEMM (HBM contention), an NVSHMEM put
kernel also takes SMs from it (SM contention). The chain timings of
benchmarks/overlap.py show the sum; this script separates the two effects.

Method: for each (op, shape, impl), one jit of the op alone (no chain) runs
--warmup times, then --calls times under ``jax.profiler.trace``, each call
waited for. Every rank reads its own trace (the device streams, as
benchmarks/profile_step.py parses them) and times each kernel:
  GEMM kernels (cuBLASLt names, ``profile_step.classify``): a GEMM is
      "concurrent" when at least --concurrent_share of its span overlaps a
      transfer on another stream, "alone" when at most --alone_share does.
      The trace names a GEMM's kernel, not its shape, so the default impls
      are those whose GEMMs of one kernel name have one shape:
      all_gather_matmul with one chunk (the local shard's GEMM beside the
      send, the peer's after it, both M/P rows) and matmul_reduce_scatter
      with two (the peer block's first chunk before any send, its second
      beside the first's send). gemm_slowdown = median(concurrent) /
      median(alone) - 1 for the kernel name with both kinds and the most
      runs. (all_gather_matmul with two chunks would compare its M/P-row
      own GEMM with M/2P-row chunk GEMMs of the same kernel.) A rank's
      trace shows its own sends only; the peer's sends into its memory run
      at the same time by symmetry (the peer's GEMM before its first send
      is as long), and end before the GEMM that waits for them.
  Transfers (copy-engine memcpys, NVSHMEM put kernels) on the streams that
      run no GEMM (the op's communication stream; matmul_all_reduce's local
      copies run on the compute stream): bandwidth from the memcpy's size in
      the trace (put kernels: the block over its chunks), median over
      transfers, against the same transfer in a second run of the op whose
      GEMM is cut to --small columns (ag: N; rs, ar: K), which moves the same
      bytes (ag sends x's shard, rs and ar the partial product) beside a GEMM
      of almost nothing: transfer_slowdown = bandwidth alone / bandwidth in
      the op - 1.
The per-call waits make the calls independent: no transfer of one call runs
beside a GEMM of the next.

Results (rank 0 writes, with every rank's figures):
``<out>/fused_contention-<machine>.json`` (the results format of
jaxoverlap.tuning.results; one record per (op, shape, impl, rank)). The raw
traces stay in --logdir (open them in https://ui.perfetto.dev).
"""

from __future__ import annotations

import os
import shutil
import statistics
from typing import Any, Iterable, Mapping, Sequence

import harness
import overlap
import profile_step

BENCHMARK = "fused_contention"
AXIS = overlap.AXIS
DEFAULT_SHAPES = "ag:16384,4096,4096;rs:16384,4096,4096"
# Per op, the chunk counts whose GEMMs of one kernel name have one shape (the docstring).
DEFAULT_IMPLS = {"ag": ("jaxoverlap:copy_engine/c1", "jaxoverlap:nvshmem/c1"),
                 "rs": ("jaxoverlap:copy_engine/c2", "jaxoverlap:nvshmem/c2"),
                 "ar": ("jaxoverlap:copy_engine/c2", "jaxoverlap:nvshmem/c2")}
# A transfer: a copy-engine memcpy, or the NVSHMEM put kernel (not the flag kernels).
_MEMCPY = ("memcpy", "Memcpy", "MEMCPY")


def is_transfer(name: str) -> bool:
  """Whether a device event moves the op's data: a memcpy, or the put kernel."""
  return any(m in name for m in _MEMCPY) or "PutKernel" in name


def small_shape(op: str, mkn: tuple[int, int, int], world: int, small: int
                ) -> tuple[int, int, int]:
  """The shape that moves the same bytes as ``mkn`` beside a GEMM cut to ``small`` columns.

  ag moves x's shard [M/P, K]: N is cut (to ``small`` per rank). rs and ar move
  the partial product [M, N] (or its rows): K is cut.
  """
  m, k, n = mkn
  if op == "ag":
    return m, k, small * world
  return m, small * world, n


def _overlap_us(start: float, end: float, spans: Sequence[tuple[float, float]]) -> float:
  """Time within [start, end] covered by the union of ``spans``."""
  covered = [(max(s, start), min(e, end)) for s, e in spans if e > start and s < end]
  return profile_step._union_us(covered)


def memcpy_bytes(ev: profile_step.Event) -> int | None:
  """A memcpy's size from its trace args (``memcpy_details``: "... size:N ..."), or None."""
  details = str((ev.args or {}).get("memcpy_details", ""))
  for field in details.split():
    if field.startswith("size:") and field[5:].isdigit():
      return int(field[5:])
  return None


def kernel_stats(events: Iterable[profile_step.Event], *, concurrent_share: float = 0.5,
                 alone_share: float = 0.05) -> dict[str, Any]:
  """GEMM spans alone and beside transfers, and the transfers, of one trace's device events.

  Args:
    events: the device-stream events of one rank (``profile_step.Event``).
    concurrent_share: a GEMM with at least this share of its span beside a
      transfer on another row counts as concurrent.
    alone_share: a GEMM with at most this share counts as alone.

  Returns:
    ``gemms``: per GEMM kernel name, the counts and median spans (us) of its
    concurrent, alone and partly overlapped runs; ``gemm_kernel``,
    ``gemm_alone_us``, ``gemm_concurrent_us`` and ``gemm_slowdown`` of the
    name with both kinds and the most runs (None where no name has both);
    ``transfers`` (transfers on rows without GEMMs), ``transfer_us`` (their
    median span) and ``transfer_gbps`` (median bandwidth of those whose
    size the trace gives, else None).
  """
  events = list(events)
  gemm_rows = {ev.row for ev in events if profile_step.classify(ev.name) == profile_step.GEMM}
  transfers = [ev for ev in events if is_transfer(ev.name) and ev.row not in gemm_rows
               and ev.end > ev.start]
  by_row: dict[Any, list[tuple[float, float]]] = {}
  for ev in transfers:
    by_row.setdefault(ev.row, []).append((ev.start, ev.end))
  gemms: dict[str, dict[str, list[float]]] = {}
  for ev in events:
    if profile_step.classify(ev.name) != profile_step.GEMM or not ev.end > ev.start:
      continue
    spans = [s for row, ss in by_row.items() if row != ev.row for s in ss]
    share = _overlap_us(ev.start, ev.end, spans) / (ev.end - ev.start)
    kind = ("concurrent" if share >= concurrent_share
            else "alone" if share <= alone_share else "partly")
    gemms.setdefault(ev.name, {"concurrent": [], "alone": [], "partly": []})[kind].append(
        ev.end - ev.start)
  table = {name: {f"{kind}_n": len(v) for kind, v in kinds.items()}
           | {f"{kind}_us": statistics.median(v) if v else None for kind, v in kinds.items()}
           for name, kinds in gemms.items()}
  paired = [name for name, k in gemms.items() if k["concurrent"] and k["alone"]]
  sized = [(memcpy_bytes(ev), ev.end - ev.start) for ev in transfers]
  rates = [b / us / 1e3 for b, us in sized if b]
  out: dict[str, Any] = {"gemms": table, "gemm_kernel": None, "gemm_alone_us": None,
                         "gemm_concurrent_us": None, "gemm_slowdown": None,
                         "transfers": len(transfers),
                         "transfer_us": statistics.median(us for _, us in sized)
                         if sized else None,
                         "transfer_gbps": statistics.median(rates) if rates else None}
  if paired:
    name = max(paired, key=lambda nm: len(gemms[nm]["concurrent"]) + len(gemms[nm]["alone"]))
    alone, conc = table[name]["alone_us"], table[name]["concurrent_us"]
    out.update(gemm_kernel=name, gemm_alone_us=alone, gemm_concurrent_us=conc,
               gemm_slowdown=conc / alone - 1.0)
  return out


def device_events(logdir: str) -> list[profile_step.Event]:
  """The events on the device streams of the newest trace under ``logdir``.

  Raises:
    FileNotFoundError: the profiler wrote no trace there.
  """
  path = profile_step.find_trace_file(logdir)
  if path is None:
    raise FileNotFoundError(f"no perfetto trace under {logdir}")
  rows, events, _ = profile_step.parse_trace(profile_step.load_trace(path))
  chosen, source = profile_step.select_rows(rows, events)
  if source == "host threads":
    return []  # CPU: no device activity to time
  keys = {r.key for r in chosen}
  return [ev for ev in events if ev.row in keys]


def traced_op(op: str, mkn, impl: str, *, mesh, dtype: str, warmup: int, calls: int,
              logdir: str) -> list[profile_step.Event]:
  """Runs ``impl`` of ``op`` at ``mkn`` ``calls`` times under the profiler; its device events."""
  import jax

  case = overlap._Case(op, mkn, mesh, dtype, chain=1)
  fn, carrier, others, out_spec = case.kernel(impl)
  names = [carrier, *others]
  case.build(names)
  run = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=tuple(case.specs[n] for n in names),
                              out_specs=out_spec))
  args = [case.arrays[n] for n in names]
  for _ in range(warmup):
    jax.block_until_ready(run(*args))
  shutil.rmtree(logdir, ignore_errors=True)
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for _ in range(calls):
      jax.block_until_ready(run(*args))
  return device_events(logdir)


def transfer_bytes(op: str, mkn, world: int, itemsize: int, transfers: int, calls: int
                   ) -> float | None:
  """Bytes one transfer moves: a peer's block of one phase, over the chunks it came in.

  The block a rank sends each peer is x's shard [M/P, K] (ag) or a block of
  rows of the partial product [M/P, N] (rs; ar sends it twice, in its
  reduce-scatter and its all-gather). The chunk count follows from the
  transfers counted in ``calls`` calls. None without transfers.
  """
  m, k, n = mkn
  block = (m // world) * (k if op == "ag" else n) * itemsize
  per_peer = transfers / (calls * (world - 1) * (2 if op == "ar" else 1))
  return block / per_peer if per_peer else None


def contention_record(op: str, mkn, impl: str, main: Mapping[str, Any],
                      small: Mapping[str, Any], small_mkn, *, world: int, rank: int,
                      itemsize: int, calls: int) -> dict[str, Any]:
  """One record from the op's ``kernel_stats`` (``main``) and the small-GEMM run's (``small``)."""
  def gbps(stats, shape):
    if stats["transfer_gbps"]:  # memcpys: their sizes are in the trace
      return stats["transfer_gbps"]
    nbytes = transfer_bytes(op, shape, world, itemsize, stats["transfers"], calls)
    return nbytes / stats["transfer_us"] / 1e3 if nbytes and stats["transfer_us"] else None

  bw_op, bw_alone = gbps(main, mkn), gbps(small, small_mkn)
  return {"op": overlap.OPS[op], "impl": impl, "shape": list(mkn), "rank": rank,
          "world": world, "gemm_kernel": main["gemm_kernel"],
          "gemm_alone_us": main["gemm_alone_us"],
          "gemm_concurrent_us": main["gemm_concurrent_us"],
          "gemm_slowdown": main["gemm_slowdown"],
          "transfer_us": main["transfer_us"], "transfer_gbps": bw_op,
          "transfer_alone_us": small["transfer_us"], "transfer_alone_gbps": bw_alone,
          # By bandwidth, so that a different chunk count in the small run still compares.
          "transfer_slowdown": bw_alone / bw_op - 1.0 if bw_op and bw_alone else None,
          "transfers": main["transfers"], "gemms": main["gemms"]}


def summary_row(r: Mapping[str, Any]) -> str:
  """One printed line of a record."""
  def pct(v):
    return "-" if v is None else f"{100 * v:+.1f}%"

  def us(v):
    return "-" if v is None else f"{v:.1f}"

  def gb(v):
    return "-" if v is None else f"{v:.0f}"

  return (f"  rank {r['rank']} {r['impl']:<28} GEMM alone {us(r['gemm_alone_us'])} us, "
          f"beside the transfer {us(r['gemm_concurrent_us'])} us ({pct(r['gemm_slowdown'])}); "
          f"transfer {gb(r['transfer_gbps'])} GB/s, alone {gb(r['transfer_alone_gbps'])} GB/s "
          f"({pct(r['transfer_slowdown'])} time)")


def define_flags():
  """Defines the command-line flags (only when run as a script)."""
  from absl import flags

  harness.define_flags("out", "machine", "dtype", "host_devices",
                       impls=([], "fused-op implementations (benchmarks/overlap.py's "
                              "names; default: per op, DEFAULT_IMPLS)"),
                       warmup=(3, "untimed calls before the trace"))
  flags.DEFINE_string("shapes", DEFAULT_SHAPES, "global shapes 'op:M,K,N;...' (ag, rs, ar)")
  flags.DEFINE_integer("calls", 10, "traced calls per (shape, impl)")
  flags.DEFINE_integer("small", 128, "columns per rank of the small-GEMM run (ag: N, rs/ar: K)")
  flags.DEFINE_float("concurrent_share", 0.5, "share of a GEMM's span beside a transfer "
                     "that makes it concurrent")
  flags.DEFINE_float("alone_share", 0.05, "share at most, for a GEMM alone")
  flags.DEFINE_string("logdir", "/tmp/jaxoverlap-contention", "where the traces go")


def main(argv):
  del argv
  from absl import app, flags

  fl = flags.FLAGS
  try:
    shapes = overlap.parse_shapes(fl.shapes)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if fl.calls < 1 or fl.warmup < 0 or fl.small < 1:
    raise app.UsageError("--calls and --small must be >= 1, --warmup >= 0")
  if not 0 <= fl.alone_share < fl.concurrent_share <= 1:
    raise app.UsageError("need 0 <= --alone_share < --concurrent_share <= 1")
  harness.use_host_devices(fl.host_devices)
  run = harness.start(AXIS)
  if run.world < 2:
    raise app.UsageError(f"a fused op needs at least 2 devices; this run has {run.world}")
  import jax
  import numpy as np

  itemsize = np.dtype(jax.numpy.dtype(fl.dtype)).itemsize
  run.log(f"fused_contention: world {run.world} ({run.platform}), {fl.calls} traced calls "
          f"per (shape, impl)")
  if run.platform != "gpu":
    run.log("no GPU: the traces hold no device kernels, so nothing pairs (a smoke run)")
  records = []
  for op, mkn in shapes:
    overlap.check_divisible(op, mkn, run.world)
    for impl in fl.impls or DEFAULT_IMPLS[op]:
      stats = {}
      small = small_shape(op, mkn, run.world, fl.small)
      for tag, shape in (("op", mkn), ("small", small)):
        logdir = os.path.join(fl.logdir, f"{op}_{'x'.join(map(str, shape))}_"
                              f"{impl.replace(':', '_').replace('/', '_')}", f"rank{run.rank}")
        events = traced_op(op, shape, impl, mesh=run.mesh, dtype=fl.dtype, warmup=fl.warmup,
                           calls=fl.calls, logdir=logdir)
        stats[tag] = kernel_stats(events, concurrent_share=fl.concurrent_share,
                                  alone_share=fl.alone_share)
      mine = contention_record(op, mkn, impl, stats["op"], stats["small"], small, world=run.world,
                               rank=run.rank, itemsize=itemsize, calls=fl.calls)
      rows = harness.gather_json(mine)
      run.log(f"{op}:{','.join(map(str, mkn))} {impl}")
      for r in rows:
        run.log(summary_row(r))
      records += rows
  if run.rank == 0:
    machine = harness.machine_name(fl.machine)
    path = harness.path(fl.out, BENCHMARK, machine)
    harness.write_result(
        path, records, benchmark=BENCHMARK, machine=machine,
        script="benchmarks/fused_contention.py", latency=False,
        method=(f"{fl.calls} calls of each op traced (jax.profiler), after {fl.warmup} "
                f"untimed; GEMM kernels concurrent at >= {fl.concurrent_share} of their span "
                f"beside a transfer on another stream, alone at <= {fl.alone_share}; "
                f"transfers against the same op with its GEMM cut to {fl.small} columns per "
                "rank; medians"),
        extra={"platform": run.platform, "world": run.world, "processes": run.processes})
    run.log(f"wrote {path}")
  return 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
