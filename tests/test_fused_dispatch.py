"""The fused ops' CUDA dispatch, checked on CPU by tracing (no kernel runs).

With the CUDA path made to look usable, each op must bind its FFI primitive
with an output of exactly the pure-JAX expression's type (shape, dtype and
varying axes), its gradient must bind the paired fused op, and every shape
the kernels do not take must raise (backend="cuda") or run the xla backend
and say so (backend="auto"). The kernels themselves are tested on GPUs by
tests/multiprocess/check_overlap.py.
"""

import logging
import re

import jax
import jax.extend
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from _helpers import make_mesh
from jaxoverlap import _cuda, _ffi, backend, overlap, reference

pytestmark = pytest.mark.skipif(_ffi.unavailable_reason() is not None,
                                reason="the CUDA extension is not built")

BF16 = jnp.bfloat16


@pytest.fixture
def cuda_usable(monkeypatch):
  monkeypatch.setattr(backend, "cuda_unavailable_reason", lambda op: None)


def _jaxpr(fn, x_shape, w_shape, dtype=BF16, in_specs=(P("tp"), P(None, "tp"))):
  mesh = make_mesh((4,), ("tp",))
  args = (jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(w_shape, dtype))
  f = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
  return jax.make_jaxpr(f)(*args)


def _inner(fn, x_shape, w_shape, dtype=BF16):
  """Per-rank output avals of fn and the names of the primitives it binds."""
  found = {}

  def body(x, w):
    out = fn(x, w)
    found["aval"] = jax.typeof(out)
    return jnp.zeros((), jnp.float32)

  mesh = make_mesh((4,), ("tp",))
  args = (jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(w_shape, dtype))
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=True)
  jaxpr = jax.make_jaxpr(f)(*args)
  return found["aval"], _primitives(jaxpr.jaxpr)


def _primitives(jaxpr) -> set[str]:
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


CASES = [
    # op, fused call, reference, x shape, w shape, primitive
    ("all_gather_matmul", lambda x, w: overlap.all_gather_matmul(x, w, "tp", backend="cuda"),
     lambda x, w: reference.all_gather_matmul(x, w, "tp"), (6, 32), (32, 24),
     "jaxoverlap_all_gather_matmul"),
    ("all_gather_matmul dim 1",
     lambda x, w: overlap.all_gather_matmul(x, w, "tp", gather_dimension=1, backend="cuda"),
     lambda x, w: reference.all_gather_matmul(x, w, "tp", gather_dimension=1), (2, 3, 5, 32),
     (32, 24), "jaxoverlap_all_gather_matmul"),
    ("matmul_reduce_scatter",
     lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp", backend="cuda"),
     lambda x, w: reference.matmul_reduce_scatter(x, w, "tp"), (8, 32), (32, 24),
     "jaxoverlap_matmul_reduce_scatter"),
    ("matmul_reduce_scatter dim 1",
     lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=1, backend="cuda"),
     lambda x, w: reference.matmul_reduce_scatter(x, w, "tp", scatter_dimension=1),
     (3, 12, 32), (32, 24), "jaxoverlap_matmul_reduce_scatter"),
    ("matmul_all_reduce",
     lambda x, w: overlap.matmul_all_reduce(x, w, "tp", backend="cuda", algorithm="nvshmem"),
     lambda x, w: reference.matmul_all_reduce(x, w, "tp"), (8, 32), (32, 24),
     "jaxoverlap_matmul_all_reduce"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_primitive_has_the_reference_type(cuda_usable, case):
  _, fused, ref, x_shape, w_shape, prim = case
  got, prims = _inner(fused, x_shape, w_shape)
  want, _ = _inner(ref, x_shape, w_shape)
  assert prim in prims
  assert got.shape == want.shape and got.dtype == want.dtype
  assert got.manual_axis_type.varying == want.manual_axis_type.varying, (got, want)


@pytest.mark.parametrize("op,fwd,bwd,specs", [
    ("all_gather_matmul", "jaxoverlap_all_gather_matmul", "jaxoverlap_matmul_reduce_scatter",
     (P("tp"), P(None, "tp"))),
    ("matmul_reduce_scatter", "jaxoverlap_matmul_reduce_scatter",
     "jaxoverlap_all_gather_matmul", (P(None, "tp"), P("tp", None))),
])
def test_gradient_binds_the_paired_fused_op(cuda_usable, op, fwd, bwd, specs):
  fn = getattr(overlap, op)

  def loss(x, w):
    return jnp.sum(fn(x, w, "tp", backend="cuda").astype(jnp.float32))

  def body(x, w):
    return jax.grad(loss, argnums=(0, 1))(x, w)

  mesh = make_mesh((4,), ("tp",))
  args = (jax.ShapeDtypeStruct((8, 32), BF16), jax.ShapeDtypeStruct((32, 16), BF16))
  f = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs)
  prims = _primitives(jax.make_jaxpr(f)(*args).jaxpr)
  assert {fwd, bwd} <= prims


def test_scatter_last_dimension_is_refused_by_cuda(cuda_usable):
  with pytest.raises(ValueError, match=re.escape(
      "matmul_reduce_scatter: the CUDA kernel does not take this call: it scatters any output "
      "dimension but the last (scatter_dimension=-1 is the last); use backend='xla'")):
    _inner(lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp", scatter_dimension=-1,
                                                      backend="cuda"), (8, 32), (32, 24))


def test_scatter_last_dimension_auto_runs_xla_and_says_so(cuda_usable, caplog):
  with caplog.at_level(logging.INFO, logger="jaxoverlap"):
    aval, prims = _inner(lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp",
                                                                    scatter_dimension=1),
                         (8, 32), (32, 24))
  assert aval.shape == (8, 6)
  assert not any(p.startswith("jaxoverlap") for p in prims)
  assert "runs on backend 'xla' (auto)" in caplog.text


def test_all_reduce_rows_not_divisible(cuda_usable):
  with pytest.raises(ValueError, match=re.escape(
      "matmul_all_reduce: algorithm='copy_engine' needs the rows of x (all leading "
      "dimensions, 6) to divide by the size 4 of axis 'tp'")):
    _inner(lambda x, w: overlap.matmul_all_reduce(x, w, "tp", algorithm="copy_engine"),
           (6, 32), (32, 24))
  _, prims = _inner(lambda x, w: overlap.matmul_all_reduce(x, w, "tp", backend="cuda"),
                    (6, 32), (32, 24))
  assert "jaxoverlap_all_reduce" in prims and "jaxoverlap_matmul_all_reduce" not in prims


def test_all_reduce_auto_uses_gemm_then_all_reduce_for_small_outputs(cuda_usable):
  _, prims = _inner(lambda x, w: overlap.matmul_all_reduce(x, w, "tp", backend="cuda"),
                    (8, 32), (32, 24))
  assert "jaxoverlap_all_reduce" in prims
  last = _cuda.fused_decisions[-1]
  assert last["algorithm"] == "gemm_all_reduce" and "under" in last["why"]
  rows = _cuda.FUSED_ALL_REDUCE_MIN_BYTES // (2 * 256)
  _, prims = _inner(lambda x, w: overlap.matmul_all_reduce(x, w, "tp", backend="cuda"),
                    (rows, 32), (32, 256))
  assert "jaxoverlap_matmul_all_reduce" in prims


@pytest.mark.parametrize("chunks", [0, 33, True, 1.5, "2"])
def test_bad_chunks(chunks):
  with pytest.raises(ValueError, match=re.escape(
      f"all_gather_matmul: chunks must be None or an int in 1..32, got {chunks!r}")):
    _inner(lambda x, w: overlap.all_gather_matmul(x, w, "tp", chunks=chunks), (8, 32), (32, 24))


def test_chunks_refused_with_gemm_all_reduce(cuda_usable):
  with pytest.raises(ValueError, match=re.escape(
      "matmul_all_reduce: chunks=2 applies to the fused algorithms, not to 'gemm_all_reduce'")):
    _inner(lambda x, w: overlap.matmul_all_reduce(x, w, "tp", algorithm="gemm_all_reduce",
                                                  chunks=2), (8, 32), (32, 24))


def test_cpu_reason_says_there_is_no_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("CPU-only check")
  reason = backend.cuda_unavailable_reason("all_gather_matmul")
  assert reason == ("JAX runs on 'cpu' here, with no GPU: the CUDA backend needs NVIDIA GPUs "
                    "(backend 'xla' runs everywhere)")


def test_chunks_refused_on_xla():
  with pytest.raises(ValueError, match=re.escape(
      "matmul_reduce_scatter: chunks=2 applies to backend 'cuda' only")):
    _inner(lambda x, w: overlap.matmul_reduce_scatter(x, w, "tp", backend="xla", chunks=2),
           (8, 32), (32, 24))


def test_cuda_algorithm_names_on_xla():
  with pytest.raises(ValueError, match=re.escape(
      "all_gather_matmul: algorithm='nvshmem' is not available with backend='xla'")):
    _inner(lambda x, w: overlap.all_gather_matmul(x, w, "tp", backend="xla",
                                                  algorithm="nvshmem"), (8, 32), (32, 24))


def test_auto_chunks():
  mib = 1 << 20
  ag = "all_gather_matmul"
  # AG: one chunk while the local shard GEMM takes much longer than the shard's
  # transfer (8192x4096x14336 on 2 ranks: 32 MiB shard, ratio 0.27) ...
  assert _cuda.auto_chunks(ag, 32 * mib, 4096, 2.0 * 4096 * 4096 * 7168) == 1
  # ... two from about half (16384x4096x8192: ratio 0.47) through parity
  # (16384x4096x4096: 0.93) to a transfer twice the GEMM (16384x4096x2048) ...
  for n_local in (4096, 2048, 1024, 64):
    assert _cuda.auto_chunks(ag, 64 * mib, 8192, 2.0 * 8192 * 4096 * n_local) == 2
  assert _cuda.auto_chunks(ag, 64 * mib, 1, 2.0 * 8192 * 4096 * 64) == 1  # at most the rows
  for op in ("matmul_reduce_scatter", "matmul_all_reduce"):
    assert _cuda.auto_chunks(op, 512 * 1024, 4096, 1e9) == 1
    assert _cuda.auto_chunks(op, 8 * mib - 1, 4096, 1e9) == 1
    assert _cuda.auto_chunks(op, 8 * mib, 4096, 1e9) == 2
    assert _cuda.auto_chunks(op, 224 * mib, 4096, 1e9) == 2
    assert _cuda.auto_chunks(op, 224 * mib, 1, 1e9) == 1  # never more chunks than rows
