"""All-reduce latency: every jaxoverlap CUDA algorithm and auto against lax.psum, in one run.

Run one process per GPU through the launcher:

  python -m jaxoverlap.launch --nproc 2 benchmarks/all_reduce.py
  JAXOVERLAP_RANKS_PER_NODE=1 python -m jaxoverlap.launch --nproc 2 benchmarks/all_reduce.py

The default implementations (and floor:launch) need the CUDA extension on
NVIDIA GPUs; without them the script stops with one line naming what is
missing. Only the XLA implementations (xla:psum, jaxoverlap:xla:collective,
jaxoverlap:xla:ppermute) run anywhere, which is the CPU smoke path:

  python benchmarks/all_reduce.py --host_devices 2 --out /tmp/all_reduce \
      --impls xla:psum,jaxoverlap:xla:ppermute --sizes 8K,64K --reps 3

Method: the chain method of jaxoverlap.tuning.timing: for each size, a chain of
--chain dependent ops in one jit (10 above 8 MiB), minus the same chain
without them, divided by the chain length. The implementations of a size are
timed interleaved (``time_chains_stats_us``: per round, the empty chain, then
each implementation's chain once, each after a small psum that lines the
processes up; a round's time is the slowest process's); each figure is the
median over --reps rounds after warm-up, with the 10th and 90th percentiles.
psum is timed twice: ``xla:psum`` with XLA's default command-buffer types,
under which every psum splits XLA's CUDA graphs, and ``xla:psum_graphs`` with
``COLLECTIVES`` added, so that it runs inside the graphs as our custom calls
do. Every implementation is first checked against a float32
lax.psum of the same input, three calls with different inputs in a row, and
then as the timed chain calls it, 8 calls back to back in one jit against the
same chain of float32 psums, on every element of every rank, within the
rounding of a float32 sum rounded once into the dtype (psum, and auto where
its plan runs XLA's collective: once per hop of a ring) (``jaxoverlap.tuning.check``,
the tuner's check);
one that fails is listed under "rejected" and not timed (floor:launch, one
kernel launch and no all-reduce, is not checked; xla:psum_graphs, the same
program as xla:psum, is checked without its XLA options). Ours and
psum are measured side by side in one process group.

Rank 0 writes <out>/all_reduce-<machine>-<nodes>x<ranks>.json: records in the
results format of jaxoverlap.tuning.results (plus num_nodes and
inter_node_transport) and auto_choices, the [bytes, algorithm, protocol] that
algorithm "auto" chose (from jaxoverlap.decisions()).
benchmarks/plot_all_reduce.py merges the files and draws the PNG. The exit
code is 1 when an implementation was rejected.
"""

from __future__ import annotations

from absl import app, flags

import harness

AXIS = "x"
CHECK_CHAIN = 8  # calls back to back in one jit in the check (the timed chain's pattern)


def define_flags():
  harness.define_flags("out", "machine", "dtype", "impls", "host_devices",
                       chain=(50, "ops per jit'd chain (10 above 8 MiB)"), reps=30)
  flags.DEFINE_list("sizes", "8K,16K,32K,64K,128K,256K,512K,1M,2M,4M,16M,64M,256M",
                    "per-rank message sizes (bytes; K/M suffix)")


def default_impls(num_nodes: int) -> list[str]:
  """Every CUDA algorithm of the topology, then auto, psum (both ways) and the launch floor."""
  ours = (["one_shot_ll", "one_shot_simple", "one_shot_lamport", "two_shot_ll", "two_shot_simple",
           "two_shot_lamport"] if num_nodes == 1
          else ["hierarchical_ll", "hierarchical_simple"])
  return [f"jaxoverlap:{a}" for a in ours] + [harness.AUTO, harness.PSUM, harness.PSUM_GRAPHS,
                                               harness.LAUNCH_FLOOR]


def needs_cuda(impl: str) -> bool:
  """Whether ``impl`` runs the CUDA extension (all but the XLA backend's).

  Raises:
    ValueError: an unknown impl name.
  """
  if impl == harness.LAUNCH_FLOOR:
    return True
  if impl in (harness.PSUM, harness.PSUM_GRAPHS):
    return False
  return harness.impl_kwargs("all_reduce", impl)["backend"] != "xla"


def cuda_missing(platform: str) -> str | None:
  """Why the CUDA implementations cannot run here (no GPU, no extension), or None."""
  if platform != "gpu":
    return f"JAX runs on {platform!r} here, not on NVIDIA GPUs"
  from jaxoverlap import _ffi  # the extension's own reason (not built, cannot load)

  return _ffi.unavailable_reason()


def check_op(op, x, mesh) -> str | None:
  """None when ``op`` (per shard, inside ``shard_map`` over ``AXIS``) sums ``x`` as psum does.

  ``jaxoverlap.tuning.check.all_reduce_mismatch``, the tuner's check: three
  calls with different inputs in a row (x, 2x, 3x; each slot parity is used
  twice, so a stale slot or a Lamport slot left unemptied shows up), then
  ``CHECK_CHAIN`` calls back to back in one jit, as the timed chain makes them,
  each against a float32 ``lax.psum``, on every element of every rank, within
  the rounding of a float32 sum rounded into x's dtype once, or at every hop of
  a ring where the op's plan runs XLA's collective or the op makes none (psum;
  ``all_reduce_mismatch``'s ``roundings=None``).

  Returns:
    None, or why not: the first difference, or the exception the op raised.
  """
  from jaxoverlap.tuning.check import all_reduce_mismatch

  try:
    return all_reduce_mismatch(op, [x * (k + 1) for k in range(3)], x, mesh=mesh,
                               axis_name=AXIS, links=CHECK_CHAIN, roundings=None)
  except Exception as e:  # noqa: BLE001: a refusal is a rejection, recorded with its reason
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def main(argv):
  del argv
  fl = flags.FLAGS
  try:
    cuda_impls = [i for i in fl.impls if needs_cuda(i)]
    sizes = [harness.parse_bytes(s) for s in fl.sizes]
  except ValueError as e:
    raise app.UsageError(f"--impls/--sizes: {e}") from e
  harness.use_host_devices(fl.host_devices)
  run = harness.start(AXIS)
  missing = cuda_missing(run.platform)
  if missing and (cuda_impls or not fl.impls):
    named = ", ".join(cuda_impls) if fl.impls else "the default impls"
    raise SystemExit(f"all_reduce.py: {named} run the CUDA extension on NVIDIA GPUs: "
                     f"{missing}. Only the XLA impls ({harness.PSUM}, jaxoverlap:xla:collective, "
                     "jaxoverlap:xla:ppermute) run without it (--impls)")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxoverlap
  from jaxoverlap import tuning

  dtype = jnp.dtype(fl.dtype)
  impls = fl.impls or default_impls(run.num_nodes)
  jaxoverlap.clear_decisions()
  arrays: dict[int, dict] = {}

  def inputs(nbytes: int) -> dict:
    """This size's input (each rank ~1e-3 N(0, 1)) and, once timed, its empty chain."""
    if nbytes not in arrays:
      arrays.clear()
      n = nbytes // dtype.itemsize
      rng = np.random.default_rng([run.rank, n])
      local = (rng.standard_normal(n * jax.local_device_count()) * 1e-3).astype(dtype)
      arrays[nbytes] = {"x": jax.make_array_from_process_local_data(
          NamedSharding(run.mesh, P(AXIS)), local, (n * run.world,))}
    return arrays[nbytes]

  def chain(nbytes: int) -> dict:
    return dict(mesh=run.mesh, axis_name=AXIS, length=fl.chain if nbytes <= (8 << 20) else 10,
                reps=fl.reps)

  def measure_row(impls: list[str], nbytes: int) -> dict[str, dict[str, float]]:
    ops = {impl: harness.all_reduce_fn(impl, AXIS) for impl in impls}
    options = {impl: harness.compile_options(impl) for impl in impls}
    return tuning.time_chains_stats_us(ops, inputs(nbytes)["x"], **chain(nbytes),
                                       compiler_options={k: v for k, v in options.items() if v})

  def check(impl: str, nbytes: int) -> str | None:
    if impl == harness.LAUNCH_FLOOR:
      return None
    # A kernel sums in float32 and rounds once; psum may add in the dtype at every hop of
    # NCCL's ring. Which one runs (auto's choice included) comes from the call's plan.
    return check_op(harness.all_reduce_fn(impl, AXIS), inputs(nbytes)["x"], run.mesh)

  records, rejected = tuning.run_tuning(
      None, check, impls, sizes, dtype=dtype.name,
      ranks_per_node=run.ranks_per_node, world=run.world, log=run.log, measure_row=measure_row)
  for r in records:
    if harness.compile_options(r["impl"]):
      r["xla_options"] = harness.compile_options(r["impl"])
    r.update(num_nodes=run.num_nodes, inter_node_transport=run.runtime.get("inter_node_transport"),
             processes=run.processes, transport=run.runtime.get("transport"),
             lamport_blocks_per_sm=run.runtime.get("lamport_blocks_per_sm"))
    if run.num_nodes > 1:  # nodes sharing a host: NVLink between them (tuning.Policy.choose)
      r["emulated_nodes"] = bool(run.runtime.get("emulated_nodes"))
  for r in rejected:
    run.log(f"WRONG: {r['impl']} at {r['bytes']} B: {r['reason']}")
  if run.rank == 0:
    machine = harness.machine_name(fl.machine)
    path = harness.path(fl.out, "all_reduce", machine,
                        f"-{run.num_nodes}x{run.ranks_per_node}")
    harness.write_result(
        path, records, benchmark="all_reduce", machine=machine,
        script="benchmarks/all_reduce.py", rejected=rejected,
        method=(f"median (time_us) and 10th/90th percentiles (time_us_p10/p90) of {fl.reps} "
                "rounds, each timing the empty chain and then every impl's chain of ops in one "
                f"jit ({fl.chain} ops up to 8 MiB, 10 above) once, interleaved, each run after "
                "a small psum that lines the processes up: (chain - the round's empty chain) / "
                "chain length, the slowest process's time per round; xla:psum with XLA's "
                "default command-buffer types (each psum splits the CUDA graphs), "
                "xla:psum_graphs with COLLECTIVES added (xla_options); every impl first "
                "checked against a float32 lax.psum (three inputs in a row) and, as "
                f"{CHECK_CHAIN} calls back to back in one jit, against the same chain of "
                "float32 psums, within a float32 sum's rounding into the dtype "
                "(jaxoverlap.tuning.check.all_reduce_mismatch)"),
        extra={"params": {}, "auto_choices": harness.auto_choices()})  # params: as tuning tables
    run.log(f"wrote {path}")
  return 1 if rejected else 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
