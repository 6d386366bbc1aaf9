"""Bad input raises ValueError (or RuntimeError for an unusable backend) before anything runs.

Every case traces the op inside shard_map over a 4-rank "tp" mesh with
jax.eval_shape (nothing is compiled or run) and checks the message. What
depends on the devices and the runtime is checked when the call is lowered
(jaxoverlap.dispatch): those cases lower with jax.jit(...).lower (nothing is
compiled or run either).
"""

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import collectives, names, overlap

AUTO = jax.sharding.AxisType.Auto
F32 = jnp.float32


@functools.cache
def mesh4():
  return jax.make_mesh((4,), ("tp",), axis_types=(AUTO,), devices=jax.devices()[:4])


def trace(fn, *shapes):
  """Traces fn on replicated per-rank operands of the given (shape, dtype)s."""
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  f = jax.shard_map(fn, mesh=mesh4(), in_specs=tuple(P() for _ in args), out_specs=P(),
                    check_vma=False)
  return jax.eval_shape(f, *args)


def lower(fn, *shapes):
  """Lowers fn (shard_map'd as in ``trace``): the dispatcher plans every call."""
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  f = jax.shard_map(fn, mesh=mesh4(), in_specs=tuple(P() for _ in args), out_specs=P(),
                    check_vma=False)
  return jax.jit(f).lower(*args)


def agmm(**kw):
  return lambda x, w: overlap.all_gather_matmul(x, w, "tp", **kw)


def mmrs(**kw):
  return lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp", **kw)


def mmar(**kw):
  return lambda x, w: overlap.matmul_all_reduce(x, w, "tp", **kw)


GEMM_OPS = {"all_gather_matmul": agmm, "matmul_reduce_scatter": mmrs, "matmul_all_reduce": mmar}


def test_good_input_traces():
  """The cases below differ from these only in the named argument."""
  assert trace(agmm(), ((8, 64), F32), ((64, 16), F32)).shape == (32, 16)
  assert trace(mmrs(), ((8, 64), F32), ((64, 16), F32)).shape == (2, 16)
  assert trace(mmar(), ((8, 64), F32), ((64, 16), F32)).shape == (8, 16)
  assert trace(lambda x: collectives.all_reduce(x, "tp"), ((8,), F32)).shape == (8,)


# ----------------------------------------------------------------------------
# Shapes and dtypes


def test_contracted_dimension_mismatch():
  with pytest.raises(ValueError, match=re.escape(
      "all_gather_matmul: x.shape[-1]=96 does not match w.shape[0]=64 "
      "(the contracted dimension k; inside jax.shard_map these are the per-rank shards: "
      "check that in_specs shard x's last and w's first dimension alike)")):
    trace(agmm(), ((8, 96), F32), ((64, 16), F32))


@pytest.mark.parametrize("op", GEMM_OPS)
def test_contracted_dimension_mismatch_every_op(op):
  with pytest.raises(ValueError, match=re.escape(
      f"{op}: x.shape[-1]=24 does not match w.shape[0]=40")):
    trace(GEMM_OPS[op](), ((4, 24), F32), ((40, 8), F32))


@pytest.mark.parametrize("op", GEMM_OPS)
def test_w_not_2d(op):
  with pytest.raises(ValueError, match=re.escape(
      f"{op}: w must be 2-D [k, n], got w.shape=(2, 8, 4)")):
    trace(GEMM_OPS[op](), ((4, 8), F32), ((2, 8, 4), F32))


@pytest.mark.parametrize("op", GEMM_OPS)
def test_x_scalar(op):
  with pytest.raises(ValueError, match=re.escape(f"{op}: x must have at least 1 dimension")):
    trace(GEMM_OPS[op](), ((), F32), ((8, 4), F32))


@pytest.mark.parametrize("op", GEMM_OPS)
def test_dtype_mismatch(op):
  with pytest.raises(ValueError, match=re.escape(
      f"{op}: x.dtype=float32 and w.dtype=bfloat16 differ")):
    trace(GEMM_OPS[op](), ((4, 8), F32), ((8, 4), jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn, jnp.complex64],
                         ids=["int32", "fp8", "complex64"])
def test_unsupported_dtype(dtype):
  msg = f"x.dtype={jnp.dtype(dtype)} is not supported; use one of float32, bfloat16, float16"
  with pytest.raises(ValueError, match=re.escape("all_reduce: " + msg)):
    trace(lambda x: collectives.all_reduce(x, "tp"), ((8,), dtype))
  with pytest.raises(ValueError, match=re.escape("matmul_all_reduce: " + msg)):
    trace(mmar(), ((4, 8), dtype), ((8, 4), dtype))


def test_float64_numpy_input():
  """A float64 NumPy array is refused, not silently cast to float32."""
  with pytest.raises(ValueError, match=re.escape("all_reduce: x.dtype=float64 is not supported")):
    trace(lambda x: collectives.all_reduce(np.ones(3), "tp"), ((8,), F32))


def test_not_an_array():
  with pytest.raises(ValueError, match=re.escape("all_reduce: x must be an array, got list")):
    trace(lambda x: collectives.all_reduce([1.0, 2.0], "tp"), ((8,), F32))


# ----------------------------------------------------------------------------
# gather_dimension / scatter_dimension


@pytest.mark.parametrize("g", [2, -3])
def test_gather_dimension_out_of_range(g):
  with pytest.raises(ValueError, match=re.escape(
      f"all_gather_matmul: gather_dimension={g} is out of range for x of ndim=2 "
      f"(valid: -2..1)")):
    trace(agmm(gather_dimension=g), ((8, 64), F32), ((64, 16), F32))


@pytest.mark.parametrize("g", [-1, 2])
def test_gather_dimension_is_contracted(g):
  with pytest.raises(ValueError, match=re.escape(
      f"all_gather_matmul: gather_dimension={g} is x's last dimension, the contracted "
      f"dimension k (x.shape=(2, 8, 64))")):
    trace(agmm(gather_dimension=g), ((2, 8, 64), F32), ((64, 16), F32))


def test_gather_dimension_of_1d_x():
  with pytest.raises(ValueError, match="gather_dimension=0 is x's last dimension"):
    trace(agmm(), ((64,), F32), ((64, 16), F32))


@pytest.mark.parametrize("bad", [1.5, "0", True], ids=["float", "str", "bool"])
def test_dimension_not_int(bad):
  with pytest.raises(ValueError, match=re.escape(
      f"all_gather_matmul: gather_dimension must be an int, got {bad!r}")):
    trace(agmm(gather_dimension=bad), ((8, 64), F32), ((64, 16), F32))
  with pytest.raises(ValueError, match=re.escape(
      f"matmul_reduce_scatter: scatter_dimension must be an int, got {bad!r}")):
    trace(mmrs(scatter_dimension=bad), ((8, 64), F32), ((64, 16), F32))


@pytest.mark.parametrize("s", [3, -4])
def test_scatter_dimension_out_of_range(s):
  with pytest.raises(ValueError, match=re.escape(
      f"matmul_reduce_scatter: scatter_dimension={s} is out of range for the output "
      f"x @ w of ndim=3 (valid: -3..2)")):
    trace(mmrs(scatter_dimension=s), ((2, 8, 64), F32), ((64, 16), F32))


@pytest.mark.parametrize("s,size", [(0, 10), (-1, 6)], ids=["rows", "last"])
def test_scatter_dimension_not_divisible(s, size):
  x_shape, w_shape = ((10, 64), (64, 16)) if s == 0 else ((8, 64), (64, 6))
  with pytest.raises(ValueError, match=re.escape(
      f"matmul_reduce_scatter: the output x @ w (shape {x_shape[:1] + w_shape[1:]}) has "
      f"size {size} along scatter_dimension={s}, which is not divisible by the size 4 "
      f"of axis 'tp'")):
    trace(mmrs(scatter_dimension=s), (x_shape, F32), (w_shape, F32))


# ----------------------------------------------------------------------------
# axis_name


def test_unknown_axis_name():
  with pytest.raises(ValueError, match=re.escape(
      "all_reduce: axis_name='dp' names ('dp',), which the mesh in scope (axes ('tp',)) does "
      "not have; call all_reduce inside jax.shard_map over a mesh with that axis")):
    trace(lambda x: collectives.all_reduce(x, "dp"), ((8,), F32))


@pytest.mark.parametrize("op", GEMM_OPS)
def test_unknown_axis_name_every_op(op):
  fn = {"all_gather_matmul": overlap.all_gather_matmul,
        "matmul_reduce_scatter": overlap.matmul_reduce_scatter,
        "matmul_all_reduce": overlap.matmul_all_reduce}[op]
  with pytest.raises(ValueError, match=re.escape(f"{op}: axis_name=('tp', 'sp') names ('sp',), "
                                                 "which the mesh in scope")):
    trace(lambda x, w: fn(x, w, ("tp", "sp")), ((8, 64), F32), ((64, 16), F32))


@pytest.mark.parametrize("how", ["jit", "eager"])
def test_axis_name_outside_shard_map(how):
  """No mesh at all (trial 44: the message spoke of a mesh with axes ())."""
  want = re.escape("all_reduce: axis_name='tp', but no jax.shard_map mesh axis is in scope: "
                   "all_reduce must be called inside jax.shard_map (a per-rank function over a "
                   "mesh with that axis), not under jit alone, eagerly or in "
                   "jax.vmap(axis_name=...)")
  x = jnp.ones((8,), F32)
  with pytest.raises(ValueError, match=want):
    if how == "jit":
      jax.jit(lambda x: collectives.all_reduce(x, "tp"))(x)
    else:
      collectives.all_reduce(x, "tp")


def test_axis_name_under_set_mesh_but_outside_shard_map():
  """The mesh is set, so 'tp' exists, but the op is not per-rank code: say so."""
  with jax.set_mesh(mesh4()):
    with pytest.raises(ValueError, match=re.escape(
        "all_reduce: axis ('tp',) of the mesh is not manual here: all_reduce must be called "
        "inside jax.shard_map")):
      jax.eval_shape(lambda x: collectives.all_reduce(x, "tp"), jax.ShapeDtypeStruct((8,), F32))


def test_axis_name_of_a_shard_map_manual_over_other_axes():
  """Inside shard_map over 'dp' only, 'tp' is not manual: name the missing axis_names entry."""
  mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  f = jax.shard_map(lambda x: collectives.all_reduce(x, "tp"), mesh=mesh, in_specs=P("dp"),
                    out_specs=P("dp"), axis_names={"dp"})
  with pytest.raises(ValueError, match=re.escape(
      "all_reduce: axis ('tp',) of the mesh is not manual here: the enclosing jax.shard_map is "
      "manual over ('dp',) only; add 'tp' to its axis_names")):
    jax.eval_shape(f, jax.ShapeDtypeStruct((8,), F32))


def test_vmap_axis_name_is_not_a_mesh_axis():
  with pytest.raises(ValueError, match=re.escape(
      "all_reduce: axis_name='b' names ('b',), which the mesh in scope (axes ('tp',))")):
    trace(lambda x: jax.vmap(lambda y: collectives.all_reduce(y, "b"), axis_name="b")(x),
          ((2, 8), F32))


@pytest.mark.parametrize("bad", [0, None, (), ("tp", "tp"), ["tp"]],
                         ids=["int", "none", "empty", "duplicate", "list"])
def test_axis_name_type(bad):
  with pytest.raises(ValueError, match=re.escape(
      f"all_reduce: axis_name must be a mesh axis name (str) or a tuple of distinct names, "
      f"got axis_name={bad!r}")):
    trace(lambda x: collectives.all_reduce(x, bad), ((8,), F32))


# ----------------------------------------------------------------------------
# backend / algorithm / protocol / transport / chunks (jaxoverlap.names)


@pytest.mark.parametrize("op", ["all_reduce", *GEMM_OPS])
def test_unknown_backend(op):
  with pytest.raises(ValueError, match=re.escape(
      f"{op}: backend='nccl' is not one of ('auto', 'xla', 'cuda')")):
    if op == "all_reduce":
      trace(lambda x: collectives.all_reduce(x, "tp", backend="nccl"), ((8,), F32))
    else:
      trace(GEMM_OPS[op](backend="nccl"), ((8, 64), F32), ((64, 16), F32))


@pytest.mark.parametrize("op", GEMM_OPS)
def test_unknown_algorithm(op):
  cuda = "('fused', 'unfused')" if op == "matmul_all_reduce" else "('fused',)"
  with pytest.raises(ValueError, match=re.escape(
      f"{op}: algorithm='ring' is unknown; valid: 'auto'; ('collective', 'ppermute') "
      f"(backend 'xla'); {cuda} (backend 'cuda')")):
    trace(GEMM_OPS[op](algorithm="ring"), ((8, 64), F32), ((64, 16), F32))


def test_unknown_algorithm_all_reduce():
  with pytest.raises(ValueError, match=re.escape(
      "all_reduce: algorithm='ring' is unknown; valid: 'auto'; ('collective', 'ppermute') "
      "(backend 'xla'); ('one_shot', 'two_shot', 'hierarchical') (backend 'cuda')")):
    trace(lambda x: collectives.all_reduce(x, "tp", algorithm="ring"), ((8,), F32))


@pytest.mark.parametrize("old,new", [
    ("one_shot_ll", "algorithm='one_shot', protocol='ll'"),
    ("hierarchical_simple", "algorithm='hierarchical', protocol='simple'")])
def test_renamed_all_reduce_algorithm(old, new):
  with pytest.raises(ValueError, match=re.escape(
      f"all_reduce: algorithm={old!r} is now spelled {new}")):
    trace(lambda x: collectives.all_reduce(x, "tp", algorithm=old), ((8,), F32))


@pytest.mark.parametrize("op,old,new", [
    ("all_gather_matmul", "copy_engine", "algorithm='fused', transport='copy_engine'"),
    ("matmul_reduce_scatter", "nvshmem", "algorithm='fused', transport='nvshmem'"),
    ("matmul_all_reduce", "gemm_all_reduce", "algorithm='unfused'")])
def test_renamed_gemm_algorithm(op, old, new):
  with pytest.raises(ValueError, match=re.escape(f"{op}: algorithm={old!r} is now spelled {new}")):
    trace(GEMM_OPS[op](algorithm=old), ((8, 64), F32), ((64, 16), F32))


def test_cuda_algorithm_with_xla_backend():
  with pytest.raises(ValueError, match=re.escape(
      "all_reduce: algorithm='one_shot' belongs to backend 'cuda', but backend='xla' was "
      "requested")):
    trace(lambda x: collectives.all_reduce(x, "tp", backend="xla", algorithm="one_shot"),
          ((8,), F32))
  with pytest.raises(ValueError, match=re.escape(
      "matmul_all_reduce: algorithm='ppermute' belongs to backend 'xla', but backend='cuda' was "
      "requested")):
    trace(mmar(backend="cuda", algorithm="ppermute"), ((8, 64), F32), ((64, 16), F32))


@pytest.mark.parametrize("kw,msg", [
    (dict(protocol="ll128"), "all_reduce: protocol='ll128' is unknown; valid: 'auto', "
                             "('ll', 'simple', 'lamport') (backend 'cuda')"),
    (dict(backend="xla", protocol="ll"), "all_reduce: protocol='ll' applies to backend 'cuda' only"),
    (dict(algorithm="ppermute", protocol="simple"), "all_reduce: protocol='simple' applies to "
                                                    "backend 'cuda' only"),
    (dict(transport="copy_engine"), "all_reduce: transport='copy_engine' is unknown; valid: "
                                    "'auto', ('nvshmem', 'peer') (backend 'cuda')"),
    (dict(protocol=1), "all_reduce: protocol must be a str, got 1"),
], ids=["unknown", "xla", "ppermute", "transport", "not-str"])
def test_all_reduce_protocol_and_transport(kw, msg):
  with pytest.raises(ValueError, match=re.escape(msg)):
    trace(lambda x: collectives.all_reduce(x, "tp", **kw), ((8,), F32))


@pytest.mark.parametrize("op", GEMM_OPS)
@pytest.mark.parametrize("kw,msg", [
    (dict(transport="nvlink"), "transport='nvlink' is unknown; valid: 'auto', "
                               "('copy_engine', 'nvshmem') (backend 'cuda')"),
    (dict(backend="xla", transport="nvshmem"), "transport='nvshmem' applies to backend 'cuda' "
                                               "only"),
    (dict(protocol="ll"), None),
    (dict(chunks=0), "chunks must be None or an int from 1 to 32, got 0"),
    (dict(chunks=33), "chunks must be None or an int from 1 to 32, got 33"),
    (dict(backend="cuda", chunks=64), "chunks must be None or an int from 1 to 32, got 64"),
    (dict(chunks=True), "chunks must be None or an int from 1 to 32, got True"),
    (dict(chunks=2.0), "chunks must be None or an int from 1 to 32, got 2.0"),
    (dict(algorithm="collective", chunks=2), "chunks=2 applies to backend 'cuda' only"),
], ids=["unknown", "xla", "protocol", "zero", "above-limit", "cuda-above-limit", "bool", "float",
        "xla-chunks"])
def test_gemm_transport_and_chunks(op, kw, msg):
  if msg is None:  # the GEMM ops take no protocol
    with pytest.raises(TypeError, match="protocol"):
      trace(GEMM_OPS[op](**kw), ((8, 64), F32), ((64, 16), F32))
    return
  with pytest.raises(ValueError, match=re.escape(f"{op}: {msg}")):
    trace(GEMM_OPS[op](**kw), ((8, 64), F32), ((64, 16), F32))


@pytest.mark.parametrize("op", GEMM_OPS)
@pytest.mark.parametrize("chunks", [np.int64(2), np.int32(3), np.uint8(1)],
                         ids=["int64", "int32", "uint8"])
def test_chunks_take_numpy_integers(op, chunks):
  """A NumPy integer is an int (operator.index); the request carries it as a Python int."""
  args = [jax.ShapeDtypeStruct(s, F32) for s in ((8, 64), (64, 16))]
  f = jax.shard_map(GEMM_OPS[op](backend="cuda", chunks=chunks), mesh=mesh4(),
                    in_specs=(P(), P()), out_specs=P(), check_vma=False)
  text = str(jax.make_jaxpr(f)(*args))  # traced only: the plan is made at lowering
  assert f"chunks={int(chunks)}," in text and "np." not in text, text


@pytest.mark.parametrize("op", GEMM_OPS)
@pytest.mark.parametrize("chunks", [np.bool_(True), np.float32(2.0), "2"], ids=str)
def test_chunks_refuse_numpy_bools_and_non_integers(op, chunks):
  with pytest.raises(ValueError, match=re.escape(
      f"{op}: chunks must be None or an int from 1 to 32, got {chunks!r}")):
    trace(GEMM_OPS[op](backend="cuda", chunks=chunks), ((8, 64), F32), ((64, 16), F32))


@pytest.mark.parametrize("kw,msg", [
    (dict(algorithm="unfused", transport="nvshmem"), "transport='nvshmem' applies to the fused "
                                                      "algorithm, not to 'unfused'"),
    (dict(algorithm="unfused", chunks=2), "chunks=2 applies to the fused algorithm, not to "
                                          "'unfused'"),
])
def test_unfused_matmul_all_reduce_options(kw, msg):
  with pytest.raises(ValueError, match=re.escape(f"matmul_all_reduce: {msg}")):
    trace(mmar(**kw), ((8, 64), F32), ((64, 16), F32))


# ----------------------------------------------------------------------------
# Planned at lowering: the CUDA kernels cannot run on these CPU machines.


@pytest.fixture
def cpu_only():
  if jax.default_backend() == "gpu":
    pytest.skip("CPU-only check: the CUDA path may be usable here")


@pytest.mark.parametrize("op", GEMM_OPS)
def test_cuda_backend_unavailable_for_gemm_ops(op, cpu_only):
  with pytest.raises(RuntimeError, match=re.escape(
      f"{op}: backend='cuda' was requested, but JAX runs on 'cpu' here, with no GPU")):
    lower(GEMM_OPS[op](backend="cuda"), ((8, 64), F32), ((64, 16), F32))


def test_cuda_backend_unavailable_for_all_reduce(cpu_only):
  with pytest.raises(RuntimeError, match=re.escape(
      "all_reduce: backend='cuda' was requested, but JAX runs on 'cpu' here, with no GPU")):
    lower(lambda x: collectives.all_reduce(x, "tp", backend="cuda"), ((8,), F32))


@pytest.mark.parametrize("kw,asked", [
    (dict(algorithm="one_shot"), "algorithm='one_shot' (backend 'cuda')"),
    (dict(protocol="ll"), "protocol='ll' (backend 'cuda')"),
], ids=["algorithm", "protocol"])
def test_cuda_choice_with_auto_backend_unavailable(kw, asked, cpu_only):
  """A choice only the kernels have is not dropped for XLA: it raises."""
  with pytest.raises(RuntimeError, match=re.escape(
      f"all_reduce: {asked} was requested, but JAX runs on 'cpu'")):
    lower(lambda x: collectives.all_reduce(x, "tp", **kw), ((8,), F32))


def test_chunks_with_auto_backend_falling_back(cpu_only):
  # chunks is a CUDA-only choice, like protocol and transport: it cannot fall back.
  with pytest.raises(RuntimeError, match=re.escape(
      "all_gather_matmul: chunks=2 (backend 'cuda') was requested, but JAX runs on 'cpu' here")):
    lower(agmm(chunks=2), ((8, 64), F32), ((64, 16), F32))



# ----------------------------------------------------------------------------
# What the docstrings promise about errors


@pytest.mark.parametrize("fn", [collectives.all_reduce, collectives.all_reduce_rms_norm,
                                overlap.all_gather_matmul, overlap.matmul_reduce_scatter,
                                overlap.matmul_all_reduce], ids=lambda f: f.__name__)
def test_public_ops_list_the_forward_mode_type_error_under_raises(fn):
  doc = fn.__doc__
  raises = doc.split("\n  Raises:\n")[1].split("\n\n")[0]
  assert re.search(r"^    TypeError:.*forward-mode", raises, flags=re.M | re.S), raises
  assert "Forward-mode differentiation (" not in doc  # not a paragraph of its own


@pytest.mark.parametrize("op", ["all_reduce", "all_gather_matmul"])
def test_forward_mode_raises_the_documented_type_error(op):
  fn = (lambda x: collectives.all_reduce(x, "tp")) if op == "all_reduce" else (
      lambda x: overlap.all_gather_matmul(x, jnp.ones((4, 2), F32), "tp", backend="xla"))
  f = jax.shard_map(fn, mesh=mesh4(), in_specs=P(), out_specs=P(), check_vma=False)
  x = jnp.ones((8, 4), F32)
  with pytest.raises(TypeError, match=f"{op}: forward-mode differentiation"):
    jax.jvp(f, (x,), (x,))  # eager: under jit JAX refuses first, without the name


@pytest.mark.parametrize("module", [
    "collectives", "dispatch", "names", "overlap", "reference", "nnx.config", "nnx.layers",
    "tuning.cluster", "tuning.cost_model"])
def test_public_module_examples_run(module):
  """Each public module's Example imports what it uses, runs, and prints what it says (8
  devices, conftest.py); trial 30: reference's, dispatch's and the NNX modules' used a mesh
  or names they never made or imported."""
  import doctest
  import importlib

  mod = importlib.import_module(f"jaxoverlap.{module}")
  test = doctest.DocTestParser().get_doctest(mod.__doc__, {}, module, None, 0)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  said = []
  result = runner.run(test, out=said.append)
  assert result.attempted >= 2 and result.failed == 0, "".join(said)


@pytest.mark.parametrize("op", names.OPS)
def test_names_list_transports_only_for_ops_that_take_the_keyword(op):
  """``names.transports(op)`` is the ``transport`` keyword's values: () where there is none."""
  takes = "transport" in inspect.signature(getattr(jaxoverlap, op)).parameters
  assert bool(names.transports(op)) == takes, (op, names.transports(op))
