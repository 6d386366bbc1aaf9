"""What programmatic dependent launch (PDL) saves a one-kernel custom call inside XLA's graphs.

Problem:
  In a decode step every all-reduce is one FFI custom call between XLA's
  kernels, inside XLA's CUDA graphs (docs/decode.md). Part of its cost in the
  step is the launch: the gap between the kernel before it and its own first
  instruction. With programmatic dependent launch (Hopper), a kernel launched
  with ``cudaLaunchAttributeProgrammaticStreamSerialization`` may be scheduled
  before the kernel ahead of it has finished, and waits for it in the kernel
  (``griddepcontrol.wait``). This measures what that saves, on one GPU and
  without communication, before the collectives' kernels adopt it.

Method:
  For each size, three jit'd chains of ``--chain`` steps on one GPU, timed
  interleaved (median of ``--reps`` rounds), with XLA's default flags (its
  command buffers capture fusions and custom calls):

    * ``xla``: each step one small XLA fusion (``x * 1.0001 + 0.5``) behind
      ``lax.optimization_barrier``, so every step stays one kernel;
    * ``floor``: the same step, then ``launch_floor(x)`` (one copy kernel,
      ffi/launch_floor.cu);
    * ``floor_pdl``: the same with ``launch_floor(x, pdl=True)``.

  Per call: (chain time - the ``xla`` chain's time) / chain; the saving is
  ``floor`` minus ``floor_pdl``. Before timing, each chain's result is checked
  against NumPy (the copies must not change the values).

Results: ``<out>/launch_floor_pdl-<machine>.json`` (records: op "launch_floor",
impl "floor" or "floor_pdl", bytes, time_us per call beyond the XLA step, and
"xla_step_us", the XLA step alone) and a Markdown table on stdout.

Example:
  python benchmarks/launch_floor_pdl.py --out /tmp/out --sizes 8K,64K,1M
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

import harness

BENCHMARK = "launch_floor_pdl"
IMPLS = ("xla", "floor", "floor_pdl")


def make_chain(impl: str, chain: int):
  """The jit'd chain of ``chain`` steps of ``impl`` (module docstring)."""
  from jaxoverlap import _cuda

  def step(x):
    x = x * jnp.asarray(1.0001, x.dtype) + jnp.asarray(0.5, x.dtype)
    x = jax.lax.optimization_barrier(x)
    if impl == "floor":
      x = _cuda.launch_floor(x)
    elif impl == "floor_pdl":
      x = _cuda.launch_floor(x, pdl=True)
    return x

  @jax.jit
  def run(x):
    for _ in range(chain):
      x = step(x)
    return x

  return run


def expected(x: np.ndarray, chain: int) -> np.ndarray:
  """The chain's value in float32, rounded to ``x``'s dtype at every step as the GPU does."""
  y = x
  for _ in range(chain):
    y = (y.astype(np.float32) * np.float32(1.0001) + np.float32(0.5)).astype(x.dtype)
  return y


def run(sizes: list[int], *, chain: int, reps: int, warmup: int, seed: int,
        log=print) -> list[dict]:
  """Times the three chains at every size; returns the records (module docstring)."""
  records = []
  rng = np.random.default_rng(seed)
  for nbytes in sizes:
    host = rng.standard_normal(nbytes // 4).astype(np.float32)
    x = jnp.asarray(host)
    fns = {impl: make_chain(impl, chain) for impl in IMPLS}
    want = expected(host, chain)
    for impl, fn in fns.items():
      got = np.asarray(fn(x))
      if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"{impl} at {nbytes} B: max |diff| {np.abs(got - want).max():.3g}")
    times = harness.time_interleaved({impl: (lambda fn=fn: fn(x)) for impl, fn in fns.items()},
                                     reps=reps, warmup=warmup)
    us = {impl: harness.median(ts) / chain * 1e6 for impl, ts in times.items()}
    for impl in ("floor", "floor_pdl"):
      records.append({"op": "launch_floor", "impl": impl, "bytes": nbytes, "dtype": "float32",
                      "time_us": round(us[impl] - us["xla"], 3),
                      "xla_step_us": round(us["xla"], 3)})
    log(f"{nbytes:>9} B: xla step {us['xla']:.2f} us; launch_floor +{us['floor'] - us['xla']:.2f}"
        f" us, with PDL +{us['floor_pdl'] - us['xla']:.2f} us per call")
  return records


def markdown_table(records: list[dict]) -> str:
  """bytes | XLA step | launch_floor | with PDL | saving (us per call)."""
  by = {(r["bytes"], r["impl"]): r for r in records}
  rows = ["| bytes | XLA step us | launch_floor us | with PDL us | saving us |",
          "|---|---|---|---|---|"]
  for b in sorted({r["bytes"] for r in records}):
    plain, pdl = by[(b, "floor")], by[(b, "floor_pdl")]
    rows.append(f"| {b} | {plain['xla_step_us']:.2f} | {plain['time_us']:.2f} | "
                f"{pdl['time_us']:.2f} | {plain['time_us'] - pdl['time_us']:.2f} |")
  return "\n".join(rows)


def define_flags():
  """Defines the command-line flags (only when run as a script)."""
  from absl import flags

  flags.DEFINE_list("sizes", ["8K", "64K", "1M"], "bytes per call (K, M: powers of 1024)")
  flags.DEFINE_integer("chain", 200, "steps of each jit'd chain")
  harness.define_flags("out", "seed",
                       machine=(None, "machine name (default: '1x <device kind>')"),
                       reps=(30, "timed rounds (median)"), warmup=(3, "untimed rounds"))


def main(argv):
  del argv
  from absl import flags

  fl = flags.FLAGS
  if jax.default_backend() != "gpu":
    raise SystemExit("launch_floor_pdl: needs an NVIDIA GPU (the custom call is a CUDA kernel)")
  sizes = [harness.parse_bytes(s) for s in fl.sizes]
  records = run(sizes, chain=fl.chain, reps=fl.reps, warmup=fl.warmup, seed=fl.seed)
  kind = jax.devices()[0].device_kind
  machine = fl.machine or f"1x {kind.removeprefix('NVIDIA ')}"
  path = harness.path(fl.out, BENCHMARK, machine)
  method = (f"one GPU; per call = (median over {fl.reps} interleaved rounds of a jit'd chain of "
            f"{fl.chain} steps - the same chain of XLA steps alone) / {fl.chain}")
  harness.write_result(path, records, benchmark=BENCHMARK, machine=machine, method=method,
                       script="benchmarks/launch_floor_pdl.py", latency=False,
                       extra={"device_kind": kind, "xla_flags": os.environ.get("XLA_FLAGS", "")})
  print(markdown_table(records))
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
