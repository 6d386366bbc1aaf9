"""GPU checks of all_reduce(backend="cuda") in N processes, one PE each.

Run through the launcher (one process per GPU, or --share_gpu on a 1-GPU box):

  python -m jaxoverlap.launch --nproc 2 tests/multiprocess/check_all_reduce.py [sections]
  JAXOVERLAP_RANKS_PER_NODE=1 python -m jaxoverlap.launch --nproc 2 ...   # 2 "nodes"

Sections (default: all but quick): sweep, stress, grads, axes, late; quick is
a short sweep (f32, 4 sizes, every algorithm) for compute-sanitizer runs.

* sweep: sizes 0 B .. 64 MiB (odd ones too) x f32/bf16/f16 x every algorithm
  valid for the topology, against a float64 NumPy reference computed from
  every rank's input (each process regenerates all ranks' inputs from seeds
  folded with rank and call), jit and eager; results hashed and compared
  across ranks through the key-value store (bit-identical on every rank).
  Algorithms that the topology forbids must raise a clear error.
* stress: >= 10,000 calls in one jit'd loop (10 sizes straddling the
  algorithm and chunk cut-offs per iteration, inputs changing every
  iteration), each compared in-graph bit for bit with lax.psum (for 2 ranks
  one fp32 add, so both are exact); plus 200 eager calls checked on the host.
  XLA captures the handler in CUDA graphs (command buffers), so replays are
  covered.
* grads: jax.grad through all_reduce equals jax.grad through lax.psum.
* axes: all-reduces over both axes of a 2-D mesh in one jit'd step.
* late: rank 1 sleeps 3 s before its first call; the result is still right.

Exits non-zero on the first failing section; prints "N passed, N failed".
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time

import numpy as np
from _checker import Checker

SECTIONS = ("sweep", "quick", "stress", "grads", "axes", "late")


def _inputs(seed: int, rank: int, n: int, dtype) -> np.ndarray:
  rng = np.random.default_rng([seed, rank, n])
  x = rng.standard_normal(n).astype(np.float32)
  if n > 8:
    idx = rng.integers(0, n, size=max(1, n // 1000))
    x[idx] *= 100.0  # outliers
  return x.astype(dtype)


def main(argv) -> int:
  from jaxoverlap import launch

  logging.basicConfig(level=logging.WARNING)
  info = launch.initialize_from_env(nvshmem=True)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxoverlap

  sections = [a for a in argv[1:] if a in SECTIONS] or [s for s in SECTIONS if s != "quick"]
  rank, nproc = info["process_id"], info["num_processes"]
  rt = jaxoverlap.runtime_info()
  nodes = rt["num_nodes"]
  print(f"rank {rank}: {nproc} PEs, {nodes} nodes x {rt['ranks_per_node']} ranks, "
        f"slot {rt['slot_bytes']} B, sections {sections}", flush=True)
  kv = None
  if nproc > 1:
    from jax._src import distributed

    kv = distributed.global_state.client
  c = Checker(rank, nproc, kv, "check")
  mesh = jax.make_mesh((nproc,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = NamedSharding(mesh, P("x"))

  def global_array(local, n):
    return jax.make_array_from_process_local_data(sharding, local, (n * nproc,))

  def local_of(out):
    return np.asarray(out.addressable_shards[0].data)

  @functools.cache
  def ours_fn(algorithm, jit=True):
    def f(x):
      y = jaxoverlap.all_reduce(x, "x", backend="cuda", algorithm=algorithm)
      return jax.lax.pcast(y, "x", to="varying")

    g = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    return jax.jit(g) if jit else g

  within_node = ("one_shot_ll", "one_shot_simple", "two_shot")
  across = ("hierarchical_ll", "hierarchical_simple")
  no_nccl = bool(os.environ.get("JAXOVERLAP_NO_NCCL"))  # several PEs per GPU: NCCL refuses
  # "auto" may hand over to psum (NCCL), so it is left out when NCCL cannot run.
  algorithms = (within_node if nodes == 1 else across) + (() if no_nccl else ("auto",))
  default_alg = (within_node if nodes == 1 else across)[0] if no_nccl else "auto"
  if nodes == 1:
    algorithms += across  # hierarchical over one node is two-shot; it must work too
  tol = {np.dtype(np.float32): 2e-6, np.dtype(np.float16): 1e-3}

  if "sweep" in sections or "quick" in sections:
    t0 = time.time()
    if "sweep" in sections:
      sizes_bytes = [0, 2, 4, 6, 14, 32, 1000, 8190, 8192, 65534, 65536, 65538, 262146,
                     1 << 20, (4 << 20) + 6, 16 << 20, 64 << 20]
      dtypes = (np.float32, jnp.bfloat16, np.float16)
    else:
      sizes_bytes, dtypes = [4, 8192, 65540, 1 << 20], (np.float32,)
    call = 0
    for dtype in dtypes:
      itemsize = np.dtype(dtype).itemsize
      for nbytes in sizes_bytes:
        n = nbytes // itemsize
        xs = [_inputs(call, r, n, dtype) for r in range(nproc)]
        ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
        garr = global_array(xs[rank], n)
        for alg in algorithms:
          if alg.startswith("hierarchical") and nodes == 1 and nbytes not in (6, 65538, 1 << 20):
            continue  # one node: the same kernel as two_shot; a few sizes suffice
          for jit in ((True, False) if nbytes <= 8192 else (True,)):
            what = f"sweep {np.dtype(dtype).name} {nbytes} B {alg} {'jit' if jit else 'eager'}"
            got = local_of(ours_fn(alg, jit)(garr))
            err = np.abs(got.astype(np.float64) - ref) / (np.abs(ref) + 1.0)
            ok = (got.shape == ref.shape and bool(np.all(np.isfinite(got)))
                  and (n == 0 or err.max() <= tol.get(np.dtype(dtype), 8e-3)))
            c.check(ok, f"{what}: max rel err {err.max() if n else 0:.3g}")
            c.check(c.same_on_all_ranks(f"{call}/{alg}/{jit}", got), f"{what}: ranks differ")
        call += 1
    # Algorithms the topology forbids raise before anything runs.
    for alg in (within_node if nodes > 1 else ()):
      try:
        ours_fn(alg)(global_array(_inputs(0, rank, 64, np.float32), 64))
        c.check(False, f"{alg} across {nodes} nodes did not raise")
      except ValueError as e:
        c.check("needs the whole group on one node" in str(e), f"{alg} error message: {e}")
    print(f"rank {rank}: sweep done in {time.time() - t0:.1f} s", flush=True)

  if "stress" in sections and nproc == 2 and not no_nccl:
    t0 = time.time()
    # Sizes (elements of bf16) straddling the LL/simple cut-off (64 KiB) and odd sizes.
    sizes = [1, 7, 4096, 32767, 32768, 32769, 65536, 131071, 262144, 1 << 19]
    iters = 1000
    algs = ["auto"] + (["one_shot_ll", "one_shot_simple", "two_shot"] if nodes == 1
                       else ["hierarchical_ll", "hierarchical_simple"])

    def stress(xs, alg):
      def body(i, carry):
        bad = carry
        scale = (i + 1).astype(jnp.float32)
        for x in xs:
          y = (x.astype(jnp.float32) * scale).astype(x.dtype)
          ours = jaxoverlap.all_reduce(y, "x", backend="cuda", algorithm=alg)
          ref = jax.lax.psum(y, "x")
          bad = bad + jnp.sum(ours != ref).astype(jnp.int32)
        return bad

      bad = jax.lax.fori_loop(0, iters, body, jnp.zeros((), jnp.int32))
      return jax.lax.pcast(bad, "x", to="varying")[None]

    for alg in algs:
      fn = jax.jit(jax.shard_map(lambda *xs, alg=alg: stress(xs, alg), mesh=mesh,
                                 in_specs=(P("x"),) * len(sizes), out_specs=P("x")))
      arrs = [global_array(_inputs(7, rank, n, jnp.bfloat16) * 0.01, n) for n in sizes]
      bad = int(local_of(fn(*arrs))[0])
      c.check(bad == 0, f"stress {alg}: {bad} elements differ from psum over "
                        f"{iters * len(sizes)} calls")
    # Eager calls of alternating sizes, each checked on the host.
    eager = {alg: ours_fn(alg, jit=False) for alg in algs}
    bad_calls = 0
    for i in range(200):
      n = sizes[i % len(sizes)]
      alg = algs[i % len(algs)]
      xs = [_inputs(1000 + i, r, n, np.float32) for r in range(nproc)]
      ref = np.sum(xs, axis=0, dtype=np.float32)  # one fp32 add: exact match expected
      got = local_of(eager[alg](global_array(xs[rank], n)))
      bad_calls += int(not np.array_equal(got, ref))
    c.check(bad_calls == 0, f"stress eager: {bad_calls} of 200 calls wrong")
    print(f"rank {rank}: stress done in {time.time() - t0:.1f} s "
          f"({iters * len(sizes) * len(algs)} jit'd calls, 200 eager)", flush=True)

  if "grads" in sections:
    n = 4099

    def loss(x, ct, use_ours):
      def f(x, ct):
        y = (jaxoverlap.all_reduce(x * x, "x", backend="cuda") if use_ours
             else jax.lax.psum(x * x, "x"))
        return jnp.sum(y * ct)[None]  # varying: ct is

      g = jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
      return jnp.sum(g(x, ct))

    x = global_array(_inputs(3, rank, n, np.float32), n)
    ct = global_array(_inputs(4, rank, n, np.float32), n)
    if nproc > 1 and not no_nccl:
      g_ours = local_of(jax.jit(jax.grad(lambda x, ct: loss(x, ct, True)))(x, ct))
      g_ref = local_of(jax.jit(jax.grad(lambda x, ct: loss(x, ct, False)))(x, ct))
      c.check(np.allclose(g_ours, g_ref, rtol=1e-6, atol=1e-6), "grads differ from psum's")

  if "axes" in sections and nproc >= 2:
    mesh2 = jax.make_mesh((nproc // 2, 2) if nproc % 2 == 0 else (nproc, 1), ("dp", "tp"),
                          axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def step(x):
      a = jaxoverlap.all_reduce(x, "tp", backend="cuda")
      b = jaxoverlap.all_reduce(x * 2, "dp", backend="cuda")
      d = jaxoverlap.all_reduce(a + b, ("dp", "tp"), backend="cuda")
      return jax.lax.pcast(d, ("dp", "tp"), to="varying")

    f2 = jax.jit(jax.shard_map(step, mesh=mesh2, in_specs=P(("dp", "tp")),
                               out_specs=P(("dp", "tp"))))
    n = 1000
    xs = [_inputs(9, r, n, np.float32) for r in range(nproc)]
    sh2 = NamedSharding(mesh2, P(("dp", "tp")))
    garr = jax.make_array_from_process_local_data(sh2, xs[rank], (n * nproc,))
    got = local_of(f2(garr)).astype(np.float64)
    # The input of the process that owns each mesh position (make_mesh may reorder devices).
    owner = np.vectorize(lambda d: d.process_index)(mesh2.devices)
    grid = np.asarray(xs, np.float64)[owner]  # [dp, tp, n]
    a = grid.sum(axis=1, keepdims=True)
    b = (2 * grid).sum(axis=0, keepdims=True)
    ref = (a + b).sum(axis=(0, 1))
    c.check(np.allclose(got, ref, rtol=1e-5, atol=1e-4), "2-D mesh all-reduces wrong")

  if "late" in sections:
    n = 12345
    xs = [_inputs(11, r, n, np.float32) for r in range(nproc)]
    garr = global_array(xs[rank], n)
    fn = ours_fn(default_alg)
    fn.lower(garr).compile()
    if rank == 1:
      time.sleep(3.0)
    got = local_of(fn(garr))
    c.check(np.allclose(got, np.sum(np.asarray(xs, np.float64), axis=0), rtol=1e-6, atol=1e-5),
            "late rank: wrong result")

  decisions = {(d["bytes"], d["algorithm"], d["protocol"]) for d in
               __import__("jaxoverlap._cuda", fromlist=["decisions"]).decisions}
  if rank == 0:
    auto = sorted(d for d in decisions)[:12]
    print(f"rank 0: some lowering decisions (bytes, algorithm, protocol): {auto}", flush=True)
  print(f"rank {rank}: {c.passed} passed, {c.failed} failed", flush=True)
  return 1 if c.failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
