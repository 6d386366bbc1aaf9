"""What the all-reduce kernels cost on one GPU without communication (a group of one).

Problem:
  On two GPUs ``all_reduce_rms_norm`` at one row of 4096 bf16 took 8.3 us,
  about 3 us more than the one-shot LL all-reduce alone (docs/kernels.md,
  "all_reduce_rms_norm"), where a cluster barrier and a second pass over the
  row had been predicted at about 1 us. In a decode step that is the gap to
  the target (docs/decode.md, "What 1.25x would need"). Is the extra time in
  the kernel itself (the cluster launch, its barriers, the norm), or in the
  communication (more blocks polling, peers arriving later)? A kernel run for
  a group of one rank sends, polls and reads epochs for no peer, but launches,
  takes Finish's ticket and computes as with peers; one GPU measures that
  part (without the per-peer reads, so below the kernels' cost with peers).

Method:
  One process on one GPU, ``jaxoverlap.initialize()`` (one PE). Each custom
  call is emitted for the group ``[this PE]`` directly (``jax.ffi.ffi_call``:
  the public ops run a group of one as the XLA expression, since nothing
  moves). For each row count (hidden ``--hidden``, bf16), jit'd chains of
  ``--chain`` steps, timed interleaved (median of ``--reps`` rounds), with
  XLA's default flags (its CUDA graphs hold fusions and custom calls). A step
  carries ``(x, r)``; each starts with one XLA fusion ``p = x * 1.0001 + 0.5``
  behind ``lax.optimization_barrier``, then:

    * ``xla``: nothing more (the baseline);
    * ``copy``: ``launch_floor(p)``, a one-kernel copy (ffi/launch_floor.cu);
    * ``one_shot_ll``: the one-shot LL all-reduce kernel of p;
    * ``norm_xla``: ``h = r + p``, ``y = rms_norm(h) * w`` as XLA compiles it
      (what the decode floor runs after each all-reduce);
    * ``unfused``: ``one_shot_ll``, then ``norm_xla`` on its result;
    * ``fused``: the ``all_reduce_rms_norm`` kernel.

  The norm steps carry ``(y, h)``, the others ``(result, r)``. Per call: (the
  chain's time - the ``xla`` chain's) / chain. Before timing, one step of
  every variant is checked against NumPy in float64 (bf16 tolerance).

  ``JAXOVERLAP_NORM_CLUSTER`` (1-8, read once per process) forces the fused
  kernel's blocks per row; run the script once per value to compare splits.

  With ``--profile_rows``, a chain of ``--profile_chain`` steps of each
  variant at those row counts is traced once more with the CUDA graphs kept
  under the profiler (``xla_enable_command_buffers_during_profiling``): how
  long each kernel runs on the GPU, apart from the gaps between kernels.

Results: ``<out>/local_cost-<machine>.json`` (records: op "local_cost", impl
one of the variants above, rows, hidden, bytes, dtype, time_us per call beyond
the XLA step, and "xla_step_us"), the knob in ``"norm_cluster"``, the traces'
kernels in ``"profile"`` (per variant and row count: ``top``, each kernel's
us and count per step, as ``benchmarks/decode_floor.py`` gives them per
token), and a Markdown table on stdout.

Example:
  python benchmarks/local_cost.py --out /tmp/out --rows 1,4,16
  JAXOVERLAP_NORM_CLUSTER=1 python benchmarks/local_cost.py --out /tmp/out/c1
"""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import harness

BENCHMARK = "local_cost"
IMPLS = ("xla", "copy", "one_shot_ll", "norm_xla", "unfused", "fused")
EPS = 1e-6


def _group_of_one() -> dict:
  """The FFI attributes of a group holding this PE alone."""
  import jaxoverlap

  pe = int(jaxoverlap.runtime_info()["pe"])
  return dict(groups=np.asarray([pe], np.int64), group_size=np.int64(1))


def one_shot_ll(x: jax.Array) -> jax.Array:
  """The one-shot LL all-reduce kernel of ``x`` over a group of one (a copy, as planned)."""
  from jaxoverlap import _cuda, names

  return jax.ffi.ffi_call("jaxoverlap_all_reduce", jax.typeof(x))(
      x, **_group_of_one(), algorithm=_cuda._enum("AllReduceAlgorithm", names.ONE_SHOT),
      protocol=_cuda._enum("Protocol", names.LL))


def fused_norm(p: jax.Array, r: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(h, y)`` of the ``all_reduce_rms_norm`` kernel over a group of one."""
  out = jax.typeof(p)
  return jax.ffi.ffi_call("jaxoverlap_all_reduce_rms_norm", (out, out))(
      p, r, w, **_group_of_one(), eps=np.float32(EPS))


def make_chain(impl: str, chain: int, w: jax.Array):
  """The jit'd chain of ``chain`` steps of ``impl`` on ``(x, r)`` (module docstring)."""
  from jaxoverlap import _cuda, _xla

  def step(x, r):
    p = jax.lax.optimization_barrier(x * jnp.asarray(1.0001, x.dtype) + jnp.asarray(0.5, x.dtype))
    if impl == "xla":
      return p, r
    if impl == "copy":
      return _cuda.launch_floor(p), r
    if impl == "one_shot_ll":
      return one_shot_ll(p), r
    if impl == "fused":
      h, y = fused_norm(p, r, w)
    else:
      h, y = _xla.rms_norm_tail(one_shot_ll(p) if impl == "unfused" else p, r, w, EPS)
    return y, h

  @jax.jit
  def run(x, r):
    for _ in range(chain):
      x, r = step(x, r)
    return x, r

  return run


def expected(impl: str, x: np.ndarray, r: np.ndarray, w: np.ndarray):
  """One step of ``impl`` in float64 from the bf16 inputs (p rounded to bf16 as on the GPU)."""
  scale = np.float32(np.asarray(1.0001, x.dtype))  # the constant as the GPU holds it
  p = (x.astype(np.float32) * scale + np.float32(0.5)).astype(x.dtype)
  p64, r64, w64 = (a.astype(np.float64) for a in (p, r, w))
  if impl in ("xla", "copy", "one_shot_ll"):
    return p64, r64
  h = r64 + p64
  y = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * w64
  return y, h


def profile(fn, x, r, steps: int, logdir: str) -> dict:
  """The kernels of one traced call of the chain ``fn`` (``steps`` steps), per step."""
  import decode_floor

  compiled = fn.lower(x, r).compile(
      compiler_options={"xla_enable_command_buffers_during_profiling": True})
  return decode_floor.profile_call(lambda: compiled(x, r), steps, logdir)


def run(rows_list: list[int], hidden: int, *, chain: int, reps: int, warmup: int, seed: int,
        profile_rows: tuple[int, ...] = (), profile_chain: int = 50, logdir: str = "",
        log=print) -> tuple[list[dict], dict]:
  """Times every chain (IMPLS) at every row count (module docstring).

  Returns:
    The records, and the profiles (``"<impl> r<rows>"`` -> ``profile``'s dict)
    of the row counts in ``profile_rows``, traced under ``logdir``.
  """
  import ml_dtypes

  bf16 = ml_dtypes.bfloat16
  records, profiles = [], {}
  rng = np.random.default_rng(seed)
  w_host = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(bf16)
  w = jnp.asarray(w_host)
  for rows in rows_list:
    x_host = rng.standard_normal((rows, hidden)).astype(bf16)
    r_host = rng.standard_normal((rows, hidden)).astype(bf16)
    x, r = jnp.asarray(x_host), jnp.asarray(r_host)
    for impl in IMPLS:  # one step of each against float64, every element
      got = [np.asarray(a, np.float64) for a in make_chain(impl, 1, w)(x, r)]
      names = ("y", "h") if impl in ("norm_xla", "unfused", "fused") else ("p", "r")
      for g, want, what in zip(got, expected(impl, x_host, r_host, w_host), names):
        bad = ~np.isclose(g, want, rtol=2e-2, atol=2e-2)
        if bad.any():
          raise AssertionError(f"{impl} at {rows} x {hidden}: {bad.sum()} of {bad.size} "
                               f"elements of {what} off, max |diff| {np.abs(g - want).max():.3g}")
    fns = {impl: make_chain(impl, chain, w) for impl in IMPLS}
    times = harness.time_interleaved({impl: (lambda fn=fn: fn(x, r)) for impl, fn in fns.items()},
                                     reps=reps, warmup=warmup)
    us = {impl: harness.median(ts) / chain * 1e6 for impl, ts in times.items()}
    for impl in IMPLS[1:]:
      records.append({"op": "local_cost", "impl": impl, "rows": rows, "hidden": hidden,
                      "bytes": rows * hidden * 2, "dtype": "bfloat16",
                      "time_us": round(us[impl] - us["xla"], 3),
                      "xla_step_us": round(us["xla"], 3)})
    log(f"{rows:>3} x {hidden}: xla step {us['xla']:.2f} us; per call beyond it: "
        + ", ".join(f"{impl} +{us[impl] - us['xla']:.2f}" for impl in IMPLS[1:]), flush=True)
    for impl in IMPLS if rows in profile_rows else ():
      key = f"{impl} r{rows}"
      p = profiles[key] = profile(make_chain(impl, profile_chain, w), x, r, profile_chain,
                                  os.path.join(logdir, f"{impl}_r{rows}"))
      log(f"  profile of {key}: " + (p.get("error") or ", ".join(
          f"{k['name'][:60]} {k['us_per_token']:.2f} us x {k['per_token']:g}"
          for k in p["top"][:4])) + " (per step)", flush=True)
  return records, profiles


def markdown_table(records: list[dict]) -> str:
  """rows x hidden | XLA step | each variant | fused - one_shot_ll (us per call)."""
  by = {(r["rows"], r["impl"]): r for r in records}
  head = ["rows x hidden", "XLA step us"] + [f"{i} us" for i in IMPLS[1:]] + [
      "fused - one_shot_ll us"]
  out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for rows in sorted({r["rows"] for r in records}):
    t = {i: by[(rows, i)]["time_us"] for i in IMPLS[1:]}
    cells = [f"{rows} x {by[(rows, 'copy')]['hidden']}", f"{by[(rows, 'copy')]['xla_step_us']:.2f}"]
    cells += [f"{t[i]:.2f}" for i in IMPLS[1:]] + [f"{t['fused'] - t['one_shot_ll']:.2f}"]
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def define_flags():
  """Defines the command-line flags (only when run as a script)."""
  from absl import flags

  flags.DEFINE_list("rows", ["1", "2", "4", "16"], "rows per call")
  flags.DEFINE_integer("hidden", 4096, "elements per row (bf16)")
  flags.DEFINE_integer("chain", 200, "steps of each jit'd chain")
  flags.DEFINE_list("profile_rows", ["1"], "row counts whose chains are also traced (empty: none)")
  flags.DEFINE_integer("profile_chain", 50, "steps of each traced chain")
  harness.define_flags("out", "seed",
                       machine=(None, "machine name (default: '1x <device kind>')"),
                       reps=(30, "timed rounds (median)"), warmup=(3, "untimed rounds"))


def main(argv):
  del argv
  from absl import flags

  import jaxoverlap

  fl = flags.FLAGS
  harness.require_one_gpu("local_cost")
  jaxoverlap.initialize()
  records, profiles = run(
      [int(v) for v in fl.rows], fl.hidden, chain=fl.chain, reps=fl.reps, warmup=fl.warmup,
      seed=fl.seed, profile_rows=tuple(int(v) for v in fl.profile_rows),
      profile_chain=fl.profile_chain, logdir=tempfile.mkdtemp(prefix="local_cost_"))
  kind, machine = harness.one_gpu_machine(fl.machine)
  path = harness.path(fl.out, BENCHMARK, machine)
  method = (f"one GPU, a group of one PE; per call = (median over {fl.reps} interleaved rounds "
            f"of a jit'd chain of {fl.chain} steps - the same chain of XLA steps alone) / "
            f"{fl.chain}")
  harness.write_result(path, records, benchmark=BENCHMARK, machine=machine, method=method,
                       script="benchmarks/local_cost.py", latency=False,
                       extra={"device_kind": kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                              "norm_cluster": os.environ.get("JAXOVERLAP_NORM_CLUSTER", ""),
                              "profile": profiles})
  print(markdown_table(records))
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
