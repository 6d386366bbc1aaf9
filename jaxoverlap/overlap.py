"""Fused compute-communication: AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce.

Problem:
  In tensor-parallel transformers every column-parallel layer all-gathers its
  sequence-parallel input before the GEMM, every row-parallel layer
  reduce-scatters (or all-reduces) the GEMM's output (Megatron-LM). Run one
  after the other, the collective is exposed: 8-46% of these ops on our
  2x H200 at TP=2 (benchmarks/results/overlap-2x_H200_NV18.json).

Algorithm:
  Each op replaces the collective by peer-to-peer shard transfers interleaved
  with shard GEMMs, in CommFuse's rank-adaptive order: AllGather+GEMM
  multiplies the local shard first and the others' shards as they arrive;
  GEMM+ReduceScatter computes the partial blocks that other ranks own first
  and sends them on while it continues, and its own block last, so the last
  step's transfer is hidden; GEMM+AllReduce is GEMM+ReduceScatter followed by
  an all-gather. Backend "xla" implements this with ``lax.ppermute``
  (algorithm "ppermute") next to the plain collective ("collective", the
  default); see ``jaxoverlap._xla``. Backend "cuda" runs it as one XLA FFI
  custom call per op (algorithm "fused", ``ffi/overlap/overlap.cu``):
  cuBLASLt shard GEMMs on XLA's stream, shard transfers by the copy engines
  (or NVSHMEM puts: ``transport=``) on a second stream, synchronised by
  events and flags in symmetric memory; see each op's docstring. How a call
  runs is planned when it is lowered (``jaxoverlap.dispatch``). Every op is a
  ``jax.custom_vjp`` whose backward pass runs the paired op with the same
  backend, algorithm, transport and chunks.

Example:
  >>> import jax, jax.numpy as jnp, jaxoverlap
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> def mlp(x_sd, w_df, w_fd):       # x_sd: [s/4, d], sequence-parallel
  ...   h_sf = jaxoverlap.all_gather_matmul(x_sd, w_df, "tp", algorithm="ppermute")
  ...   return jaxoverlap.matmul_reduce_scatter(jax.nn.gelu(h_sf), w_fd, "tp",
  ...                                           algorithm="ppermute")
  >>> f = jax.jit(jax.shard_map(mlp, mesh=mesh,
  ...     in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp")))
  >>> f(jnp.ones((64, 32)), jnp.ones((32, 128)), jnp.ones((128, 32))).shape
  (64, 32)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax

from jaxoverlap import _checks, _primitives, _xla, names
from jaxoverlap.dispatch import Request

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]


class _Config(NamedTuple):
  request: Request  # what the caller asked for; the backward pass derives its own
  num_ranks: int
  checked: bool  # shard_map(check_vma=True)
  x_vma: frozenset
  w_vma: frozenset


def _config(op, x, w, axis_name, dim, backend, algorithm, transport, chunks) -> _Config:
  """Checks the choices and records what the backward pass needs."""
  _checks.refuse_forward_mode(op, x, w)
  _checks.check_options(op, backend=backend, algorithm=algorithm, transport=transport,
                        chunks=chunks)
  chunks = _checks.normalize_chunks(op, chunks)  # a NumPy integer becomes an int
  request = Request(op, axis_name, backend=backend, algorithm=algorithm, transport=transport,
                    chunks=chunks, dim=dim)
  return _Config(request, int(jax.lax.axis_size(axis_name)), _xla.vma_checked(axis_name),
                 _xla.varying_axes(x), _xla.varying_axes(w))


def _paired(request: Request, op: str, dim: int | None, gathered: bool = False) -> Request:
  """The request of the backward pass's op: the same backend, transport and chunks."""
  algorithm = request.algorithm
  if algorithm not in (names.AUTO,) + names.algorithms(op):  # e.g. "unfused" has no pair
    algorithm = names.AUTO
  transport = request.transport if request.transport in names.transports(op) else names.AUTO
  return dataclasses.replace(request, op=op, dim=dim, gathered=gathered, algorithm=algorithm,
                             transport=transport,
                             chunks=request.chunks if op in names.FUSED_OPS else None)


def _same_vma(x, w, axis_name):
  """Casts x and w to varying over the union of their axes and ``axis_name``."""
  vma = _xla.varying_axes(x) | _xla.varying_axes(w) | frozenset(names.axis_names(axis_name))
  return _xla.cast_to_vma(x, vma), _xla.cast_to_vma(w, vma)


def _check_operands(op, x, w, axis_name) -> int:
  """Validates x, w and axis_name; returns the number of ranks along the axis."""
  _checks.check_matmul_operands(op, x, w)
  return _checks.axis_size(op, axis_name)


# ----------------------------------------------------------------------------
# Implementations shared by forward and backward passes (no custom_vjp): each
# binds the op's primitive, whose lowering plans how it runs.


def _ag_matmul_impl(x, w, request, num_ranks):
  """``(AG(x) @ w, AG(x) or None)`` along ``request.dim``."""
  x, w = _same_vma(x, w, request.axis_name)
  return _primitives.bind_all_gather_matmul(x, w, request, num_ranks)


def _matmul_rs_impl(x, w, request, num_ranks):
  x, w = _same_vma(x, w, request.axis_name)
  return _primitives.bind_matmul_reduce_scatter(x, w, request, num_ranks)


def _matmul_ar_impl(x, w, request, num_ranks):
  x, w = _same_vma(x, w, request.axis_name)
  return _primitives.bind_matmul_all_reduce(x, w, request, num_ranks)


def _grads(cfg, dx, dw, dtype):
  return (_xla.cast_to_vma(dx.astype(dtype), cfg.x_vma),
          _xla.cast_to_vma(dw.astype(dtype), cfg.w_vma))


# ----------------------------------------------------------------------------
# all_gather_matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _all_gather_matmul(x, w, cfg):
  return _ag_matmul_impl(x, w, cfg.request, cfg.num_ranks)[0]


def _all_gather_matmul_fwd(x, w, cfg):
  request = dataclasses.replace(cfg.request, gathered=True)
  y, xg = _ag_matmul_impl(x, w, request, cfg.num_ranks)
  return y, (xg, w)


def _all_gather_matmul_bwd(cfg, res, dy):
  xg, w = res
  # dX = RS(dY @ w^T) along the gathered dimension; dW = AG(X)^T @ dY.
  request = _paired(cfg.request, names.MATMUL_REDUCE_SCATTER, cfg.request.dim)
  dx = _matmul_rs_impl(dy, w.T, request, cfg.num_ranks)
  dw = _xla.contract_leading(xg, dy)
  return _grads(cfg, dx, dw, w.dtype)


_all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0, backend="auto",
                      algorithm="auto", transport="auto", chunks=None):
  """All-gathers ``x`` along ``gather_dimension`` and multiplies by ``w``.

  Equals ``reference.all_gather_matmul``, i.e. ``lax.all_gather(x, axis_name,
  axis=gather_dimension, tiled=True) @ w``, up to the order of float32
  summation. Call inside ``jax.shard_map``. This is the column-parallel
  linear layer under sequence parallelism (``x`` sharded over the sequence,
  ``w`` over its columns).

  Args:
    x: ``[..., m_local, ..., k]`` float32, bfloat16 or float16: this rank's
      shard, ``m_local`` at ``gather_dimension``; any leading dimensions.
    w: ``[k, n_local]``, x's dtype (``n_local`` = this rank's columns, or all
      of them when ``w`` is replicated).
    axis_name: the mesh axis to gather over (str), or a tuple of axes.
    gather_dimension: the dimension of ``x`` to gather; negative counts from
      the end; must not be the last (contracted) one.
    backend: ``"auto"``, ``"xla"`` or ``"cuda"``. "auto" runs the CUDA
      kernel where it can run (GPUs, ``jaxoverlap.initialize()`` called, the
      group within one node) and XLA elsewhere, and logs why.
    algorithm: ``"auto"``; backend "xla": ``"collective"`` (``lax.all_gather``
      then one GEMM) or ``"ppermute"`` (the rank-adaptive ring); backend
      "cuda": ``"fused"`` (one custom call).
    transport: backend "cuda": ``"auto"`` (= ``"copy_engine"``),
      ``"copy_engine"`` (shards moved by the copy engines, no SMs taken from
      the GEMM) or ``"nvshmem"`` (NVSHMEM block puts from a kernel).
    chunks: backend "cuda" only: pieces each shard transfer is cut into (a
      positive int up to the kernels' limit, 32; None: chosen from the
      shapes by ``jaxoverlap.tuning.policy.fused_chunks``: one, or two where
      the shard's transfer is estimated at over 0.4x the local shard's GEMM;
      calibrated on 2x H200, docs/results.md). Each arriving chunk's GEMM
      starts as soon as that chunk is in. Chunks cut the shard's rows, or, where dimensions precede
      ``gather_dimension``, whole entries of those (so at most their product:
      each chunk is one contiguous copy, which a CUDA graph can update).

  Returns:
    ``[..., m_local * num_ranks, ..., n_local]`` in x's dtype (float32
    accumulation), ranks' shards in rank order along ``gather_dimension``.

  Raises:
    ValueError: unsupported or mismatched dtypes, ``w`` not 2-D,
      ``x.shape[-1] != w.shape[0]``, ``gather_dimension`` out of range or the
      contracted dimension, an axis that is not a manual axis of the
      enclosing ``shard_map``, an unknown or contradictory backend, algorithm
      or transport, ``chunks`` out of range or with backend "xla"; at
      lowering, with backend "cuda": a group that spans nodes, or a shard
      larger than the fused-op slot (``runtime_info()["overlap_slot_bytes"]``).
    RuntimeError: at lowering, backend "cuda" or a CUDA-only choice
      (algorithm "fused", a transport, chunks) while the CUDA kernels cannot
      run in this process; the message says why.
    TypeError: a forward-mode tangent on ``x`` or ``w`` (``jax.jvp``,
      ``jax.jacfwd``): the op is a ``jax.custom_vjp``, with a reverse-mode
      rule only (``jaxoverlap._checks.refuse_forward_mode`` says when the
      message names the op). Reverse mode of any order and ``jax.hessian``
      work (README, "Known limits").

  Algorithm:
    "ppermute": a ring of ``num_ranks - 1`` ``ppermute`` steps. Each rank
    multiplies its own shard first, then the shards of ranks ``r - 1, r - 2,
    ...`` as they arrive, each product written straight into its rows of the
    output; every transfer overlaps the previous shard's GEMM.
    Backend "cuda" (ffi/overlap/overlap.cu): one custom call. On a second
    stream, rank r writes its shard into a slot of ranks r+1, r+2, ... (in
    that order, chunk by chunk, each chunk then flagged); on XLA's stream it
    multiplies its own shard (cuBLASLt), then each arriving chunk of ranks
    r-1, r-2, ..., writing every product into its rows of the output. Within
    one node (the TP group); empty operands and a group of one rank take the
    xla expression (nothing to communicate), whatever the backend.
    Backward: dX =
    ``matmul_reduce_scatter(dY, w.T, scatter_dimension=gather_dimension)``
    with the same backend, algorithm, transport and chunks, dW = ``AG(x)^T @ dY`` with ``AG(x)``
    saved by the forward pass (summed over the axis when ``w`` is invariant
    over it).

  Source:
    CommFuse, arXiv 2604.24013, section 3 (AllGather+GEMM with rank-adaptive
    order); Megatron-LM sequence parallelism, arXiv 2205.05198, section 4.2.2.
  """
  op = names.ALL_GATHER_MATMUL
  _check_operands(op, x, w, axis_name)
  g = _checks.normalize_dimension(op, "gather_dimension", gather_dimension, len(x.shape), "x")
  if g == len(x.shape) - 1:
    raise ValueError(
        f"{op}: gather_dimension={gather_dimension} is x's last dimension, the "
        f"contracted dimension k (x.shape={tuple(x.shape)}); gather a leading "
        f"dimension instead")
  cfg = _config(op, x, w, axis_name, g, backend, algorithm, transport, chunks)
  # The scope names the op in HLO metadata and profiles.
  with jax.named_scope("jaxoverlap." + names.ALL_GATHER_MATMUL):
    return _all_gather_matmul(x, w, cfg)


# ----------------------------------------------------------------------------
# matmul_reduce_scatter


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_reduce_scatter(x, w, cfg):
  return _matmul_rs_impl(x, w, cfg.request, cfg.num_ranks)


def _matmul_reduce_scatter_fwd(x, w, cfg):
  # The primitive itself, not the custom_vjp: jax.hessian (forward over reverse)
  # differentiates this rule forward, which a custom_vjp refuses.
  return _matmul_rs_impl(x, w, cfg.request, cfg.num_ranks), (x, w)


def _matmul_reduce_scatter_bwd(cfg, res, dy):
  x, w = res
  # dX = AG(dY) @ w^T, gathered along the scattered dimension. When that is
  # the last one (w's columns), AG(dY) @ w^T contracts over the gathered
  # dimension: the same ring sums the shard products instead of placing them.
  request = _paired(cfg.request, names.ALL_GATHER_MATMUL, cfg.request.dim, gathered=True)
  dx, dy_full = _ag_matmul_impl(dy, w.T, request, cfg.num_ranks)
  dw = _xla.contract_leading(x, dy_full)
  return _grads(cfg, dx, dw, w.dtype)


_matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension=0, backend="auto",
                          algorithm="auto", transport="auto", chunks=None):
  """Multiplies ``x @ w`` and reduce-scatters the product over ``axis_name``.

  Equals ``reference.matmul_reduce_scatter``, i.e. ``lax.psum_scatter(x @ w,
  axis_name, scatter_dimension=scatter_dimension, tiled=True)``, up to
  rounding: in float32 exactly up to the order of summation; in bfloat16 and
  float16 also where the cross-rank sum rounds (Returns). Call inside
  ``jax.shard_map``. This is the
  row-parallel linear layer under sequence parallelism (``x`` sharded over
  its features, ``w`` over its rows, the output over the sequence).

  Args:
    x: ``[..., k_local]`` float32, bfloat16 or float16, any leading
      dimensions.
    w: ``[k_local, n]``, x's dtype.
    axis_name: the mesh axis to reduce over (str), or a tuple of axes.
    scatter_dimension: the dimension of the OUTPUT ``x @ w`` (shape
      ``[..., n]``) to scatter, any one including the last; negative counts
      from the end. Its size must be divisible by the axis size. Backend
      "cuda" scatters any dimension but the last (``"auto"`` runs the xla
      backend for the last and logs so).
    backend: ``"auto"``, ``"xla"`` or ``"cuda"``, as in ``all_gather_matmul``.
    algorithm: ``"auto"``; backend "xla": ``"collective"`` (one GEMM, then
      ``lax.psum_scatter``) or ``"ppermute"`` (the rank-adaptive ring);
      backend "cuda": ``"fused"``.
    transport: backend "cuda": ``"auto"`` (= ``"copy_engine"``),
      ``"copy_engine"`` or ``"nvshmem"`` (how partial blocks move, as in
      ``all_gather_matmul``).
    chunks: backend "cuda" only: pieces each partial block is computed and
      sent in (a positive int up to 32; None: one chunk for blocks under
      8 MiB, else two).

  Returns:
    ``x @ w`` summed over the ranks, of which this rank keeps block ``rank``
    along ``scatter_dimension``: ``[..., n]`` with that dimension divided by
    ``num_ranks``, in x's dtype (float32 GEMM accumulation). How the
    cross-rank sum rounds to x's dtype depends on the algorithm: "collective"
    sums the rounded products as ``psum_scatter`` does (at each step);
    "ppermute" carries the sum in float32 and rounds once; backend "cuda"
    rounds each rank's partial block and adds them in float32 (Algorithm).

  Raises:
    ValueError: unsupported or mismatched dtypes, ``w`` not 2-D,
      ``x.shape[-1] != w.shape[0]``, ``scatter_dimension`` out of range, the
      scattered size not divisible by the axis size, an axis that is not a
      manual axis of the enclosing ``shard_map``, an unknown or contradictory
      backend, algorithm or transport, ``chunks`` out of range or with
      backend "xla"; at lowering, with backend "cuda": the last dimension
      scattered, a group that spans nodes, or a partial block larger than the
      fused-op slot.
    RuntimeError: at lowering, backend "cuda" or a CUDA-only choice
      (algorithm "fused", a transport, chunks) while the CUDA kernels cannot
      run in this process; the message says why.
    TypeError: a forward-mode tangent on ``x`` or ``w`` (``jax.jvp``,
      ``jax.jacfwd``): the op is a ``jax.custom_vjp``, with a reverse-mode
      rule only (``jaxoverlap._checks.refuse_forward_mode`` says when the
      message names the op). Reverse mode of any order and ``jax.hessian``
      work (README, "Known limits").

  Algorithm:
    "ppermute": the accumulator of output block ``d`` starts on rank ``d + 1``
    and moves right around a ring; each rank adds its partial product
    (the rows of ``x``, or the columns of ``w`` when the last dimension is
    scattered) and passes it on. A rank thus computes the other ranks' blocks
    first and its own last, while the final transfer is in flight.
    Backend "cuda": one custom call. Rank r computes the partial block of rank
    r+1 chunk by chunk (cuBLASLt, into a staging buffer), each chunk sent by
    a second stream into r+1's slot as soon as it is done; then r+2's, ...;
    its own block last, straight into the output, chunk by chunk, each chunk
    adding rank r-1's partial (the first to arrive) in the GEMM's epilogue
    (float32, one rounding to x's dtype); with more than 2 ranks the other
    partials are added after it in float32. Within one node; empty operands
    and a group of one rank take the xla expression, whatever the backend.
    Backward:
    dX = ``all_gather_matmul(dY, w.T, gather_dimension=scatter_dimension)``
    with the same backend and algorithm, dW = ``x^T @ AG(dY)`` with the
    gathered ``dY`` from that op. For the last dimension the gather runs
    along the contraction of ``dY @ w.T``, so the ring sums the shard
    products instead of placing them.

  Source:
    CommFuse, arXiv 2604.24013, section 3 (GEMM+ReduceScatter, rank-adaptive
    order and tail latency); Megatron-LM, arXiv 2205.05198, section 4.2.2.
  """
  op = names.MATMUL_REDUCE_SCATTER
  num_ranks = _check_operands(op, x, w, axis_name)
  out_shape = tuple(x.shape[:-1]) + (w.shape[1],)
  s = _checks.normalize_dimension(op, "scatter_dimension", scatter_dimension, len(out_shape),
                                  "the output x @ w")
  _checks.check_divisible(op, "scatter_dimension", scatter_dimension, out_shape[s], axis_name,
                          num_ranks, f"the output x @ w (shape {out_shape})")
  cfg = _config(op, x, w, axis_name, s, backend, algorithm, transport, chunks)
  with jax.named_scope("jaxoverlap." + names.MATMUL_REDUCE_SCATTER):
    return _matmul_reduce_scatter(x, w, cfg)


# ----------------------------------------------------------------------------
# matmul_all_reduce


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_all_reduce(x, w, cfg):
  return _matmul_ar_impl(x, w, cfg.request, cfg.num_ranks)


def _matmul_all_reduce_fwd(x, w, cfg):
  # The primitive, as in _matmul_reduce_scatter_fwd.
  return _matmul_ar_impl(x, w, cfg.request, cfg.num_ranks), (x, w)


def _matmul_all_reduce_bwd(cfg, res, dy):
  x, w = res
  axis_name = cfg.request.axis_name
  if cfg.checked:
    # The output is invariant over the axis; psum transposes to a cast.
    dy = _xla.to_varying(dy, axis_name)
  else:
    # check_vma=False: every value counts as per-rank; psum transposes to psum.
    request = _paired(cfg.request, names.ALL_REDUCE, None)
    dy = _primitives.bind_all_reduce(_xla.to_varying(dy, axis_name), request, cfg.num_ranks)
  dx = _xla.matmul(dy, w.T)
  dw = _xla.contract_leading(x, dy)
  return _grads(cfg, dx, dw, w.dtype)


_matmul_all_reduce.defvjp(_matmul_all_reduce_fwd, _matmul_all_reduce_bwd)


def matmul_all_reduce(x, w, axis_name, *, backend="auto", algorithm="auto", transport="auto",
                      chunks=None):
  """Multiplies ``x @ w`` and sums the product over the ranks of ``axis_name``.

  Equals ``reference.matmul_all_reduce``, i.e. ``lax.psum(x @ w,
  axis_name)``, up to rounding (in float32 the order of summation; in
  bfloat16 and float16 also where the sum rounds, as in
  ``matmul_reduce_scatter``); the result has psum's
  type (invariant over ``axis_name``). Call inside ``jax.shard_map``. This is
  Megatron's row-parallel linear layer without sequence parallelism.

  In decode at batch 1, a local ``x @ w`` padded to two rows, then
  ``all_reduce`` (or ``all_reduce_rms_norm``), was faster: XLA reads the
  weights of a one-row product well below the HBM roofline and those of a
  two-row one at it, and this op does not pad (docs/decode.md, "The one-row
  GEMM, and padding it"; ``jaxoverlap.nnx.ParallelConfig(row_reduction=
  "all_reduce", min_matmul_rows=2)`` does both).

  Args:
    x: ``[..., k_local]`` float32, bfloat16 or float16, any leading
      dimensions.
    w: ``[k_local, n]``, x's dtype.
    axis_name: the mesh axis to reduce over (str), or a tuple of axes.
    backend: ``"auto"``, ``"xla"`` or ``"cuda"``, as in ``all_gather_matmul``.
    algorithm: ``"auto"``; backend "xla": ``"collective"`` (one GEMM, then
      ``lax.psum``) or ``"ppermute"``; backend "cuda": ``"fused"`` (one
      custom call; the rows of x, all leading dimensions flattened, must
      divide by the axis size) or ``"unfused"`` (the GEMM, then the CUDA
      ``all_reduce`` with its own automatic choice). ``"auto"`` on the CUDA
      kernels takes "fused" when the rows divide and the output has at least
      ``jaxoverlap.tuning.policy.FUSED_ALL_REDUCE_MIN_BYTES`` (32 MiB,
      calibrated on 2x H200) per rank, else "unfused"; the plan
      (``jaxoverlap.decisions()``) says which and why.
    transport: "fused" only: ``"auto"`` (= ``"copy_engine"``),
      ``"copy_engine"`` or ``"nvshmem"``.
    chunks: "fused" only: pieces each partial block is computed and sent in
      (a positive int up to 32; None: one chunk for blocks under 8 MiB, else
      two). Given while "auto" picks "unfused", it is unused, and the plan
      says so.

  Returns:
    ``[..., n]`` in x's dtype, the same on every rank (bit-identical).

  Raises:
    ValueError: unsupported or mismatched dtypes, ``w`` not 2-D,
      ``x.shape[-1] != w.shape[0]``, an axis that is not a manual axis of the
      enclosing ``shard_map``, an unknown or contradictory backend,
      algorithm or transport, ``chunks`` out of range or given for backend
      "xla" or with "unfused"; at lowering: "fused" with rows not divisible
      by the axis size; with backend "cuda", a group that spans nodes or has
      more than 8 ranks, or a block larger than half a fused-op slot.
    RuntimeError: at lowering, backend "cuda" or a CUDA-only choice
      (algorithm "fused", a transport, chunks) while the CUDA kernels cannot
      run in this process; the message says why.
    TypeError: a forward-mode tangent on ``x`` or ``w`` (``jax.jvp``,
      ``jax.jacfwd``): the op is a ``jax.custom_vjp``, with a reverse-mode
      rule only (``jaxoverlap._checks.refuse_forward_mode`` says when the
      message names the op). Reverse mode of any order and ``jax.hessian``
      work (README, "Known limits").

  Algorithm:
    "ppermute": views ``x`` as ``[rows, k_local]`` and runs the
    GEMM+ReduceScatter ring over the rows of the product (over its columns if
    only they divide by the axis size, else over zero-padded rows), then
    all-gathers the reduced blocks with ``lax.all_gather(...,
    to="invarying")``. Backend "cuda", fused: the GEMM+ReduceScatter kernel
    over the rows, writing this rank's reduced block into its rows of the
    output; each chunk of it, once final, goes by a second stream to every
    peer, while XLA's stream copies each arriving chunk into place. Empty
    operands and a group of one rank take the xla expression, whatever the
    backend. Backward: dX = ``dY @ w.T``, dW = ``x^T @ dY`` (the transpose of
    psum is the cast to varying).

  Source:
    CommFuse, arXiv 2604.24013, section 3 (GEMM+AllReduce as GEMM+RS then
    all-gather); Megatron-LM, arXiv 1909.08053, section 3 (row-parallel
    layers).
  """
  op = names.MATMUL_ALL_REDUCE
  _check_operands(op, x, w, axis_name)
  cfg = _config(op, x, w, axis_name, None, backend, algorithm, transport, chunks)
  with jax.named_scope("jaxoverlap." + names.MATMUL_ALL_REDUCE):
    return _matmul_all_reduce(x, w, cfg)
