"""JAX transformations through the ops: vmap, jacrev, and a clear error for forward mode.

Every op binds a primitive with a batching rule (jaxoverlap._primitives), so
``jax.vmap`` works on every backend: all_reduce folds the batch into its
message; the GEMM ops fold a batched ``x`` into a leading dimension when ``w``
is shared and loop when ``w`` is batched. Each case is compared with
``jax.vmap`` of the pure-JAX expression (``jaxoverlap.reference``) inside the
same ``shard_map``, on fresh random inputs, every element checked. On these CPU
machines the ops plan backend "xla"; the CUDA lowering of the same primitives
is checked in tests/test_dispatch.py and on GPUs in tests/gpu.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from _helpers import make_mesh
from jaxoverlap import reference

F32 = jnp.float32
R = 4  # ranks


def _mesh():
  return make_mesh((R,), ("tp",))


def _close(a, b, tol=2e-5):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert a.shape == b.shape, (a.shape, b.shape)
  scale = np.maximum(1.0, np.abs(b))
  err = np.abs(a - b) / scale
  assert err.max() <= tol, f"max rel err {err.max():.3g} at {np.unravel_index(err.argmax(), a.shape)}"


def _pair(fn, in_specs, out_spec):
  """``fn`` with the op and with the reference, each jit(shard_map)'d; both get the same shards."""
  def run(lib):
    return jax.jit(jax.shard_map(lambda *a: fn(lib, *a), mesh=_mesh(), in_specs=in_specs,
                                 out_specs=out_spec))
  return run(jaxoverlap), run(reference)


def _ops(lib, name):
  return getattr(lib, name)


# ---------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("algorithm", ["auto", "ppermute"])
@pytest.mark.parametrize("in_axis", [0, 1])
def test_vmap_all_reduce(rng, algorithm, in_axis):
  x = jnp.asarray(rng.standard_normal((3, R * 5, 7)), F32)
  x = jnp.moveaxis(x, 0, in_axis)

  def fn(lib, x):
    kw = {"algorithm": algorithm} if lib is jaxoverlap else {}
    return jax.vmap(lambda a: lib.all_reduce(a, "tp", **kw), in_axes=in_axis)(x)

  spec = P(None, "tp") if in_axis == 0 else P("tp")
  ours, ref = _pair(fn, (spec,), P())
  _close(ours(x), ref(x))


# Per op: global x and w shapes (without the batch) and their specs, and the
# output spec (AG and RS outputs vary over the ranks: stacked along their rows).
GEMM = {
    "all_gather_matmul": ((R * 3, 16), ("tp", None), (16, 8), (None, None), ("tp",)),
    "matmul_reduce_scatter": ((4 * R, R * 4), (None, "tp"), (R * 4, 8), ("tp", None), ("tp",)),
    "matmul_all_reduce": ((5, R * 4), (None, "tp"), (R * 4, 8), ("tp", None), ()),
}


@pytest.mark.parametrize("algorithm", ["auto", "ppermute"])
@pytest.mark.parametrize("batched", ["x", "x_and_w", "w"])
@pytest.mark.parametrize("name", GEMM)
def test_vmap_gemm_ops(rng, name, batched, algorithm):
  """Batched x with a shared w folds into a leading dimension; a batched w loops."""
  x_shape, x_spec, w_shape, w_spec, out_spec = GEMM[name]
  b = 3
  bx, bw = batched in ("x", "x_and_w"), batched in ("w", "x_and_w")
  x = jnp.asarray(rng.standard_normal(((b,) if bx else ()) + x_shape), F32)
  w = jnp.asarray(rng.standard_normal(((b,) if bw else ()) + w_shape) / 4, F32)
  specs = (P(*(((None,) if bx else ()) + x_spec)), P(*(((None,) if bw else ()) + w_spec)))

  def fn(lib, x, w):
    extra = {"algorithm": algorithm} if lib is jaxoverlap else {}
    return jax.vmap(lambda a, c: _ops(lib, name)(a, c, "tp", **extra),
                    in_axes=(0 if bx else None, 0 if bw else None))(x, w)

  ours, ref = _pair(fn, specs, P(None, *out_spec))
  _close(ours(x, w), ref(x, w))


def test_vmap_all_gather_matmul_batch_dims_and_gather_dimension(rng):
  """x [b, s, m, k] gathered along m (dimension 1 of the per-example x)."""
  x = jnp.asarray(rng.standard_normal((2, 3, 4 * R, 16)), F32)
  w = jnp.asarray(rng.standard_normal((16, 8)), F32)

  def fn(lib, x, w):
    return jax.vmap(lambda a: lib.all_gather_matmul(a, w, "tp", gather_dimension=1))(x)

  ours, ref = _pair(fn, (P(None, None, "tp"), P()), P(None, None, "tp"))
  _close(ours(x, w), ref(x, w))


def test_vmap_of_grad(rng):
  """Per-example gradients: vmap over grad runs the batched backward ops."""
  x = jnp.asarray(rng.standard_normal((3, 4 * R, 16)), F32)
  w = jnp.asarray(rng.standard_normal((16, 8)), F32)

  def fn(lib, x, w):
    def loss(a):
      return jnp.sum(jnp.sin(lib.matmul_reduce_scatter(a, w, "tp")))
    return jax.vmap(jax.grad(loss))(x)

  ours, ref = _pair(fn, (P(None, None, "tp"), P("tp")), P(None, None, "tp"))
  _close(ours(x, w), ref(x, w), tol=1e-4)


# ---------------------------------------------------------------------------- jacrev


@pytest.mark.parametrize("name", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_jacrev_equals_the_expression(rng, name):
  if name == "all_gather_matmul":
    x = jnp.asarray(rng.standard_normal((2 * R, 6)), F32)
    w = jnp.asarray(rng.standard_normal((6, 3)), F32)
    specs, out = (P("tp"), P()), P("tp")
  else:
    x = jnp.asarray(rng.standard_normal((2 * R, 6 * R)), F32)
    w = jnp.asarray(rng.standard_normal((6 * R, 3)), F32)
    specs, out = (P(None, "tp"), P("tp")), P("tp")

  def fn(lib, x, w):
    return jax.jacrev(lambda a: _ops(lib, name)(a, w, "tp"))(x)

  ours, ref = _pair(fn, specs, out)
  _close(ours(x, w), ref(x, w))


# ---------------------------------------------------------------------------- second order
#
# Reverse over reverse (grad of grad, jacrev of grad) and forward over reverse
# (jax.hessian) differentiate the ops' backward passes, which bind the
# primitives: their JVP rules (jaxoverlap._primitives) carry the second-order
# terms. Against the same derivatives of the pure-JAX expressions.

SECOND_ORDER_CASES = {  # op: (shapes, in_specs, out_specs)
    "all_reduce": (((R * 2, 3),), (P("tp"),), P()),
    "all_gather_matmul": (((R * 2, 3), (3, 5)), (P("tp"), P()), P("tp")),
    "matmul_reduce_scatter": (((R * 2, R * 3), (R * 3, 5)), (P(None, "tp"), P("tp")), P("tp")),
    "matmul_all_reduce": (((3, R * 3), (R * 3, 5)), (P(None, "tp"), P("tp")), P()),
    "all_reduce_rms_norm": (((R * 2, 6), (2, 6), (6,)), (P("tp"), P(), P()), (P(), P())),
}


def _second_order(lib, op, mode, specs, out, check_vma, algorithm):
  f = jax.shard_map(lambda *a: getattr(lib, op)(*a, "tp", **algorithm), mesh=_mesh(),
                    in_specs=specs, out_specs=out, check_vma=check_vma)

  def loss(*a):
    return sum(jnp.sum(jnp.sin(o) ** 2) for o in jax.tree.leaves(f(*a)))

  argnums = tuple(range(len(specs)))
  if mode == "grad_of_grad":
    def g(*a):
      return jax.grad(lambda *b: sum(jnp.sum(jnp.cos(d)) for d in jax.grad(loss, argnums)(*b)),
                      argnums)(*a)
  elif mode == "jacrev_of_grad":
    g = jax.jacrev(jax.grad(loss, argnums), argnums)
  else:
    g = jax.hessian(loss, argnums)
  return jax.jit(g)


@pytest.mark.parametrize("mode", ["grad_of_grad", "jacrev_of_grad", "hessian"])
@pytest.mark.parametrize("check_vma,algorithm", [(True, "auto"), (False, "auto"),
                                                 (True, "ppermute")])
@pytest.mark.parametrize("op", list(SECOND_ORDER_CASES))
def test_second_order_equals_the_expression(rng, op, check_vma, algorithm, mode):
  shapes, specs, out = SECOND_ORDER_CASES[op]
  args = tuple(jnp.asarray(rng.standard_normal(s), F32) for s in shapes)
  kw = {} if algorithm == "auto" else {"algorithm": algorithm}
  ours = _second_order(jaxoverlap, op, mode, specs, out, check_vma, kw)(*args)
  ref = _second_order(reference, op, mode, specs, out, check_vma, {})(*args)
  assert jax.tree.structure(ours) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    _close(a, b, tol=1e-4)
  assert any(np.abs(np.asarray(b)).max() > 0 for b in jax.tree.leaves(ref))  # not all zero


def test_second_order_of_an_invariant_input(rng):
  """psum of a value the same on every rank: d psum(x)/dx = num_ranks, twice through."""
  x = jnp.asarray(rng.standard_normal((3, 4)), F32)

  def run(lib):
    f = jax.shard_map(lambda a: lib.all_reduce(a, "tp"), mesh=_mesh(), in_specs=P(),
                      out_specs=P())
    return jax.jit(jax.hessian(lambda a: jnp.sum(jnp.sin(f(a)))))(x)

  _close(run(jaxoverlap), run(reference), tol=1e-4)


# ---------------------------------------------------------------------------- forward mode


FORWARD_CASES = {  # op: (shapes of x and w, in_specs, out_spec)
    "all_reduce": (((R * 2, 4),), (P("tp"),), P()),
    "all_gather_matmul": (((R * 2, 4), (4, 3)), (P("tp"), P()), P("tp")),
    "matmul_reduce_scatter": (((R * 2, R * 4), (R * 4, 3)), (P(None, "tp"), P("tp")), P("tp")),
    "matmul_all_reduce": (((R * 2, R * 4), (R * 4, 3)), (P(None, "tp"), P("tp")), P()),
}


@pytest.mark.parametrize("mode", ["eager", "jit", "jacfwd"])
@pytest.mark.parametrize("op", list(FORWARD_CASES))
def test_forward_mode_is_refused_clearly(op, mode):
  """Forward mode names the op and says why (eager shard_map failed inside JAX, 'unhashable')."""
  shapes, specs, out = FORWARD_CASES[op]
  mesh = _mesh()
  args = tuple(jax.device_put(jnp.ones(s, F32), NamedSharding(mesh, sp))
               for s, sp in zip(shapes, specs))
  f = jax.shard_map(lambda *a: getattr(jaxoverlap, op)(*a, "tp"), mesh=mesh, in_specs=specs,
                    out_specs=out)
  with pytest.raises(TypeError, match=f"{op}: forward-mode differentiation .* cannot go through "
                                      "jaxoverlap's ops"):
    if mode == "eager":
      jax.jvp(f, args, args)
    elif mode == "jit":
      jax.jit(lambda *a: jax.jvp(f, a, a))(*args)
    else:
      jax.jacfwd(lambda a0: f(a0, *args[1:]))(args[0])


def test_reverse_mode_is_not_mistaken_for_forward_mode():
  shapes, specs, out = FORWARD_CASES["matmul_reduce_scatter"]
  mesh = _mesh()
  x, w = (jax.device_put(jnp.ones(s, F32), NamedSharding(mesh, sp)) for s, sp in zip(shapes, specs))
  f = jax.shard_map(lambda a, b: jaxoverlap.matmul_reduce_scatter(a, b, "tp"), mesh=mesh,
                    in_specs=specs, out_specs=out)
  for grad in (jax.grad(lambda a, b: f(a, b).sum(), argnums=(0, 1)),
               jax.jit(jax.grad(lambda a, b: f(a, b).sum(), argnums=(0, 1)))):
    dx, dw = grad(x, w)
    assert dx.shape == x.shape and dw.shape == w.shape


def test_forward_mode_of_a_jitted_function_is_refused_by_jax():
  """jax.jvp of jit(shard_map(op)): JAX refuses the custom_vjp before the op runs (docstrings)."""
  shapes, specs, out = FORWARD_CASES["all_reduce"]
  x = jnp.ones(shapes[0], F32)
  f = jax.jit(jax.shard_map(lambda a: jaxoverlap.all_reduce(a, "tp"), mesh=_mesh(),
                            in_specs=specs, out_specs=out))
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(f, (x,), (x,))


# ---------------------------------------------------------------------------- vmap over meshes


@pytest.mark.parametrize("op", ["all_reduce", "all_reduce_rms_norm", "matmul_all_reduce"])
def test_grad_of_vmap_with_spmd_axis_name(rng, op):
  """Trial 20: the norm's backward took jax.vjp inside its rule, which jax fails under
  vmap(spmd_axis_name=...) ("varying manual axes to match"); values and gradients against
  the reference, the vmapped axis spread over the mesh's dp."""
  mesh = make_mesh((2, R), ("dp", "tp"))
  b = 2  # the vmapped batch, over dp
  if op == "all_reduce_rms_norm":
    args = (rng.standard_normal((b, R * 4, 8)), rng.standard_normal((b, 4, 8)),
            rng.standard_normal((b, 8)))
    in_specs, out_specs = (P("tp"), P(), P()), (P(), P())
    fn = lambda lib, p, r, w: lib.all_reduce_rms_norm(p, r, w, "tp")
  elif op == "all_reduce":
    args, in_specs, out_specs = (rng.standard_normal((b, R * 3, 5)),), (P("tp"),), P()
    fn = lambda lib, x: lib.all_reduce(x, "tp")
  else:
    args = (rng.standard_normal((b, 6, R * 4)), rng.standard_normal((b, R * 4, 5)))
    in_specs, out_specs = (P(None, "tp"), P("tp")), P()
    fn = lambda lib, x, w: lib.matmul_all_reduce(x, w, "tp")
  args = tuple(jnp.asarray(a, F32) for a in args)

  def run(lib):
    f = jax.vmap(jax.shard_map(lambda *a: fn(lib, *a), mesh=mesh, in_specs=in_specs,
                               out_specs=out_specs), spmd_axis_name="dp")
    loss = lambda *a: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(f(*a)))
    return jax.jit(f)(*args), jax.jit(jax.grad(loss, tuple(range(len(args)))))(*args)

  (got_y, got_g), (want_y, want_g) = run(jaxoverlap), run(reference)
  for g, w in zip(jax.tree.leaves((got_y, got_g)), jax.tree.leaves((want_y, want_g))):
    _close(g, w, tol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_rms_norm_vjp_in_closed_form_equals_jax_vjp(rng, dtype):
  """_xla.rms_norm_vjp (the norm's backward rule) against jax.vjp of the expression."""
  from jaxoverlap import _xla

  h = jnp.asarray(rng.standard_normal((3, 5, 16)) * 3, dtype)
  w = jnp.asarray(rng.standard_normal(16), dtype)
  ct = jnp.asarray(rng.standard_normal((3, 5, 16)), dtype)
  _, vjp = jax.vjp(lambda h, w: _xla.rms_norm_tail(jnp.zeros_like(h), h, w, 1e-6)[1], h, w)
  want = vjp(ct)
  got = _xla.rms_norm_vjp(h, w, ct, 1e-6)
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  for g, x in zip(got, want):
    assert g.dtype == x.dtype and g.shape == x.shape
    _close(g, x, tol=tol)


@pytest.mark.parametrize("op", ["all_reduce", "matmul_all_reduce"])
def test_shape_polymorphic_export_is_refused_naming_the_op(op):
  """Trial 20: jax.export with a symbolic dimension failed in the planner with JAX's
  InconclusiveDimensionOperation, naming neither the op nor the limit."""
  from jax import export

  mesh = _mesh()
  if op == "all_reduce":
    shapes, specs, out = ("4*b, 8",), (P("tp"),), P()
    fn = lambda x: jaxoverlap.all_reduce(x, "tp", backend="xla")
  else:
    shapes, specs, out = ("b, 16", "16, 8"), (P(None, "tp"), P("tp")), P()
    fn = lambda x, w: jaxoverlap.matmul_all_reduce(x, w, "tp", backend="xla")
  args = [jax.ShapeDtypeStruct(export.symbolic_shape(s), F32, sharding=NamedSharding(mesh, sp))
          for s, sp in zip(shapes, specs)]
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out))
  with pytest.raises(ValueError, match=rf"{op}: x has the symbolic dimensions \[b\].*cannot be "
                                       r"exported shape-polymorphically"):
    export.export(f)(*args)


def test_a_key_array_gets_the_dtype_message():
  """Trial 20: a PRNG key array got NumPy's "Cannot interpret 'key<fry>' as a data type"."""
  keys = jax.random.split(jax.random.key(0), R)
  f = jax.shard_map(lambda k: jaxoverlap.all_reduce(k, "tp"), mesh=_mesh(), in_specs=P("tp"),
                    out_specs=P())
  with pytest.raises(ValueError, match=r"all_reduce: x.dtype=key<fry> is not supported"):
    f(keys)


def test_unreduced_and_reduced_inputs_are_refused_naming_the_op():
  """Trial 20: an input typed unreduced failed in JAX's pcast without naming the op; one typed
  reduced was summed again (num_ranks * x), where lax.psum refuses it."""
  mesh = jax.make_mesh((R,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:R])
  with jax.set_mesh(mesh):
    x = jax.reshard(jnp.ones((8, 4 * R), F32), P(None, "tp"))
    w = jax.reshard(jnp.ones((4 * R, 6), F32), P("tp", None))
    try:
      partial = jax.jit(lambda x, w: jnp.dot(x, w, out_sharding=P(None, None,
                                                                   unreduced={"tp"})))(x, w)
    except (TypeError, ValueError) as e:  # a jax without unreduced types
      pytest.skip(f"this jax has no unreduced types: {e}")
    f = jax.jit(jax.shard_map(lambda v: jaxoverlap.all_reduce(v, "tp"),
                              in_specs=P(None, None, unreduced={"tp"}), out_specs=P()))
    with pytest.raises(ValueError, match=r"all_reduce: x is typed unreduced over mesh axes "
                                         r"\['tp'\].*reduce it with lax.psum"):
      f(partial)
  # A sum already taken, typed reduced: lax.psum refuses it; so does the op, by name.
  def body(v):
    return jaxoverlap.all_reduce(jax.lax.pcast(jax.lax.psum(v, "tp"), "tp", to="reduced"), "tp")

  h = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("tp"), out_specs=P()))
  with pytest.raises(ValueError, match=r"all_reduce: x is typed reduced over mesh axes \['tp'\]"):
    h(jnp.ones((2 * R, 3), F32))


# ---------------------------------------------------------------------------- names in programs


@pytest.mark.parametrize("op", ["all_reduce", "all_reduce_rms_norm", "all_gather_matmul",
                                "matmul_reduce_scatter", "matmul_all_reduce"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_programs_name_the_op_and_carry_no_probe(op, check_vma):
  """Trial 44: profiles and HLO named the ops' XLA parts only (``psum_invariant``), and every
  call left a dead ``axis_index`` in the jaxpr (the check_vma probe)."""
  x, w = jnp.ones((R * 8, 16)), jnp.ones((16, R * 4))
  call = {
      "all_reduce": lambda x, w: jaxoverlap.all_reduce(x, "tp"),
      "all_reduce_rms_norm": lambda x, w: jaxoverlap.all_reduce_rms_norm(x, x, x[0], "tp")[1],
      "all_gather_matmul": lambda x, w: jaxoverlap.all_gather_matmul(x, w, "tp"),
      "matmul_reduce_scatter": lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w[:, :4], "tp"),
      "matmul_all_reduce": lambda x, w: jaxoverlap.matmul_all_reduce(x, w[:, :4], "tp"),
  }[op]
  fn = jax.jit(jax.shard_map(call, mesh=_mesh(), in_specs=(P("tp"), P()), out_specs=P("tp"),
                             check_vma=check_vma))
  eqns = jax.make_jaxpr(fn)(x, w).eqns[0].params["jaxpr"].eqns[0].params["jaxpr"].eqns
  assert "axis_index" not in {e.primitive.name for e in eqns}, [e.primitive.name for e in eqns]
  hlo = fn.lower(x, w).compile().as_text()
  assert f"/jaxoverlap.{op}/" in hlo, "the op's scope is missing from the HLO metadata"
