"""All-reduce + residual add + RMSNorm per call: the fused kernel against the two unfused forms.

Run one process per GPU through the launcher:

  python -m jaxoverlap.launch --nproc 2 benchmarks/all_reduce_rms_norm.py
  # CPU smoke run (backend xla, 2 simulated devices):
  python benchmarks/all_reduce_rms_norm.py --host_devices 2 --backend xla --rows 1 \\
      --hidden 256 --reps 3 --out /tmp/arn

What is timed, per [rows, hidden] shape of p (each rank's partial sums, the decode pattern after a
row-parallel layer: rows = batch x new tokens), side by side in one process group:

* ``xla:psum+norm``: ``h = residual + lax.psum(p)``, ``y = rms_norm(h) * weight`` in JAX;
* ``jaxoverlap:all_reduce+norm``: the same with ``jaxoverlap.all_reduce`` (auto) for the sum;
* ``jaxoverlap:all_reduce_rms_norm``: ``jaxoverlap.all_reduce_rms_norm``, one kernel
  (``algorithm="one_shot"`` on backend "cuda");
* ``jaxoverlap:all_reduce_rms_norm/auto``: the same op with ``algorithm="auto"``: the fused
  kernel or the all-reduce then the norm, as ``jaxoverlap.tuning.policy.fuse_norm`` says.

Method: the chain method of ``jaxoverlap.tuning.timing``: a chain of --chain dependent calls in
one jit (each call's y is the next call's p), minus the same chain without them, divided by the
chain length; the median of --reps runs. Each implementation is first checked against
``xla:psum+norm`` on every element (``harness.close``); one that fails is listed under
"rejected" and not timed.

Rank 0 writes <out>/all_reduce_rms_norm-<machine>.json (records: op "all_reduce_rms_norm",
impl, dtype, bytes = rows x hidden x itemsize, shape, world, ranks_per_node, time_us) and prints
a table with the fused kernel's speed-up over each unfused form.
"""

from __future__ import annotations

from absl import app, flags

import harness

AXIS = "x"
OP = "all_reduce_rms_norm"
PSUM_NORM = "xla:psum+norm"
OURS_NORM = "jaxoverlap:all_reduce+norm"
FUSED = "jaxoverlap:all_reduce_rms_norm"
AUTO = "jaxoverlap:all_reduce_rms_norm/auto"
IMPLS = (PSUM_NORM, OURS_NORM, FUSED, AUTO)
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

  if impl == PSUM_NORM:
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
    kw = dict(mesh=run.mesh, axis_name=AXIS, length=fl.chain, reps=fl.reps)
    empty_s = tuning.chain_time_s(None, x, **kw)
    ref = make_op(PSUM_NORM, residual, weight, fl.backend)
    both = jax.jit(jax.shard_map(lambda p: ref(p), mesh=run.mesh, in_specs=P(AXIS),
                                 out_specs=(P(), P())))
    want = both(x)
    line = [f"[{rows}, {hidden}] {nbytes} B:"]
    for impl in impls:
      op = make_op(impl, residual, weight, fl.backend)
      try:
        got = jax.jit(jax.shard_map(op, mesh=run.mesh, in_specs=P(AXIS),
                                    out_specs=(P(), P())))(x)
        oks = [harness.close(g, w) for g, w in zip(got, want)]
        why = None if all(ok for ok, _, _ in oks) else (
            f"differs from {PSUM_NORM}: max |diff| h {oks[0][1]:.3g}, y {oks[1][1]:.3g}")
      except Exception as e:  # noqa: BLE001: a refusal is a rejection, recorded with its reason
        why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
      if why:
        rejected.append({"impl": impl, "bytes": nbytes, "shape": [rows, hidden], "reason": why})
        run.log(f"WRONG: {impl} at [{rows}, {hidden}]: {why}")
        continue
      t = tuning.time_chain_us(lambda p, op=op: op(p)[1], x, empty_s=empty_s, **kw)
      records.append({"op": OP, "impl": impl, "dtype": dtype.name, "bytes": nbytes,
                      "shape": [rows, hidden], "world": run.world,
                      "ranks_per_node": run.ranks_per_node, "time_us": t,
                      "processes": run.processes})
      line.append(f"{harness.short_name(impl)}={t:.1f}us")
    run.log(f"({i + 1}/{len(shapes)}) " + "  ".join(line))
  if run.rank == 0:
    _print_table(records)
    machine = harness.machine_name(fl.machine)
    path = harness.path(fl.out, OP, machine)
    harness.write_result(
        path, records, benchmark=OP, machine=machine,
        script="benchmarks/all_reduce_rms_norm.py", rejected=rejected,
        method=(f"median of {fl.reps} runs of a chain of {fl.chain} calls in one jit (each "
                "call's y the next call's p), minus the same chain without them, divided by "
                f"the chain length; every impl first checked against {PSUM_NORM}"),
        extra={"plans": [p.summary() for p in jaxoverlap.decisions(OP)][-len(shapes):],
               "platform": run.platform, "world": run.world})
    run.log(f"wrote {path}")
  return 1 if rejected else 0


def _print_table(records) -> None:
  by = {}
  for r in records:
    by.setdefault(tuple(r["shape"]), {})[r["impl"]] = r["time_us"]
  print("| rows x hidden | psum + norm us | all_reduce + norm us | fused us | auto us "
        "| fused vs psum+norm | fused vs all_reduce+norm |")
  print("|---|---|---|---|---|---|---|")
  nan = float("nan")
  for (rows, hidden), t in by.items():
    f = t.get(FUSED)
    ratio = lambda k: f"{t[k] / f:.2f}x" if f and k in t else "-"  # noqa: E731
    print(f"| {rows} x {hidden} | {t.get(PSUM_NORM, nan):.1f} | {t.get(OURS_NORM, nan):.1f} | "
          f"{f if f is not None else nan:.1f} | {t.get(AUTO, nan):.1f} | {ratio(PSUM_NORM)} | "
          f"{ratio(OURS_NORM)} |")


if __name__ == "__main__":
  define_flags()
  app.run(main)
