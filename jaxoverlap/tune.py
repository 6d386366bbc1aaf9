"""Measures every all-reduce algorithm against lax.psum and saves the tuning table.

Run it inside every process of the job, one process per GPU, or in the one
process that drives every GPU of the host (JAX's default):

  python -m jaxoverlap.launch --nproc 8 -m jaxoverlap.tune
  srun --ntasks-per-node 8 python -m jaxoverlap.tune --out /shared/all_reduce-tuning.json
  python -m jaxoverlap.tune --out /tmp/one_process.json

Each run replaces the table at ``--out``. Each record carries the process
model (``processes``, ``transport``: "nvshmem" across processes, "peer"
within one). Where a table's records of the caller's transport cover the size
(psum and a kernel measured there), the policy decides from those alone
(``tuning.Policy.choose``), so one table can serve both models: build it from
both runs' files with ``--from_results`` (files that time every kernel: this
tool's, or ``benchmarks/all_reduce.py`` with its default impls).

For each size (``--sizes``, per-rank bytes) every impl is first checked
against a float32 psum of the same inputs, on three different inputs in a row,
then as ``CHECK_CHAIN`` calls back to back in one jit (the timed chain's
pattern) against a chain of float32 psums, on every element of every rank; one
that fails (or cannot run) is recorded under ``"rejected"`` and not timed, so
a wrong but fast configuration never wins. The rest are timed together with
``tuning.time_chains_stats_us`` (per round, the chain of ``--chain`` ops in
one jit of every impl in turn, each after a small psum that lines the
processes up, minus that round's chain without them; the slowest process's
round; median of ``--reps`` rounds, with the 10th and 90th percentiles). The
timings become the table; it goes to ``--out``
(default ``$JAXOVERLAP_TUNING_FILE`` or
``~/.cache/jaxoverlap/all_reduce-tuning.json``), written by rank 0 and by the
first process of every other host, so that node-local caches agree and every
process chooses the same algorithm. ``--net_alpha_us`` / ``--net_beta_gbps``
are stored in the table's ``"params"`` for the cost model (used at sizes and
topologies the table lacks).

``--from_results`` builds a table from ``benchmarks/all_reduce.py`` results
files instead of measuring (the shipped
``jaxoverlap/tuning_tables/all_reduce-NVIDIA_H200.json`` is made this way):

  R=benchmarks/results/all_reduce-2x_H200_NV18
  python -m jaxoverlap.tune --out jaxoverlap/tuning_tables/all_reduce-NVIDIA_H200.json \\
      --from_results $R-1x2.json,$R-2x1.json
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

from jaxoverlap import _cli, names, runtime, tuning
from jaxoverlap.tuning.check import all_reduce_mismatch
from jaxoverlap.tuning.results import parse_bytes

flags.DEFINE_string("out", "", "tuning table path (default: tuning.default_tuning_path())")
flags.DEFINE_list("sizes", [f"{4 << i}K" for i in range(8)] + [f"{1 << i}M" for i in range(9)],
                  "per-rank message sizes, bytes (K/M/G suffixes)")
flags.DEFINE_list("impls", ["all"],
                  "impls to measure, e.g. jaxoverlap:one_shot_ll,xla:psum; 'all': every "
                  "algorithm/protocol valid for the topology, and xla:psum")
flags.DEFINE_string("dtype", "bfloat16", "element type")
flags.DEFINE_integer("chain", 50, "ops per jit'd chain up to 8 MiB")
flags.DEFINE_integer("chain_large", 10, "ops per jit'd chain above 8 MiB")
flags.DEFINE_integer("reps", 30, "timed runs per chain (median)")
flags.DEFINE_integer("warmup", 3, "untimed runs per chain")
flags.DEFINE_integer("ranks_per_node", 0,
                     "GPUs per node (0: from jaxoverlap.runtime_info(), else all on one node)")
flags.DEFINE_string("machine", "", "machine name for the table (default: '<world>x <device kind>')")
flags.DEFINE_float("net_alpha_us", None, "network latency per message, us, saved into 'params'")
flags.DEFINE_float("net_beta_gbps", None, "network bandwidth per GPU, GB/s, saved into 'params'")
flags.DEFINE_list("from_results", [],
                  "instead of measuring: build the table from these benchmarks/all_reduce.py "
                  "results files (their kernel and psum records; no GPU needed)")
FLAGS = flags.FLAGS

_AXIS = "x"
# Calls back to back in one jit in the correctness check: the timed chain's pattern (slots and
# epochs reused inside one program, with no host in between).
CHECK_CHAIN = 4


def default_impls(num_nodes: int) -> list[str]:
  """xla:psum, then every CUDA all-reduce algorithm and protocol valid for the topology.

  Args:
    num_nodes: nodes of the group (one_shot and two_shot within one node,
      hierarchical across nodes).

  Returns:
    impl names of the results format, e.g. ``"jaxoverlap:one_shot_ll"``; an
    algorithm with one protocol keeps its bare name (``"jaxoverlap:two_shot"``).
  """
  impls = ["xla:psum"]
  for algorithm in names.algorithms(names.ALL_REDUCE, names.CUDA):
    if (num_nodes > 1) != (algorithm == names.HIERARCHICAL):
      continue
    protocols = names.protocols(algorithm)
    impls += ([tuning.impl_name(algorithm, p) for p in protocols] if len(protocols) > 1
              else [tuning.impl_name(algorithm, None)])
  return impls


def _op(impl: str):
  """The per-shard function of an impl."""
  import jax

  import jaxoverlap

  if impl == "xla:psum":
    return lambda y: jax.lax.psum(y, _AXIS)
  parsed = tuning.parse_impl(impl)
  if parsed is None or parsed[0] == tuning.PSUM:
    raise ValueError(f"unknown impl {impl!r}")
  algorithm, protocol = parsed
  return lambda y: jaxoverlap.all_reduce(y, _AXIS, backend="cuda", algorithm=algorithm,
                                         protocol=protocol or "auto")


class _Bench:
  """``measure`` and ``check`` for ``tuning.run_tuning`` on the real devices."""

  def __init__(self, dtype, rank: int):
    import jax

    self.jax = jax
    self.mesh = jax.make_mesh((jax.device_count(),), (_AXIS,),
                              axis_types=(jax.sharding.AxisType.Auto,))
    self.dtype, self.rank = dtype, rank
    self.num_ranks = jax.device_count()
    self.num_local = jax.local_device_count()

  def _array(self, nbytes: int, seed, outliers: bool):
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = nbytes // self.dtype.itemsize
    rng = np.random.default_rng(seed)
    local = rng.standard_normal(n * self.num_local).astype(np.float32)
    if outliers and local.size:
      idx = rng.integers(0, local.size, max(1, local.size // 1000))
      local[idx] *= 100.0
    local = (local if outliers else local * 1e-3).astype(self.dtype)
    return self.jax.make_array_from_process_local_data(
        NamedSharding(self.mesh, P(_AXIS)), local, (n * self.num_ranks,))

  def measure_row(self, impls, nbytes: int) -> dict[str, dict[str, float]]:
    """Every impl of one size, timed interleaved (``tuning.time_chains_stats_us``)."""
    x = self._array(nbytes, [self.rank, nbytes], outliers=False)
    length = FLAGS.chain if nbytes <= (8 << 20) else FLAGS.chain_large
    return tuning.time_chains_stats_us({impl: _op(impl) for impl in impls}, x, mesh=self.mesh,
                                       axis_name=_AXIS, length=length, reps=FLAGS.reps,
                                       warmup=FLAGS.warmup)

  def check(self, impl: str, nbytes: int) -> str | None:
    """None when ``impl`` equals a float32 psum on every element of every rank, called alone
    (three inputs in a row) and ``CHECK_CHAIN`` times back to back in one jit
    (``tuning.check.all_reduce_mismatch``)."""
    import numpy as np
    from jax.experimental import multihost_utils

    if impl == "xla:psum":
      return None
    try:
      # No outliers in the chain: it multiplies by the group size at every link, and 100x
      # outliers would overflow float16 at 8 ranks (the single calls test them).
      reason = all_reduce_mismatch(
          _op(impl), [self._array(nbytes, [self.rank, nbytes, step, 1], outliers=True)
                      for step in range(3)],
          self._array(nbytes, [self.rank, nbytes, 3, 1], outliers=False),
          mesh=self.mesh, axis_name=_AXIS, links=CHECK_CHAIN)
    except Exception as e:  # pylint: disable=broad-except  # recorded, never silent
      reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    # Every process must reject the same configurations (the verdict is the same on every
    # process; an exception may not be).
    ok = multihost_utils.process_allgather(np.array([reason is None]))
    if reason is None and not np.all(ok):
      reason = "failed its correctness check on another process"
    return reason


def _broadcast_json(obj, rank: int):
  """Rank 0's JSON-able ``obj`` on every process."""
  import numpy as np
  from jax.experimental import multihost_utils

  data = np.frombuffer(json.dumps(obj).encode(), np.uint8) if rank == 0 else None
  n = int(multihost_utils.broadcast_one_to_all(np.int32(0 if data is None else data.size)))
  buf = data if data is not None else np.zeros(n, np.uint8)
  return json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes().decode())


def table_from_results(paths, command: str) -> dict:
  """A tuning table made of the records of ``benchmarks/all_reduce.py`` results files.

  Keeps the records that are choices (kernels and ``xla:psum``; not auto or
  the launch floor) and the rejected configurations; machine and versions
  come from the first file, the method from each (named by file where they
  differ). Every file must be the all-reduce's (benchmark ``all_reduce`` or
  ``all_reduce_tuning``, every record of op ``all_reduce``), and the files
  together must time at least one CUDA kernel: the checks of
  ``tuning.validate_tuning_table``, which every table read for use passes.

  Args:
    paths: results files (JSON, the results format with ``"records"``).
    command: recorded as the table's ``"command"``.

  Raises:
    OSError: a file that cannot be read.
    ValueError: a file that is not JSON, has no records, or is not the
      all-reduce's; files of different machines; files that time no CUDA
      kernel (psum alone, or only ``auto`` and floors).
  """
  results = []
  for path in paths:
    with open(path) as f:
      try:
        results.append(json.load(f))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"tune --from_results: {path} is not JSON ({e})") from e
    if not isinstance(results[-1], dict) or not results[-1].get("records"):
      raise ValueError(f"tune --from_results: {path} has no records")
    tuning.check_all_reduce_records(results[-1], f"tune --from_results: {path}")
  tuning.check_kernel_measured([rec for r in results for rec in r["records"]],
                               f"tune --from_results: {', '.join(paths)}")
  machines = {r.get("machine") for r in results}
  if len(machines) > 1:
    raise ValueError(f"tune --from_results: the files come from different machines {machines}")
  records = [dict(rec) for r in results for rec in r["records"]
             if tuning.parse_impl(rec.get("impl", "")) is not None]
  rejected = [rej for r in results for rej in r.get("rejected", [])
              if tuning.parse_impl(rej.get("impl", "")) is not None]
  first = results[0]
  methods = {r["method"] for r in results}
  method = first["method"] if len(methods) == 1 else "; ".join(
      f"{os.path.basename(p)}: {r['method']}" for p, r in zip(paths, results))
  table = tuning.make_result(records, machine=first["machine"], command=command,
                             method=method, versions=first.get("versions"),
                             params=first.get("params") or {}, rejected=rejected)
  tuning.validate_tuning_table(table, f"tune --from_results: the table of {', '.join(paths)}")
  return table


def main(argv):
  del argv
  # Warnings and errors only (jaxoverlap's fallbacks among them): absl's default shows JAX's
  # INFO lines (e.g. which platforms it could not start), which would bury the tuner's output.
  logging.set_verbosity(logging.WARNING)
  if FLAGS.from_results:
    try:
      result = table_from_results(FLAGS.from_results,
                                  "python -m jaxoverlap.tune " + " ".join(sys.argv[1:]))
    except (OSError, ValueError) as e:  # unreadable, not JSON, no records, no kernel, another op
      print(f"jaxoverlap.tune: error: {e}", file=sys.stderr, flush=True)
      return 1
    print(f"wrote {tuning.save_result(result, FLAGS.out or None)} "
          f"({len(result['records'])} records)", flush=True)
    return
  try:  # before anything starts: a bad size is the command's fault, on every machine
    sizes = [parse_bytes(s, "--sizes") for s in FLAGS.sizes]
  except ValueError as e:
    print(f"jaxoverlap.tune: error: {e}", file=sys.stderr, flush=True)
    return 1
  from jaxoverlap import launch

  info = launch.initialize_from_env()
  import jax
  import jax.numpy as jnp

  import jaxoverlap

  rank = info["process_id"]
  rt = jaxoverlap.runtime_info()
  if jax.default_backend() != "gpu":
    # The table is read by backend "cuda" only; one measured here would hold psum alone and
    # would replace any real table at the default path. One line, not app.UsageError's
    # flag help: the command was right, the machine is not.
    print(f"jaxoverlap.tune: error: jaxoverlap.tune measures the CUDA kernels and needs "
          f"NVIDIA GPUs; JAX runs on {jax.default_backend()!r} here", file=sys.stderr,
          flush=True)
    return 1
  world = jax.device_count()
  ranks_per_node = FLAGS.ranks_per_node or rt.get("ranks_per_node") or world
  if world % ranks_per_node:
    raise app.UsageError(f"--ranks_per_node={ranks_per_node} does not divide {world} ranks")
  num_nodes = world // ranks_per_node
  params = {k: v for k, v in (("net_alpha_us", FLAGS.net_alpha_us),
                              ("net_beta_gbps", FLAGS.net_beta_gbps)) if v is not None}
  tuning.DEFAULT_PARAMS.replace(**params)  # bad values fail before measuring
  impls = default_impls(num_nodes) if FLAGS.impls == ["all"] else FLAGS.impls
  if "xla:psum" not in impls:
    impls = ["xla:psum"] + impls  # the table needs the handover's times
  dtype = jnp.dtype(FLAGS.dtype)
  log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
  log(f"tuning all_reduce: {world} ranks = {num_nodes} nodes x {ranks_per_node}, "
      f"{dtype.name}, impls {impls}")

  bench = _Bench(dtype, rank)
  records, rejected = tuning.run_tuning(
      None, bench.check, impls, sizes, dtype=dtype.name,
      ranks_per_node=ranks_per_node, world=world, log=log, measure_row=bench.measure_row)
  for r in rejected:
    log(f"rejected {r['impl']} at {r['bytes']} B: {r['reason']}")
  # Nodes that share a host (ranks_per_node below a host's GPUs) are marked: their
  # inter-node steps ran over NVLink, and the policy keeps them from real nodes.
  hosts = rt.get("hosts") or [None] * jax.process_count()
  emulated = runtime.nodes_are_emulated(hosts, num_nodes)
  for r in records:  # the process model: the policy prefers the records of the caller's
    r.update(processes=jax.process_count(), transport=rt.get("transport"))
    if num_nodes > 1:
      r["emulated_nodes"] = emulated

  result = None
  if rank == 0:
    result = tuning.make_result(
        records, machine=FLAGS.machine or f"{world}x {jax.devices()[0].device_kind}",
        command="python -m jaxoverlap.tune " + " ".join(sys.argv[1:]),
        method=f"median of {FLAGS.reps} rounds, each timing the empty chain and then every "
               f"impl's chain of ops in one jit ({FLAGS.chain} ops up to 8 MiB, "
               f"{FLAGS.chain_large} above) once, interleaved: (chain - the round's empty "
               "chain) / chain length; rank 0's timings",
        versions=tuning.package_versions(), params=params, rejected=rejected)
  if jax.process_count() > 1:
    result = _broadcast_json(result, rank)
  try:  # every kernel rejected: such a table would hand every call to psum, and is refused
    tuning.validate_tuning_table(result, "jaxoverlap.tune")
  except ValueError as e:  # on every process alike (the same result)
    print(f"jaxoverlap.tune: error: {e}; no table written", file=sys.stderr, flush=True)
    return 1
  if rank == 0 or hosts[rank] not in hosts[:rank]:  # first process of its host
    path = tuning.save_result(result, FLAGS.out or None)
    print(f"wrote {path} (process {rank})", flush=True)
  if rank == 0:
    policy = tuning.Policy.from_result(result, FLAGS.out or None)
    for row in policy.table(ranks_per_node, num_nodes, sizes=sizes, itemsize=dtype.itemsize,
                            transport=rt.get("transport"),
                            emulated_nodes=emulated if num_nodes > 1 else None):
      print(f"{row['bytes']:>10} B  {row['impl']:<28} {row['source']}", flush=True)


if __name__ == "__main__":
  _cli.run(main)
