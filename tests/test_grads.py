"""Gradients of every op (custom_vjp backward passes), backend "xla".

Inside one shard_map (check_vma=True unless a test says otherwise), jax.grad
of sum(op(x, w) * ct) and of sum(reference(x, w) * ct), with a random
cotangent ct of the output's type, for x and w. Every rank's gradients are
exposed and checked against each other, the gradient types against each
other, and both against float64 NumPy gradients of the global computation,
within eps(dtype)**(2/3) times the same expressions on |x|, |w|, |ct|.

Under check_vma=True a value invariant over an axis (a replicated w, or a
psum output and its cotangent) is one value shared by the ranks, so:
  * varying outputs (all_gather_matmul, matmul_reduce_scatter): the loss is
    the sum over ranks of the per-rank losses;
  * invariant outputs (all_reduce, matmul_all_reduce): one loss;
  * a replicated w gets the sum over ranks of the per-rank gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxoverlap import collectives, overlap, reference

from _helpers import assert_close, make_mesh, randn

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
ALGORITHMS = ("collective", "ppermute")


def lead_dot(a, b):
  """a [..., k], b [..., n] -> [k, n] summed over the leading dimensions."""
  lead = list(range(a.ndim - 1))
  return np.tensordot(a, b, axes=(lead, lead))


# float64 gradients (dx of rank r, dw of rank r) from per-rank locals.


def want_all_gather_matmul(g, w_replicated):
  def f(r, xs, ws, cs):
    x_all = np.concatenate(xs, axis=g)
    dx = np.split(sum(c @ w.T for c, w in zip(cs, ws)), len(xs), axis=g)[r]
    dws = [lead_dot(x_all, c) for c in cs]
    return dx, sum(dws) if w_replicated else dws[r]
  return f


def want_matmul_reduce_scatter(s, w_replicated):
  def f(r, xs, ws, cs):
    c_all = np.concatenate(cs, axis=s)
    dws = [lead_dot(x, c_all) for x in xs]
    return c_all @ ws[r].T, sum(dws) if w_replicated else dws[r]
  return f


def want_matmul_all_reduce(w_replicated):
  def f(r, xs, ws, cs):  # one (invariant) cotangent: cs[r] is the same for all r
    dws = [lead_dot(x, cs[r]) for x in xs]
    return cs[r] @ ws[r].T, sum(dws) if w_replicated else dws[r]
  return f


def sharded_shape(local, dim, factor):
  shape = list(local)
  if dim is not None:
    shape[dim] *= factor
  return tuple(shape)


def check_grads(rng, *, n, dtype, op_fn, ref_fn, want_fn, x_local, x_dim, w_local, w_dim,
                out_local, ct_varying, mesh=None, axis="tp", dp=False, check_vma=True,
                scale=1.0):
  """Gradients of op_fn and ref_fn (both (x, w) -> y) inside one shard_map.

  x_dim / w_dim: the dim sharded over ``axis`` (None: replicated). With
  ``dp``, the mesh is ("dp", "tp"), x is also sharded over "dp" along dim 0
  and w is replicated over "dp". ct varies over ``axis`` iff ``ct_varying``,
  and over "dp" with ``dp``. ``scale`` multiplies the NumPy gradients.
  """
  mesh = mesh or make_mesh((n,), ("tp",))
  groups = mesh.shape["dp"] if dp else 1
  x_shape = sharded_shape(sharded_shape(x_local, x_dim, n), 0 if dp else None, groups)
  w_shape = sharded_shape(w_local, w_dim, n)
  names = axis if isinstance(axis, tuple) else (axis,)
  ct_axes = (("dp",) if dp else ()) + (names if ct_varying else ())
  num_ct = groups * (n if ct_varying else 1)
  x, x64 = randn(rng, x_shape, dtype, 100.0)
  w, w64 = randn(rng, w_shape, dtype, 10.0)
  ct, ct64 = randn(rng, (num_ct,) + tuple(out_local), dtype, 10.0)

  def spec(ndim, dim, dp_dim=None):
    entries = [None] * ndim
    if dim is not None:
      entries[dim] = axis
    if dp_dim is not None:
      entries[dp_dim] = "dp"
    return P(*entries)

  in_specs = (spec(len(x_local), x_dim, 0 if dp else None), spec(2, w_dim),
              P(ct_axes) if ct_axes else P())
  stack = ("dp", axis) if dp else axis

  def body(x, w, ct):
    ct = ct[0]

    def grads(fn):
      return jax.grad(lambda x, w: jnp.sum((fn(x, w) * ct).astype(jnp.float32)),
                      argnums=(0, 1))(x, w)

    got, ref = grads(op_fn), grads(ref_fn)
    for a, b, name in zip(got, ref, ("dx", "dw")):
      assert str(jax.typeof(a)) == str(jax.typeof(b)), (name, jax.typeof(a), jax.typeof(b))
    return tuple(g[None] for g in got + ref)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(stack),) * 4,
                            check_vma=check_vma))
  dx, dw, dx_ref, dw_ref = f(x, w, ct)

  # NumPy: per dp group, the per-rank locals; a w replicated over dp sums its groups' grads.
  want, bound = {}, {}
  for i in range(groups):
    xg = np.split(x64, groups, axis=0)[i] if dp else x64
    xs = [xg] * n if x_dim is None else np.split(xg, n, axis=x_dim)
    ws = [w64] * n if w_dim is None else np.split(w64, n, axis=w_dim)
    cg = ct64[i * num_ct // groups:(i + 1) * num_ct // groups]
    cs = list(cg) if ct_varying else [cg[0]] * n
    for r in range(n):
      want[i, r] = want_fn(r, xs, ws, cs)
      bound[i, r] = want_fn(r, [np.abs(a) for a in xs], [np.abs(a) for a in ws],
                            [np.abs(a) for a in cs])
  for i, r in want:
    rank = i * n + r
    dw_want = sum(want[j, r][1] for j in range(groups))
    dw_bound = sum(bound[j, r][1] for j in range(groups))
    for got, wnt, bnd, name in ((dx, want[i, r][0], bound[i, r][0], "dx"),
                                (dw, dw_want, dw_bound, "dw")):
      ref = dx_ref if name == "dx" else dw_ref
      assert_close(got[rank], scale * wnt, scale * bnd, dtype, f"{name} of op, rank {rank}")
      assert_close(ref[rank], scale * wnt, scale * bnd, dtype, f"{name} of reference, rank {rank}")
      assert_close(got[rank], np.asarray(ref[rank].astype(jnp.float32), np.float64),
                   scale * bnd, dtype, f"{name} op vs reference, rank {rank}")


# ----------------------------------------------------------------------------
# Cases: (x per rank, x sharded dim, w per rank, w sharded dim, output per rank).


def agmm(rng, n, dtype, algo, *, m=3, k=24, nl=5, w_replicated=False, batch=None, g=0,
         **kw):
  """x [m, k] (or [b, m, k] with g = 1 / -2) gathered; w [k, nl] over columns or replicated."""
  x_local = (m, k) if batch is None else (batch, m, k)
  g_pos = g % len(x_local)
  out_local = tuple(d * n if i == g_pos else d for i, d in enumerate(x_local[:-1])) + (nl,)
  check_grads(
      rng, n=n, dtype=dtype,
      op_fn=lambda x, w: overlap.all_gather_matmul(x, w, kw.get("axis", "tp"),
                                                   gather_dimension=g, algorithm=algo),
      ref_fn=lambda x, w: reference.all_gather_matmul(x, w, kw.get("axis", "tp"),
                                                      gather_dimension=g),
      want_fn=want_all_gather_matmul(g_pos, w_replicated), x_local=x_local, x_dim=g_pos,
      w_local=(k, nl), w_dim=None if w_replicated else 1, out_local=out_local,
      ct_varying=True, **kw)


def mmrs(rng, n, dtype, algo, *, rows=None, k=6, nout=40, s=0, w_replicated=False, batch=None,
         **kw):
  """Row-parallel: x [rows, k] over k, w [k, nout] over rows; replicated w: x over rows."""
  rows = rows or 3 * n
  x_local = (rows, k) if batch is None else (batch, rows, k)
  s_pos = s % len(x_local)
  out_full = x_local[:-1] + (nout,)
  out_local = tuple(d // n if i == s_pos else d for i, d in enumerate(out_full))
  check_grads(
      rng, n=n, dtype=dtype,
      op_fn=lambda x, w: overlap.matmul_reduce_scatter(x, w, kw.get("axis", "tp"),
                                                       scatter_dimension=s, algorithm=algo),
      ref_fn=lambda x, w: reference.matmul_reduce_scatter(x, w, kw.get("axis", "tp"),
                                                          scatter_dimension=s),
      want_fn=want_matmul_reduce_scatter(s_pos, w_replicated), x_local=x_local,
      x_dim=0 if w_replicated else len(x_local) - 1, w_local=(k, nout),
      w_dim=None if w_replicated else 0, out_local=out_local, ct_varying=True, **kw)


def mmar(rng, n, dtype, algo, *, rows=5, k=6, nout=40, w_replicated=False, batch=None, **kw):
  x_local = (rows, k) if batch is None else (batch, rows, k)
  check_grads(
      rng, n=n, dtype=dtype,
      op_fn=lambda x, w: overlap.matmul_all_reduce(x, w, kw.get("axis", "tp"), algorithm=algo),
      ref_fn=lambda x, w: reference.matmul_all_reduce(x, w, kw.get("axis", "tp")),
      want_fn=want_matmul_all_reduce(w_replicated), x_local=x_local,
      x_dim=0 if w_replicated else len(x_local) - 1, w_local=(k, nout),
      w_dim=None if w_replicated else 0, out_local=x_local[:-1] + (nout,), ct_varying=False,
      **kw)


CASES = {"all_gather_matmul": agmm, "matmul_reduce_scatter": mmrs, "matmul_all_reduce": mmar}


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("w_layout", ("wtp", "wrep"))
@pytest.mark.parametrize("op", CASES)
def test_grads(rng, op, w_layout, algo):
  CASES[op](rng, 4, jnp.float32, algo, w_replicated=w_layout == "wrep")


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("n,dt", [(8, "bf16"), (2, "f16"), (3, "f32")],
                         ids=["tp8-bf16", "tp2-f16", "tp3-f32"])
@pytest.mark.parametrize("op", CASES)
def test_grads_dtypes_and_sizes(rng, op, n, dt, algo):
  CASES[op](rng, n, DTYPES[dt], algo)


DIM_CASES = [  # (op, keyword arguments)
    ("all_gather_matmul", dict(batch=2, g=1)),
    ("all_gather_matmul", dict(batch=2, g=-2, w_replicated=True)),
    ("matmul_reduce_scatter", dict(s=-1)),                       # scatter w's columns
    ("matmul_reduce_scatter", dict(s=1, w_replicated=True)),
    ("matmul_reduce_scatter", dict(batch=2, rows=8, s=-2)),
    ("matmul_reduce_scatter", dict(batch=2, rows=3, s=2)),
    ("matmul_all_reduce", dict(batch=2, rows=3, nout=7)),        # zero-padded ring rows
]


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("op,kwargs", DIM_CASES,
                         ids=[op + "-" + "-".join(f"{k}{v}" for k, v in kw.items())
                              for op, kw in DIM_CASES])
def test_grads_dims(rng, op, kwargs, algo):
  CASES[op](rng, 4, jnp.float32, algo, **kwargs)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_grads_dp_tp_mesh(rng, algo):
  """("dp", "tp") = (2, 4): x over dp and tp, w over tp only, so dw sums over dp."""
  mesh = make_mesh((2, 4), ("dp", "tp"))
  agmm(rng, 4, jnp.float32, algo, batch=2, g=1, mesh=mesh, dp=True)
  mmrs(rng, 4, jnp.float32, algo, mesh=mesh, dp=True)
  mmar(rng, 4, jnp.float32, algo, mesh=mesh, dp=True)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_grads_axis_tuple(rng, algo):
  mesh = make_mesh((2, 4), ("dp", "tp"))
  agmm(rng, 8, jnp.float32, algo, mesh=mesh, axis=("dp", "tp"))
  mmrs(rng, 8, jnp.float32, algo, mesh=mesh, axis=("dp", "tp"))


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_grads_without_vma_checks(rng, algo):
  """check_vma=False: every value is per-rank, psum transposes to psum, and jax
  sums the per-rank losses, so the invariant-output ops' grads are n times larger."""
  n = 4
  agmm(rng, n, jnp.float32, algo, check_vma=False)
  mmrs(rng, n, jnp.float32, algo, check_vma=False)
  mmar(rng, n, jnp.float32, algo, check_vma=False, scale=n)


# ----------------------------------------------------------------------------
# all_reduce


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("case", ["tp4-f32", "tp4-f32-xrep", "tp8-bf16", "tp4-f32-novma"])
def test_all_reduce_grads(rng, case, algo):
  """d/dx sum(psum(x) * ct) = ct; for a replicated x psum(x) = n x, so n * ct."""
  n = int(case[2])
  dtype = jnp.bfloat16 if "bf16" in case else jnp.float32
  replicated, check_vma = "xrep" in case, "novma" not in case
  x, _ = randn(rng, (3, 5 * (1 if replicated else n)), dtype, 100.0)
  ct, ct64 = randn(rng, (3, 5), dtype, 10.0)

  def body(x, ct):
    def grad(fn):
      return jax.grad(lambda x: jnp.sum((fn(x) * ct).astype(jnp.float32)))(x)

    got = grad(lambda x: collectives.all_reduce(x, "tp", algorithm=algo))
    ref = grad(lambda x: reference.all_reduce(x, "tp"))
    assert str(jax.typeof(got)) == str(jax.typeof(ref)), (jax.typeof(got), jax.typeof(ref))
    return got[None], ref[None]

  f = jax.jit(jax.shard_map(body, mesh=make_mesh((n,), ("tp",)),
                            in_specs=(P() if replicated else P(None, "tp"), P()),
                            out_specs=P("tp"), check_vma=check_vma))
  got, ref = f(x, ct)
  scale = n if (replicated or not check_vma) else 1
  for r in range(n):
    assert_close(got[r], scale * ct64, scale * np.abs(ct64), dtype, f"op, rank {r}")
    assert_close(ref[r], scale * ct64, scale * np.abs(ct64), dtype, f"reference, rank {r}")
