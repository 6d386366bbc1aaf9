"""The "ppermute" rings of backend xla: any axis order, and float32 partials across hops.

The rings (jaxoverlap._xla) reduce-scatter by passing accumulators around the
ranks. They carry those accumulators in float32 and round once, so they are
no worse than XLA's collective in bfloat16 and float16 and give every rank the
same bits; and a tuple ``axis_name`` may name the mesh axes in any order.
Every result is checked element by element, on every rank, against a float64
or pure-JAX reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxoverlap
from _helpers import make_mesh
from jaxoverlap import _xla, reference

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def _stacked(fn, mesh, in_specs, axes):
  """jit(shard_map(fn)) whose output is every rank's result stacked along a new axis 0."""
  def per_rank(*args):
    return _xla.to_varying(fn(*args), axes)[None]

  return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=in_specs, out_specs=P(axes)))


# ---------------------------------------------------------------------------- axis order


OPS = {
    "all_reduce": (lambda lib, **kw: lambda x, w: lib.all_reduce(x, AXES, **kw)),
    "all_gather_matmul": (lambda lib, **kw: lambda x, w: lib.all_gather_matmul(x, w, AXES, **kw)),
    "matmul_reduce_scatter": (
        lambda lib, **kw: lambda x, w: lib.matmul_reduce_scatter(x, w, AXES, **kw)),
    "matmul_all_reduce": (lambda lib, **kw: lambda x, w: lib.matmul_all_reduce(x, w, AXES, **kw)),
}
AXES = None  # set per test


@pytest.mark.parametrize("algorithm", ["collective", "ppermute"])
@pytest.mark.parametrize("order", [("dp", "tp"), ("tp", "dp")], ids=["mesh-order", "reversed"])
@pytest.mark.parametrize("op", OPS)
def test_tuple_axis_in_any_order(rng, op, order, algorithm):
  global AXES
  AXES = order
  mesh = make_mesh((2, 4), ("dp", "tp"))
  both = ("dp", "tp")
  x = jnp.asarray(rng.standard_normal((16, 8 * 8)), F32)
  w = jnp.asarray(rng.standard_normal((8 * 8, 8)), F32)
  # all_reduce and all_gather_matmul: x sharded on its rows over both axes; the
  # others: x sharded on its columns and w on its rows (row-parallel).
  if op in ("all_reduce", "all_gather_matmul"):
    specs = (P(both), P())
  else:
    specs = (P(None, both), P(both))
  ours = _stacked(OPS[op](jaxoverlap, algorithm=algorithm), mesh, specs, both)(x, w)
  want = _stacked(OPS[op](reference), mesh, specs, both)(x, w)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------- precision


def test_fp16_partial_sums_do_not_overflow_and_agree_across_ranks():
  """4 ranks hold 41000, 40000, -40000, -40000 (exact sum 992): fp16 overflows half-way."""
  mesh = make_mesh((4,), ("tp",))
  v = jnp.asarray([41000.0, 40000.0, -40000.0, -40000.0], F16)[:, None] * jnp.ones((4, 64), F16)
  ring = _stacked(lambda x: jaxoverlap.all_reduce(x, "tp", algorithm="ppermute"), mesh,
                  (P("tp"),), "tp")(v)
  assert np.array_equal(np.asarray(ring, np.float32), np.full((4, 1, 64), 992.0, np.float32))
  # GEMM+RS and GEMM+AR rings as well: x @ I puts the values through the GEMM unchanged.
  eye = jnp.eye(64, dtype=F16)
  rs = _stacked(lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=1,
                                                              algorithm="ppermute"),
                mesh, (P("tp"), P()), "tp")(v, eye)
  assert np.array_equal(np.asarray(rs, np.float32), np.full((4, 1, 16), 992.0, np.float32))
  ar = _stacked(lambda x, w: jaxoverlap.matmul_all_reduce(x, w, "tp", algorithm="ppermute"),
                mesh, (P("tp"), P()), "tp")(v, eye)
  assert np.array_equal(np.asarray(ar, np.float32), np.full((4, 1, 64), 992.0, np.float32))


def _rel_rms(got, want):
  got = np.asarray(jnp.asarray(got).astype(F32), np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_low_precision_ring_no_worse_than_the_collective(rng, dtype):
  """GEMM+RS at 8 ranks: the ring's error against float64 is at most psum_scatter's."""
  mesh = make_mesh((8,), ("tp",))
  x32 = rng.standard_normal((64, 8 * 32)).astype(np.float32)
  w32 = (rng.standard_normal((8 * 32, 48)) / 16).astype(np.float32)
  x, w = jnp.asarray(x32, dtype), jnp.asarray(w32, dtype)
  specs = (P(None, "tp"), P("tp"))
  exact = np.asarray(x.astype(F32), np.float64) @ np.asarray(w.astype(F32), np.float64)

  def run(algorithm):
    f = jax.jit(jax.shard_map(
        lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, "tp", algorithm=algorithm),
        mesh=mesh, in_specs=specs, out_specs=P("tp")))
    return _rel_rms(f(x, w), exact)

  ring, collective = run("ppermute"), run("collective")
  assert ring <= collective * 1.05, (ring, collective)
  # All-reduce of bf16/f16 values at 8 ranks, the same comparison.
  v = jnp.asarray(rng.standard_normal((8 * 16, 32)), dtype)
  exact = np.asarray(v.astype(F32), np.float64).reshape(8, 16, 32).sum(0)

  def run_ar(algorithm):
    f = jax.jit(jax.shard_map(lambda y: jaxoverlap.all_reduce(y, "tp", algorithm=algorithm),
                              mesh=mesh, in_specs=P("tp"), out_specs=P()))
    return _rel_rms(f(v), exact)

  assert run_ar("ppermute") <= run_ar("collective") * 1.05


@pytest.mark.parametrize("op", ["all_reduce", "all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce", "all_reduce_rms_norm"])
def test_an_xla_algorithm_without_its_branch_raises(monkeypatch, op):
  """Trial 45: a name added to names._ALGORITHMS[XLA] alone ran the ring while the plan named
  it. Each _xla op branches on "collective" and "ppermute" only and raises on any other.
  Trial 46: decisions() then showed the plan of a program that never lowered; the name is now
  refused while planning, before the plan is logged."""
  from jaxoverlap import names

  table = dict(names._ALGORITHMS)
  table[names.XLA] = {o: (*a, "tree") for o, a in names._ALGORITHMS[names.XLA].items()}
  monkeypatch.setattr(names, "_ALGORITHMS", table)
  mesh = make_mesh((4,), ("tp",))
  x, w = jnp.ones((4 * 8, 16)), jnp.ones((16, 16))
  call = {
      "all_reduce": lambda x, w: jaxoverlap.all_reduce(x, "tp", algorithm="tree"),
      "all_gather_matmul": lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp",
                                                                     algorithm="tree"),
      "matmul_reduce_scatter": lambda x, w: jaxoverlap.matmul_reduce_scatter(
          x, w, "tp", algorithm="tree"),
      "matmul_all_reduce": lambda x, w: jaxoverlap.matmul_all_reduce(x, w, "tp",
                                                                     algorithm="tree"),
      "all_reduce_rms_norm": lambda x, w: jaxoverlap.all_reduce_rms_norm(
          x, x, x[0], "tp", algorithm="tree")[1],
  }[op]
  fn = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"),
                             check_vma=False))
  jaxoverlap.clear_decisions()
  with pytest.raises(ValueError, match=f"_xla.{op}: no branch for algorithm 'tree'"):
    fn(x, w)
  assert jaxoverlap.decisions() == []
  for algorithm in ("tree", "collective", "ppermute"):  # the ops' own check, below the plan's
    if algorithm == "tree":
      with pytest.raises(ValueError, match="_xla.all_reduce: no branch for algorithm 'tree'"):
        _xla._ring(names.ALL_REDUCE, algorithm)
    else:
      assert _xla._ring(names.ALL_REDUCE, algorithm) == (algorithm == "ppermute")
