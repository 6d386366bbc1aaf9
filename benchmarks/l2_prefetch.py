"""Can a collective's wait load the next GEMM's weights into L2? (one GPU)

Problem:
  In tensor-parallel decode each all-reduce is followed by a GEMM that reads a
  weight from HBM (the next layer's QKV or the MLP's up-projection), and the
  GEMMs read at about the HBM roofline (docs/decode.md). While the all-reduce's
  few blocks wait for their peers, HBM is idle. PRESERVE (Yuzuguler, Zhuang and
  Cavigelli 2025, arXiv:2501.08192) prefetches the next operator's weights into
  the on-chip cache during the collective. On an H200 that could save up to
  (bytes loaded in the wait) / (HBM bandwidth) of the GEMM after each call. Does
  it work here: do lines a custom call's kernel prefetches into L2 stay there
  for XLA's next GEMM, how many bytes can a few blocks bring in while they wait,
  and what does the GEMM save?

Method:
  One process on one GPU. ``layers`` distinct weights ``w_i`` (4096 x n, bf16;
  together at least four times the L2, so nothing stays in L2 from one visit
  to the next) and a (rows x 4096) activation. A jit'd chain visits the layers
  in turn, ``--chain`` visits in all; a visit is

      h = call(x, w_i)            # the custom call below
      y = h @ w_i                 # XLA's GEMM (f32 accumulation, bf16 out)
      x = h + y[:, :1]            # keeps the chain's data dependence

  where ``call`` is ``jaxoverlap_launch_floor_prefetch`` (ffi/launch_floor.cu):
  a copy of x on k blocks of 256 threads that first issues prefetches of the
  first B bytes of ``w_i`` into L2 (each block a contiguous share) and then
  waits W us (the stand-in for the all-reduce's wait for its peers; thread 0
  of each block reads the global timer). Variants, timed interleaved (median
  of ``--reps`` rounds), for every k of ``--blocks`` and W of ``--wait_us``:

    * ``xla``: the chain without the custom call;
    * ``b<k>:wait<W>``: the call with no prefetch;
    * ``b<k>:wait<W>+<method><MB>``: the call prefetching B = MB MiB
      (``all``: the whole weight) with ``bulk`` (cp.async.bulk.prefetch.L2,
      Hopper's TMA, in ``--chunk_kib`` chunks issued by warp 0 of each block),
      ``lines`` (prefetch.global.L2, one 128-byte line per thread and
      instruction) or ``last`` (the same with the evict_last priority).

  Per visit: the chain's time / chain. What a prefetch saves is
  ``b<k>:wait<W>`` minus ``b<k>:wait<W>+...``; at most the time the GEMM takes
  to read those bytes from HBM, MB / the measured read bandwidth. With
  ``wait0`` the prefetch is not hidden: whether it costs the GEMM anything. A
  kernel ends when its prefetches have landed, so the call lengthens wherever
  its blocks cannot bring B in within W.

  The variants of ``--profile_variants`` are traced once more, with XLA's
  CUDA graphs kept under the profiler: the GEMM kernel's own time on the GPU,
  apart from the call's.

Results: ``<out>/l2_prefetch-<machine>.json`` (records: op "l2_prefetch", impl
the variant, n, rows, layers, wait_us, method, prefetch_bytes, time_us per
visit, saved_us against ``b<k>:wait<W>``), ``"profile"`` (per variant: ``top``,
each kernel's us and count per visit), the GPU's L2 size, and a Markdown
table on stdout.

Example:
  python benchmarks/l2_prefetch.py --out /tmp/out --n 1536,14336 --wait_us 0,4
  python benchmarks/l2_prefetch.py --out /tmp/out --blocks 4,16,64 --wait_us 4 --mib 4,8,16
"""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import harness

BENCHMARK = "l2_prefetch"
HIDDEN = 4096
METHODS = {"bulk": 1, "lines": 2, "last": 3}
MIB = 1 << 20


def l2_bytes() -> int:
  """The L2 size of GPU 0 from the driver API (0 where it cannot be read)."""
  import ctypes

  try:
    cuda = ctypes.CDLL("libcuda.so.1")
    value = ctypes.c_int(0)
    attribute_l2_cache_size = 38  # CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetAttribute(ctypes.byref(value),
                                                       attribute_l2_cache_size, 0) != 0:
      return 0
    return int(value.value)
  except OSError:
    return 0


def prefetch_call(x: jax.Array, w: jax.Array, *, wait_us: float, method: int,
                  prefetch_bytes: int, blocks: int, chunk: int) -> jax.Array:
  """A copy of ``x`` that prefetches ``w``'s first bytes into L2, then waits."""
  from jaxoverlap import _ffi

  _ffi.load()
  return jax.ffi.ffi_call("jaxoverlap_launch_floor_prefetch", jax.typeof(x))(
      x, w, prefetch_bytes=np.int64(prefetch_bytes), method=np.int32(method),
      blocks=np.int32(blocks), chunk=np.int32(chunk), wait_ns=np.int64(round(wait_us * 1000)))


def parse_variant(name: str) -> tuple[int | None, float | None, str, float | None]:
  """``"xla"`` -> (None, None, "", None); ``"b4:wait4+bulk8"`` -> (4, 4.0, "bulk", 8.0).

  ``all`` MiB -> inf (the whole weight); without ``b<k>:`` the blocks are None
  (the ``--blocks`` default).
  """
  if name == "xla":
    return None, None, "", None
  blocks, _, rest = name.rpartition(":")
  if blocks and not (blocks.startswith("b") and blocks[1:].isdigit()):
    raise ValueError(f"l2_prefetch: bad block count in {name!r}")
  wait, _, pref = rest.partition("+")
  if not wait.startswith("wait"):
    raise ValueError(f"l2_prefetch: bad variant {name!r}")
  nblocks = int(blocks[1:]) if blocks else None
  try:
    wait_us = float(wait[4:])
  except ValueError:
    raise ValueError(f"l2_prefetch: bad wait in {name!r} (wait<us>)") from None
  if not pref:
    return nblocks, wait_us, "", None
  method = next((m for m in METHODS if pref.startswith(m)), None)
  if method is None:
    raise ValueError(f"l2_prefetch: bad method in {name!r} (one of {sorted(METHODS)})")
  mib = pref[len(method):]
  try:
    return nblocks, wait_us, method, float("inf") if mib == "all" else float(mib)
  except ValueError:
    raise ValueError(f"l2_prefetch: bad size in {name!r} (<method><MiB> or <method>all)") from None


def variants(blocks: list[int], waits: list[float], methods: list[str],
             mibs: list[str]) -> list[str]:
  """The variant names of the flags: xla, then per block count and wait the bare call and
  each prefetch."""
  out = ["xla"]
  for b in blocks:
    for wait in waits:
      w = f"b{b}:wait{wait:g}"
      out += [w] + [f"{w}+{m}{mib}" for m in methods for mib in mibs]
  return out


def make_chain(variant: str, chain: int, *, blocks: int, chunk: int):
  """The jit'd chain of ``chain`` visits (module docstring) for ``variant``."""
  nblocks, wait, method, mib = parse_variant(variant)
  blocks = nblocks or blocks

  def visit(x, w):
    if wait is not None:
      b = 0 if not method else int(min(w.size * w.dtype.itemsize, mib * MIB))
      x = prefetch_call(x, w, wait_us=wait, method=METHODS.get(method, 0), prefetch_bytes=b,
                        blocks=blocks, chunk=chunk)
    y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x + y[:, :1]

  @jax.jit
  def run(x, ws):
    for i in range(chain):
      x = visit(x, ws[i % len(ws)])
    return x

  return run


def read_bandwidth_tbs(reps: int = 10) -> float:
  """HBM read bandwidth, TB/s: decode_floor's probe (float32 sums over 4 GiB of bf16)."""
  import decode_floor

  return decode_floor.hbm_read_gbs(4.0, reps)["best"] / 1000


def run(ns: list[int], names: list[str], *, rows: int, chain: int, reps: int, warmup: int,
        seed: int, blocks: int, chunk: int, min_layer_bytes: int,
        profile_variants: tuple[str, ...],
        logdir: str, log=print) -> tuple[list[dict], dict]:
  """Times every variant at every weight width (module docstring)."""
  import ml_dtypes

  bf16 = ml_dtypes.bfloat16
  rng = np.random.default_rng(seed)
  records, profiles = [], {}
  for n in ns:
    layer_bytes = HIDDEN * n * 2
    layers = max(2, -(-min_layer_bytes // layer_bytes))
    ws = [jnp.asarray((0.02 * rng.standard_normal((HIDDEN, n))).astype(bf16))
          for _ in range(layers)]
    x = jnp.asarray(rng.standard_normal((rows, HIDDEN)).astype(bf16))
    # The call is a copy, so one visit of every variant equals the XLA visit bit for bit.
    want = np.asarray(make_chain("xla", 1, blocks=blocks, chunk=chunk)(x, ws), np.float32)
    for name in names[1:]:
      got = np.asarray(make_chain(name, 1, blocks=blocks, chunk=chunk)(x, ws), np.float32)
      if not np.array_equal(got, want):
        raise AssertionError(f"{name} at n={n}: the visit differs from XLA's "
                             f"(max |diff| {np.abs(got - want).max():.3g})")
    fns = {name: make_chain(name, chain, blocks=blocks, chunk=chunk) for name in names}
    log(f"n={n}: {layers} layers of {layer_bytes / MIB:.1f} MiB, {len(names)} variants, "
        f"compiling and timing ...", flush=True)
    times = harness.time_interleaved({k: (lambda fn=fn: fn(x, ws)) for k, fn in fns.items()},
                                     reps=reps, warmup=warmup)
    us = {k: harness.median(t) / chain * 1e6 for k, t in times.items()}
    for name in names:
      nblocks, wait, method, mib = parse_variant(name)
      base = us.get(name.partition("+")[0]) if method else None
      pbytes = 0 if not method else int(min(layer_bytes, mib * MIB))
      records.append({"op": BENCHMARK, "impl": name, "n": n, "hidden": HIDDEN, "rows": rows,
                      "layers": layers, "layer_bytes": layer_bytes, "dtype": "bfloat16",
                      "wait_us": wait, "method": method or None, "prefetch_bytes": pbytes,
                      "blocks": nblocks or blocks, "time_us": round(us[name], 3),
                      "saved_us": None if base is None else round(base - us[name], 3)})
    log(f"n={n}: " + ", ".join(f"{k} {v:.2f}" for k, v in us.items()) + " us per visit",
        flush=True)
    if profile_variants:
      import decode_floor

      for name in (v for v in names if v in profile_variants):
        fn = make_chain(name, chain, blocks=blocks, chunk=chunk)
        compiled = fn.lower(x, ws).compile(
            compiler_options={"xla_enable_command_buffers_during_profiling": True})
        p = profiles[f"{name} n{n}"] = decode_floor.profile_call(
            lambda: compiled(x, ws), chain, os.path.join(logdir, f"{name}_n{n}"))
        log(f"  profile of {name} n={n}: " + (p.get("error") or ", ".join(
            f"{k['name'][:50]} {k['us_per_token']:.2f} us x {k['per_token']:g}"
            for k in p["top"][:3])) + " (per visit)", flush=True)
  return records, profiles


def markdown_table(records: list[dict], bandwidth_tbs: float) -> str:
  """n | variant | us per visit | saved against the bare wait | MiB / HBM bandwidth."""
  head = ["n", "variant", "us per visit", "saved us", "the prefetched bytes at HBM speed, us"]
  out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in records:
    hbm = r["prefetch_bytes"] / (bandwidth_tbs * 1e12) * 1e6 if bandwidth_tbs else 0.0
    out.append(f"| {r['n']} | {r['impl']} | {r['time_us']:.2f} | "
               f"{'' if r['saved_us'] is None else f'{r['saved_us']:.2f}'} | "
               f"{f'{hbm:.2f}' if r['prefetch_bytes'] else ''} |")
  return "\n".join(out)


def define_flags():
  """Defines the command-line flags (only when run as a script)."""
  from absl import flags

  flags.DEFINE_list("n", ["1536", "14336"], "weight widths (4096 x n bf16): 1536 is a TP=2 "
                    "rank's QKV of a Llama-3-8B-like layer, 14336 its MLP up-projection")
  flags.DEFINE_integer("rows", 2, "activation rows (a batch-1 decode padded to 2 rows)")
  flags.DEFINE_list("wait_us", ["0", "4"], "the call's waits, us")
  flags.DEFINE_list("methods", ["bulk", "lines"], f"prefetch methods ({sorted(METHODS)})")
  flags.DEFINE_list("mib", ["4", "16", "all"], "prefetched MiB per visit ('all': the weight)")
  flags.DEFINE_list("blocks", ["4"], "the call's blocks (the one-row norm kernel's cluster: 4)")
  flags.DEFINE_integer("chunk_kib", 64, "bytes per bulk prefetch, KiB")
  flags.DEFINE_integer("chain", 64, "visits per jit'd chain")
  flags.DEFINE_integer("min_mib", 256, "the layers' weights together at least this many MiB")
  flags.DEFINE_list("profile_variants", ["b4:wait4", "b4:wait4+bulkall", "b4:wait4+linesall"],
                    "variants also traced once (empty: none)")
  harness.define_flags("out", "seed",
                       machine=(None, "machine name (default: '1x <device kind>')"),
                       reps=(20, "timed rounds (median)"), warmup=(3, "untimed rounds"))


def main(argv):
  del argv
  from absl import flags

  fl = flags.FLAGS
  harness.require_one_gpu("l2_prefetch")
  names = variants([int(b) for b in fl.blocks], [float(w) for w in fl.wait_us],
                   list(fl.methods), list(fl.mib))
  for name in names:
    parse_variant(name)  # bad flags fail before anything compiles
  bandwidth = read_bandwidth_tbs()
  print(f"HBM read bandwidth {bandwidth:.2f} TB/s, L2 {l2_bytes() / MIB:.0f} MiB", flush=True)
  records, profiles = run(
      [int(v) for v in fl.n], names, rows=fl.rows, chain=fl.chain, reps=fl.reps,
      warmup=fl.warmup, seed=fl.seed, blocks=int(fl.blocks[0]), chunk=fl.chunk_kib * 1024,
      min_layer_bytes=fl.min_mib * MIB, profile_variants=tuple(fl.profile_variants),
      logdir=tempfile.mkdtemp(prefix="l2_prefetch_"))
  kind, machine = harness.one_gpu_machine(fl.machine)
  path = harness.path(fl.out, BENCHMARK, machine)
  method = (f"one GPU; per visit = median over {fl.reps} interleaved rounds of a jit'd chain of "
            f"{fl.chain} visits / {fl.chain}")
  harness.write_result(path, records, benchmark=BENCHMARK, machine=machine, method=method,
                       script="benchmarks/l2_prefetch.py", latency=False,
                       extra={"device_kind": kind, "l2_bytes": l2_bytes(),
                              "hbm_read_tbs": round(bandwidth, 3),
                              "xla_flags": os.environ.get("XLA_FLAGS", ""),
                              "profile": profiles})
  print(markdown_table(records, bandwidth))
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
