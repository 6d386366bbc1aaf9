"""Fused compute-communication: AllGather+GEMM, GEMM+ReduceScatter, GEMM+AllReduce.

Problem:
  In tensor-parallel transformers every column-parallel layer all-gathers its
  sequence-parallel input before the GEMM, every row-parallel layer
  reduce-scatters (or all-reduces) the GEMM's output (Megatron-LM). Run one
  after the other, the collective is exposed: 15-55% of these ops on our
  2x H200.

Algorithm:
  Each op replaces the collective by peer-to-peer shard transfers interleaved
  with shard GEMMs, in CommFuse's rank-adaptive order: AllGather+GEMM
  multiplies the local shard first and the others' shards as they arrive;
  GEMM+ReduceScatter computes the partial blocks that other ranks own first
  and sends them on while it continues, and its own block last, so the last
  step's transfer is hidden; GEMM+AllReduce is GEMM+ReduceScatter followed by
  an all-gather. Backend "xla" implements this with ``lax.ppermute``
  (algorithm "ppermute") next to the plain collective ("collective", the
  default); see ``jaxoverlap._xla``. Every op is a ``jax.custom_vjp`` whose
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
from typing import NamedTuple

import jax

from jaxoverlap import _checks, _xla

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]


class _Config(NamedTuple):
  axis_name: str | tuple[str, ...]
  dim: int | None  # gather/scatter dimension, normalised to >= 0
  backend: str
  algorithm: str
  checked: bool  # shard_map(check_vma=True)
  x_vma: frozenset
  w_vma: frozenset


def _check_operands(op, x, w, axis_name) -> int:
  """Validates x, w and axis_name; returns the number of ranks along the axis."""
  _checks.check_matmul_operands(op, x, w)
  return _checks.axis_size(op, axis_name)


def _config(op, x, w, axis_name, dim, backend, algorithm) -> _Config:
  """Resolves backend and algorithm and records what the backward pass needs."""
  backend, algorithm = _checks.resolve_algorithm(op, backend, algorithm)
  return _Config(axis_name, dim, backend, algorithm, _xla.vma_checked(axis_name),
                 _xla.varying_axes(x), _xla.varying_axes(w))


def _no_cuda(op):
  # backend.select_backend never resolves these ops to "cuda" in this version.
  raise RuntimeError(f"{op}: no CUDA kernel in this version")


# ----------------------------------------------------------------------------
# Implementations shared by forward and backward passes (no custom_vjp).


def _ag_matmul_impl(x, w, axis_name, dim, backend, algorithm):
  if backend != "xla":
    _no_cuda("all_gather_matmul")
  return _xla.all_gather_matmul(x, w, axis_name, dim, algorithm)


def _matmul_rs_impl(x, w, axis_name, dim, backend, algorithm):
  if backend != "xla":
    _no_cuda("matmul_reduce_scatter")
  return _xla.matmul_reduce_scatter(x, w, axis_name, dim, algorithm)


def _matmul_ar_impl(x, w, axis_name, backend, algorithm):
  if backend != "xla":
    _no_cuda("matmul_all_reduce")
  return _xla.matmul_all_reduce(x, w, axis_name, algorithm)


def _grads(cfg, dx, dw, dtype):
  return (_xla.cast_to_vma(dx.astype(dtype), cfg.x_vma),
          _xla.cast_to_vma(dw.astype(dtype), cfg.w_vma))


# ----------------------------------------------------------------------------
# all_gather_matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _all_gather_matmul(x, w, cfg):
  return _ag_matmul_impl(x, w, cfg.axis_name, cfg.dim, cfg.backend, cfg.algorithm)[0]


def _all_gather_matmul_fwd(x, w, cfg):
  y, xg = _ag_matmul_impl(x, w, cfg.axis_name, cfg.dim, cfg.backend, cfg.algorithm)
  return y, (xg, w)


def _all_gather_matmul_bwd(cfg, res, dy):
  xg, w = res
  # dX = RS(dY @ w^T) along the gathered dimension; dW = AG(X)^T @ dY.
  dx = _matmul_rs_impl(dy, w.T, cfg.axis_name, cfg.dim, cfg.backend, cfg.algorithm)
  dw = _xla.contract_leading(xg, dy)
  return _grads(cfg, dx, dw, w.dtype)


_all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0, backend="auto",
                      algorithm="auto"):
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
    backend: ``"auto"`` or ``"xla"`` (no CUDA kernel yet).
    algorithm: ``"auto"`` (= ``"collective"``), ``"collective"`` or
      ``"ppermute"``.

  Returns:
    ``[..., m_local * num_ranks, ..., n_local]`` in x's dtype (float32
    accumulation), ranks' shards in rank order along ``gather_dimension``.

  Raises:
    ValueError: unsupported or mismatched dtypes, ``w`` not 2-D,
      ``x.shape[-1] != w.shape[0]``, ``gather_dimension`` out of range or the
      contracted dimension, an unbound axis name, unknown backend or
      algorithm.
    RuntimeError: ``backend="cuda"`` (no kernel for this op yet).

  Algorithm:
    "ppermute": a ring of ``num_ranks - 1`` ``ppermute`` steps. Each rank
    multiplies its own shard first, then the shards of ranks ``r - 1, r - 2,
    ...`` as they arrive, each product written straight into its rows of the
    output; every transfer overlaps the previous shard's GEMM. Backward: dX =
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
  cfg = _config(op, x, w, axis_name, g, backend, algorithm)
  return _all_gather_matmul(x, w, cfg)


# ----------------------------------------------------------------------------
# matmul_reduce_scatter


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_reduce_scatter(x, w, cfg):
  return _matmul_rs_impl(x, w, cfg.axis_name, cfg.dim, cfg.backend, cfg.algorithm)


def _matmul_reduce_scatter_fwd(x, w, cfg):
  return _matmul_reduce_scatter(x, w, cfg), (x, w)


def _matmul_reduce_scatter_bwd(cfg, res, dy):
  x, w = res
  # dX = AG(dY) @ w^T, gathered along the scattered dimension. When that is
  # the last one (w's columns), AG(dY) @ w^T contracts over the gathered
  # dimension: the same ring sums the shard products instead of placing them.
  dx, dy_full = _ag_matmul_impl(dy, w.T, cfg.axis_name, cfg.dim, cfg.backend, cfg.algorithm)
  dw = _xla.contract_leading(x, dy_full)
  return _grads(cfg, dx, dw, w.dtype)


_matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension=0, backend="auto",
                          algorithm="auto"):
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
      from the end. Its size must be divisible by the axis size.
    backend: ``"auto"`` or ``"xla"`` (no CUDA kernel yet).
    algorithm: ``"auto"`` (= ``"collective"``), ``"collective"`` or
      ``"ppermute"``.

  Returns:
    ``x @ w`` summed over the ranks, of which this rank keeps block ``rank``
    along ``scatter_dimension``: ``[..., n]`` with that dimension divided by
    ``num_ranks``, in x's dtype (float32 GEMM accumulation; the cross-rank
    sum rounds to x's dtype at each step, like ``psum_scatter``).

  Raises:
    ValueError: unsupported or mismatched dtypes, ``w`` not 2-D,
      ``x.shape[-1] != w.shape[0]``, ``scatter_dimension`` out of range, the
      scattered size not divisible by the axis size, an unbound axis name,
      unknown backend or algorithm.
    RuntimeError: ``backend="cuda"`` (no kernel for this op yet).

  Algorithm:
    "ppermute": the accumulator of output block ``d`` starts on rank ``d + 1``
    and moves right around a ring; each rank adds its partial product
    (the rows of ``x``, or the columns of ``w`` when the last dimension is
    scattered) and passes it on. A rank thus computes the other ranks' blocks
    first and its own last, while the final transfer is in flight. Backward:
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
  cfg = _config(op, x, w, axis_name, s, backend, algorithm)
  return _matmul_reduce_scatter(x, w, cfg)


# ----------------------------------------------------------------------------
# matmul_all_reduce


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_all_reduce(x, w, cfg):
  return _matmul_ar_impl(x, w, cfg.axis_name, cfg.backend, cfg.algorithm)


def _matmul_all_reduce_fwd(x, w, cfg):
  return _matmul_all_reduce(x, w, cfg), (x, w)


def _matmul_all_reduce_bwd(cfg, res, dy):
  x, w = res
  if cfg.checked:
    # The output is invariant over the axis; psum transposes to a cast.
    dy = _xla.to_varying(dy, cfg.axis_name)
  else:
    # check_vma=False: every value counts as per-rank; psum transposes to psum.
    dy = _xla.all_reduce(dy, cfg.axis_name, cfg.algorithm)
  dx = _xla.matmul(dy, w.T)
  dw = _xla.contract_leading(x, dy)
  return _grads(cfg, dx, dw, w.dtype)


_matmul_all_reduce.defvjp(_matmul_all_reduce_fwd, _matmul_all_reduce_bwd)


def matmul_all_reduce(x, w, axis_name, *, backend="auto", algorithm="auto"):
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
    backend: ``"auto"`` or ``"xla"`` (no CUDA kernel yet).
    algorithm: ``"auto"`` (= ``"collective"``), ``"collective"`` or
      ``"ppermute"``.

  Returns:
    ``[..., n]`` in x's dtype, the same on every rank.

  Raises:
    ValueError: unsupported or mismatched dtypes, ``w`` not 2-D,
      ``x.shape[-1] != w.shape[0]``, an unbound axis name, unknown backend or
      algorithm.
    RuntimeError: ``backend="cuda"`` (no kernel for this op yet).

  Algorithm:
    "ppermute": views ``x`` as ``[rows, k_local]`` and runs the
    GEMM+ReduceScatter ring over the rows of the product (over its columns if
    only they divide by the axis size, else over zero-padded rows), then
    all-gathers the reduced blocks with ``lax.all_gather(...,
    to="invarying")``. Backward: dX = ``dY @ w.T``, dW = ``x^T @ dY`` (the
    transpose of psum is the cast to varying).

  Source:
    CommFuse, arXiv 2604.24013, section 3 (GEMM+AllReduce as GEMM+RS then
    all-gather); Megatron-LM, arXiv 1909.08053, section 3 (row-parallel
    layers).
  """
  op = "matmul_all_reduce"
  _check_operands(op, x, w, axis_name)
  cfg = _config(op, x, w, axis_name, None, backend, algorithm)
  return _matmul_all_reduce(x, w, cfg)
