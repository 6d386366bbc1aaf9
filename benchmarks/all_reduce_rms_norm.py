"""All-reduce + residual add + RMSNorm per call: the fused kernel against the two unfused forms.

Run one process per GPU through the launcher:

  python -m jaxoverlap.launch --nproc 2 benchmarks/all_reduce_rms_norm.py
  # CPU smoke run (backend xla, 2 simulated devices):
  python benchmarks/all_reduce_rms_norm.py --host_devices 2 --backend xla --rows 1 \\
      --hidden 256 --reps 3 --out /tmp/arn

What is timed, per [rows, hidden] shape of p (each rank's partial sums, the decode pattern after a
row-parallel layer: rows = batch x new tokens), side by side in one process group:

* ``xla:psum+norm``: ``h = residual + lax.psum(p)``, ``y = rms_norm(h) * weight`` in JAX,
  with XLA's default command-buffer types (each psum splits XLA's CUDA graphs);
* ``xla:psum+norm/graphs``: the same, compiled with ``COLLECTIVES`` added to them
  (``harness.compile_options``), so that psum runs inside the graphs as our custom calls do;
* ``jaxoverlap:all_reduce+norm``: the same with ``jaxoverlap.all_reduce`` (auto) for the sum;
* ``jaxoverlap:all_reduce_rms_norm``: ``jaxoverlap.all_reduce_rms_norm``, one kernel
  (``algorithm="one_shot"`` on backend "cuda");
* ``jaxoverlap:all_reduce_rms_norm/auto``: the same op with ``algorithm="auto"``: the fused
  kernel or the all-reduce then the norm, as ``jaxoverlap.tuning.policy.fuse_norm`` says.

Method: the chain method of ``jaxoverlap.tuning.timing``: a chain of --chain dependent calls in
one jit (each call's y is the next call's p), minus the same chain without them, divided by the
chain length. The implementations of a shape are timed interleaved
(``tuning.time_chains_stats_us``: per round, the empty chain and then each one's chain, each
run after a small psum that lines the processes up; a round's time is the slowest process's):
the median of --reps rounds, with the 10th and 90th percentiles. Each implementation is first
checked against ``xla:psum+norm`` on every element of h and y, for three inputs in a row (p, 2p,
3p: each slot is used again with other data) (``harness.close``); one that fails is listed
under "rejected" and not timed.

Rank 0 writes <out>/all_reduce_rms_norm-<machine>.json (records: op "all_reduce_rms_norm",
impl, dtype, bytes = rows x hidden x itemsize, shape, world, ranks_per_node, time_us,
time_us_p10, time_us_p90) and prints
a table with the fused kernel's speed-up over each unfused form.
"""

from __future__ import annotations

from absl import app, flags

import harness

AXIS = "x"
OP = "all_reduce_rms_norm"
PSUM_NORM = "xla:psum+norm"
PSUM_NORM_GRAPHS = "xla:psum+norm/graphs"
OURS_NORM = "jaxoverlap:all_reduce+norm"
FUSED = "jaxoverlap:all_reduce_rms_norm"
AUTO = "jaxoverlap:all_reduce_rms_norm/auto"
IMPLS = (PSUM_NORM, PSUM_NORM_GRAPHS, OURS_NORM, FUSED, AUTO)
EPS = 1e-6


def define_flags():
  harness.define_flags("out", "machine", "dtype", "impls", "host_devices", "seed",
                       chain=(50, "calls per jit'd chain"), reps=30)
  flags.DEFINE_list("rows", ["1", "4", "16", "64"], "rows of p per rank (batch x tokens)")
  flags.DEFINE_list("hidden", ["4096", "8192"], "the normalized (model) dimension")
  flags.DEFINE_string("backend", "cuda", "jaxoverlap backend of the two jaxoverlap impls")


def make_op(impl: str, residual, weight, backend: str):
  """The per-shard function p -> (h, y) of an implementation (inside shard_map)."""
  import jax
  import jax.numpy as jnp

  import jaxoverlap

  def norm(h):
    hf = h.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + EPS)
    return (hf * scale * weight.astype(jnp.float32)).astype(h.dtype)

  if impl in (PSUM_NORM, PSUM_NORM_GRAPHS):
    def op(p):
      h = residual + jax.lax.psum(p, AXIS)
      return h, norm(h)
  elif impl == OURS_NORM:
    def op(p):
      h = residual + jaxoverlap.all_reduce(p, AXIS, backend=backend)
      return h, norm(h)
  elif impl in (FUSED, AUTO):
    algorithm = "one_shot" if impl == FUSED and backend == "cuda" else "auto"

    def op(p):
      return jaxoverlap.all_reduce_rms_norm(p, residual, weight, AXIS, eps=EPS, backend=backend,
                                            algorithm=algorithm)
  else:
    raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
  return op


def main(argv):
  del argv
  fl = flags.FLAGS
  try:
    shapes = [(r, h) for h in harness.parse_ints("hidden", fl.hidden)
              for r in harness.parse_ints("rows", fl.rows)]
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  harness.use_host_devices(fl.host_devices)
  run = harness.start(AXIS)
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxoverlap
  from jaxoverlap import tuning

  dtype = jnp.dtype(fl.dtype)
  impls = fl.impls or list(IMPLS)
  jaxoverlap.clear_decisions()
  records, rejected = [], []
  for i, (rows, hidden) in enumerate(shapes):
    rng = np.random.default_rng([fl.seed, rows, hidden])
    # Each rank's p ~ N(0, 1) / world, the residual ~ N(0, 1), the weight ~ 1 + N(0, 0.1).
    local = (rng.standard_normal((rows * jax.local_device_count(), hidden)) / run.world)
    x = jax.make_array_from_process_local_data(
        NamedSharding(run.mesh, P(AXIS)), local.astype(dtype), (rows * run.world, hidden))
    residual = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype)
    nbytes = rows * hidden * dtype.itemsize
    ref = make_op(PSUM_NORM, residual, weight, fl.backend)
    both = jax.jit(jax.shard_map(lambda p: ref(p), mesh=run.mesh, in_specs=P(AXIS),
                                 out_specs=(P(), P())))
    inputs = [x * k for k in (1, 2, 3)]  # each slot used again with other data
    wants = [both(xk) for xk in inputs]
    line = [f"[{rows}, {hidden}] {nbytes} B:"]
    ops = {}
    for impl in impls:
      op = make_op(impl, residual, weight, fl.backend)
      try:
        fn = jax.jit(jax.shard_map(op, mesh=run.mesh, in_specs=P(AXIS), out_specs=(P(), P())))
        why = None
        for k, (xk, want) in enumerate(zip(inputs, wants)):
          oks = [harness.close(g, w) for g, w in zip(fn(xk), want)]
          if not all(ok for ok, _, _ in oks):
            why = (f"differs from {PSUM_NORM} (call {k + 1} of 3): max |diff| h "
                   f"{oks[0][1]:.3g}, y {oks[1][1]:.3g}")
            break
      except Exception as e:  # noqa: BLE001: a refusal is a rejection, recorded with its reason
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
      if why:
        rejected.append({"impl": impl, "bytes": nbytes, "shape": [rows, hidden], "reason": why})
        run.log(f"WRONG: {impl} at [{rows}, {hidden}]: {why}")
        continue
      ops[impl] = lambda p, op=op: op(p)[1]
    options = {impl: harness.compile_options(impl) for impl in ops}
    times = tuning.time_chains_stats_us(
        ops, x, mesh=run.mesh, axis_name=AXIS, length=fl.chain, reps=fl.reps,
        compiler_options={k: v for k, v in options.items() if v}) if ops else {}
    for impl, t in times.items():
      records.append({"op": OP, "impl": impl, "dtype": dtype.name, "bytes": nbytes,
                      "shape": [rows, hidden], "world": run.world,
                      "ranks_per_node": run.ranks_per_node, "time_us": t["time_us"],
                      "time_us_p10": t["p10_us"], "time_us_p90": t["p90_us"],
                      "processes": run.processes,
                      **({"xla_options": options[impl]} if options[impl] else {})})
      line.append(f"{harness.short_name(impl)}={t['time_us']:.1f}us")
    run.log(f"({i + 1}/{len(shapes)}) " + "  ".join(line))
  if run.rank == 0:
    _print_table(records)
    machine = harness.machine_name(fl.machine)
    path = harness.path(fl.out, OP, machine)
    harness.write_result(
        path, records, benchmark=OP, machine=machine,
        script="benchmarks/all_reduce_rms_norm.py", rejected=rejected,
        method=(f"median (time_us) and 10th/90th percentiles of {fl.reps} rounds, each timing "
                f"the empty chain and then every impl's chain of {fl.chain} calls in one jit "
                "(each call's y the next call's p) once, interleaved, each run after a small "
                "psum that lines the processes up: (chain - the round's empty chain) / chain "
                "length, the slowest process's time per round; every impl first checked "
                f"against {PSUM_NORM} on three inputs in a row; {PSUM_NORM_GRAPHS} compiled "
                "with COLLECTIVES in XLA's command buffers (xla_options)"),
        extra={"plans": [p.summary() for p in jaxoverlap.decisions(OP)][-len(shapes):],
               "platform": run.platform, "world": run.world})
    run.log(f"wrote {path}")
  return 1 if rejected else 0


def _print_table(records) -> None:
  by = {}
  for r in records:
    by.setdefault(tuple(r["shape"]), {})[r["impl"]] = r["time_us"]
  print("| rows x hidden | psum + norm us | the same, psum in graphs us | all_reduce + norm us "
        "| fused us | auto us | fused vs psum+norm | vs psum+norm in graphs "
        "| vs all_reduce+norm |")
  print("|---|---|---|---|---|---|---|---|---|")
  nan = float("nan")
  for (rows, hidden), t in by.items():
    f = t.get(FUSED)
    ratio = lambda k: f"{t[k] / f:.2f}x" if f and k in t else "-"  # noqa: E731
    print(f"| {rows} x {hidden} | {t.get(PSUM_NORM, nan):.1f} | "
          f"{t.get(PSUM_NORM_GRAPHS, nan):.1f} | {t.get(OURS_NORM, nan):.1f} | "
          f"{f if f is not None else nan:.1f} | {t.get(AUTO, nan):.1f} | {ratio(PSUM_NORM)} | "
          f"{ratio(PSUM_NORM_GRAPHS)} | {ratio(OURS_NORM)} |")


if __name__ == "__main__":
  define_flags()
  app.run(main)
