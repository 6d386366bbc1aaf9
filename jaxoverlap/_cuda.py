"""The CUDA backend's primitives: FFI custom calls lowered with the mesh's PE groups.

Inside ``shard_map`` a kernel sees only its own shard; which PEs share its
collective depends on the mesh, which JAX knows only at lowering time. So each
op is a JAX primitive whose lowering rule reads the concrete mesh from the
lowering context, turns the axis into PE groups (like an HLO
``replica_groups``), and emits the FFI custom call with them as attributes.
The handler finds its own PE among the groups.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxoverlap import _ffi, _xla, runtime

__all__ = ["all_reduce", "ALL_REDUCE_ALGORITHMS"]

# Algorithm ids shared with ffi/include/jaxoverlap/all_reduce.h (enum Algorithm).
_ALL_REDUCE_IDS = {"one_shot": 1}
ALL_REDUCE_ALGORITHMS = ("auto", "one_shot", "two_shot", "hierarchical")
_NOT_BUILT = ("two_shot", "hierarchical")


def _concrete_mesh(ctx, op: str):
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  if mesh is None or not hasattr(mesh, "devices"):
    raise ValueError(
        f"{op} with backend='cuda' must run inside jax.shard_map over a concrete "
        "jax.sharding.Mesh (the PE groups come from the mesh's devices)")
  return mesh


_all_reduce_p = Primitive("jaxoverlap_all_reduce")


def _all_reduce_abstract_eval(x, *, axis_name, algorithm):
  del algorithm
  # Like psum: the result is the same on every rank of the axis.
  mat = x.manual_axis_type
  return x.update_manual_axis_type(mat.update(varying=frozenset(mat.varying) - {axis_name}))


def _all_reduce_lowering(ctx, x, *, axis_name, algorithm):
  mesh = _concrete_mesh(ctx, "all_reduce")
  groups = runtime.groups_along_axis(mesh, axis_name)
  rule = jax.ffi.ffi_lowering("jaxoverlap_all_reduce")
  return rule(
      ctx,
      x,
      groups=np.asarray(groups, dtype=np.int64).reshape(-1),
      group_size=np.int64(len(groups[0])),
      algorithm=np.int64(_ALL_REDUCE_IDS[algorithm]),
  )


_all_reduce_p.def_abstract_eval(_all_reduce_abstract_eval)
mlir.register_lowering(_all_reduce_p, _all_reduce_lowering, platform="cuda")


@functools.cache
def _registered() -> bool:
  _ffi.load()
  return True


def resolve_all_reduce_algorithm(algorithm: str) -> str:
  """Maps ``algorithm`` to a kernel this build has.

  Raises:
    ValueError: unknown algorithm, or one this build does not have yet.
  """
  if algorithm not in ALL_REDUCE_ALGORITHMS:
    raise ValueError(
        f"all_reduce: algorithm {algorithm!r} is not a cuda algorithm; "
        f"expected one of {ALL_REDUCE_ALGORITHMS}")
  if algorithm in _NOT_BUILT:
    raise ValueError(
        f"all_reduce: algorithm {algorithm!r} is not available in this build "
        f"(available: {sorted(_ALL_REDUCE_IDS)})")
  return "one_shot" if algorithm == "auto" else algorithm


def all_reduce(x: jax.Array, axis_name: str, *, algorithm: str = "auto") -> jax.Array:
  """Sum of ``x`` over ``axis_name`` by the CUDA kernels (call inside shard_map).

  Args:
    x: per-rank array, float32/bfloat16/float16, any shape.
    axis_name: the shard_map mesh axis to reduce over.
    algorithm: "auto" or "one_shot".

  Returns:
    An array like ``x``, equal to ``lax.psum(x, axis_name)`` up to fp32
    summation order, bit-identical on every rank.
  """
  algorithm = resolve_all_reduce_algorithm(algorithm)
  _registered()
  # psum of a value that is the same on every rank is num_ranks * x.
  x = _xla.to_varying(x, axis_name)
  return _all_reduce_p.bind(x, axis_name=axis_name, algorithm=algorithm)
