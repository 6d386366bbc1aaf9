"""Rank side: all_reduce_rms_norm(backend="cuda") in N processes, one NVSHMEM PE each.

Run by tests/gpu/test_gpu_norm.py (every rank runs this module; see conftest.py
for the fixtures and the SPMD rules). What is checked:

* sweep: float32/bfloat16/float16 x rows 1, 5, 64 x hidden 8, 128, 1000, 1996,
  4096, 8192, the fused kernel (algorithm "one_shot"; a row spread over 1-8
  blocks of a cluster, 1996 split unevenly): every element of this rank's
  h and y against a float64 NumPy reference computed from every rank's
  inputs (each process regenerates all ranks' inputs from seeds); h and y
  compared bit for bit across ranks. Shapes above one launch of the kernel
  (float32 64 x 8192 with the 2 MiB LL slot) run with "auto" and must plan
  "unfused" (skipped without NCCL). ``quick``: bfloat16, a few shapes.
* unfused and auto: the same checks for algorithm "unfused" (the CUDA
  all_reduce, then the norm in XLA) and for "auto", whose plan must follow
  ``jaxoverlap.tuning.policy.fuse_norm``; "auto" also for a row that is not
  whole LL lines (unfused on CUDA).
* plan: the calls ran what was asked (``jaxoverlap.decisions()``);
  "one_shot" refuses a row that is not whole LL lines and a message above
  one launch with a ValueError naming the cause; "auto" runs them unfused.
* stress (2 ranks): 1,000 iterations of one jit'd ``fori_loop`` alternating
  the fused op and the plain one-shot all-reduce (which share the slots and
  the pair epochs), inputs changing every iteration, float32: h equals
  ``residual + all_reduce(p)`` bit for bit (both one fp32 add in rank order,
  then one add) and y the JAX norm of it within 1e-5.
* nnx: decode through NNX blocks chained by ``jaxoverlap.nnx.apply_blocks``
  with ``fuse_norm`` (two fused ops a block, forced onto the kernel at one row)
  against the same blocks unsharded in this process.
* negative_zero: rows whose p is -0.0 on every rank and whose residual is -0.0 give
  h = -0.0 and y = -0.0 (the pure expression's), beside an ordinary row.
* grads: jax.grad through the op equals jax.grad through the pure expression
  with lax.psum (NCCL).
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import dispatch, reference
from jaxoverlap.tuning import policy

pytestmark = pytest.mark.usefixtures("runtime")

DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}
ROWS = (1, 5, 64)
# 8: 2 bf16 lines (fewer lines than blocks when forced onto 8); 1996: 499 bf16 lines,
# blocks of unequal parts.
HIDDEN = (8, 128, 1000, 1996, 4096, 8192)
QUICK = ((1, 4096), (16, 8192), (3, 1000))
EPS = 1e-6


def _inputs(seed, rank: int, shape, dtype, outlier=8.0) -> np.ndarray:
  """Rank ``rank``'s values (rank -1: the ones every rank shares), in ``dtype``."""
  rng = np.random.default_rng([*np.atleast_1d(seed), rank + 2, *shape])
  x = rng.standard_normal(shape).astype(np.float32)
  if x.size > 8:
    idx = rng.integers(0, x.size, size=max(1, x.size // 500))
    x.flat[idx] *= outlier
  return x.astype(dtype)


def _f64(a) -> np.ndarray:
  return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


class Norm:
  """The jit'd op over the 1-D mesh: this rank's p, the shared residual and weight."""

  def __init__(self, mesh, ops, rank: int, nproc: int):
    self.mesh, self.ops, self.rank, self.nproc = mesh, ops, rank, nproc
    self._fns = {}

  def arrays(self, p, r, w):
    rows, hidden = p.shape
    pa = jax.make_array_from_process_local_data(NamedSharding(self.mesh, P("x")), p,
                                                (rows * self.nproc, hidden))
    rep = NamedSharding(self.mesh, P())
    return (pa, jax.make_array_from_process_local_data(rep, r, r.shape),
            jax.make_array_from_process_local_data(rep, w, w.shape))

  def fn(self, eps=EPS, backend=None, algorithm="one_shot"):
    """The jit'd op; backend None: "cuda" with ``algorithm`` ("xla" in a dry run)."""
    key = (eps, backend, algorithm)
    if key not in self._fns:
      if backend is None:
        op = lambda p, r, w: self.ops.all_reduce_rms_norm(p, r, w, "x", eps=eps,
                                                          algorithm=algorithm)
      else:
        op = lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "x", eps=eps,
                                                            backend=backend, algorithm=algorithm)
      f = jax.shard_map(op, mesh=self.mesh, in_specs=(P("x"), P(), P()), out_specs=(P(), P()))
      self._fns[key] = jax.jit(f)
    return self._fns[key]

  @staticmethod
  def local(out) -> np.ndarray:
    return np.asarray(out.addressable_shards[0].data)


@pytest.fixture(scope="module")
def norm(mesh, ops, rank, nproc) -> Norm:
  return Norm(mesh, ops, rank, nproc)


def _check(h, y, ps, r, w, dtype, what, eps=EPS) -> list[str]:
  """Every element of h and y against float64 (tests/test_all_reduce_rms_norm.py's bounds)."""
  p64 = np.stack([_f64(p) for p in ps])
  r64, w64 = _f64(r), _f64(w)
  h_want = r64 + p64.sum(axis=0)
  rms = np.sqrt(np.mean(h_want * h_want, axis=-1, keepdims=True) + eps)
  y_want = h_want / rms * w64
  e = float(jnp.finfo(dtype).eps)
  mag = np.abs(p64).sum(axis=0) + np.abs(r64)
  h_lim = 4 * e * mag + 1e-30
  y_lim = 4 * e * (np.abs(y_want) + np.abs(w64) * (mag + np.max(mag, -1, keepdims=True)) / rms)
  out = []
  for name, got, want, lim in (("h", h, h_want, h_lim), ("y", y, y_want, y_lim + 1e-30)):
    got = _f64(got)
    if got.shape != want.shape:
      out.append(f"{what} {name}: shape {got.shape}, want {want.shape}")
      continue
    bad = ~(np.abs(got - want) <= lim)
    if bad.any():
      i = np.unravel_index(int(np.argmax(np.where(bad, np.abs(got - want) / lim, -1))),
                           got.shape)
      out.append(f"{what} {name}: {int(bad.sum())} of {bad.size} off; at {i}: got {got[i]}, "
                 f"want {want[i]}, allowed {lim[i]:.3g}")
  return out


def _capacity(topology, dtype) -> int | None:
  """Elements one launch of the fused kernel takes per rank (None in a dry run)."""
  ll_slot = topology.info.get("ll_slot_bytes")
  return None if ll_slot is None else dispatch.norm_capacity(np.dtype(dtype).itemsize,
                                                             int(ll_slot))


def _want(algorithm, fits, rows, row_bytes) -> tuple[str, str]:
  """The (backend, algorithm) a call must plan."""
  if algorithm == "one_shot":
    return "cuda", "one_shot"
  if algorithm == "auto" and fits and (row_bytes % 8 == 0) and policy.fuse_norm(rows, row_bytes):
    return ("cuda", "one_shot")
  return ("cuda", "unfused")


def _run(norm, kv, topology, nccl, shapes, dtype, seed, algorithm="one_shot") -> list[str]:
  """Runs every shape with ``algorithm``.

  With "one_shot", those above one launch run with "auto" (unfused; skipped
  without NCCL, which the all-reduce's own automatic choice may need there).
  """
  failures = []
  capacity = _capacity(topology, dtype)
  for i, (rows, hidden) in enumerate(shapes):
    fits = capacity is None or rows * hidden <= capacity
    if algorithm == "one_shot" and not fits and not nccl:
      continue  # its all-reduce's own choice may be lax.psum, and NCCL cannot run here
    ps = [_inputs((seed, i), q, (rows, hidden), dtype) for q in range(norm.nproc)]
    r = _inputs((seed, i), -1, (rows, hidden), dtype)
    w = _inputs((seed, i), -2, (hidden,), dtype, outlier=1.0)
    jaxoverlap.clear_decisions()
    jax.clear_caches()  # every shape lowers here, so its plan is this call's (an earlier test
    # may have compiled the same shape)
    alg = "auto" if algorithm == "one_shot" and not fits else algorithm  # "auto": unfused
    h, y = norm.fn(algorithm=alg)(*norm.arrays(ps[norm.rank], r, w))
    h, y = norm.local(h), norm.local(y)
    what = f"{np.dtype(dtype).name} [{rows}, {hidden}] {alg}"
    if not norm.ops.dry_run:
      plans = jaxoverlap.decisions("all_reduce_rms_norm")
      want = _want(alg, fits, rows, hidden * np.dtype(dtype).itemsize)
      if not plans or (plans[-1].backend, plans[-1].algorithm) != want:
        failures.append(f"{what}: planned {plans[-1].summary() if plans else None}, want {want}")
    failures += _check(h, y, ps, r, w, dtype, what)
    for name, a in (("h", h), ("y", y)):
      same, digests = kv.same_on_all_ranks(a)
      if not same:
        failures.append(f"{what} {name}: differs across ranks ({digests})")
  return failures


def _report(failures: list[str], limit: int = 25) -> str:
  more = f"\n... and {len(failures) - limit} more" if len(failures) > limit else ""
  return f"{len(failures)} wrong:\n" + "\n".join(failures[:limit]) + more


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sweep(dtype, norm, kv, topology, nccl):
  shapes = [(r, h) for r in ROWS for h in HIDDEN]
  failures = _run(norm, kv, topology, nccl, shapes, DTYPES[dtype],
                  seed=list(DTYPES).index(dtype))
  assert not failures, _report(failures)


@pytest.mark.quick
def test_sweep_quick(norm, kv, topology, nccl):
  failures = _run(norm, kv, topology, nccl, QUICK, jnp.bfloat16, seed=50)
  assert not failures, _report(failures)


# Both sides of the rule (rows of 8 and 16 KiB), a row of 1000 bf16
# (not whole LL lines: "auto" runs unfused on CUDA) and shapes of the sweep.
UNFUSED_SHAPES = ((1, 4096), (3, 4096), (4, 4096), (4, 8192), (16, 2048), (5, 1001), (64, 128))


@pytest.mark.quick
@pytest.mark.parametrize("algorithm", ["unfused", "auto"])
def test_unfused_and_auto(algorithm, norm, kv, topology, nccl):
  failures = _run(norm, kv, topology, nccl, UNFUSED_SHAPES, jnp.bfloat16, seed=90,
                  algorithm=algorithm)
  failures += _run(norm, kv, topology, nccl, ((2, 4096), (4, 1000)), np.float32, seed=91,
                   algorithm=algorithm)
  assert not failures, _report(failures)


@pytest.mark.quick
def test_eps_reaches_the_kernel(norm, kv):
  """eps = 1 on tiny rows (the scale ~1, not ~1/rms as with eps = 1e-6), a row of zeros, an
  ordinary row; h and y against float64 from the inputs, with a random weight, on every rank."""
  rows, hidden = 3, 256
  scale = np.array([[1e-3], [0.0], [1.0]], np.float32)
  ps = [_inputs(60, q, (rows, hidden), np.float32) * scale for q in range(norm.nproc)]
  r = _inputs(60, -1, (rows, hidden), np.float32) * scale
  w = _inputs(60, -2, (hidden,), np.float32, outlier=1.0)
  h, y = norm.fn(eps=1.0)(*norm.arrays(ps[norm.rank], r, w))
  h, y = norm.local(h), norm.local(y)
  failures = _check(h, y, ps, r, w, np.float32, "eps=1", eps=1.0)
  for name, a in (("h", h), ("y", y)):
    same, digests = kv.same_on_all_ranks(a)
    if not same:
      failures.append(f"eps=1 {name}: differs across ranks ({digests})")
  assert not failures, _report(failures)


@pytest.mark.quick
def test_negative_zero(norm, kv):
  """Trial 29: the kernel summed p from +0.0, so h = residual + sum(p) of -0.0 everywhere came
  out +0.0 (the expression with lax.psum: -0.0), and y with it. Row 0 is -0.0 in p on every
  rank and in the residual (h and y: -0.0), row 1 the same but for one element of the
  residual that is +0.0 (there h: +0.0), row 2 ordinary values."""
  rows, hidden = 3, 1024
  ps = [_inputs(61, q, (rows, hidden), np.float32) for q in range(norm.nproc)]
  r = _inputs(61, -1, (rows, hidden), np.float32)
  w = np.abs(_inputs(61, -2, (hidden,), np.float32, outlier=1.0)) + 0.5
  for p in ps:
    p[:2] = -0.0
  r[:2] = -0.0
  r[1, 7] = 0.0
  h, y = norm.fn()(*norm.arrays(ps[norm.rank], r, w))
  h, y = norm.local(h), norm.local(y)
  failures = _check(h, y, ps, r, w, np.float32, "signed zeros")
  want_negative = np.ones((2, hidden), bool)
  want_negative[1, 7] = False
  for name, a in (("h", h), ("y", y)):
    zeros = a[:2]
    wrong = (zeros != 0) | (np.signbit(zeros) != want_negative)
    if wrong.any():
      i = np.unravel_index(int(np.argmax(wrong)), wrong.shape)
      failures.append(f"{name}: {int(wrong.sum())} of {wrong.size} signed zeros wrong; "
                      f"e.g. {i} = {zeros[i]!r}")
    same, digests = kv.same_on_all_ranks(a)
    if not same:
      failures.append(f"{name}: differs across ranks ({digests})")
  assert not failures, _report(failures)


@pytest.mark.quick
def test_plan_refusals_and_fallbacks(norm, ops, mesh, topology):
  ops.require_cuda("the plan of the fused kernel")
  ll_slot = int(topology.info["ll_slot_bytes"])

  def lower(backend, rows, hidden, dtype=jnp.bfloat16, algorithm="auto"):
    f = jax.shard_map(lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "x",
                                                                     backend=backend,
                                                                     algorithm=algorithm),
                      mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P(), P()))
    s = jax.ShapeDtypeStruct
    return jax.jit(f).lower(s((rows * norm.nproc, hidden), dtype), s((rows, hidden), dtype),
                            s((hidden,), dtype))

  with pytest.raises(ValueError, match="is not a whole number of LL8 lines"):
    lower("cuda", 4, 1001, algorithm="one_shot")
  with pytest.raises(ValueError, match="is not a whole number of LL8 lines"):
    lower("auto", 4, 1001, algorithm="one_shot")  # naming a CUDA algorithm asks for CUDA
  jaxoverlap.clear_decisions()
  lower("auto", 4, 1001)  # algorithm "auto": the CUDA all-reduce, then the norm
  (plan,) = jaxoverlap.decisions("all_reduce_rms_norm")
  assert (plan.backend, plan.algorithm) == ("cuda", "unfused"), plan
  assert "LL8 lines" in plan.reason("algorithm")
  # A message above one launch: rows of 8192 bf16 (16 KiB, 32 KiB of LL lines).
  rows = ll_slot // (32 << 10) + 1
  with pytest.raises(ValueError, match="exceeds one launch of the one-shot LL all-reduce"):
    lower("cuda", rows, 8192, algorithm="one_shot")
  jaxoverlap.clear_decisions()
  lower("auto", 4, 4096)
  (plan,) = jaxoverlap.decisions("all_reduce_rms_norm")
  assert (plan.backend, plan.algorithm, plan.protocol) == ("cuda", "one_shot", "ll"), plan


# ---------------------------------------------------------------------------- stress

STRESS_SHAPES = ((1, 4096), (7, 1000), (32, 8192), (3, 128))  # float32; 32 x 8192: 1 MiB,
# one full LL slot of 2 MiB
STRESS_ITERS = 1000


@pytest.mark.stress
def test_stress_interleaved_with_all_reduce(norm, mesh, ops, nproc, rank):
  ops.require_cuda("the fused kernel's slot reuse")
  if nproc != 2:
    pytest.skip("2 ranks only: there both sums are one fp32 add (h bit-exact)")

  def stress(*args):
    def body(i, bad):
      scale = (i + 1).astype(jnp.float32) * 0.5
      for p, r, w in zip(args[0::3], args[1::3], args[2::3]):
        p = p * scale
        h, y = jaxoverlap.all_reduce_rms_norm(p, r, w, "x", backend="cuda", algorithm="one_shot")
        s = jaxoverlap.all_reduce(p, "x", backend="cuda", algorithm="one_shot", protocol="ll")
        h_ref = r + s
        h32 = h_ref.astype(jnp.float32)
        y_ref = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + EPS) * w
        bad = bad + jnp.sum(h != h_ref).astype(jnp.int32)
        bad = bad + jnp.sum(jnp.abs(y - y_ref) > 1e-5 * (jnp.abs(y_ref) + 1)).astype(jnp.int32)
      return bad

    bad = jax.lax.fori_loop(0, STRESS_ITERS, body, jnp.zeros((), jnp.int32))
    return jax.lax.pcast(bad, "x", to="varying")[None]

  arrays, specs = [], []
  for k, (rows, hidden) in enumerate(STRESS_SHAPES):
    p = _inputs((70, k), rank, (rows, hidden), np.float32)
    r = _inputs((70, k), -1, (rows, hidden), np.float32)
    w = _inputs((70, k), -2, (hidden,), np.float32, outlier=1.0)
    arrays += list(norm.arrays(p, r, w))
    specs += [P("x"), P(), P()]
  fn = jax.jit(jax.shard_map(stress, mesh=mesh, in_specs=tuple(specs), out_specs=P("x")))
  t0 = time.time()
  bad = int(np.asarray(fn(*arrays).addressable_shards[0].data)[0])
  print(f"stress: {2 * STRESS_ITERS * len(STRESS_SHAPES)} calls in {time.time() - t0:.1f} s")
  assert bad == 0, f"{bad} elements wrong over {STRESS_ITERS * len(STRESS_SHAPES)} fused calls"


# ---------------------------------------------------------------------------- grads


@pytest.mark.quick
def test_nnx_blocks_decode_as_unsharded(ops, nproc):
  """Decode through Llama-style blocks chained by jaxoverlap.nnx.apply_blocks with fuse_norm.

  Two fused ops a block (attention: the MLP's norm; MLP: the next block's or the
  final norm), forced onto the fused kernel ("one_shot") at 1 row, on tp = every
  rank, against the same blocks unsharded in this process (no NCCL needed):
  a prompt of 3 tokens, then 2 single tokens; every element, float32.
  """
  from flax import nnx

  from jaxoverlap import nnx as jnnx

  d, layers, b, max_len = 256, 2, 1, 8
  auto = jax.sharding.AxisType.Auto
  tp_mesh = jax.make_mesh((1, nproc), ("dp", "tp"), axis_types=(auto, auto))
  algorithm = "auto" if ops.dry_run else "one_shot"

  class Stack(nnx.Module):
    def __init__(self, config):
      self.blocks = nnx.List([
          jnnx.TransformerBlock(d, 2 * nproc, 64 * nproc, config=config, num_kv_heads=nproc,
                                rope_theta=10000.0, activation="swiglu", norm="rms",
                                use_bias=False, epsilon=0.25, rngs=nnx.Rngs(i))
          for i in range(layers)])
      # Epsilons far apart: a norm computed with another's epsilon shows.
      self.final_norm = jnnx.RMSNorm(d, config=config, epsilon=0.5, rngs=nnx.Rngs(0))

  config = jnnx.ParallelConfig(mesh=tp_mesh, backend=ops.backend, row_reduction="all_reduce",
                               all_reduce_algorithm=algorithm, fuse_norm=True)
  sharded = nnx.jit(lambda: Stack(config))()
  ref = Stack(jnnx.ParallelConfig(mesh=None))
  # The same random weights in both, from seeds (every process makes every value).
  state, ref_state = nnx.state(sharded, nnx.Param), nnx.state(ref, nnx.Param)
  pure, ref_pure = nnx.to_pure_dict(state), nnx.to_pure_dict(ref_state)
  values = {}
  for i, (path, a) in enumerate(jax.tree_util.tree_flatten_with_path(pure)[0]):
    scale = 1.0 / math.sqrt(a.shape[0]) if a.ndim == 2 else 0.5
    values[jax.tree_util.keystr(path)] = _inputs((90, i), -1, a.shape, np.float32) * scale
  put = lambda path, a: jax.make_array_from_callback(  # noqa: E731
      a.shape, a.sharding, lambda idx, v=values[jax.tree_util.keystr(path)]: v[idx])
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(put, pure))
  nnx.replace_by_pure_dict(ref_state, jax.tree_util.tree_map_with_path(
      lambda path, a: jnp.asarray(values[jax.tree_util.keystr(path)]), ref_pure))
  nnx.update(sharded, state)
  nnx.update(ref, ref_state)
  for model in (sharded, ref):
    for block in model.blocks:
      block.init_cache((b, max_len, d))

  step = nnx.jit(lambda m, x: jnnx.apply_blocks(m.blocks, x, m.final_norm, decode=True))
  x = _inputs(91, -1, (b, 5, d), np.float32)
  failures = []  # asserted after every step ran (every rank runs the same collectives)
  with jax.default_matmul_precision("highest"):
    jaxoverlap.clear_decisions()
    for lo, hi in ((0, 3), (3, 4), (4, 5)):
      xs = x[:, lo:hi]
      got = step(sharded, jax.make_array_from_callback(
          xs.shape, NamedSharding(tp_mesh, P()), lambda idx, v=xs: v[idx]))
      want = np.asarray(step(ref, jnp.asarray(x[:, lo:hi])), np.float64)
      for shard in got.addressable_shards:
        err = np.abs(_f64(shard.data) - want[shard.index]).max()
        if not err <= 1e-4:
          failures.append(f"tokens {lo}:{hi}: max |diff| {err:.3g}")
  assert not failures, failures
  plans = jaxoverlap.decisions("all_reduce_rms_norm")
  assert plans  # one a distinct call (tests/test_nnx_layers.py counts two a block)
  if not ops.dry_run:
    assert all(p.backend == "cuda" and p.algorithm == "one_shot" for p in plans), [
        p.summary() for p in plans]


@pytest.mark.quick
def test_grads_match_the_expression(norm, mesh, ops, nproc, rank, needs_nccl):
  rows, hidden = 4, 1000
  dtype = np.float32

  def loss(p, r, w, ch, cy, ours):
    def f(p, r, w, ch, cy):
      h, y = (ops.all_reduce_rms_norm(p, r, w, "x") if ours
              else reference.all_reduce_rms_norm(p, r, w, "x"))
      return jnp.sum(h * ch + y * cy)[None]

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P(), P(), P("x"), P("x")),
                      out_specs=P("x"))
    return jnp.sum(g(p, r, w, ch, cy))

  ps = _inputs(80, rank, (rows, hidden), dtype)
  r = _inputs(80, -1, (rows, hidden), dtype)
  w = _inputs(80, -2, (hidden,), dtype, outlier=1.0)
  pa, ra, wa = norm.arrays(ps, r, w)
  sh = NamedSharding(mesh, P("x"))
  ch = jax.make_array_from_process_local_data(sh, _inputs(81, rank, (rows, hidden), dtype),
                                              (rows * nproc, hidden))
  cy = jax.make_array_from_process_local_data(sh, _inputs(82, rank, (rows, hidden), dtype),
                                              (rows * nproc, hidden))
  grad = lambda ours: jax.jit(jax.grad(lambda p, r, w, ch, cy: loss(p, r, w, ch, cy, ours),
                                       argnums=(0, 1, 2)))(pa, ra, wa, ch, cy)
  for name, got, want in zip(("dp", "dresidual", "dweight"), grad(True), grad(False)):
    got, want = Norm.local(got).astype(np.float64), Norm.local(want).astype(np.float64)
    scale = np.abs(want).max() + 1e-30
    err = np.abs(got - want).max() / scale
    assert err <= 1e-4, f"{name}: max |diff| / max |want| = {err:.3g}"
