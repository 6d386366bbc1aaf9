"""All-reduce latency: every jaxoverlap CUDA algorithm and auto against lax.psum, in one run.

Run one process per GPU through the launcher:

  python -m jaxoverlap.launch --nproc 2 benchmarks/all_reduce.py
  JAXOVERLAP_RANKS_PER_NODE=1 python -m jaxoverlap.launch --nproc 2 benchmarks/all_reduce.py

Method (BRIEF section 5): for each size, a chain of --chain dependent ops in
one jit, minus the same chain without them, divided by the chain length; the
median of --reps timed runs after warm-up (jaxoverlap.tuning.time_chain_us).
Every implementation is first checked against lax.psum on the same input.
Ours and psum are measured side by side in one process group. Rank 0 writes
<out>/all_reduce-<machine>-<nodes>x<ranks>.json (BRIEF section 7 records);
benchmarks/plot_all_reduce.py merges the files and draws the PNG.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

from absl import app, flags

flags.DEFINE_string("out", "benchmarks/results", "folder for the JSON")
flags.DEFINE_string("machine", "2x H200 NV18", "machine name for the results")
flags.DEFINE_list("sizes", "8K,16K,32K,64K,128K,256K,512K,1M,2M,4M,16M,64M,256M",
                  "per-rank message sizes (bytes; K/M suffix)")
flags.DEFINE_list("impls", [], "implementations (default: all valid for the topology + psum)")
flags.DEFINE_string("dtype", "bfloat16", "element type")
flags.DEFINE_integer("chain", 50, "ops per jit'd chain (10 above 8 MiB)")
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
  from jaxoverlap import tuning

  rank, nproc = info["process_id"], info["num_processes"]
  rt = jaxoverlap.runtime_info()
  nodes, rpn = rt["num_nodes"], rt["ranks_per_node"]
  mesh = jax.make_mesh((nproc,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = NamedSharding(mesh, P("x"))
  dtype = jnp.dtype(FLAGS.dtype)
  impls = FLAGS.impls or (
      ["jaxoverlap:one_shot_ll", "jaxoverlap:one_shot_simple", "jaxoverlap:two_shot"]
      if nodes == 1 else ["jaxoverlap:hierarchical_ll", "jaxoverlap:hierarchical_simple"]
  ) + ["jaxoverlap:auto", "xla:psum", "floor:launch"]

  def op_of(impl):
    if impl == "floor:launch":
      from jaxoverlap import _cuda

      # Not an all-reduce: one kernel launch, to show the floor of the method.
      return _cuda.launch_floor
    if impl == "xla:psum":
      return lambda y: jax.lax.psum(y, "x")
    alg = impl.split(":")[1]
    return lambda y: jaxoverlap.all_reduce(y, "x", backend="cuda", algorithm=alg)

  def check(op, x):
    f = jax.jit(jax.shard_map(lambda y: jax.lax.pcast(op(y), "x", to="varying"), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    g = jax.jit(jax.shard_map(lambda y: jax.lax.pcast(jax.lax.psum(y, "x"), "x", to="varying"),
                              mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    a = np.asarray(f(x).addressable_shards[0].data, np.float32)
    b = np.asarray(g(x).addressable_shards[0].data, np.float32)
    return np.allclose(a, b, rtol=2e-2, atol=1e-5)

  records = []
  for size in [_bytes(s) for s in FLAGS.sizes]:
    n = size // dtype.itemsize
    local = (np.random.default_rng([rank, n]).standard_normal(n) * 1e-3).astype(dtype)
    x = jax.make_array_from_process_local_data(sharding, local, (n * nproc,))
    chain = FLAGS.chain if size <= (8 << 20) else 10
    kw = dict(mesh=mesh, axis_name="x", length=chain, reps=FLAGS.reps)
    empty = tuning.chain_time_s(None, x, **kw)
    row = []
    for impl in impls:
      op = op_of(impl)
      if impl != "floor:launch" and not check(op, x):
        row.append(f"{impl}=WRONG")
        continue
      us = tuning.time_chain_us(op, x, empty_s=empty, **kw)
      row.append(f"{impl.split(':')[1]}={us:.1f}")
      records.append({"op": "all_reduce", "impl": impl, "dtype": dtype.name, "bytes": size,
                      "shape": [n], "world": nproc, "ranks_per_node": rpn, "num_nodes": nodes,
                      "inter_node_transport": rt.get("inter_node_transport"),
                      "time_us": round(us, 2)})
    if rank == 0:
      print(f"{size:>10} B  " + "  ".join(row), flush=True)

  if rank == 0:
    from jaxoverlap import _cuda

    auto = sorted({(d["bytes"], d["algorithm"], d["protocol"]) for d in _cuda.decisions})
    os.makedirs(FLAGS.out, exist_ok=True)
    tag = FLAGS.machine.replace(" ", "_")
    result = tuning.make_result(
        records, machine=FLAGS.machine,
        command=("JAXOVERLAP_RANKS_PER_NODE=%d python -m jaxoverlap.launch --nproc %d "
                 "benchmarks/all_reduce.py %s" % (rpn, nproc, " ".join(sys.argv[1:]))),
        method=("median of %d runs of a chain of ops in one jit (50 ops up to 8 MiB, 10 "
                "above), minus the same chain without them, divided by the chain length"
                % FLAGS.reps),
        versions=tuning.package_versions())
    result["benchmark"] = "all_reduce"
    result["auto_choices"] = [list(a) for a in auto]
    path = os.path.join(FLAGS.out, f"all_reduce-{tag}-{nodes}x{rpn}.json")
    with open(path, "w") as f:
      json.dump(result, f, indent=1)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
  app.run(main)
