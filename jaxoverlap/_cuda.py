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
import os

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


# ----------------------------------------------------------------------------
# Fused compute-communication ops (ffi/overlap/overlap.cu)

# Ids shared with ffi/include/jaxoverlap/overlap.h (enum Transport) and gemm.h
# (enum Precision).
_TRANSPORT_IDS = {"copy_engine": 0, "nvshmem": 1}
FUSED_TRANSPORTS = tuple(_TRANSPORT_IDS)
# What algorithm="auto" uses for the fused ops (measured: NOTES.md).
DEFAULT_TRANSPORT = "copy_engine"
# matmul_all_reduce(algorithm="auto") takes the fused kernel from this output
# size per rank (bytes) on; below it the GEMM then jaxoverlap.all_reduce.
# Calibrated on 2x H200 (benchmarks/results/fused_calibration-*.json, three
# runs): the fused kernel lost by 37-78 us at 1-8 MiB (its two dependent
# transfers and their flag waits; NOTES.md), tied at 16 MiB (medians 1% apart;
# single runs from 10% faster to 15% slower), and won by 10-29% at every
# measured size from 32 MiB.
FUSED_ALL_REDUCE_MIN_BYTES = 32 << 20
MAX_CHUNKS = 32  # kMaxChunks in runtime.h

# What the lowering chose for each fused call site, newest last.
fused_decisions: list[dict] = []

# Auto chunking, calibrated on 2x H200 by three chunk sweeps (1, 2, 3, 4, 8
# chunks over 27 shapes; every configuration's median over its measurements;
# benchmarks/calibrate_fused.py, NOTES.md "fused calibration"). No shape ran
# more than 2.7% faster with more than two chunks, so auto uses one or two:
# * all_gather_matmul: ratio = the shard's transfer time over the local
#   shard's GEMM time (estimated with the rates below). Up to
#   _AG_ONE_CHUNK_RATIO that GEMM hides the transfer whole and cutting the
#   GEMM only costs: one chunk (ratios 0.14 and 0.27: two chunks 1-5% slower
#   on four shapes, 1.5% faster on one).
#   From 0.47 on the transfer, slowed by the GEMM beside it, is exposed and
#   two chunks win: 6% at 0.47, 3.5% at 0.63, 9-15% at 0.95, 10% at 1.90
#   (larger ratios were not measured).
# * matmul_reduce_scatter / matmul_all_reduce: this rank's block GEMM adds the
#   partial of rank r-1 chunk by chunk, so that partial must arrive in chunks
#   ahead of it, but each chunk adds a dependent transfer: one chunk for blocks
#   under _RS_TWO_CHUNK_BYTES (two cost 9-63% at 0.5-4 MiB), two from there
#   (8-224 MiB: the best count or within 1.1% of it).
_LINK_BYTES_PER_S = 350e9    # one copy-engine stream over NV18 (a 64 MiB shard hid in 185 us)
_GEMM_FLOPS_PER_S = 680e12   # bf16 GEMM on one H200 (the sweeps' local GEMMs: median 692 TF/s)
_AG_ONE_CHUNK_RATIO = 0.4    # t_comm / t_gemm up to which AG sends its shard whole
_RS_TWO_CHUNK_BYTES = 8 << 20


def auto_chunks(op: str, payload_bytes: int, rows: int, gemm_flops: float) -> int:
  """Chunks per shard transfer chosen from the shapes (see the rules above).

  Args:
    op: "all_gather_matmul", "matmul_reduce_scatter" or "matmul_all_reduce".
    payload_bytes: bytes of one shard (AG) or one partial block (RS, AR).
    rows: pieces the shard or block can be cut into (its rows; all_gather_matmul
      with batch dims: the batch entries); chunks never exceed them.
    gemm_flops: flops of the GEMM that the first transfer overlaps (AG: the
      local shard's).
  """
  if op == "all_gather_matmul":
    ratio = (payload_bytes / _LINK_BYTES_PER_S) / max(gemm_flops / _GEMM_FLOPS_PER_S, 1e-12)
    chunks = 1 if ratio <= _AG_ONE_CHUNK_RATIO else 2
  else:
    chunks = 1 if payload_bytes < _RS_TWO_CHUNK_BYTES else 2
  return int(max(1, min(rows, chunks)))


def record_fused_decision(op: str, axis_name, algorithm: str, why: str) -> None:
  """Keeps a trace-time choice of a fused op in ``fused_decisions`` (runtime_info)."""
  fused_decisions.append({"op": op, "axis_name": axis_name, "algorithm": algorithm,
                          "source": "auto", "why": why})
  del fused_decisions[:-_MAX_DECISIONS]


def _precision_id() -> int:
  """gemm::Precision for float32 GEMMs, from JAX's matmul precision setting."""
  p = jax.config.jax_default_matmul_precision
  return 1 if str(p).lower() in ("highest", "float32", "precision.highest") else 0


def _fused_lowering(target, op, ctx, x, w, *, axis_name, transport, chunks, shape_attrs,
                    payload_bytes, chunk_units, chunk_bytes, gemm_flops):
  mesh = _concrete_mesh(ctx, op)
  groups = runtime.groups_along_axis(mesh, axis_name)
  info = runtime.runtime_info()
  rpn = info["ranks_per_node"]
  mine = next(g for g in groups if info["pe"] in g)
  if len(mine) > info["max_group_size"]:
    raise ValueError(
        f"{op} with backend='cuda' supports groups of at most {info['max_group_size']} ranks; "
        f"the group over {axis_name!r} has {len(mine)}; use backend='xla'")
  if len({pe // rpn for pe in mine}) > 1:
    raise ValueError(
        f"{op} with backend='cuda' runs within one node, but the group over {axis_name!r} "
        f"(PEs {mine}) spans nodes (ranks_per_node={rpn}); use backend='xla' or put the "
        "tensor-parallel axis within a node")
  slot = info["overlap_slot_bytes"]
  if payload_bytes > slot:
    raise ValueError(
        f"{op}: this call needs {payload_bytes} bytes of fused-op slot per sender, but "
        f"the slot has {slot} bytes; raise overlap_heap_bytes in jaxoverlap.initialize() "
        f"(or JAXOVERLAP_OVERLAP_HEAP_BYTES), or run with more ranks")
  source = "requested"
  if chunks is None:
    chunks, source = auto_chunks(op, chunk_bytes, chunk_units, gemm_flops), "auto"
  elif chunks > chunk_units:
    source = f"requested {chunks}, at most {chunk_units} pieces"
    chunks = chunk_units
  fused_decisions.append({"op": op, "axis_name": axis_name, "algorithm": transport,
                          "transport": transport,
                          "chunks": chunks, "chunks_source": source,
                          "shape": {k: int(v) for k, v in shape_attrs.items()},
                          "dtype": ctx.avals_in[0].dtype.name})
  del fused_decisions[:-_MAX_DECISIONS]
  logger.info("jaxoverlap: %s over %r: transport %s, %d chunks (%s), %s", op, axis_name,
              transport, chunks, source, shape_attrs)
  if os.environ.get("JAXOVERLAP_FUSED_CMD_BUFFER") == "1":
    # The handler variant with XLA's command-buffer trait: XLA may record the
    # call into its CUDA graphs. Opt-in: it failed under jax.profiler tracing
    # (ffi/overlap/overlap_ffi.cc, NOTES.md "CUDA graphs").
    target += "_cmdbuf"
  fused_decisions[-1]["target"] = target
  rule = jax.ffi.ffi_lowering(target)
  return rule(
      ctx, x, w,
      groups=np.asarray(groups, dtype=np.int64).reshape(-1),
      group_size=np.int64(len(groups[0])),
      transport=np.int64(_TRANSPORT_IDS[transport]),
      chunks=np.int64(chunks),
      precision=np.int64(_precision_id()),
      **{k: np.int64(v) for k, v in shape_attrs.items()},
  )


def _axes(axis_name) -> set:
  return set(axis_name) if isinstance(axis_name, tuple) else {axis_name}


def _with_vma(aval, shape, vma):
  out = aval.update(shape=shape)
  mat = out.manual_axis_type
  return out.update_manual_axis_type(mat.update(varying=frozenset(vma)))


def _same_vma(x, w, axis_name):
  """Casts x and w to varying over the union of their axes and ``axis_name``."""
  vma = _xla.varying_axes(x) | _xla.varying_axes(w) | _axes(axis_name)
  return _xla.cast_to_vma(x, vma), _xla.cast_to_vma(w, vma)


# all_gather_matmul ----------------------------------------------------------

_ag_matmul_p = Primitive("jaxoverlap_all_gather_matmul")
_ag_matmul_p.multiple_results = True


def _ag_shapes(x_shape, n, dim, num_ranks):
  out = list(x_shape)
  out[dim] *= num_ranks
  gathered = tuple(out)
  out[-1] = n
  return tuple(out), gathered


def _ag_abstract_eval(x, w, *, axis_name, dim, num_ranks, transport, chunks, gathered):
  del transport, chunks
  out_shape, g_shape = _ag_shapes(x.shape, w.shape[1], dim, num_ranks)
  vma = frozenset(x.manual_axis_type.varying)
  outs = [_with_vma(x, out_shape, vma)]
  if gathered:
    outs.append(_with_vma(x, g_shape, vma))
  return outs


def _ag_lowering(ctx, x, w, *, axis_name, dim, num_ranks, transport, chunks, gathered):
  shape = ctx.avals_in[0].shape
  outer = int(np.prod(shape[:dim], dtype=np.int64))
  rows = int(np.prod(shape[dim:-1], dtype=np.int64))
  k, n = int(shape[-1]), int(ctx.avals_in[1].shape[1])
  itemsize = ctx.avals_in[0].dtype.itemsize
  target = ("jaxoverlap_all_gather_matmul_gathered" if gathered
            else "jaxoverlap_all_gather_matmul")
  return _fused_lowering(target, "all_gather_matmul", ctx, x, w, axis_name=axis_name,
                         transport=transport, chunks=chunks,
                         shape_attrs={"outer": outer, "rows": rows, "k": k, "n": n},
                         # Chunks cut the shard's rows, or whole batch entries where it
                         # has batch dims (each chunk one contiguous, graph-updatable copy).
                         payload_bytes=outer * rows * k * itemsize,
                         chunk_units=outer if outer > 1 else rows,
                         chunk_bytes=outer * rows * k * itemsize,
                         gemm_flops=2.0 * outer * rows * k * n)


_ag_matmul_p.def_abstract_eval(_ag_abstract_eval)
mlir.register_lowering(_ag_matmul_p, _ag_lowering, platform="cuda")


def all_gather_matmul(x, w, axis_name, gather_dimension: int, transport: str,
                      chunks: int | None, gathered: bool):
  """The fused AllGather+GEMM kernel: ``(AG(x) @ w, AG(x) or None)``.

  ``gather_dimension`` must not be x's last dimension (checked by the caller).
  """
  _registered()
  num_ranks = int(jax.lax.axis_size(axis_name))
  x, w = _same_vma(x, w, axis_name)
  outs = _ag_matmul_p.bind(x, w, axis_name=axis_name, dim=gather_dimension,
                           num_ranks=num_ranks, transport=transport, chunks=chunks,
                           gathered=gathered)
  return outs[0], (outs[1] if gathered else None)


# matmul_reduce_scatter ------------------------------------------------------

_matmul_rs_p = Primitive("jaxoverlap_matmul_reduce_scatter")


def _rs_abstract_eval(x, w, *, axis_name, dim, num_ranks, transport, chunks):
  del axis_name, transport, chunks
  out = list(x.shape[:-1]) + [w.shape[1]]
  out[dim] //= num_ranks
  return _with_vma(x, tuple(out), x.manual_axis_type.varying)


def _rs_lowering(ctx, x, w, *, axis_name, dim, num_ranks, transport, chunks):
  shape = ctx.avals_in[0].shape
  outer = int(np.prod(shape[:dim], dtype=np.int64))
  rows = int(np.prod(shape[dim:-1], dtype=np.int64)) // num_ranks
  k, n = int(shape[-1]), int(ctx.avals_in[1].shape[1])
  itemsize = ctx.avals_in[0].dtype.itemsize
  return _fused_lowering("jaxoverlap_matmul_reduce_scatter", "matmul_reduce_scatter", ctx, x, w,
                         axis_name=axis_name, transport=transport, chunks=chunks,
                         shape_attrs={"outer": outer, "rows": rows, "k": k, "n": n},
                         payload_bytes=outer * rows * n * itemsize, chunk_units=rows,
                         chunk_bytes=outer * rows * n * itemsize,
                         gemm_flops=2.0 * outer * rows * k * n)


_matmul_rs_p.def_abstract_eval(_rs_abstract_eval)
mlir.register_lowering(_matmul_rs_p, _rs_lowering, platform="cuda")


def matmul_reduce_scatter(x, w, axis_name, scatter_dimension: int, transport: str,
                          chunks: int | None):
  """The fused GEMM+ReduceScatter kernel; ``scatter_dimension`` is not the last."""
  _registered()
  num_ranks = int(jax.lax.axis_size(axis_name))
  x, w = _same_vma(x, w, axis_name)
  return _matmul_rs_p.bind(x, w, axis_name=axis_name, dim=scatter_dimension,
                           num_ranks=num_ranks, transport=transport, chunks=chunks)


# matmul_all_reduce ----------------------------------------------------------

_matmul_ar_p = Primitive("jaxoverlap_matmul_all_reduce")


def _ar_abstract_eval(x, w, *, axis_name, num_ranks, transport, chunks):
  del num_ranks, transport, chunks
  out = tuple(x.shape[:-1]) + (w.shape[1],)
  return _with_vma(x, out, frozenset(x.manual_axis_type.varying) - _axes(axis_name))


def _ar_lowering(ctx, x, w, *, axis_name, num_ranks, transport, chunks):
  shape = ctx.avals_in[0].shape
  rows = int(np.prod(shape[:-1], dtype=np.int64)) // num_ranks
  k, n = int(shape[-1]), int(ctx.avals_in[1].shape[1])
  itemsize = ctx.avals_in[0].dtype.itemsize
  block = rows * n * itemsize
  return _fused_lowering("jaxoverlap_matmul_all_reduce", "matmul_all_reduce", ctx, x, w,
                         axis_name=axis_name, transport=transport, chunks=chunks,
                         shape_attrs={"rows": rows, "k": k, "n": n},
                         payload_bytes=2 * (-(-block // 256) * 256), chunk_units=rows,
                         chunk_bytes=block, gemm_flops=2.0 * rows * k * n)


_matmul_ar_p.def_abstract_eval(_ar_abstract_eval)
mlir.register_lowering(_matmul_ar_p, _ar_lowering, platform="cuda")


def matmul_all_reduce(x, w, axis_name, transport: str, chunks: int | None):
  """The fused GEMM+AllReduce kernel; x's rows must divide by the axis size."""
  _registered()
  num_ranks = int(jax.lax.axis_size(axis_name))
  x, w = _same_vma(x, w, axis_name)
  return _matmul_ar_p.bind(x, w, axis_name=axis_name, num_ranks=num_ranks,
                           transport=transport, chunks=chunks)
