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
  custom call per op (``ffi/overlap/overlap.cu``): cuBLASLt shard GEMMs on
  XLA's stream, shard transfers by the copy engines (or NVSHMEM puts) on a
  second stream, synchronised by events and flags in symmetric memory; see
  each op's docstring. Every op is a ``jax.custom_vjp`` whose
  backward pass runs the paired fused op with the same backend and
  algorithm.

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

import functools
import math
from typing import NamedTuple

import jax

from jaxoverlap import _checks, _cuda, _xla
from jaxoverlap import backend as _backend

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]


class _Config(NamedTuple):
  axis_name: str | tuple[str, ...]
  dim: int | None  # gather/scatter dimension, normalised to >= 0
  backend: str
  algorithm: str  # xla: collective/ppermute; cuda: copy_engine/nvshmem/gemm_all_reduce
  chunks: int | None  # cuda: chunks per shard transfer (None: chosen from the shapes)
  checked: bool  # shard_map(check_vma=True)
  x_vma: frozenset
  w_vma: frozenset


def _check_operands(op, x, w, axis_name) -> int:
  """Validates x, w and axis_name; returns the number of ranks along the axis."""
  _checks.check_matmul_operands(op, x, w)
  return _checks.axis_size(op, axis_name)


def _check_chunks(op, chunks):
  if chunks is None:
    return
  if (isinstance(chunks, bool) or not isinstance(chunks, int)
      or not 1 <= chunks <= _cuda.MAX_CHUNKS):
    raise ValueError(
        f"{op}: chunks must be None or an int in 1..{_cuda.MAX_CHUNKS}, got {chunks!r}")


def _config(op, x, w, axis_name, dim, backend, algorithm, chunks,
            cuda_unsupported=None) -> _Config:
  """Resolves backend and algorithm and records what the backward pass needs.

  ``cuda_unsupported`` is None, or why the CUDA kernel cannot take this call
  (a shape it does not cover). Then ``backend="cuda"`` raises, and
  ``backend="auto"`` runs the xla backend and logs why.
  """
  _check_chunks(op, chunks)
  requested = backend
  backend, algorithm = _checks.resolve_algorithm(op, backend, algorithm)
  if backend == "cuda":
    if cuda_unsupported is not None:
      if requested == "cuda" or algorithm != "auto":
        raise ValueError(f"{op}: the CUDA kernel does not take this call: {cuda_unsupported}; "
                         "use backend='xla'")
      _backend.log_once(op, f"runs on backend 'xla' (auto): {cuda_unsupported}")
      backend, algorithm = "xla", "collective"
    elif algorithm == "auto":
      algorithm = _cuda.DEFAULT_TRANSPORT
  if backend == "xla" and chunks is not None:
    raise ValueError(f"{op}: chunks={chunks} applies to backend 'cuda' only (this call runs on "
                     "backend 'xla')")
  return _Config(axis_name, dim, backend, algorithm, chunks, _xla.vma_checked(axis_name),
                 _xla.varying_axes(x), _xla.varying_axes(w))


# ----------------------------------------------------------------------------
# Implementations shared by forward and backward passes (no custom_vjp).


def _ag_matmul_impl(x, w, cfg, gathered=True):
  """``(AG(x) @ w, AG(x))`` along ``cfg.dim``; AG(x) is None when not ``gathered`` (cuda)."""
  if cfg.backend == "xla" or x.size == 0 or w.size == 0:
    return _xla.all_gather_matmul(x, w, cfg.axis_name, cfg.dim, _xla_algorithm(cfg))
  return _cuda.all_gather_matmul(x, w, cfg.axis_name, cfg.dim, cfg.algorithm, cfg.chunks,
                                 gathered)


def _matmul_rs_impl(x, w, cfg):
  if cfg.backend == "xla" or x.size == 0 or w.size == 0:
    return _xla.matmul_reduce_scatter(x, w, cfg.axis_name, cfg.dim, _xla_algorithm(cfg))
  return _cuda.matmul_reduce_scatter(x, w, cfg.axis_name, cfg.dim, cfg.algorithm, cfg.chunks)


def _matmul_ar_impl(x, w, cfg):
  if cfg.backend == "xla" or x.size == 0 or w.size == 0:
    return _xla.matmul_all_reduce(x, w, cfg.axis_name, _xla_algorithm(cfg))
  if cfg.algorithm == "gemm_all_reduce":
    return _cuda.all_reduce(_xla.matmul(x, w).astype(x.dtype), cfg.axis_name)
  return _cuda.matmul_all_reduce(x, w, cfg.axis_name, cfg.algorithm, cfg.chunks)


def _xla_algorithm(cfg):
  # Empty operands move no data on either backend: the xla expression gives
  # the (empty or zero) result without a kernel.
  return cfg.algorithm if cfg.backend == "xla" else "collective"


def _grads(cfg, dx, dw, dtype):
  return (_xla.cast_to_vma(dx.astype(dtype), cfg.x_vma),
          _xla.cast_to_vma(dw.astype(dtype), cfg.w_vma))


# ----------------------------------------------------------------------------
# all_gather_matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _all_gather_matmul(x, w, cfg):
  return _ag_matmul_impl(x, w, cfg, gathered=False)[0]


def _all_gather_matmul_fwd(x, w, cfg):
  y, xg = _ag_matmul_impl(x, w, cfg)
  return y, (xg, w)


def _all_gather_matmul_bwd(cfg, res, dy):
  xg, w = res
  # dX = RS(dY @ w^T) along the gathered dimension; dW = AG(X)^T @ dY.
  dx = _matmul_rs_impl(dy, w.T, cfg)
  dw = _xla.contract_leading(xg, dy)
  return _grads(cfg, dx, dw, w.dtype)


_all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0, backend="auto",
                      algorithm="auto", chunks=None):
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
    backend: ``"auto"``, ``"xla"`` or ``"cuda"`` (see ``jaxoverlap.backend``).
    algorithm: backend "xla": ``"auto"`` (= ``"collective"``),
      ``"collective"`` or ``"ppermute"``; backend "cuda": ``"auto"`` (=
      ``"copy_engine"``), ``"copy_engine"`` (shards moved by the copy
      engines, no SMs taken from the GEMM) or ``"nvshmem"`` (NVSHMEM block
      puts from a kernel).
    chunks: backend "cuda" only: pieces each shard transfer is cut into (1 to
      32; None: chosen from the shapes by ``_cuda.auto_chunks``: one, or two
      where the shard's transfer is estimated at over 0.4x the local shard's
      GEMM; calibrated on 2x H200, README "Calibration of the automatic
      choices"). Each arriving chunk's GEMM starts as soon as that chunk is
      in. Chunks cut the shard's rows, or, where dimensions precede
      ``gather_dimension``, whole entries of those (so at most their product:
      each chunk is one contiguous copy, which a CUDA graph can update).

  Returns:
    ``[..., m_local * num_ranks, ..., n_local]`` in x's dtype (float32
    accumulation), ranks' shards in rank order along ``gather_dimension``.

  Raises:
    ValueError: unsupported or mismatched dtypes, ``w`` not 2-D,
      ``x.shape[-1] != w.shape[0]``, ``gather_dimension`` out of range or the
      contracted dimension, an unbound axis name, unknown backend or
      algorithm, ``chunks`` out of range or given for backend "xla"; with
      backend "cuda", at lowering: a group that spans nodes, or a shard
      larger than the fused-op slot (``runtime_info()["overlap_slot_bytes"]``).
    RuntimeError: ``backend="cuda"`` but the CUDA path is not usable (the
      message says why).

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
    one node (the TP group); empty operands take the xla expression.
    Backward: dX =
    ``matmul_reduce_scatter(dY, w.T, scatter_dimension=gather_dimension)``
    with the same backend and algorithm, dW = ``AG(x)^T @ dY`` with ``AG(x)``
    saved by the forward pass (summed over the axis when ``w`` is invariant
    over it).

  Source:
    CommFuse, arXiv 2604.24013, section 3 (AllGather+GEMM with rank-adaptive
    order); Megatron-LM sequence parallelism, arXiv 2205.05198, section 4.2.2.
  """
  op = "all_gather_matmul"
  _check_operands(op, x, w, axis_name)
  g = _checks.normalize_dimension(op, "gather_dimension", gather_dimension, len(x.shape), "x")
  if g == len(x.shape) - 1:
    raise ValueError(
        f"{op}: gather_dimension={gather_dimension} is x's last dimension, the "
        f"contracted dimension k (x.shape={tuple(x.shape)}); gather a leading "
        f"dimension instead")
  cfg = _config(op, x, w, axis_name, g, backend, algorithm, chunks)
  return _all_gather_matmul(x, w, cfg)


# ----------------------------------------------------------------------------
# matmul_reduce_scatter


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_reduce_scatter(x, w, cfg):
  return _matmul_rs_impl(x, w, cfg)


def _matmul_reduce_scatter_fwd(x, w, cfg):
  return _matmul_reduce_scatter(x, w, cfg), (x, w)


def _matmul_reduce_scatter_bwd(cfg, res, dy):
  x, w = res
  # dX = AG(dY) @ w^T, gathered along the scattered dimension. When that is
  # the last one (w's columns), AG(dY) @ w^T contracts over the gathered
  # dimension: the same ring sums the shard products instead of placing them.
  dx, dy_full = _ag_matmul_impl(dy, w.T, cfg)
  dw = _xla.contract_leading(x, dy_full)
  return _grads(cfg, dx, dw, w.dtype)


_matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension=0, backend="auto",
                          algorithm="auto", chunks=None):
  """Multiplies ``x @ w`` and reduce-scatters the product over ``axis_name``.

  Equals ``reference.matmul_reduce_scatter``, i.e. ``lax.psum_scatter(x @ w,
  axis_name, scatter_dimension=scatter_dimension, tiled=True)``, up to the
  order of float32 summation. Call inside ``jax.shard_map``. This is the
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
    backend: ``"auto"``, ``"xla"`` or ``"cuda"`` (see ``jaxoverlap.backend``).
    algorithm: backend "xla": ``"auto"`` (= ``"collective"``),
      ``"collective"`` or ``"ppermute"``; backend "cuda": ``"auto"`` (=
      ``"copy_engine"``), ``"copy_engine"`` or ``"nvshmem"`` (how partial
      blocks move, as in ``all_gather_matmul``).
    chunks: backend "cuda" only: pieces each partial block is computed and
      sent in (1 to 32; None: one chunk for blocks
      under 8 MiB, else two).

  Returns:
    ``x @ w`` summed over the ranks, of which this rank keeps block ``rank``
    along ``scatter_dimension``: ``[..., n]`` with that dimension divided by
    ``num_ranks``, in x's dtype (float32 GEMM accumulation; the cross-rank
    sum rounds to x's dtype at each step, like ``psum_scatter``).

  Raises:
    ValueError: unsupported or mismatched dtypes, ``w`` not 2-D,
      ``x.shape[-1] != w.shape[0]``, ``scatter_dimension`` out of range, the
      scattered size not divisible by the axis size, an unbound axis name,
      unknown backend or algorithm, ``chunks`` out of range or given for
      backend "xla"; backend "cuda" with the last dimension scattered; at
      lowering: a group that spans nodes, or a partial block larger than the
      fused-op slot.
    RuntimeError: ``backend="cuda"`` but the CUDA path is not usable.

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
    take the xla expression. Backward:
    dX = ``all_gather_matmul(dY, w.T, gather_dimension=scatter_dimension)``
    with the same backend and algorithm, dW = ``x^T @ AG(dY)`` with the
    gathered ``dY`` from that op. For the last dimension the gather runs
    along the contraction of ``dY @ w.T``, so the ring sums the shard
    products instead of placing them.

  Source:
    CommFuse, arXiv 2604.24013, section 3 (GEMM+ReduceScatter, rank-adaptive
    order and tail latency); Megatron-LM, arXiv 2205.05198, section 4.2.2.
  """
  op = "matmul_reduce_scatter"
  num_ranks = _check_operands(op, x, w, axis_name)
  out_shape = tuple(x.shape[:-1]) + (w.shape[1],)
  s = _checks.normalize_dimension(op, "scatter_dimension", scatter_dimension, len(out_shape),
                                  "the output x @ w")
  _checks.check_divisible(op, "scatter_dimension", scatter_dimension, out_shape[s], axis_name,
                          num_ranks, f"the output x @ w (shape {out_shape})")
  unsupported = ("it scatters any output dimension but the last (scatter_dimension="
                 f"{scatter_dimension} is the last)") if s == len(out_shape) - 1 else None
  cfg = _config(op, x, w, axis_name, s, backend, algorithm, chunks, unsupported)
  return _matmul_reduce_scatter(x, w, cfg)


# ----------------------------------------------------------------------------
# matmul_all_reduce


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_all_reduce(x, w, cfg):
  return _matmul_ar_impl(x, w, cfg)


def _matmul_all_reduce_fwd(x, w, cfg):
  return _matmul_all_reduce(x, w, cfg), (x, w)


def _matmul_all_reduce_bwd(cfg, res, dy):
  x, w = res
  if cfg.checked:
    # The output is invariant over the axis; psum transposes to a cast.
    dy = _xla.to_varying(dy, cfg.axis_name)
  else:
    # check_vma=False: every value counts as per-rank; psum transposes to psum.
    dy = (_cuda.all_reduce(dy, cfg.axis_name) if cfg.backend == "cuda"
          else _xla.all_reduce(dy, cfg.axis_name, cfg.algorithm))
  dx = _xla.matmul(dy, w.T)
  dw = _xla.contract_leading(x, dy)
  return _grads(cfg, dx, dw, w.dtype)


_matmul_all_reduce.defvjp(_matmul_all_reduce_fwd, _matmul_all_reduce_bwd)


def matmul_all_reduce(x, w, axis_name, *, backend="auto", algorithm="auto", chunks=None):
  """Multiplies ``x @ w`` and sums the product over the ranks of ``axis_name``.

  Equals ``reference.matmul_all_reduce``, i.e. ``lax.psum(x @ w,
  axis_name)``, up to the order of float32 summation; the result has psum's
  type (invariant over ``axis_name``). Call inside ``jax.shard_map``. This is
  Megatron's row-parallel linear layer without sequence parallelism.

  Args:
    x: ``[..., k_local]`` float32, bfloat16 or float16, any leading
      dimensions.
    w: ``[k_local, n]``, x's dtype.
    axis_name: the mesh axis to reduce over (str), or a tuple of axes.
    backend: ``"auto"``, ``"xla"`` or ``"cuda"`` (see ``jaxoverlap.backend``).
    algorithm: backend "xla": ``"auto"`` (= ``"collective"``),
      ``"collective"`` or ``"ppermute"``; backend "cuda": ``"auto"``,
      ``"copy_engine"`` or ``"nvshmem"`` (the fused kernel; the rows of x,
      all leading dimensions flattened, must divide by the axis size), or
      ``"gemm_all_reduce"`` (the GEMM, then ``jaxoverlap.all_reduce``).
      ``"auto"`` takes the fused kernel when the rows divide and the output
      has at least ``_cuda.FUSED_ALL_REDUCE_MIN_BYTES`` (32 MiB, calibrated
      on 2x H200) per rank, else ``"gemm_all_reduce"``; the choice is logged
      (logger ``jaxoverlap``, INFO) and kept in ``runtime_info()["fused_decisions"]``.
    chunks: backend "cuda", fused algorithms only: pieces each partial block
      is computed and sent in (1 to 32; None: one chunk for blocks
      under 8 MiB, else two).

  Returns:
    ``[..., n]`` in x's dtype, the same on every rank (bit-identical).

  Raises:
    ValueError: unsupported or mismatched dtypes, ``w`` not 2-D,
      ``x.shape[-1] != w.shape[0]``, an unbound axis name, unknown backend or
      algorithm, ``chunks`` out of range or given for backend "xla" or with
      ``"gemm_all_reduce"``; a fused CUDA algorithm with rows not divisible
      by the axis size; at lowering: a group that spans nodes or has more
      than 8 ranks, or a block larger than half a fused-op slot.
    RuntimeError: ``backend="cuda"`` but the CUDA path is not usable.

  Algorithm:
    "ppermute": views ``x`` as ``[rows, k_local]`` and runs the
    GEMM+ReduceScatter ring over the rows of the product (over its columns if
    only they divide by the axis size, else over zero-padded rows), then
    all-gathers the reduced blocks with ``lax.all_gather(...,
    to="invarying")``. Backend "cuda", fused: the GEMM+ReduceScatter kernel
    over the rows, writing this rank's reduced block into its rows of the
    output; each chunk of it, once final, goes by a second stream to every
    peer, while XLA's stream copies each arriving chunk into place.
    Backward: dX = ``dY @ w.T``, dW = ``x^T @ dY`` (the transpose of psum is
    the cast to varying).

  Source:
    CommFuse, arXiv 2604.24013, section 3 (GEMM+AllReduce as GEMM+RS then
    all-gather); Megatron-LM, arXiv 1909.08053, section 3 (row-parallel
    layers).
  """
  op = "matmul_all_reduce"
  num_ranks = _check_operands(op, x, w, axis_name)
  cfg = _config(op, x, w, axis_name, None, backend, algorithm, chunks)
  if cfg.backend == "cuda" and cfg.algorithm != "gemm_all_reduce":
    rows = math.prod(x.shape[:-1])
    out_bytes = rows * w.shape[1] * jax.numpy.dtype(x.dtype).itemsize
    why = None
    if rows % num_ranks:
      if algorithm != "auto":
        raise ValueError(
            f"{op}: algorithm={algorithm!r} needs the rows of x (all leading dimensions, "
            f"{rows}) to divide by the size {num_ranks} of axis {axis_name!r}; use "
            "'gemm_all_reduce' or 'auto'")
      why = f"{rows} rows do not divide by {num_ranks} ranks"
    elif algorithm == "auto" and out_bytes < _cuda.FUSED_ALL_REDUCE_MIN_BYTES:
      why = (f"the output has {out_bytes} bytes per rank, under "
             f"{_cuda.FUSED_ALL_REDUCE_MIN_BYTES} (FUSED_ALL_REDUCE_MIN_BYTES)")
    if why is not None:
      cfg = cfg._replace(algorithm="gemm_all_reduce")
      _cuda.record_fused_decision(op, axis_name, "gemm_all_reduce", why)
      unused = f"; chunks={chunks} is unused" if chunks is not None else ""
      _backend.log_once(op, f"auto runs gemm_all_reduce: {why}{unused}", info=True)
  elif cfg.backend == "cuda" and chunks is not None:
    raise ValueError(f"{op}: chunks={chunks} applies to the fused algorithms, not to "
                     "'gemm_all_reduce'")
  return _matmul_all_reduce(x, w, cfg)
