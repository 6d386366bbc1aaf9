"""A one-kernel custom call's cost in XLA's graphs: with PDL, and with the all-reduce's bookkeeping.

Problem:
  In a decode step every all-reduce is one FFI custom call between XLA's
  kernels, inside XLA's CUDA graphs (docs/decode.md). Part of its cost in the
  step is the launch: the gap between the kernel before it and its own first
  instruction. Two questions, each on one GPU and without communication:

    * With programmatic dependent launch (Hopper), a kernel launched with
      ``cudaLaunchAttributeProgrammaticStreamSerialization`` may be scheduled
      before the kernel ahead of it has finished, and waits for it in the
      kernel (``griddepcontrol.wait``). What does that save?
    * The all-reduce kernels read the call's epoch from device memory before
      their first store, and end with ``Finish``: a barrier, a ticket per
      block from an atomic counter, and the last block advancing the epoch
      (and, until this measured it, fencing). What does that bookkeeping cost
      a call, apart from the communication (docs/kernels.md, distance to the
      floors)?

Method:
  For each size, jit'd chains of ``--chain`` steps on one GPU, timed
  interleaved (median of ``--reps`` rounds), with XLA's default flags (its
  command buffers capture fusions and custom calls):

    * ``xla``: each step one small XLA fusion (``x * 1.0001 + 0.5``) behind
      ``lax.optimization_barrier``, so every step stays one kernel;
    * ``floor``: the same step, then ``launch_floor(x)`` (one copy kernel,
      ffi/launch_floor.cu);
    * ``floor_pdl``: the same with ``launch_floor(x, variant="pdl")``;
    * ``floor_bookkeeping``: with ``variant="bookkeeping"`` (the copy plus the
      epoch read and Finish's ticket, epoch advance and fence, as the kernels
      did until Finish stopped fencing);
    * ``floor_bookkeeping_nofence``: the same without the last block's fence
      (the kernels' Finish today);
    * ``floor_epoch_read`` and ``floor_end_ticket``: the epoch read alone, and
      Finish's end (ticket, advance, fence) alone;
    * ``floor_start_count``: an alternative with no ticket at the end: thread 0
      of each block reads the epoch, the block meets at a barrier, thread 0
      adds to a start counter (release); at the end block 0 waits until every
      block has added, then advances the epoch;
    * ``floor_start_ticket``: thread 0 of each block reads the epoch, a
      barrier, then thread 0 takes a ticket (acquire-release); the last block
      to take one advances the epoch at once: nothing at the end.

  Per call: (chain time - the ``xla`` chain's time) / chain. PDL saves
  ``floor`` minus ``floor_pdl``; the bookkeeping costs ``floor_bookkeeping``
  minus ``floor``. Before timing, each chain's result is checked against
  NumPy (the copies must not change the values).

Results: ``<out>/launch_floor_pdl-<machine>.json`` (records: op "launch_floor",
impl one of those above, bytes, time_us per call beyond the XLA step, and
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
IMPLS = ("xla", "floor", "floor_pdl", "floor_bookkeeping", "floor_bookkeeping_nofence",
         "floor_epoch_read", "floor_end_ticket", "floor_start_count", "floor_start_ticket")
VARIANTS = {impl: impl.removeprefix("floor_") for impl in IMPLS[2:]} | {"floor": "plain"}


def make_chain(impl: str, chain: int):
  """The jit'd chain of ``chain`` steps of ``impl`` (module docstring)."""
  from jaxoverlap import _cuda

  def step(x):
    x = x * jnp.asarray(1.0001, x.dtype) + jnp.asarray(0.5, x.dtype)
    x = jax.lax.optimization_barrier(x)
    if impl != "xla":
      x = _cuda.launch_floor(x, variant=VARIANTS[impl])
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
  """Times every chain (IMPLS) at every size; returns the records (module docstring)."""
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
    for impl in IMPLS[1:]:
      records.append({"op": "launch_floor", "impl": impl, "bytes": nbytes, "dtype": "float32",
                      "time_us": round(us[impl] - us["xla"], 3),
                      "xla_step_us": round(us["xla"], 3)})
    log(f"{nbytes:>9} B: xla step {us['xla']:.2f} us; per call beyond it: "
        + ", ".join(f"{impl} +{us[impl] - us['xla']:.2f} us" for impl in IMPLS[1:]))
  return records


def markdown_table(records: list[dict]) -> str:
  """bytes | XLA step | each variant | PDL's saving | the bookkeeping's cost (us per call).

  Files written before the bookkeeping variants existed have only floor and
  floor_pdl; their table has those columns.
  """
  by = {(r["bytes"], r["impl"]): r for r in records}
  impls = [i for i in IMPLS[1:] if any(r["impl"] == i for r in records)]
  book = "floor_bookkeeping" in impls
  head = (["bytes", "XLA step us"] + [f"{i} us" for i in impls] + ["PDL saves us"]
          + (["bookkeeping costs us"] if book else []))
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for b in sorted({r["bytes"] for r in records}):
    t = {i: by[(b, i)]["time_us"] for i in impls}
    cells = [str(b), f"{by[(b, 'floor')]['xla_step_us']:.2f}"] + [f"{t[i]:.2f}" for i in impls]
    cells.append(f"{t['floor'] - t['floor_pdl']:.2f}")
    if book:
      cells.append(f"{t['floor_bookkeeping'] - t['floor']:.2f}")
    rows.append("| " + " | ".join(cells) + " |")
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
  kind, machine = harness.one_gpu_machine(fl.machine)
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
