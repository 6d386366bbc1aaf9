"""all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce (backend "xla").

Each case runs the op and reference.py's expression in the same shard_map on
the same shards, exposes every rank's output (a leading axis stacked over the
mesh axis), and checks every element of both against a float64 NumPy
reference computed from the global arrays, within eps(dtype)**(2/3) times
the same expression evaluated on |x| and |w| (a bound on the rounding error of
any summation order).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxoverlap import overlap, reference

from _helpers import assert_close, make_mesh, randn

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
ALGORITHMS = ("collective", "ppermute")
GRID = (list(itertools.product((2, 4, 8), DTYPES, ALGORITHMS))
        + [(3, "f32", algo) for algo in ALGORITHMS])  # an odd world size
GRID_IDS = [f"tp{n}-{dt}-{algo}" for n, dt, algo in GRID]


# ----------------------------------------------------------------------------
# Helpers


def spec(ndim, dim, axis):
  return P() if dim is None else P(*[axis if i == dim else None for i in range(ndim)])


def split(a, n, dim):
  return [a] * n if dim is None else np.split(a, n, axis=dim)


def check_op(fn, want_fn, operands, dtype, *, n, mesh=None, axis="tp", dp_dims=None):
  """Runs ``fn`` (returning op and reference results) and checks every rank.

  Args:
    fn: local arrays -> (op result, reference.py result).
    want_fn: (rank, per-rank float64 locals of each operand...) -> that rank's
      float64 result.
    operands: (array, float64 copy, dim sharded over ``axis`` or None).
    n: the size of ``axis``.
    mesh: default: the 1-D mesh ("tp",) of n devices.
    dp_dims: for a ("dp", "tp") mesh: per operand, the dim sharded over "dp"
      (or None); outputs are stacked over ("dp", "tp").
  """
  mesh = mesh or make_mesh((n,), ("tp",))
  num_dp = mesh.shape["dp"] if dp_dims else 1
  in_specs = []
  for k, (a, _, dim) in enumerate(operands):
    entries = [None] * a.ndim
    if dim is not None:
      entries[dim] = axis
    if dp_dims and dp_dims[k] is not None:
      entries[dp_dims[k]] = "dp"
    in_specs.append(P(*entries))
  stack_axis = ("dp", axis) if dp_dims else axis

  def body(*local):
    out, ref = fn(*local)
    # Same shape, dtype and varying-manual-axes type as the reference.
    assert str(jax.typeof(out)) == str(jax.typeof(ref)), (jax.typeof(out), jax.typeof(ref))
    return out[None], ref[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs),
                            out_specs=P(stack_axis)))
  out, ref = f(*(a for a, _, _ in operands))
  assert out.shape[0] == num_dp * n
  for i in range(num_dp):
    locals64, abs64 = [], []
    for k, (_, a64, dim) in enumerate(operands):
      if dp_dims and dp_dims[k] is not None:
        a64 = np.split(a64, num_dp, axis=dp_dims[k])[i]
      locals64.append(split(a64, n, dim))
      abs64.append([np.abs(t) for t in locals64[-1]])
    for r in range(n):
      want, bound = want_fn(r, *locals64), want_fn(r, *abs64)
      rank = i * n + r
      assert_close(out[rank], want, bound, dtype, f"op, rank {rank}")
      assert_close(ref[rank], want, bound, dtype, f"reference, rank {rank}")
      assert_close(out[rank], np.asarray(ref[rank].astype(jnp.float32), np.float64), bound,
                   dtype, f"op vs reference, rank {rank}")


# float64 results of the ops from each rank's local operands.


def want_all_gather_matmul(g):
  return lambda r, xs, ws: np.concatenate(xs, axis=g) @ ws[r]


def want_matmul_reduce_scatter(s):
  return lambda r, xs, ws: np.split(sum(x @ w for x, w in zip(xs, ws)), len(xs), axis=s)[r]


def want_matmul_all_reduce(r, xs, ws):
  return sum(x @ w for x, w in zip(xs, ws))


# ----------------------------------------------------------------------------
# all_gather_matmul


def agmm_case(rng, n, dtype, algo, x_local, g, *, n_local=5, w_sharded=True):
  """x: x_local per rank, sharded over tp along g; w: [k, n_local] per rank."""
  g_pos = g % len(x_local)
  x_shape = tuple(d * n if i == g_pos else d for i, d in enumerate(x_local))
  k = x_local[-1]
  x, x64 = randn(rng, x_shape, dtype, 100.0)
  w, w64 = randn(rng, (k, n_local * n if w_sharded else n_local), dtype, 10.0)

  def fn(x, w):
    return (overlap.all_gather_matmul(x, w, "tp", gather_dimension=g, algorithm=algo),
            reference.all_gather_matmul(x, w, "tp", gather_dimension=g))

  check_op(fn, want_all_gather_matmul(g_pos),
           [(x, x64, g_pos), (w, w64, 1 if w_sharded else None)], dtype, n=n)


@pytest.mark.parametrize("n,dt,algo", GRID, ids=GRID_IDS)
def test_all_gather_matmul(rng, n, dt, algo):
  # Per rank x [3, 24], w [24, 5]: sizes that divide no tile.
  agmm_case(rng, n, DTYPES[dt], algo, (3, 24), 0)


AGMM_DIMS = [  # (x per rank, gather_dimension, w sharded)
    ((2, 3, 24), 1, True),     # [b, s/tp, d]: batch-major sequence parallel
    ((3, 2, 24), 0, True),     # [s/tp, b, d]
    ((2, 3, 24), -2, False),   # negative dim, replicated w
    ((2, 3, 2, 16), 1, True),  # 4-D
    ((1, 40), 0, False),       # one row per rank
]


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("x_local,g,w_sharded", AGMM_DIMS,
                         ids=[f"x{'x'.join(map(str, s))}-g{g}-{'wtp' if ws else 'wrep'}"
                              for s, g, ws in AGMM_DIMS])
def test_all_gather_matmul_dims(rng, x_local, g, w_sharded, algo):
  agmm_case(rng, 4, jnp.float32, algo, x_local, g, w_sharded=w_sharded)


def test_all_gather_matmul_rank_encoded():
  """Rank r's x is all r + 1 and w is all ones: output rows of block j are k*(j+1)."""
  n, m, k, nl = 4, 2, 3, 2
  x = jnp.repeat(jnp.arange(1, n + 1, dtype=jnp.float32), m)[:, None] * jnp.ones((1, k))
  w = jnp.ones((k, nl * n), jnp.float32)
  for algo in ALGORITHMS:
    f = jax.jit(jax.shard_map(
        lambda x, w: overlap.all_gather_matmul(x, w, "tp", algorithm=algo)[None],
        mesh=make_mesh((n,), ("tp",)), in_specs=(P("tp"), P(None, "tp")), out_specs=P("tp")))
    out = np.asarray(f(x, w))
    rows = np.repeat(np.arange(1, n + 1) * k, m).astype(np.float32)
    np.testing.assert_array_equal(out, np.broadcast_to(rows[None, :, None], (n, n * m, nl)))


# ----------------------------------------------------------------------------
# matmul_reduce_scatter


def mmrs_case(rng, n, dtype, algo, x_local, s, *, n_out=40, w_sharded=True):
  """Row-parallel: x_local [..., k_local] sharded over tp along k, w [k, n_out] over rows.

  With a replicated w, x is instead sharded along its first dimension (each
  rank's full-k contribution differs) and w is the same on every rank.
  """
  if w_sharded:
    x_dim = len(x_local) - 1
    x_shape = tuple(x_local[:-1]) + (x_local[-1] * n,)
    w_shape = (x_local[-1] * n, n_out)
  else:
    x_dim = 0
    x_shape = (x_local[0] * n,) + tuple(x_local[1:])
    w_shape = (x_local[-1], n_out)
  x, x64 = randn(rng, x_shape, dtype, 100.0)
  w, w64 = randn(rng, w_shape, dtype, 10.0)

  def fn(x, w):
    return (overlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=s, algorithm=algo),
            reference.matmul_reduce_scatter(x, w, "tp", scatter_dimension=s))

  check_op(fn, want_matmul_reduce_scatter(s % len(x_local)),
           [(x, x64, x_dim), (w, w64, 0 if w_sharded else None)], dtype, n=n)


@pytest.mark.parametrize("n,dt,algo", GRID, ids=GRID_IDS)
def test_matmul_reduce_scatter(rng, n, dt, algo):
  # Per rank x [3n, 6], w [6, 40], output [3, 40].
  mmrs_case(rng, n, DTYPES[dt], algo, (3 * n, 6), 0)


MMRS_DIMS = [  # (x per rank, scatter_dimension, w sharded)
    ((12, 6), -1, True),       # scatter the last dimension (w's columns)
    ((12, 6), 1, False),       # the last dimension, replicated w
    ((2, 12, 6), 1, True),     # [b, s, f] -> [b, s/tp, d]
    ((2, 12, 6), -2, False),   # negative dim, replicated w
    ((8, 3, 6), 0, True),      # [s, b, f] -> [s/tp, b, d]
    ((2, 3, 6), 2, True),      # batch dims, scatter the last
]


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("x_local,s,w_sharded", MMRS_DIMS,
                         ids=[f"x{'x'.join(map(str, sh))}-s{s}-{'wtp' if ws else 'wrep'}"
                              for sh, s, ws in MMRS_DIMS])
def test_matmul_reduce_scatter_dims(rng, x_local, s, w_sharded, algo):
  mmrs_case(rng, 4, jnp.float32, algo, x_local, s, w_sharded=w_sharded)


def test_matmul_reduce_scatter_bf16_last_dim(rng):
  mmrs_case(rng, 8, jnp.bfloat16, "ppermute", (2, 5, 6), -1)


def test_matmul_reduce_scatter_rank_encoded():
  """x_r [M, 1] has row i equal to (r + 1) * (i + 1), w = [[1]]: out row i = (i+1) * n(n+1)/2."""
  n, m_out = 4, 8
  rows = np.arange(1, m_out + 1, dtype=np.float32)
  x = jnp.asarray(np.concatenate([(r + 1) * rows[:, None] for r in range(n)], axis=1))
  w = jnp.ones((n, 1), jnp.float32)
  for algo in ALGORITHMS:
    f = jax.jit(jax.shard_map(
        lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp", algorithm=algo)[None],
        mesh=make_mesh((n,), ("tp",)), in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp")))
    out = np.asarray(f(x, w))
    want = (rows * n * (n + 1) / 2).reshape(n, m_out // n, 1)  # rank r keeps rows block r
    np.testing.assert_array_equal(out, want)


# ----------------------------------------------------------------------------
# matmul_all_reduce


def mmar_case(rng, n, dtype, algo, x_local, *, n_out=40, w_sharded=True):
  if w_sharded:
    x_dim, x_shape = len(x_local) - 1, tuple(x_local[:-1]) + (x_local[-1] * n,)
    w_shape = (x_local[-1] * n, n_out)
  else:
    x_dim, x_shape = 0, (x_local[0] * n,) + tuple(x_local[1:])
    w_shape = (x_local[-1], n_out)
  x, x64 = randn(rng, x_shape, dtype, 100.0)
  w, w64 = randn(rng, w_shape, dtype, 10.0)

  def fn(x, w):
    return (overlap.matmul_all_reduce(x, w, "tp", algorithm=algo),
            reference.matmul_all_reduce(x, w, "tp"))

  check_op(fn, want_matmul_all_reduce, [(x, x64, x_dim), (w, w64, 0 if w_sharded else None)],
           dtype, n=n)


@pytest.mark.parametrize("n,dt,algo", GRID, ids=GRID_IDS)
def test_matmul_all_reduce(rng, n, dt, algo):
  # Per rank x [5, 6], w [6, 40]: 5 rows divide by no rank count.
  mmar_case(rng, n, DTYPES[dt], algo, (5, 6))


MMAR_SHAPES = [  # (x per rank, n_out, w sharded): which ring layout "ppermute" picks
    ((8, 6), 40, True),      # rows divisible
    ((2, 3, 6), 7, True),    # 6 rows, 7 columns: zero-padded rows
    ((2, 3, 6), 40, False),  # batch dims, replicated w, columns divisible
    ((6,), 12, True),        # 1-D x: one row
]


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("x_local,n_out,w_sharded", MMAR_SHAPES,
                         ids=[f"x{'x'.join(map(str, sh))}-n{no}-{'wtp' if ws else 'wrep'}"
                              for sh, no, ws in MMAR_SHAPES])
def test_matmul_all_reduce_shapes(rng, x_local, n_out, w_sharded, algo):
  mmar_case(rng, 4, jnp.float32, algo, x_local, n_out=n_out, w_sharded=w_sharded)


def test_matmul_all_reduce_rank_encoded():
  """x_r = [[r + 1]], w_r = [[1, 2]]: every rank gets n(n+1)/2 * [1, 2]."""
  n = 8
  x = jnp.arange(1, n + 1, dtype=jnp.float16)[None, :]
  w = jnp.tile(jnp.array([[1.0, 2.0]], jnp.float16), (n, 1))
  for algo in ALGORITHMS:
    f = jax.jit(jax.shard_map(
        lambda x, w: overlap.matmul_all_reduce(x, w, "tp", algorithm=algo)[None],
        mesh=make_mesh((n,), ("tp",)), in_specs=(P(None, "tp"), P("tp")), out_specs=P("tp")))
    out = np.asarray(f(x, w).astype(jnp.float32))
    np.testing.assert_array_equal(out, np.broadcast_to([[[36.0, 72.0]]], (n, 1, 2)))


# ----------------------------------------------------------------------------
# Empty shards


EMPTY = {  # op -> (call, x global, x spec, w global, w spec, output per rank)
    "all_gather_matmul": (overlap.all_gather_matmul, (0, 8), P("tp"), (8, 6), P(None, "tp"),
                          (0, 2)),
    "matmul_reduce_scatter": (overlap.matmul_reduce_scatter, (0, 6), P(None, "tp"), (6, 6),
                              P("tp"), (0, 6)),
    "matmul_all_reduce": (overlap.matmul_all_reduce, (0, 6), P(None, "tp"), (6, 6), P("tp"),
                          (0, 6)),
}


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("op", EMPTY)
def test_empty_shards(op, algo):
  """No rows on any rank: the op and its gradients trace, compile and run.

  (XLA rejects lax.all_gather / psum_scatter along an empty dimension, so the
  reference expressions themselves fail here; see _xla.)
  """
  call, x_shape, x_spec, w_shape, w_spec, out_local = EMPTY[op]
  n = 3

  def body(x, w):
    y = call(x, w, "tp", algorithm=algo)
    dx, dw = jax.grad(lambda x, w: jnp.sum(call(x, w, "tp", algorithm=algo)), (0, 1))(x, w)
    return y[None], dx, dw

  f = jax.jit(jax.shard_map(body, mesh=make_mesh((n,), ("tp",)), in_specs=(x_spec, w_spec),
                            out_specs=(P("tp"), x_spec, w_spec)))
  y, dx, dw = f(jnp.ones(x_shape, jnp.bfloat16), jnp.ones(w_shape, jnp.bfloat16))
  assert y.shape == (n,) + out_local and y.dtype == jnp.bfloat16
  assert dx.shape == x_shape and dw.shape == w_shape
  np.testing.assert_array_equal(np.asarray(dw, np.float32), 0.0)  # nothing to contract


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_matmul_all_reduce_without_columns(algo):
  """w [k, 0] with rows the axis does not divide: the op and its gradients give empty results."""
  n = 4

  def body(x, w):
    y = overlap.matmul_all_reduce(x, w, "tp", algorithm=algo)
    dx, dw = jax.grad(lambda x, w: jnp.sum(overlap.matmul_all_reduce(x, w, "tp", algorithm=algo)),
                      (0, 1))(x, w)
    return y, dx, dw

  f = jax.jit(jax.shard_map(body, mesh=make_mesh((n,), ("tp",)), in_specs=(P(None, "tp"), P("tp")),
                            out_specs=(P(), P(None, "tp"), P("tp"))))
  y, dx, dw = f(jnp.ones((3, 8), jnp.float32), jnp.ones((8, 0), jnp.float32))
  assert y.shape == (3, 0) and dw.shape == (8, 0)
  np.testing.assert_array_equal(dx, 0.0)  # x meets no column: no gradient
  assert dx.shape == (3, 8)


# ----------------------------------------------------------------------------
# Meshes with two axes


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_ops_on_dp_tp_mesh(rng, algo):
  """("dp", "tp") = (2, 4): x also sharded over dp; the ops act on tp only."""
  mesh = make_mesh((2, 4), ("dp", "tp"))
  dtype = jnp.float32
  # all_gather_matmul: x [b/dp, s/tp, d], w [d, f/tp].
  x, x64 = randn(rng, (2 * 2, 3 * 4, 16), dtype, 100.0)
  w, w64 = randn(rng, (16, 5 * 4), dtype, 10.0)
  check_op(lambda x, w: (overlap.all_gather_matmul(x, w, "tp", gather_dimension=1,
                                                   algorithm=algo),
                         reference.all_gather_matmul(x, w, "tp", gather_dimension=1)),
           want_all_gather_matmul(1), [(x, x64, 1), (w, w64, 1)], dtype, n=4, mesh=mesh,
           dp_dims=(0, None))
  # matmul_reduce_scatter and matmul_all_reduce: x [b/dp, s, f/tp], w [f/tp, d].
  x, x64 = randn(rng, (2 * 2, 8, 6 * 4), dtype, 100.0)
  w, w64 = randn(rng, (6 * 4, 16), dtype, 10.0)
  check_op(lambda x, w: (overlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=1,
                                                       algorithm=algo),
                         reference.matmul_reduce_scatter(x, w, "tp", scatter_dimension=1)),
           want_matmul_reduce_scatter(1), [(x, x64, 2), (w, w64, 0)], dtype, n=4, mesh=mesh,
           dp_dims=(0, None))
  check_op(lambda x, w: (overlap.matmul_all_reduce(x, w, "tp", algorithm=algo),
                         reference.matmul_all_reduce(x, w, "tp")),
           want_matmul_all_reduce, [(x, x64, 2), (w, w64, 0)], dtype, n=4, mesh=mesh,
           dp_dims=(0, None))


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_ops_over_axis_tuple(rng, algo):
  """axis_name=("dp", "tp"): the ops run over all 8 ranks of a (2, 4) mesh."""
  mesh, axis, dtype = make_mesh((2, 4), ("dp", "tp")), ("dp", "tp"), jnp.float32
  x, x64 = randn(rng, (3 * 8, 16), dtype, 100.0)
  w, w64 = randn(rng, (16, 5), dtype, 10.0)
  check_op(lambda x, w: (overlap.all_gather_matmul(x, w, axis, algorithm=algo),
                         reference.all_gather_matmul(x, w, axis)),
           want_all_gather_matmul(0), [(x, x64, 0), (w, w64, None)], dtype, n=8, mesh=mesh,
           axis=axis)
  x, x64 = randn(rng, (16, 3 * 8), dtype, 100.0)
  w, w64 = randn(rng, (3 * 8, 5), dtype, 10.0)
  check_op(lambda x, w: (overlap.matmul_reduce_scatter(x, w, axis, algorithm=algo),
                         reference.matmul_reduce_scatter(x, w, axis)),
           want_matmul_reduce_scatter(0), [(x, x64, 1), (w, w64, 0)], dtype, n=8, mesh=mesh,
           axis=axis)
  check_op(lambda x, w: (overlap.matmul_all_reduce(x, w, axis, algorithm=algo),
                         reference.matmul_all_reduce(x, w, axis)),
           want_matmul_all_reduce, [(x, x64, 1), (w, w64, 0)], dtype, n=8, mesh=mesh,
           axis=axis)


def test_eager_shard_map_without_jit(rng):
  """The ops also run in shard_map outside jit."""
  x, x64 = randn(rng, (8, 6), jnp.float32, 100.0)
  w, w64 = randn(rng, (6, 8), jnp.float32, 10.0)
  f = jax.shard_map(lambda x, w: overlap.all_gather_matmul(x, w, "tp", algorithm="ppermute")[None],
                    mesh=make_mesh((4,), ("tp",)), in_specs=(P("tp"), P(None, "tp")),
                    out_specs=P("tp"))
  out = f(x, w)
  want = np.stack(np.split(x64 @ w64, 4, axis=1))
  assert_close(out, want, np.stack(np.split(np.abs(x64) @ np.abs(w64), 4, axis=1)),
               jnp.float32, "eager")
