"""all_reduce (backend "xla": "collective" and "ppermute").

Each case runs the op and reference.all_reduce (psum) in the same shard_map on
the same shards, exposes every rank's output (a leading axis stacked over the
mesh axis), and checks every element of both against a float64 NumPy sum of
the global array, within eps(dtype)**(2/3) times the sum of |x|.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxoverlap import collectives, reference

from _helpers import assert_close, make_mesh, randn

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
ALGORITHMS = ("collective", "ppermute")
GRID = (list(itertools.product((2, 4, 8), DTYPES, ALGORITHMS))
        + [(3, "f32", algo) for algo in ALGORITHMS])  # an odd world size
GRID_IDS = [f"tp{n}-{dt}-{algo}" for n, dt, algo in GRID]


def check_all_reduce(rng, n, dtype, algo, x_local, *, x_dim=0, mesh=None, axis="tp",
                     in_spec=None, stack=None, groups=1, local_fn=None):
  """all_reduce of per-rank x_local; x sharded over ``axis`` along ``x_dim``.

  ``x_dim=None``: x replicated (invariant), so psum gives num_ranks * x.
  ``groups``: independent reductions (a "dp" axis) stacked before the ranks.
  ``local_fn``: maps the local block to the op's input (e.g. to a scalar).
  """
  mesh = mesh or make_mesh((n,), ("tp",))
  local_fn = local_fn or (lambda a: a)
  shape = list(x_local)
  if x_dim is not None:
    shape[x_dim] *= n
  shape[0] *= groups  # the "dp" blocks (used with x_dim != 0)
  x_shape = tuple(shape)
  x, x64 = randn(rng, x_shape, dtype)
  if in_spec is None:
    in_spec = P() if x_dim is None else P(*[axis if i == x_dim else None
                                            for i in range(len(x_local))])

  def body(a):
    a = local_fn(a)
    out, ref = collectives.all_reduce(a, axis, algorithm=algo), reference.all_reduce(a, axis)
    assert str(jax.typeof(out)) == str(jax.typeof(ref)), (jax.typeof(out), jax.typeof(ref))
    return out[None], ref[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_spec,),
                            out_specs=P(stack or axis)))
  out, ref = f(x)
  assert out.shape[0] == groups * n
  for i in range(groups):
    xg = np.split(x64, groups, axis=0)[i] if groups > 1 else x64
    locs = [xg] * n if x_dim is None else np.split(xg, n, axis=x_dim)
    want = local_fn(sum(locs))
    bound = local_fn(sum(np.abs(t) for t in locs))
    for r in range(n):
      rank = i * n + r
      assert_close(out[rank], want, bound, dtype, f"op, rank {rank}")
      assert_close(ref[rank], want, bound, dtype, f"reference, rank {rank}")
      assert_close(out[rank], np.asarray(ref[rank].astype(jnp.float32), np.float64), bound,
                   dtype, f"op vs reference, rank {rank}")


@pytest.mark.parametrize("n,dt,algo", GRID, ids=GRID_IDS)
def test_all_reduce(rng, n, dt, algo):
  # 35 elements per rank: divisible by no rank count, so "ppermute" pads.
  check_all_reduce(rng, n, DTYPES[dt], algo, (5, 7))


SHAPES = [  # per-rank shape; the local_fn makes a scalar out of shape (1,)
    ((1,), "scalar"),
    ((3,), "1d"),
    ((2, 3, 4), "3d"),
    ((16, 8), "divisible"),
    ((0, 3), "empty"),
]


@pytest.mark.parametrize("algo", ALGORITHMS)
@pytest.mark.parametrize("x_local,name", SHAPES, ids=[name for _, name in SHAPES])
def test_all_reduce_shapes(rng, x_local, name, algo):
  local_fn = (lambda a: a.reshape(())) if name == "scalar" else None
  check_all_reduce(rng, 4, jnp.float32, algo, x_local, local_fn=local_fn)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_all_reduce_replicated_input(rng, algo):
  """An input invariant over tp: psum gives num_ranks * x, typed invariant."""
  check_all_reduce(rng, 4, jnp.float32, algo, (3, 5), x_dim=None)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_all_reduce_dp_tp_mesh(rng, algo):
  """("dp", "tp") = (2, 4): x sharded over dp along dim 0 and tp along dim 1."""
  mesh = make_mesh((2, 4), ("dp", "tp"))
  check_all_reduce(rng, 4, jnp.bfloat16, algo, (3, 5), x_dim=1, mesh=mesh,
                   in_spec=P("dp", "tp"), stack=("dp", "tp"), groups=2)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_all_reduce_axis_tuple(rng, algo):
  """axis_name=("dp", "tp"): one reduction over all 8 ranks."""
  mesh = make_mesh((2, 4), ("dp", "tp"))
  check_all_reduce(rng, 8, jnp.float32, algo, (3, 5), mesh=mesh, axis=("dp", "tp"))


def test_all_reduce_rank_encoded():
  """Rank r contributes r + 1 everywhere: every element is n(n+1)/2 on every rank."""
  n = 8
  x = jnp.repeat(jnp.arange(1, n + 1, dtype=jnp.bfloat16), 11)
  for kwargs in ({}, {"algorithm": "collective"}, {"algorithm": "ppermute"}):
    f = jax.jit(jax.shard_map(lambda a: collectives.all_reduce(a, "tp", **kwargs)[None],
                              mesh=make_mesh((n,), ("tp",)), in_specs=P("tp"),
                              out_specs=P("tp")))
    np.testing.assert_array_equal(np.asarray(f(x).astype(jnp.float32)),
                                  np.full((n, 11), n * (n + 1) / 2, np.float32))
