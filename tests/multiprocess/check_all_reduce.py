"""GPU check of all_reduce(backend="cuda") in N processes, one PE each.

Run through the launcher (one process per GPU, or --share_gpu on a 1-GPU box):

  python -m jaxoverlap.launch --nproc 2 tests/multiprocess/check_all_reduce.py

Every process draws every rank's input from a seed folded with the rank and
the call, so each can compute the float64 reference of the sum on the host; no
XLA collective is needed (NCCL refuses two ranks on one GPU). Outputs are
poisoned with NaN first (the kernel writes into a fresh buffer each call; the
check is that every element is finite and right). Each rank checks its own
result, and results are bit-compared across ranks through the key-value store.
Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import hashlib
import sys
import time

import numpy as np


def _inputs(seed: int, rank: int, n: int, dtype) -> np.ndarray:
  rng = np.random.default_rng([seed, rank, n])
  x = rng.standard_normal(n).astype(np.float32)
  if n > 8:
    idx = rng.integers(0, n, size=max(1, n // 1000))
    x[idx] *= 100.0  # outliers
  return x.astype(dtype)


def main() -> int:
  import logging

  from jaxoverlap import launch

  logging.basicConfig(level=logging.INFO)
  info = launch.initialize_from_env(nvshmem=True)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxoverlap

  rank, nproc = info["process_id"], info["num_processes"]
  print(f"runtime: {jaxoverlap.runtime_info()}", flush=True)
  mesh = jax.make_mesh((nproc,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = NamedSharding(mesh, P("x"))
  kv = None
  if nproc > 1:
    from jax._src import distributed

    kv = distributed.global_state.client

  def build(fn, jit=True):
    f = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    return jax.jit(f) if jit else f

  def ours(x):
    y = jaxoverlap.all_reduce(x, "x", backend="cuda", algorithm="one_shot")
    return jax.lax.pcast(y, "x", to="varying")

  ours_jit = build(ours)
  ours_eager = build(ours, jit=False)

  def chain(x):  # 20 dependent calls in one jit: epochs advance inside one program
    def body(i, y):
      y = jaxoverlap.all_reduce(y * 0.5, "x", backend="cuda")
      return jax.lax.pcast(y, "x", to="varying")
    return jax.lax.fori_loop(0, 20, body, x)

  chain_jit = build(chain)

  failures = 0
  checks = 0
  sizes = [0, 1, 7, 8, 33, 1000, 4097, 65536 + 3, 262144, 1 << 20, (4 << 20) + 5]
  dtypes = [np.float32, jnp.bfloat16, np.float16]
  t0 = time.time()
  for call, (dtype, n) in enumerate([(d, n) for d in dtypes for n in sizes]):
    xs = [_inputs(call, r, n, dtype) for r in range(nproc)]
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    local = xs[rank]
    garr = jax.make_array_from_process_local_data(sharding, local, (n * nproc,))
    for name, fn in (("jit", ours_jit), ("eager", ours_eager)):
      if call < 2:
        print(f"call {call}: {np.dtype(dtype).name} n={n} {name}", flush=True)
      out = fn(garr)
      got = np.asarray(out.addressable_shards[0].data).astype(np.float64)
      tol = {np.dtype(np.float32): 1e-6, np.dtype(np.float16): 1e-3}.get(np.dtype(dtype), 8e-3)
      err = np.abs(got - ref) / (np.abs(ref) + 1.0)
      ok = got.shape == ref.shape and np.all(np.isfinite(got)) and (n == 0 or err.max() <= tol)
      checks += 1
      digest = hashlib.sha256(np.asarray(out.addressable_shards[0].data).tobytes()).hexdigest()
      if kv is not None:
        key = f"check/{call}/{name}"
        kv.key_value_set(f"{key}/{rank}", digest)
        others = [kv.blocking_key_value_get(f"{key}/{r}", 60_000) for r in range(nproc)]
        if len(set(others)) != 1:
          ok = False
          print(f"rank {rank}: results differ across ranks for {np.dtype(dtype).name} n={n} {name}")
      if not ok:
        failures += 1
        print(f"FAIL rank {rank} {np.dtype(dtype).name} n={n} {name}: max rel err "
              f"{err.max() if n else 0:.3g} (tol {tol})", flush=True)

  # A chain of 20 calls in one jit (epochs advance on the device).
  for call in range(3):
    n = [4096, 1 << 18, 77][call]
    xs = [_inputs(1000 + call, r, n, np.float32) for r in range(nproc)]
    ref = np.asarray(xs, np.float64)
    y = ref.copy()
    for _ in range(20):
      y = np.broadcast_to(np.sum(y * 0.5, axis=0), y.shape).copy()
    garr = jax.make_array_from_process_local_data(sharding, xs[rank], (n * nproc,))
    got = np.asarray(chain_jit(garr).addressable_shards[0].data).astype(np.float64)
    err = np.abs(got - y[rank]) / (np.abs(y[rank]) + 1.0)
    checks += 1
    if not (np.all(np.isfinite(got)) and err.max() <= 1e-5):
      failures += 1
      print(f"FAIL rank {rank} chain n={n}: max rel err {err.max():.3g}", flush=True)

  print(f"rank {rank}: {checks - failures} passed, {failures} failed "
        f"({time.time() - t0:.1f} s)", flush=True)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
