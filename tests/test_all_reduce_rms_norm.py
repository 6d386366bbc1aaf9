"""all_reduce_rms_norm on CPU: values, gradients, errors, batching and plans.

Values: every rank's h and y against a float64 NumPy reference of
``h = residual + sum_ranks(p)``, ``y = h / sqrt(mean(h^2) + eps) * weight``,
element by element. Gradients: ``jax.vjp`` of the op equals ``jax.vjp`` of
the pure expression (``reference.all_reduce_rms_norm``) for random
cotangents of both outputs, w.r.t. p, the residual and the weight, with and
without ``check_vma``. Plans: ``dispatch.make_plan`` with simulated runtime
facts (as tests/test_dispatch.py); the kernel itself is tested on GPUs
(tests/gpu/test_gpu_norm.py).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxoverlap
from _helpers import make_mesh, randn
from jaxoverlap import _ffi, dispatch, names, reference, runtime
from jaxoverlap.dispatch import Request
from jaxoverlap.tuning import policy

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
EPS = 1e-6


def norm_reference(p64, r64, w64, eps=EPS):
  """float64 (h, y) from the per-rank partial sums p64 [n, ..., hidden]."""
  h = r64 + p64.sum(axis=0)
  y = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * w64
  return h, y


def check_outputs(h, y, p64, r64, w64, dtype, what, eps=EPS):
  """Checks h and y of one rank, every element, against the float64 reference.

  h may differ from the exact sum by the dtype's rounding of the rank sums
  and of h: ``eps(dtype) * (sum |p| + |r|)`` times a small factor. y inherits
  h's error through the norm (``|w| / rms`` per unit of h) plus its own
  rounding (``eps(dtype) * |y|``).
  """
  h_want, y_want = norm_reference(p64, r64, w64, eps)
  e = float(jnp.finfo(dtype).eps)
  mag = np.abs(p64).sum(axis=0) + np.abs(r64)
  h_lim = 4 * e * mag + 1e-30
  rms = np.sqrt(np.mean(h_want * h_want, axis=-1, keepdims=True) + eps)
  y_lim = 4 * e * (np.abs(y_want) + np.abs(w64) * (mag / rms + np.max(mag, -1, keepdims=True)
                                                   / rms)) + 1e-30
  for name, got, want, lim in (("h", h, h_want, h_lim), ("y", y, y_want, y_lim)):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert got.shape == want.shape, (what, name, got.shape, want.shape)
    err = np.abs(got - want)
    bad = ~(err <= lim)
    if bad.any():
      i = np.unravel_index(np.argmax(np.where(bad, err / lim, -1)), got.shape)
      raise AssertionError(f"{what} {name}: {bad.sum()} of {bad.size} off; at {i}: got "
                           f"{got[i]}, want {want[i]}, allowed {lim[i]:.3g}")


def run(n, shape, dtype, rng, *, algorithm="auto", backend="auto", varying_residual=False,
        check_vma=True, eps=EPS, row_scales=None):
  """Runs the op on n ranks; returns per-rank (h, y) [n, *shape] and the float64 inputs.

  ``row_scales``: {row: factor} applied to p's and the residual's row (0: a row of zeros).
  """
  mesh = make_mesh((n,), ("tp",))
  p, p64 = randn(rng, (n,) + shape, dtype, outlier=8.0)
  r, r64 = randn(rng, ((n,) if varying_residual else ()) + shape, dtype, outlier=8.0)
  w, w64 = randn(rng, shape[-1:], dtype, outlier=1.0)
  for row, factor in (row_scales or {}).items():
    p, r = p.at[..., row, :].multiply(factor), r.at[..., row, :].multiply(factor)
    p64, r64 = p64.copy(), r64.copy()
    p64[..., row, :] = np.asarray(p[..., row, :].astype(jnp.float32), np.float64)
    r64[..., row, :] = np.asarray(r[..., row, :].astype(jnp.float32), np.float64)

  def body(p, r, w):
    r = r[0] if varying_residual else r
    h, y = jaxoverlap.all_reduce_rms_norm(p[0], r, w, "tp", eps=eps, backend=backend,
                                          algorithm=algorithm)
    hr, yr = reference.all_reduce_rms_norm(p[0], r, w, "tp", eps=eps)
    if check_vma:
      assert str(jax.typeof(h)) == str(jax.typeof(hr)), (jax.typeof(h), jax.typeof(hr))
      assert str(jax.typeof(y)) == str(jax.typeof(yr)), (jax.typeof(y), jax.typeof(yr))
    return h[None], y[None]

  r_spec = P("tp") if varying_residual else P()
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), r_spec, P()),
                            out_specs=P("tp"), check_vma=check_vma))
  h, y = f(p, r, w)
  return h, y, p64, r64, w64


@pytest.mark.parametrize("n,dt,algorithm,shape", [
    (2, "f32", "collective", (4, 128)), (2, "bf16", "collective", (1, 1000)),
    (4, "f16", "collective", (3, 256)), (8, "bf16", "ppermute", (2, 5, 64)),
    (4, "f32", "ppermute", (16, 96)), (3, "bf16", "auto", (7, 40))])
def test_values_every_rank_every_element(rng, n, dt, algorithm, shape):
  dtype = DTYPES[dt]
  h, y, p64, r64, w64 = run(n, shape, dtype, rng, algorithm=algorithm)
  assert h.dtype == dtype and y.dtype == dtype
  for k in range(n):
    check_outputs(h[k], y[k], p64, r64, w64, dtype, f"rank {k}")


def test_varying_residual_adds_each_ranks_own(rng):
  h, y, p64, r64, w64 = run(4, (3, 64), jnp.float32, rng, varying_residual=True)
  for k in range(4):
    check_outputs(h[k], y[k], p64, r64[k], w64, jnp.float32, f"rank {k}")


def test_eps_is_used(rng):
  """A row of zeros (h = 0, y = 0 * rsqrt(eps) = 0), a tiny row that feels the large eps
  (y ~ h / sqrt(eps)), and ordinary rows, on every rank."""
  eps = 1.0
  h, y, p64, r64, w64 = run(2, (4, 32), jnp.float32, rng, eps=eps, row_scales={1: 0.0, 2: 1e-3})
  assert not np.asarray(h[:, 1]).any() and not np.asarray(y[:, 1]).any()
  for k in range(2):
    check_outputs(h[k], y[k], p64, r64, w64, jnp.float32, f"eps=1, rank {k}", eps=eps)


def test_equals_the_pure_expression_bitwise(rng):
  """backend "xla", "collective" is the pure expression itself."""
  mesh = make_mesh((4,), ("tp",))
  p, _ = randn(rng, (4, 6, 128), jnp.bfloat16)
  r, _ = randn(rng, (6, 128), jnp.bfloat16)
  w, _ = randn(rng, (128,), jnp.bfloat16)

  def body(p, r, w):
    ours = jaxoverlap.all_reduce_rms_norm(p[0], r, w, "tp", backend="xla")
    return ours, reference.all_reduce_rms_norm(p[0], r, w, "tp")

  (h, y), (hr, yr) = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()),
                                           out_specs=P()))(p, r, w)
  np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(hr, np.float32))
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(yr, np.float32))


# ---------------------------------------------------------------------------- gradients


def _grads(fn, n, shape, dtype, rng, *, varying_residual, check_vma, varying_weight=False):
  mesh = make_mesh((n,), ("tp",))
  p, _ = randn(rng, (n,) + shape, dtype, outlier=4.0)
  r, _ = randn(rng, ((n,) if varying_residual else ()) + shape, dtype, outlier=4.0)
  w, _ = randn(rng, ((n * shape[-1]) if varying_weight else shape[-1],), dtype, outlier=1.0)
  w_spec = P("tp") if varying_weight else P()  # a weight of its own on each rank
  ch, _ = randn(rng, (n,) + shape, dtype, outlier=1.0)
  cy, _ = randn(rng, (n,) + shape, dtype, outlier=1.0)
  r_spec = P("tp") if varying_residual else P()

  def body(p, r, w):
    h, y = fn(p[0], r[0] if varying_residual else r, w)
    return h[None], y[None]

  f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), r_spec, w_spec), out_specs=P("tp"),
                    check_vma=check_vma)
  _, vjp = jax.vjp(jax.jit(f), p, r, w)
  return vjp((ch, cy))


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("algorithm", ["collective", "ppermute"])
@pytest.mark.parametrize("varying_residual", [False, True])
@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients_equal_the_pure_expression(rng, dt, algorithm, varying_residual, check_vma):
  _check_gradients(rng, DTYPES[dt], algorithm, varying_residual=varying_residual,
                   check_vma=check_vma)


@pytest.mark.parametrize("algorithm", ["collective", "ppermute"])
@pytest.mark.parametrize("varying_residual", [False, True])
def test_gradients_with_a_weight_that_varies_where_h_does_not(rng, algorithm, varying_residual):
  """weight varies over tp, h (an invariant residual + the sum) does not: the backward added
  h's summed cotangent to the norm's still-varying one, then summed both over tp, so dp and
  dresidual counted ct_h 4 times (errors of 12 where the gradient is at most 10)."""
  _check_gradients(rng, jnp.float32, algorithm, varying_residual=varying_residual,
                   check_vma=True, varying_weight=True)


def _check_gradients(rng, dtype, algorithm, **kw):
  seed = int(rng.integers(1 << 30))
  ours = _grads(lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "tp",
                                                               algorithm=algorithm),
                4, (3, 64), dtype, np.random.default_rng(seed), **kw)
  want = _grads(lambda p, r, w: reference.all_reduce_rms_norm(p, r, w, "tp"),
                4, (3, 64), dtype, np.random.default_rng(seed), **kw)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for name, a, b in zip(("dp", "dresidual", "dweight"), ours, want):
    assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape)
    a64, b64 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (a, b))
    scale = np.abs(b64).max() + 1e-30
    assert np.abs(a64 - b64).max() <= tol * scale, (name, np.abs(a64 - b64).max(), scale)


def test_gradient_of_collective_is_bitwise_the_expressions(rng):
  """With "collective" the backward pass is the expression's, operation for operation."""
  seed = int(rng.integers(1 << 30))
  kw = dict(varying_residual=False, check_vma=True)
  ours = _grads(lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "tp"),
                2, (4, 128), jnp.float32, np.random.default_rng(seed), **kw)
  want = _grads(lambda p, r, w: reference.all_reduce_rms_norm(p, r, w, "tp"),
                2, (4, 128), jnp.float32, np.random.default_rng(seed), **kw)
  for a, b in zip(ours, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_vmap_equals_the_loop(rng):
  mesh = make_mesh((2,), ("tp",))
  p, _ = randn(rng, (2, 3, 4, 64), jnp.float32)
  r, _ = randn(rng, (3, 4, 64), jnp.float32)
  w, _ = randn(rng, (3, 64), jnp.float32)

  def body(p, r, w):
    op = lambda a, b, c: jaxoverlap.all_reduce_rms_norm(a, b, c, "tp")
    batched = jax.vmap(op)(p[0], r, w)                 # weight batched: a loop
    shared = jax.vmap(op, in_axes=(1, 1, None))(p[0], r, w[0])  # weight shared: folded
    loop = [op(p[0][i], r[i], w[i]) for i in range(3)]
    loop_shared = [op(p[0][:, j], r[:, j], w[0]) for j in range(4)]
    return batched, shared, loop, loop_shared

  batched, shared, loop, loop_shared = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P()))(p, r, w)
  for k in range(2):
    np.testing.assert_allclose(batched[k], np.stack([l[k] for l in loop]), rtol=1e-6)
    np.testing.assert_allclose(shared[k], np.stack([l[k] for l in loop_shared]), rtol=1e-6)


# ---------------------------------------------------------------------------- errors


def _call(p, r, w, **kw):
  mesh = make_mesh((2,), ("tp",))
  f = jax.shard_map(lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "tp", **kw),
                    mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P())
  return jax.jit(f).lower(p, r, w)


X = jnp.zeros((4, 64), jnp.float32)
R = jnp.zeros((2, 64), jnp.float32)
W = jnp.zeros((64,), jnp.float32)


@pytest.mark.parametrize("args,kw,kind,msg", [
    ((X.astype(jnp.int32), R, W), {}, ValueError, r"p.dtype=int32 is not supported"),
    ((X, R.astype(jnp.bfloat16), W), {}, ValueError,
     r"p.dtype=float32, residual.dtype=bfloat16 and weight.dtype=float32 must be one dtype"),
    ((X, jnp.zeros((2, 32)), W), {}, ValueError,
     r"residual.shape=\(2, 32\) differs from p.shape=\(2, 64\)"),
    ((X, R, jnp.zeros((32,))), {}, ValueError,
     r"weight.shape=\(32,\) must be \(hidden,\) = \(64,\)"),
    ((X, R, jnp.zeros((1, 64))), {}, ValueError, r"weight.shape=\(1, 64\) must be"),
    ((X, R, W), {"eps": 0.0}, ValueError, r"eps must be positive and finite, got eps=0.0"),
    ((X, R, W), {"eps": float("nan")}, ValueError, r"eps must be positive and finite"),
    ((X, R, W), {"eps": "1e-6"}, TypeError, r"eps must be a Python float, got str"),
    ((X, R, W), {"backend": "nccl"}, ValueError, r"backend='nccl' is not one of"),
    ((X, R, W), {"algorithm": "two_shot"}, ValueError, r"algorithm='two_shot' is unknown"),
    ((X, R, W), {"backend": "xla", "algorithm": "one_shot"}, ValueError,
     r"algorithm='one_shot' belongs to backend 'cuda'"),
])
def test_errors_name_the_op_and_the_values(args, kw, kind, msg):
  with pytest.raises(kind, match="all_reduce_rms_norm: " + msg):
    _call(*args, **kw)


def test_scalar_p_is_refused():
  mesh = make_mesh((2,), ("tp",))
  f = jax.shard_map(lambda p: jaxoverlap.all_reduce_rms_norm(p[0], p[0], p, "tp"),
                    mesh=mesh, in_specs=P("tp"), out_specs=P())
  with pytest.raises(ValueError, match=r"all_reduce_rms_norm: p must have at least 1 dim"):
    jax.jit(f).lower(jnp.zeros((2,)))


def test_outside_shard_map_is_refused():
  with pytest.raises(ValueError, match=r"all_reduce_rms_norm: axis_name=.tp., but no "
                                       r"jax.shard_map mesh axis is in scope: "
                                       r"all_reduce_rms_norm must be called inside "
                                       r"jax.shard_map"):
    jaxoverlap.all_reduce_rms_norm(R, R, W, "tp")


def test_cuda_on_cpu_raises_and_auto_runs_xla_with_the_reason():
  with pytest.raises(RuntimeError, match=r"all_reduce_rms_norm: backend='cuda' was requested"):
    _call(X, R, W, backend="cuda")
  with pytest.raises(RuntimeError, match=r"all_reduce_rms_norm: algorithm='one_shot' "
                                         r"\(backend 'cuda'\) was requested"):
    _call(X, R, W, algorithm="one_shot")
  jaxoverlap.clear_decisions()
  _call(X, R, W)
  (plan,) = jaxoverlap.decisions(names.ALL_REDUCE_RMS_NORM)
  assert (plan.backend, plan.algorithm) == ("xla", "collective")
  assert plan.reason("backend").startswith("auto: ")
  assert plan.shapes == ((2, 64), (2, 64), (64,)) and plan.nbytes == 2 * 64 * 4
  assert names.ALL_REDUCE_RMS_NORM in jaxoverlap.runtime_info()["backends"]


def test_forward_mode_is_refused():
  mesh = make_mesh((2,), ("tp",))
  f = jax.shard_map(lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "tp")[1],
                    mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P())
  with pytest.raises(TypeError, match="all_reduce_rms_norm: forward-mode"):
    jax.jvp(f, (X, R, W), (X, R, W))


# ---------------------------------------------------------------------------- plans

MIB = 1 << 20
LIMITS = {"max_group_size": 8, "max_nodes": 64, "max_pes": 512, "max_chunks": 32,
          "max_blocks": 128}


class A:
  def __init__(self, shape, dtype=jnp.bfloat16):
    self.shape, self.dtype = tuple(shape), jnp.dtype(dtype)


def facts(ranks_per_node=4, transport="nvshmem", ll_slot_bytes=2 * MIB, **kw):
  return runtime.Facts(unavailable=None, transport=transport, pe=0, num_pes=8,
                       ranks_per_node=ranks_per_node, slot_bytes=64 * MIB,
                       ll_slot_bytes=ll_slot_bytes, overlap_slot_bytes=1 << 30,
                       limits=LIMITS, **kw)


@pytest.fixture
def one_process_per_device(monkeypatch):
  monkeypatch.setattr(runtime, "pe_of_device", lambda d: d.id)
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", "/nonexistent/none.json")


def plan(shape, dtype=jnp.bfloat16, mesh_shape=(4,), backend="auto", algorithm="auto", **fkw):
  mesh = make_mesh(mesh_shape, ("tp",))
  req = Request(names.ALL_REDUCE_RMS_NORM, "tp", backend=backend, algorithm=algorithm)
  return dispatch.make_plan(req, [A(shape, dtype), A(shape, dtype), A(shape[-1:], dtype)],
                            mesh, facts(**fkw))


def test_plan_one_node_is_the_fused_kernel(one_process_per_device):
  p = plan((16, 4096))
  assert (p.backend, p.algorithm, p.protocol, p.transport) == ("cuda", "one_shot", "ll",
                                                               "nvshmem")
  assert (p.num_ranks, p.ranks_per_node, p.num_nodes, p.groups) == (4, 4, 1, ((0, 1, 2, 3),))
  assert p.reason("backend") == "auto: the CUDA kernels run here"
  assert plan((1, 8192), backend="cuda", algorithm="one_shot").reason("algorithm") == "requested"


def test_plan_across_nodes_falls_back_or_raises(one_process_per_device):
  p = plan((4, 4096), ranks_per_node=2)
  assert (p.backend, p.algorithm) == ("xla", "collective")
  assert "spans 2 nodes" in p.reason("backend"), p.reason("backend")
  with pytest.raises(ValueError, match="spans 2 nodes"):
    plan((4, 4096), backend="cuda", ranks_per_node=2)


@pytest.mark.parametrize("shape,dtype,why", [
    ((4, 1001), jnp.bfloat16, "hidden=1001 bfloat16 elements is not a whole number"),
    ((4, 3), jnp.float32, "hidden=3 float32"),
    ((1024, 8192), jnp.bfloat16, "exceeds one launch of the one-shot LL all-reduce "
                                 "(1048576 bytes"),
])
def test_what_the_fused_kernel_cannot_take_runs_unfused(one_process_per_device, shape, dtype,
                                                        why):
  """auto: the CUDA all-reduce, then the norm; one_shot (which asks for CUDA): an error."""
  p = plan(shape, dtype)
  assert (p.backend, p.algorithm) == ("cuda", "unfused")
  assert why in p.reason("algorithm"), p.reason("algorithm")
  sub = p.all_reduce
  assert (sub.op, sub.shapes, sub.dtype) == ("all_reduce", (shape,), jnp.dtype(dtype).name)
  assert p.groups == sub.groups == ((0, 1, 2, 3),)
  for backend in ("auto", "cuda"):
    with pytest.raises(ValueError, match=re.escape(why)):
      plan(shape, dtype, backend=backend, algorithm="one_shot")


@pytest.mark.parametrize("shape,dtype,fused", [
    ((1, 4096), jnp.bfloat16, True),    # one row of 8 KiB: kernel v2 measured 1.12x
    ((3, 4096), jnp.bfloat16, True),
    ((4, 4096), jnp.bfloat16, True),
    ((1, 8192), jnp.bfloat16, False),   # rows of 16 KiB: v1 measured 0.55x, v2 not measured
    ((64, 4096), jnp.bfloat16, True),
    ((4, 8192), jnp.bfloat16, False),   # rows of 16 KiB: measured 0.55x
    ((4, 2048), jnp.float32, True),     # 8 KiB rows in float32
    ((2, 3, 1024), jnp.float16, True),  # 6 rows over two leading dimensions
])
def test_auto_follows_the_measured_rule(one_process_per_device, shape, dtype, fused):
  p = plan(shape, dtype)
  rows, row_bytes = int(np.prod(shape[:-1])), shape[-1] * jnp.dtype(dtype).itemsize
  assert policy.fuse_norm(rows, row_bytes) == fused
  if fused:
    assert (p.backend, p.algorithm, p.protocol) == ("cuda", "one_shot", "ll")
    assert p.reason("algorithm").startswith("rule: the fused kernel is faster here")
    assert p.all_reduce is None
  else:
    assert (p.backend, p.algorithm) == ("cuda", "unfused") and p.protocol is None
    assert p.reason("algorithm").startswith(f"rule: {rows} rows of {row_bytes} bytes")
    assert (p.all_reduce.backend, p.all_reduce.algorithm) == ("cuda", "one_shot")
  # Either algorithm when named.
  assert plan(shape, dtype, algorithm="one_shot").algorithm == "one_shot"
  named = plan(shape, dtype, algorithm="unfused")
  assert (named.algorithm, named.reason("algorithm")) == ("unfused", "requested")


def test_plan_capacity_edge(one_process_per_device):
  cap = dispatch.norm_capacity(2, 2 * MIB)
  assert cap == (2 * MIB // 16) * 4
  assert plan((cap // 4096, 4096)).algorithm == "one_shot"
  assert plan((cap // 4096 + 1, 4096)).algorithm == "unfused"
  with pytest.raises(ValueError, match="exceeds one launch"):
    plan((cap // 4096 + 1, 4096), algorithm="one_shot")


def test_plan_in_process_runtime_across_processes_falls_back(one_process_per_device):
  p = plan((4, 4096), transport="peer", ranks_per_node=2)
  assert p.backend == "xla" and "spans 2 nodes" in p.reason("backend")
  p = plan((4, 4096), transport="peer")
  assert (p.backend, p.transport) == ("cuda", "peer")


def test_plan_empty_rows_run_the_expression(one_process_per_device):
  p = plan((0, 4096))
  assert p.backend == "xla" and p.reason("backend").startswith("empty operands")



@pytest.mark.parametrize("backend,algorithm", [("auto", "auto"), ("cuda", "auto"),
                                               ("auto", "one_shot"), ("cuda", "unfused")])
def test_plan_a_group_of_one_rank_runs_the_expression(one_process_per_device, backend,
                                                      algorithm):
  """Nothing to communicate over one rank: the xla expression, as for empty operands."""
  p = plan((4, 4096), mesh_shape=(1,), backend=backend, algorithm=algorithm)
  assert (p.backend, p.algorithm, p.num_ranks, p.protocol) == ("xla", "collective", 1, None)
  assert p.reason("backend") == ("a group of one rank: nothing to communicate (the xla "
                                 "expression, no kernel)")
  assert plan((4, 4096), mesh_shape=(2,), backend=backend, algorithm=algorithm).backend == "cuda"


@pytest.mark.parametrize("algorithm", ["auto", "one_shot"])
def test_a_group_of_one_rank_runs_on_cpu_with_the_runtime_up(one_process_per_device,
                                                             monkeypatch, rng, algorithm):
  """The simulated runtime would plan the kernel over two ranks; over one the values are right."""
  monkeypatch.setattr(runtime, "facts", lambda: facts())
  jaxoverlap.clear_decisions()
  h, y, p64, r64, w64 = run(1, (3, 256), jnp.float32, rng, backend="cuda", algorithm=algorithm)
  check_outputs(h[0], y[0], p64, r64, w64, jnp.float32, "one rank")
  (p,) = jaxoverlap.decisions(names.ALL_REDUCE_RMS_NORM)
  assert (p.backend, p.num_ranks) == ("xla", 1), p.summary()


def test_plan_a_row_that_is_not_whole_ll8_lines_says_what_a_line_is(one_process_per_device):
  why = plan((4, 1001)).reason("algorithm")
  assert ("is not a whole number of LL8 lines (8 bytes of data each, as two 8-byte LL cells of "
          "4 bytes of data + a 4-byte flag" in why), why


needs_extension = pytest.mark.skipif(_ffi.unavailable_reason() is not None,
                                     reason="the CUDA extension is not built")


def _lowered_text(monkeypatch, rows: int, hidden: int) -> str:
  """StableHLO of the op at 4 ranks (this rank's p: [rows, hidden] bf16) under fake GPU facts."""
  monkeypatch.setattr(runtime, "facts", lambda: facts())
  mesh = make_mesh((4,), ("tp",))
  f = jax.shard_map(lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "tp", eps=1e-5),
                    mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P(), check_vma=False)
  x = jnp.zeros((4 * rows, hidden), jnp.bfloat16)
  return jax.jit(f).lower(x, x[:rows], x[0]).as_text()


@needs_extension
def test_lowers_to_the_fused_custom_call(one_process_per_device, monkeypatch):
  text = _lowered_text(monkeypatch, 4, 512)
  call = re.search(r"custom_call @jaxoverlap_all_reduce_rms_norm\(.*", text).group(0)
  assert "group_size = 4 : i64" in call and "groups = dense<[0, 1, 2, 3]>" in call
  assert "eps = 9.99999974E-6 : f32" in call, call
  assert jaxoverlap.decisions(names.ALL_REDUCE_RMS_NORM)[-1].backend == "cuda"


@needs_extension
def test_unfused_lowers_to_the_all_reduce_then_xla(one_process_per_device, monkeypatch):
  """A row of 16 KiB: the plain all-reduce custom call, then the add and the norm as XLA ops."""
  text = _lowered_text(monkeypatch, 1, 8192)
  assert "custom_call @jaxoverlap_all_reduce(" in text
  assert "jaxoverlap_all_reduce_rms_norm" not in text
  assert "rsqrt" in text  # the norm, in XLA
  assert jaxoverlap.decisions(names.ALL_REDUCE_RMS_NORM)[-1].algorithm == "unfused"
