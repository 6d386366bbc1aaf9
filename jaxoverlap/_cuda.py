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
import logging

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxoverlap import _ffi, _xla, runtime

__all__ = ["all_reduce", "ALL_REDUCE_ALGORITHMS"]

logger = logging.getLogger("jaxoverlap")

# Ids shared with ffi/include/jaxoverlap/all_reduce.h (enums Algorithm, Protocol).
_ALGORITHM_IDS = {"one_shot": 1, "two_shot": 2, "hierarchical": 3}
_PROTOCOL_IDS = {"auto": 0, "ll": 1, "simple": 2}
ALL_REDUCE_ALGORITHMS = (
    "auto",
    "one_shot",
    "one_shot_ll",
    "one_shot_simple",
    "two_shot",
    "hierarchical",
    "hierarchical_ll",
    "hierarchical_simple",
)

# What the lowering chose for each all_reduce call site, newest last (for
# runtime_info(): no silent choice); the last _MAX_DECISIONS are kept.
decisions: list[dict] = []
_MAX_DECISIONS = 1000


def _split(algorithm: str) -> tuple[str, str]:
  for proto in ("_ll", "_simple"):
    if algorithm.endswith(proto):
      return algorithm[: -len(proto)], proto[1:]
  return algorithm, "auto"


def group_topology(groups: list[list[int]], my_pe: int, ranks_per_node: int) -> tuple[int, int]:
  """(ranks of the group per node, nodes of the group) for the group holding my_pe."""
  group = next((g for g in groups if my_pe in g), groups[0])
  nodes = {pe // ranks_per_node for pe in group}
  return len(group) // len(nodes), len(nodes)


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
  axes = set(axis_name) if isinstance(axis_name, tuple) else {axis_name}
  return x.update_manual_axis_type(mat.update(varying=frozenset(mat.varying) - axes))


def _all_reduce_lowering(ctx, x, *, axis_name, algorithm):
  mesh = _concrete_mesh(ctx, "all_reduce")
  groups = runtime.groups_along_axis(mesh, axis_name)
  info = runtime.runtime_info()
  local_size, num_nodes = group_topology(groups, info["pe"], info["ranks_per_node"])
  aval = ctx.avals_in[0]
  nbytes = int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize
  name, protocol = _split(algorithm)
  source = "requested"
  if name == "auto":
    choice = runtime.tuning_policy().choose(nbytes, aval.dtype.itemsize, local_size, num_nodes)
    name, protocol, source = choice.algorithm, choice.protocol or "auto", choice.source
  if name in ("one_shot", "two_shot") and num_nodes > 1:
    raise ValueError(
        f"all_reduce: algorithm {name!r} needs the whole group on one node, but the group over "
        f"{axis_name!r} spans {num_nodes} nodes (ranks_per_node={info['ranks_per_node']}); use "
        "'hierarchical' or 'auto'")
  decisions.append({
      "axis_name": axis_name, "bytes": nbytes, "dtype": aval.dtype.name,
      "ranks_per_node": local_size, "num_nodes": num_nodes,
      "algorithm": name, "protocol": protocol, "source": source,
  })
  del decisions[:-_MAX_DECISIONS]
  logger.info("jaxoverlap: all_reduce of %d bytes over %r (%d nodes x %d ranks): %s/%s (%s)",
              nbytes, axis_name, num_nodes, local_size, name, protocol, source)
  if name == "psum":
    # Hand over to XLA (NCCL) where it is faster: the policy says so, explicitly.
    return mlir.lower_fun(functools.partial(jax.lax.psum, axis_name=axis_name),
                          multiple_results=False)(ctx, x)
  rule = jax.ffi.ffi_lowering("jaxoverlap_all_reduce")
  return rule(
      ctx,
      x,
      groups=np.asarray(groups, dtype=np.int64).reshape(-1),
      group_size=np.int64(len(groups[0])),
      algorithm=np.int64(_ALGORITHM_IDS[name]),
      protocol=np.int64(_PROTOCOL_IDS[protocol]),
  )


_all_reduce_p.def_abstract_eval(_all_reduce_abstract_eval)
mlir.register_lowering(_all_reduce_p, _all_reduce_lowering, platform="cuda")


@functools.cache
def _registered() -> bool:
  _ffi.load()
  return True


def check_all_reduce_algorithm(algorithm: str) -> str:
  """Validates a cuda all_reduce algorithm name.

  Raises:
    ValueError: unknown algorithm.
  """
  if algorithm not in ALL_REDUCE_ALGORITHMS:
    raise ValueError(
        f"all_reduce: algorithm {algorithm!r} is not a cuda algorithm; "
        f"expected one of {ALL_REDUCE_ALGORITHMS}")
  return algorithm


def all_reduce(x: jax.Array, axis_name: str, *, algorithm: str = "auto") -> jax.Array:
  """Sum of ``x`` over ``axis_name`` by the CUDA kernels (call inside shard_map).

  Args:
    x: per-rank array, float32/bfloat16/float16, any shape.
    axis_name: the shard_map mesh axis to reduce over.
    algorithm: one of ``ALL_REDUCE_ALGORITHMS``. "auto" asks the tuning
      policy (measured table, else cost model) at lowering time, which may
      hand over to ``lax.psum`` where NCCL is faster; the choice is logged and
      kept in ``jaxoverlap._cuda.decisions``.

  Returns:
    An array like ``x``, equal to ``lax.psum(x, axis_name)`` up to fp32
    summation order, bit-identical on every rank.
  """
  algorithm = check_all_reduce_algorithm(algorithm)
  _registered()
  # psum of a value that is the same on every rank is num_ranks * x.
  x = _xla.to_varying(x, axis_name)
  return _all_reduce_p.bind(x, axis_name=axis_name, algorithm=algorithm)


def launch_floor(x: jax.Array) -> jax.Array:
  """A custom call that copies ``x`` with one kernel and no communication.

  A benchmark aid: timed in the same chain as the all-reduces, it is the cost
  any single-kernel FFI call pays inside XLA.
  """
  _registered()
  return jax.ffi.ffi_call("jaxoverlap_launch_floor", jax.typeof(x))(x)
