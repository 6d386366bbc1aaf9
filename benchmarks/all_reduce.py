"""All-reduce latency: jaxoverlap's CUDA algorithms against lax.psum, in one run.

Run one process per GPU through the launcher:

  python -m jaxoverlap.launch --nproc 2 benchmarks/all_reduce.py --out benchmarks/results

Method (BRIEF section 5): for each size, a chain of --chain dependent ops in one
jit, minus the same chain without them, divided by --chain; the median of
--reps timed runs after warm-up. Ours and psum are measured side by side in one
process group. Rank 0 writes benchmarks/results/all_reduce-<machine>.json in
the BRIEF section 7 format, and a PNG.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

from absl import app, flags

flags.DEFINE_string("out", "benchmarks/results", "folder for the JSON and PNG")
flags.DEFINE_string("machine", "", "machine name for the results (default: from nvidia-smi)")
flags.DEFINE_list("sizes", "8K,32K,64K,256K,1M,2M,4M", "per-rank message sizes (bytes; K/M suffix)")
flags.DEFINE_list("impls", "jaxoverlap:one_shot,xla:psum", "implementations to time")
flags.DEFINE_string("dtype", "bfloat16", "element type")
flags.DEFINE_integer("chain", 50, "ops per jit'd chain")
flags.DEFINE_integer("reps", 30, "timed repetitions (median reported)")
FLAGS = flags.FLAGS


def _bytes(s: str) -> int:
  s = s.strip().upper()
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
  return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def main(argv):
  del argv
  from jaxoverlap import launch

  info = launch.initialize_from_env()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxoverlap

  rank, nproc = info["process_id"], info["num_processes"]
  mesh = jax.make_mesh((nproc,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = NamedSharding(mesh, P("x"))
  dtype = jnp.dtype(FLAGS.dtype)
  rt = jaxoverlap.runtime_info()

  def chain_fn(impl):
    def op(y):
      if impl == "xla:psum":
        y = jax.lax.psum(y, "x")
      elif impl == "none":
        return y
      else:
        y = jaxoverlap.all_reduce(y, "x", backend="cuda", algorithm=impl.split(":")[1])
      return jax.lax.pcast(y, "x", to="varying")

    def f(x):
      for _ in range(FLAGS.chain):
        x = op(x)
      return x

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

  def time_fn(fn, x):
    for _ in range(3):
      fn(x).block_until_ready()
    ts = []
    for _ in range(FLAGS.reps):
      t = time.perf_counter()
      fn(x).block_until_ready()
      ts.append(time.perf_counter() - t)
    return statistics.median(ts)

  records = []
  for size in [_bytes(s) for s in FLAGS.sizes]:
    n = size // dtype.itemsize
    local = (np.random.default_rng([rank, n]).standard_normal(n) * 1e-3).astype(dtype)
    x = jax.make_array_from_process_local_data(sharding, local, (n * nproc,))
    t_empty = time_fn(chain_fn("none"), x)
    row = []
    for impl in FLAGS.impls:
      t = time_fn(chain_fn(impl), x)
      us = (t - t_empty) / FLAGS.chain * 1e6
      row.append(f"{impl}={us:.1f}us")
      records.append({"op": "all_reduce", "impl": impl if impl.startswith("xla") else impl,
                      "dtype": dtype.name, "bytes": size, "shape": [n], "world": nproc,
                      "ranks_per_node": rt.get("ranks_per_node", nproc), "time_us": round(us, 2)})
    if rank == 0:
      print(f"{size:>9} B  " + "  ".join(row), flush=True)

  if rank == 0:
    machine = FLAGS.machine or _machine(nproc)
    os.makedirs(FLAGS.out, exist_ok=True)
    tag = machine.replace(" ", "_").replace("/", "-")
    result = {
        "benchmark": "all_reduce",
        "machine": machine,
        "command": "python -m jaxoverlap.launch --nproc %d benchmarks/all_reduce.py %s" % (
            nproc, " ".join(sys.argv[1:])),
        "method": f"median of {FLAGS.reps} runs of a chain of {FLAGS.chain} ops in one jit, "
                  "minus the same chain without them, divided by the chain length",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "records": records,
    }
    path = os.path.join(FLAGS.out, f"all_reduce-{tag}.json")
    with open(path, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {path}")


def _machine(nproc: int) -> str:
  import jax

  kind = jax.devices()[0].device_kind
  return f"{nproc}x {kind}"


def _versions() -> dict:
  import importlib.metadata as md

  out = {}
  for name, dist in (("jax", "jax"), ("jaxlib", "jaxlib"), ("nvshmem", "nvidia-nvshmem-cu13"),
                     ("nccl", "nvidia-nccl-cu13")):
    try:
      out[name] = md.version(dist)
    except md.PackageNotFoundError:
      out[name] = None
  return out


if __name__ == "__main__":
  app.run(main)
