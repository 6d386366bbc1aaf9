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
      to take one advances the epoch at once: nothing at the end;
    * ``floor_threads128``: the copy in blocks of 128 threads (as XLA's small
      fusions and the Pallas kernel below) instead of 512;
    * ``floor_empty``: a custom call that launches nothing (its output aliases
      its input): XLA's custom-call node alone;
    * ``xla_kernel``: the same step, then a second XLA kernel that does what
      the copy does (``x * one``, ``one`` a runtime 1.0, behind its own
      barrier): what one more kernel of XLA's own costs in its graphs;
    * ``pallas_copy``: the same step, then a Pallas copy kernel (Triton,
      blocks of 1024 elements). XLA compiles it into a kernel of its own
      program, as it does its fusions, where an FFI custom call is recorded by
      capturing its stream into a graph nested in XLA's: the two side by side
      tell what the custom call's form costs beyond its kernel.

  Per call: (chain time - the ``xla`` chain's time) / chain. PDL saves
  ``floor`` minus ``floor_pdl``; the bookkeeping costs ``floor_bookkeeping``
  minus ``floor``. Before timing, each chain's result is checked against
  NumPy (the copies must not change the values).

  Anatomy (``--profile_chain N``): for each chain at the first size, one call
  of N steps compiled with the command buffers kept under the profiler
  (``xla_enable_command_buffers_during_profiling``), traced with
  jax.profiler: per kernel name, its count per step, its mean duration and
  the mean idle gap before it (its start minus the end of the device event
  before it), and the compiled module's kernels by kind (its optimized HLO).
  That tells where a chain's extra time per step goes: a longer kernel, a
  longer gap before it, or more kernels.

Results: ``<out>/launch_floor_pdl-<machine>.json`` (records: op "launch_floor",
impl one of those above, bytes, time_us per call beyond the XLA step, and
"xla_step_us", the XLA step alone; with --profile_chain, "anatomy": impl ->
{"hlo": kernels by kind, "kernels": [{name, per_step, mean_us, mean_gap_before_us}],
"window_us_per_step"}) and a Markdown table on stdout.

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
         "floor_epoch_read", "floor_end_ticket", "floor_start_count", "floor_start_ticket",
         "xla_kernel", "pallas_copy", "floor_threads128", "floor_empty")
VARIANTS = ({impl: impl.removeprefix("floor_") for impl in IMPLS if impl.startswith("floor_")}
            | {"floor": "plain"})
PALLAS_BLOCK = 1024  # float32 elements a program of pallas_copy


def pallas_copy(x: jax.Array, interpret: bool = False) -> jax.Array:
  """``x`` (1-D, a multiple of PALLAS_BLOCK elements) copied by one Pallas (Triton) kernel.

  ``interpret``: Pallas's interpreter instead of a kernel (tests off GPUs).
  """
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  spec = pl.BlockSpec((PALLAS_BLOCK,), lambda i: (i,))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // PALLAS_BLOCK,), in_specs=[spec],
                        out_specs=spec, interpret=interpret)(x)


def make_chain(impl: str, chain: int):
  """The jit'd chain of ``chain`` steps of ``impl`` (module docstring)."""
  from jaxoverlap import _cuda

  def step(x, one):
    x = x * jnp.asarray(1.0001, x.dtype) + jnp.asarray(0.5, x.dtype)
    x = jax.lax.optimization_barrier(x)
    if impl == "xla_kernel":
      x = jax.lax.optimization_barrier(x * one)
    elif impl == "pallas_copy":
      x = pallas_copy(x)
    elif impl != "xla":
      x = _cuda.launch_floor(x, variant=VARIANTS[impl])
    return x

  @jax.jit
  def run(x, one):
    for _ in range(chain):
      x = step(x, one)
    return x

  return run


def expected(x: np.ndarray, chain: int) -> np.ndarray:
  """The chain's value in float32, rounded to ``x``'s dtype at every step as the GPU does."""
  y = x
  for _ in range(chain):
    y = (y.astype(np.float32) * np.float32(1.0001) + np.float32(0.5)).astype(x.dtype)
  return y


def run(sizes: list[int], *, chain: int, reps: int, warmup: int, seed: int,
        impls: tuple[str, ...] = IMPLS, log=print) -> list[dict]:
  """Times the chains of ``impls`` ("xla" always) at every size; returns the records.

  Raises:
    ValueError: an unknown name in ``impls``, or (``pallas_copy``) a size that
      is not a multiple of PALLAS_BLOCK float32 elements.
  """
  unknown = [i for i in impls if i not in IMPLS]
  if unknown:
    raise ValueError(f"unknown impls {unknown}; known: {list(IMPLS)}")
  impls = ("xla",) + tuple(i for i in IMPLS[1:] if i in impls)
  if "pallas_copy" in impls and any(n % (4 * PALLAS_BLOCK) for n in sizes):
    raise ValueError(f"pallas_copy: sizes must be multiples of {4 * PALLAS_BLOCK} bytes, "
                     f"got {sizes}")
  records = []
  rng = np.random.default_rng(seed)
  one = jnp.ones((), jnp.float32)
  for nbytes in sizes:
    host = rng.standard_normal(nbytes // 4).astype(np.float32)
    x = jnp.asarray(host)
    fns = {impl: make_chain(impl, chain) for impl in impls}
    want = expected(host, chain)
    for impl, fn in fns.items():
      got = np.asarray(fn(x, one))
      if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"{impl} at {nbytes} B: max |diff| {np.abs(got - want).max():.3g}")
    times = harness.time_interleaved(
        {impl: (lambda fn=fn: fn(x, one)) for impl, fn in fns.items()}, reps=reps, warmup=warmup)
    us = {impl: harness.median(ts) / chain * 1e6 for impl, ts in times.items()}
    for impl in impls[1:]:
      records.append({"op": "launch_floor", "impl": impl, "bytes": nbytes, "dtype": "float32",
                      "time_us": round(us[impl] - us["xla"], 3),
                      "xla_step_us": round(us["xla"], 3)})
    log(f"{nbytes:>9} B: xla step {us['xla']:.2f} us; per call beyond it: "
        + ", ".join(f"{impl} +{us[impl] - us['xla']:.2f} us" for impl in impls[1:]))
  return records


def gaps_by_kernel(events, steps: int) -> list[dict]:
  """Per kernel name: count per step, mean duration and mean idle gap before it, in us.

  ``events``: the device events of one traced call (``profile_step.Event``:
  ``name``, ``start``, ``end``), on one stream; the gap before an event is
  its start minus the latest end of the events before it (0 where they
  overlap; the first event has none).
  """
  stats: dict[str, list[float]] = {}
  last_end = None
  for ev in sorted(events, key=lambda e: e.start):
    t = stats.setdefault(ev.name, [0, 0.0, 0.0, 0])  # count, duration, gap, gaps
    t[0] += 1
    t[1] += ev.end - ev.start
    if last_end is not None:
      t[2] += max(0.0, ev.start - last_end)
      t[3] += 1
    last_end = ev.end if last_end is None else max(last_end, ev.end)
  return [{"name": n[:120], "per_step": round(t[0] / steps, 2), "mean_us": round(t[1] / t[0], 3),
           "mean_gap_before_us": round(t[2] / t[3], 3) if t[3] else None}
          for n, t in sorted(stats.items(), key=lambda kv: -kv[1][0])]


def anatomy(impl: str, nbytes: int, chain: int, logdir: str) -> dict:
  """One traced call of ``impl``'s chain (module docstring, "Anatomy")."""
  import decode_floor
  import profile_step

  x = jnp.asarray(np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32))
  one = jnp.ones((), jnp.float32)
  compiled = make_chain(impl, chain).lower(x, one).compile(
      compiler_options={"xla_enable_command_buffers_during_profiling": True})
  jax.block_until_ready(compiled(x, one))
  os.makedirs(logdir, exist_ok=True)
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    with jax.profiler.StepTraceAnnotation(profile_step.STEP_NAME, step_num=0):
      jax.block_until_ready(compiled(x, one))
  path = profile_step.find_trace_file(logdir)
  if path is None:
    return {"error": f"no perfetto trace under {logdir}"}
  a = profile_step.analyze(profile_step.load_trace(path), max_rows=8)
  return {"hlo": decode_floor.count_fusions(compiled.as_text()), "source": a["source"],
          "window_us_per_step": round(a["summary"]["window_us"] / chain, 3),
          "kernels": gaps_by_kernel(a["events"], chain)}


def markdown_table(records: list[dict]) -> str:
  """bytes | XLA step | each variant | PDL's saving | the bookkeeping's cost (us per call).

  Files written before the bookkeeping variants existed have only floor and
  floor_pdl; their table has those columns.
  """
  by = {(r["bytes"], r["impl"]): r for r in records}
  impls = [i for i in IMPLS[1:] if any(r["impl"] == i for r in records)]
  pdl = "floor" in impls and "floor_pdl" in impls
  book = "floor" in impls and "floor_bookkeeping" in impls
  head = (["bytes", "XLA step us"] + [f"{i} us" for i in impls]
          + (["PDL saves us"] if pdl else []) + (["bookkeeping costs us"] if book else []))
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for b in sorted({r["bytes"] for r in records}):
    t = {i: by[(b, i)]["time_us"] for i in impls}
    cells = [str(b), f"{by[(b, impls[0])]['xla_step_us']:.2f}"] + [f"{t[i]:.2f}" for i in impls]
    if pdl:
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
  flags.DEFINE_list("impls", list(IMPLS[1:]), f"chains to time beside 'xla', of {list(IMPLS[1:])}")
  flags.DEFINE_integer("profile_chain", 0, "steps of one traced call per chain at the first size "
                       "(0: no anatomy)")
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
  records = run(sizes, chain=fl.chain, reps=fl.reps, warmup=fl.warmup, seed=fl.seed,
                impls=tuple(fl.impls))
  extra = {}
  if fl.profile_chain > 0:
    import tempfile

    logdir = tempfile.mkdtemp(prefix="launch_floor_anatomy_")
    extra["anatomy_bytes"] = sizes[0]
    extra["anatomy"] = {}
    for impl in ("xla",) + tuple(fl.impls):
      a = extra["anatomy"][impl] = anatomy(impl, sizes[0], fl.profile_chain,
                                           os.path.join(logdir, impl))
      print(f"anatomy of {impl} at {sizes[0]} B: {a.get('error', '')}"
            f"{a.get('window_us_per_step', '')} us a step; HLO {a.get('hlo')}", flush=True)
      for k in a.get("kernels", []):
        print(f"    {k['per_step']:>5} a step, {k['mean_us']:7.3f} us, gap before "
              f"{k['mean_gap_before_us']} us: {k['name']}", flush=True)
  kind, machine = harness.one_gpu_machine(fl.machine)
  path = harness.path(fl.out, BENCHMARK, machine)
  method = (f"one GPU; per call = (median over {fl.reps} interleaved rounds of a jit'd chain of "
            f"{fl.chain} steps - the same chain of XLA steps alone) / {fl.chain}")
  harness.write_result(path, records, benchmark=BENCHMARK, machine=machine, method=method,
                       script="benchmarks/launch_floor_pdl.py", latency=False,
                       extra={"device_kind": kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                              **extra})
  print(markdown_table(records))
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
