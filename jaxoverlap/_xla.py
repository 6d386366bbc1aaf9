"""The "xla" backend: every public op in pure JAX, as one of two algorithms.

Problem:
  The ops must run everywhere (CPU, GPU without the CUDA extension, under
  ``jit`` and ``shard_map``) and give the CUDA kernels a baseline. XLA runs a
  collective next to a GEMM one after the other, so the communication is
  exposed.

Algorithm:
  ``"collective"`` is the reference expression with float32 accumulation: the
  ``lax`` collective, then (or before) one GEMM. ``"ppermute"`` decomposes the
  collective into a ring of ``lax.ppermute`` steps (rank ``i`` sends to rank
  ``i + 1``) with one shard GEMM per step. A step's GEMM never depends on the
  transfer of the same step, so XLA may run them at the same time:

  * AllGather+GEMM: each rank multiplies its own shard first, then each shard
    as it arrives from the left (ranks ``r - 1, r - 2, ...``), writing every
    product straight into its rows of the output.
  * GEMM+ReduceScatter: the accumulator for output block ``d`` starts on rank
    ``d + 1`` and travels right; each rank adds its partial product to the
    accumulator it receives and passes it on. A rank therefore computes the
    blocks of the other ranks first and its own block last, while the last
    transfer is in flight (CommFuse's rank-adaptive order).
  * GEMM+AllReduce: the GEMM+ReduceScatter ring over the rows of ``x @ w``
    (or its columns, or zero-padded rows when neither divides), then
    ``lax.all_gather(..., to="invarying")``, so that the result has the type
    of ``psum`` (invariant over the axis).
  * AllReduce: flatten, zero-pad to a multiple of the number of ranks, ring
    reduce-scatter by ``ppermute``, then ``lax.all_gather(...,
    to="invarying")`` as above, so that the ring returns psum's type too.

  Types: each function returns what its ``lax`` expression types, psum's
  invariance included. The primitives' lowerings (``jaxoverlap._primitives``,
  via ``mlir.lower_fun``) take the output type from the primitive's abstract
  evaluation, so there a mistyped result would pass unnoticed; but the JVP
  rules call these functions (with "collective") outside any lowering, and the
  tests compare the types of both algorithms, so keep them right.

  The ops branch on the two names alone (``_ring``) and raise on any other: an
  algorithm added to ``names`` needs its own branch here.

  Accumulators travel in float32 and round to the input dtype once, at the
  end: for bfloat16 and float16 inputs the ring sends twice the bytes of
  ``psum_scatter``, but its result is no less accurate than XLA's collective
  (which rounds at every step), an fp16 partial sum that leaves fp16's range
  half-way does not overflow, and every rank rounds the same fp32 sum.

  A tuple ``axis_name`` may name the mesh axes in any order: the ring follows
  ``lax.axis_index(axis_name)`` (ranks numbered in the order given), and each
  ``lax.ppermute`` names the axes in the mesh's order with the ring's
  permutation translated to it (``_send_right``).

Example:
  >>> y = all_gather_matmul(x, w, "tp", 0, "ppermute")[0]   # inside shard_map
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxoverlap import names

__all__ = [
    "matmul",
    "contract_leading",
    "varying_axes",
    "vma_checked",
    "to_varying",
    "cast_to_vma",
    "all_reduce",
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "rms_norm_tail",
    "rms_norm_vjp",
    "all_reduce_rms_norm",
]


# ----------------------------------------------------------------------------
# GEMMs


def matmul(x, w):
  """``x [..., k] @ w [k, n]`` accumulated and returned in float32."""
  return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=None,
                         preferred_element_type=jnp.float32)


def contract_leading(a, b):
  """``a [..., k]``, ``b [..., n]`` -> ``[k, n]`` in float32, summed over ``...``.

  This is the weight gradient ``x^T @ dy`` of ``y = x @ w`` for any number of
  leading (batch) dimensions.
  """
  lead = tuple(range(a.ndim - 1))
  return lax.dot_general(a, b, ((lead, lead), ((), ())), precision=None,
                         preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------
# Varying-manual-axes ("vma") types under shard_map(check_vma=True)


def varying_axes(x) -> frozenset:
  """The mesh axes over which ``x`` is typed varying (empty outside shard_map)."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)  # None: an aval of another kind
  return frozenset(mat.varying) if mat is not None else frozenset()


def vma_checked(axis_name) -> bool:
  """True inside ``shard_map(check_vma=True)`` over ``axis_name``.

  ``lax.axis_index`` is typed varying over its axis when types are checked,
  and has no varying axes when ``check_vma=False``. It is typed inside
  ``jax.eval_shape``, so the probe leaves no equation in the caller's jaxpr.
  """
  found = []
  jax.eval_shape(lambda: found.append(varying_axes(lax.axis_index(axis_name))))
  return set(names.axis_names(axis_name)) <= found[0]


def to_varying(x, axis_name):
  """Casts ``x`` to varying over ``axis_name`` where it is not yet (no data moves)."""
  missing = tuple(a for a in names.axis_names(axis_name) if a not in varying_axes(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def cast_to_vma(ct, vma: frozenset):
  """Gives the cotangent ``ct`` the varying axes ``vma`` of its primal input.

  An input typed invariant over an axis entered the forward through an
  implicit ``pvary``, whose transpose sums over that axis: the axes on which
  ``ct`` varies but the input did not are summed with ``psum``. Axes on which
  the input varies but ``ct`` does not are cast to varying (the transpose of a
  ``psum``). Under ``check_vma=False`` both sets are empty and this does
  nothing.
  """
  have = varying_axes(ct)
  extra = tuple(sorted(have - vma))
  if extra:
    ct = lax.psum(ct, extra)
  missing = tuple(sorted(vma - have))
  if missing:
    ct = lax.pcast(ct, missing, to="varying")
  return ct


# ----------------------------------------------------------------------------
# Ring helpers


def _mesh_axes() -> tuple[str, ...]:
  """The axis names of the mesh in scope, in the mesh's order (empty if none)."""
  mesh = jax.sharding.get_abstract_mesh()
  return tuple(getattr(mesh, "axis_names", ()) or ())


def _send_right(x, axis_name, num_ranks, mesh_axes=None):
  """Rank ``i`` sends ``x`` to rank ``(i + 1) % num_ranks``, ranks as ``lax.axis_index``.

  ``lax.ppermute`` takes a tuple of axes only in the mesh's order; for another
  order the ring's pairs are translated from the given order's numbering to
  the mesh order's. ``mesh_axes``: the mesh's axis names in order (default:
  the abstract mesh in scope).
  """
  pairs = [(i, (i + 1) % num_ranks) for i in range(num_ranks)]
  axes = names.axis_names(axis_name)
  if len(axes) > 1:
    order = tuple(mesh_axes) if mesh_axes else _mesh_axes()
    ordered = tuple(sorted(axes, key=lambda a: order.index(a) if a in order else len(order)))
    if ordered != axes:
      sizes = {a: int(lax.axis_size(a)) for a in axes}

      def renumber(i):  # position in `axes` numbering -> position in `ordered` numbering
        coord = {}
        for a in reversed(axes):
          i, coord[a] = divmod(i, sizes[a])
        out = 0
        for a in ordered:
          out = out * sizes[a] + coord[a]
        return out

      return lax.ppermute(x, ordered, [(renumber(s), renumber(d)) for s, d in pairs])
  return lax.ppermute(x, axis_name, pairs)


def _ring_reduce_scatter(partial, dtype, axis_name, num_ranks, mesh_axes=None):
  """Ring reduce-scatter of the blocks ``partial(d)``, ``d = 0..num_ranks-1``.

  ``partial(d)`` is this rank's float32 contribution to output block ``d``.
  At step ``t`` a rank holds the accumulator of block ``r - 1 - t``: it adds
  its own contribution and sends it right; after ``num_ranks - 1`` transfers
  rank ``r`` holds block ``r``, its own contribution added last. The
  accumulator travels in float32 and is rounded to ``dtype`` once.
  """
  r = lax.axis_index(axis_name)
  acc = partial((r - 1) % num_ranks).astype(jnp.float32)
  for t in range(1, num_ranks):
    acc = _send_right(acc, axis_name, num_ranks, mesh_axes) + partial((r - 1 - t) % num_ranks)
  return acc.astype(dtype)




# ----------------------------------------------------------------------------
# Ops. Arguments are validated and dimensions normalised by the callers.


# The algorithms the ops below branch on (every op both). Every dispatch.Plan on backend "xla"
# checks its algorithm against them when it is made, before it is logged, so decisions() never
# shows a program that cannot lower.
IMPLEMENTED = (names.COLLECTIVE, names.PPERMUTE)


def check_algorithm(op: str, algorithm: str) -> None:
  """Raises unless ``algorithm`` is one this module implements.

  Raises:
    ValueError: any name but those of ``IMPLEMENTED``. Each op below branches
      on these two names alone, so a name added to ``names`` without its own
      branch here would otherwise run the ring while the plan names it.
  """
  if algorithm not in IMPLEMENTED:
    raise ValueError(f"_xla.{op}: no branch for algorithm {algorithm!r}; the xla backend "
                     f"implements {IMPLEMENTED} (add one in jaxoverlap/_xla.py)")


def _ring(op: str, algorithm: str) -> bool:
  """Whether ``algorithm`` is the ring ("ppermute") rather than the collective (checked)."""
  check_algorithm(op, algorithm)
  return algorithm == names.PPERMUTE


def all_reduce(x, axis_name, algorithm: str, mesh_axes=None):
  """``psum(x)``; "ppermute": ring reduce-scatter of the flattened, padded x + all-gather."""
  if not _ring(names.ALL_REDUCE, algorithm) or x.size == 0:
    return lax.psum(x, axis_name)
  num_ranks = lax.axis_size(axis_name)
  x = to_varying(x, axis_name)
  size = x.size
  chunk = -(-size // num_ranks)
  flat = jnp.pad(x.reshape(-1), (0, num_ranks * chunk - size))
  chunks = flat.reshape(num_ranks, chunk)

  def partial(d):
    return lax.dynamic_index_in_dim(chunks, d, 0, keepdims=False).astype(jnp.float32)

  mine = _ring_reduce_scatter(partial, x.dtype, axis_name, num_ranks, mesh_axes)
  full = lax.all_gather(mine, axis_name, axis=0, tiled=True, to="invarying")
  return full[:size].reshape(x.shape)


def all_gather_matmul(x, w, axis_name, gather_dimension: int, algorithm: str, mesh_axes=None):
  """``(AG(x) @ w, AG(x))``, AG = tiled all-gather along ``gather_dimension``.

  ``gather_dimension`` may be x's last (contracted) dimension; then ``w`` has
  ``num_ranks * x.shape[-1]`` rows and the ring sums the shard products
  instead of placing them (used by matmul_reduce_scatter's backward pass when
  it scatters the last dimension).

  An empty shard (``x.shape[gather_dimension] == 0``) takes the ring path
  under "collective" too: XLA rejects an all-gather along an empty dimension.

  Returns:
    The product in x's dtype, and the gathered x (the backward's residual).
  """
  g = gather_dimension
  # XLA rejects an all-gather along an empty dimension; the ring moves nothing.
  if not _ring(names.ALL_GATHER_MATMUL, algorithm) and x.shape[g] != 0:
    xg = lax.all_gather(x, axis_name, axis=g, tiled=True)
    return matmul(xg, w).astype(x.dtype), xg
  num_ranks = lax.axis_size(axis_name)
  r = lax.axis_index(axis_name)
  x = to_varying(x, axis_name)
  m = x.shape[g]
  contracted = g == x.ndim - 1
  xg = jnp.zeros(x.shape[:g] + (num_ranks * m,) + x.shape[g + 1:], x.dtype)
  if contracted:
    acc = None
  else:
    out = jnp.zeros(xg.shape[:-1] + (w.shape[1],), x.dtype)
  shard = x
  for s in range(num_ranks):
    src = (r - s) % num_ranks  # the rank whose shard this rank holds at step s
    nxt = _send_right(shard, axis_name, num_ranks, mesh_axes) if s < num_ranks - 1 else None
    xg = lax.dynamic_update_slice_in_dim(xg, shard, src * m, axis=g)
    if contracted:
      part = matmul(shard, lax.dynamic_slice_in_dim(w, src * m, m, axis=0))
      acc = part if acc is None else acc + part
    else:
      out = lax.dynamic_update_slice_in_dim(out, matmul(shard, w).astype(x.dtype), src * m,
                                            axis=g)
    shard = nxt
  if contracted:
    out = acc.astype(x.dtype)
  return out, xg


def matmul_reduce_scatter(x, w, axis_name, scatter_dimension: int, algorithm: str,
                          mesh_axes=None):
  """``psum_scatter(x @ w)`` along ``scatter_dimension`` of the output.

  An empty scattered dimension takes the ring path under "collective" too:
  XLA rejects a reduce-scatter to an empty dimension.
  """
  s = scatter_dimension
  last = s == x.ndim - 1
  size = w.shape[1] if last else x.shape[s]
  if not _ring(names.MATMUL_REDUCE_SCATTER, algorithm) and size != 0:
    return lax.psum_scatter(matmul(x, w).astype(x.dtype), axis_name, scatter_dimension=s,
                            tiled=True)
  num_ranks = lax.axis_size(axis_name)
  x = to_varying(x, axis_name)
  blk = size // num_ranks

  def partial(d):
    if last:
      return matmul(x, lax.dynamic_slice_in_dim(w, d * blk, blk, axis=1))
    return matmul(lax.dynamic_slice_in_dim(x, d * blk, blk, axis=s), w)

  return _ring_reduce_scatter(partial, x.dtype, axis_name, num_ranks, mesh_axes)


def matmul_all_reduce(x, w, axis_name, algorithm: str, mesh_axes=None):
  """``psum(x @ w)``; "ppermute": the GEMM+RS ring on a 2-D view, then all-gather.

  With no rows or no columns (``x.size == 0``, ``w.shape[1] == 0``)
  "ppermute" runs the psum: XLA rejects an all-gather along an empty
  dimension, and there is nothing to overlap.
  """
  if not _ring(names.MATMUL_ALL_REDUCE, algorithm) or x.size == 0 or w.shape[1] == 0:
    return lax.psum(matmul(x, w).astype(x.dtype), axis_name)
  num_ranks = lax.axis_size(axis_name)
  lead = x.shape[:-1]
  rows, n = math.prod(lead), w.shape[1]
  x2 = x.reshape(rows, x.shape[-1])
  if rows % num_ranks == 0:
    dim = 0
  elif n % num_ranks == 0:
    dim = 1
  else:  # zero rows contribute zero; sliced off below
    dim = 0
    x2 = jnp.pad(x2, ((0, -rows % num_ranks), (0, 0)))
  mine = matmul_reduce_scatter(x2, w, axis_name, dim, "ppermute", mesh_axes)
  full = lax.all_gather(mine, axis_name, axis=dim, tiled=True, to="invarying")
  return full[:rows].reshape(lead + (n,))


# ----------------------------------------------------------------------------
# All-reduce + residual + RMSNorm


def rms_norm_tail(s, residual, weight, eps: float):
  """``h = residual + s``, ``y = rms_norm(h) * weight``; returns ``(h, y)``.

  The norm is computed in float32 from ``h`` as stored (in its dtype) and
  rounded once to that dtype: ``h * rsqrt(mean(h^2, -1) + eps) * weight``.
  """
  h = residual + s
  h32 = h.astype(jnp.float32)
  ms = jnp.mean(jnp.square(h32), axis=-1, keepdims=True)
  y = (h32 * lax.rsqrt(ms + eps) * weight.astype(jnp.float32)).astype(h.dtype)
  return h, y


def rms_norm_vjp(h, weight, ct_y, eps: float):
  """The VJP of ``y = rms_norm_tail(0, h, weight, eps)[1]``, in closed form: ``(dh, dw)``.

  With ``r = rsqrt(mean(h^2, -1) + eps)`` and ``g = ct_y * weight`` (float32):
  ``dh = r * g - h * r^3 * mean(g * h, -1)``, ``dw = sum(ct_y * h * r)`` over
  every axis but the last; each rounded once to its input's dtype, as
  ``jax.vjp`` of the expression gives them. Written out rather than taken with
  ``jax.vjp`` inside a backward rule, where jax (0.12) fails under
  ``jax.vmap(..., spmd_axis_name=...)`` ("varying manual axes to match").
  """
  h32 = h.astype(jnp.float32)
  ct32 = ct_y.astype(jnp.float32)
  r = lax.rsqrt(jnp.mean(jnp.square(h32), axis=-1, keepdims=True) + eps)
  g = ct32 * weight.astype(jnp.float32)
  dh = r * g - h32 * r ** 3 * jnp.mean(g * h32, axis=-1, keepdims=True)
  dw = jnp.sum(ct32 * h32 * r, axis=tuple(range(h.ndim - 1)))
  return dh.astype(h.dtype), dw.astype(weight.dtype)


def all_reduce_rms_norm(p, residual, weight, axis_name, eps: float, algorithm: str,
                        mesh_axes=None):
  """``rms_norm_tail(all_reduce(p), residual, weight, eps)`` (the op's pure expression)."""
  return rms_norm_tail(all_reduce(p, axis_name, algorithm, mesh_axes), residual, weight, eps)
