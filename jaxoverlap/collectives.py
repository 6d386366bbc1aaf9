"""all_reduce: the sum of an array over the ranks of a mesh axis (and all_reduce_rms_norm).

Problem:
  Tensor-parallel decode all-reduces small activations (8 KB - 4 MB) once or
  twice per layer; NCCL's latency for such messages costs a large part of a
  step, across nodes most of all.

Algorithm:
  ``backend="cuda"`` runs the CUDA kernels of this package over their runtime
  (NVSHMEM, or CUDA peer access in one process): one-shot, two-shot, or
  NVRAR's hierarchical reduce-scatter / recursive doubling / all-gather.
  ``backend="xla"`` runs ``lax.psum`` ("collective") or a ring reduce-scatter
  by ``lax.ppermute`` followed by an all-gather ("ppermute").
  Which one runs is planned when the call is lowered (``jaxoverlap.dispatch``).
  The op is a ``jax.custom_vjp``: its backward pass is the transpose of
  ``psum`` (a cast to varying under ``check_vma=True``).

Example:
  >>> import jax, jax.numpy as jnp, jaxoverlap
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> f = jax.shard_map(lambda x: jaxoverlap.all_reduce(x, "tp"), mesh=mesh,
  ...                   in_specs=P("tp"), out_specs=P())
  >>> f(jnp.ones((8, 16))).shape   # each rank's [2, 16] summed over 4 ranks
  (2, 16)
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxoverlap import _checks, _primitives, _xla, names
from jaxoverlap.dispatch import Request

__all__ = ["all_reduce", "all_reduce_rms_norm"]


class _Config(NamedTuple):
  request: Request
  num_ranks: int
  checked: bool  # shard_map(check_vma=True)
  x_vma: frozenset


def _all_reduce_impl(x, cfg: _Config):
  # psum of a value that is the same on every rank is num_ranks * x.
  x = _xla.to_varying(x, cfg.request.axis_name)
  return _primitives.bind_all_reduce(x, cfg.request, cfg.num_ranks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_reduce(x, cfg):
  return _all_reduce_impl(x, cfg)


def _all_reduce_fwd(x, cfg):
  return _all_reduce_impl(x, cfg), None


def _all_reduce_bwd(cfg, _, ct):
  axis_name = cfg.request.axis_name
  if cfg.checked:
    # psum's output is invariant over the axis; its transpose is the cast to
    # varying. An x that was itself invariant entered psum through pvary,
    # whose transpose (in cast_to_vma) sums: d psum(x) / dx = num_ranks.
    return (_xla.cast_to_vma(_xla.to_varying(ct, axis_name), cfg.x_vma),)
  # check_vma=False: every value counts as per-rank and psum transposes to psum.
  return (_all_reduce_impl(ct, cfg),)


_all_reduce.defvjp(_all_reduce_fwd, _all_reduce_bwd)


def all_reduce(x, axis_name, *, backend="auto", algorithm="auto", protocol="auto",
               transport="auto"):
  """Sums ``x`` over the ranks of ``axis_name``; call inside ``jax.shard_map``.

  Equals ``reference.all_reduce(x, axis_name)``, i.e. ``lax.psum(x,
  axis_name)``, up to the order of summation; the result has psum's type
  (invariant over ``axis_name``).

  Args:
    x: this rank's array, any shape, float32, bfloat16 or float16. Its size
      in bytes is the message size.
    axis_name: the mesh axis to reduce over (str), or a tuple of axes.
    backend: ``"auto"``, ``"xla"`` or ``"cuda"``. "auto" runs the CUDA
      kernels where they can run (GPUs, ``jaxoverlap.initialize()`` called,
      a group the kernels take) and XLA elsewhere, and logs why.
    algorithm: ``"auto"``; backend "xla": ``"collective"`` (``lax.psum``) or
      ``"ppermute"``; backend "cuda": ``"one_shot"``, ``"two_shot"`` or
      ``"hierarchical"``. "auto" asks the tuning policy
      (``jaxoverlap.tuning.policy``: the measured table, else the cost
      model), which may hand the call to ``lax.psum`` where NCCL is faster.
    protocol: backend "cuda": ``"auto"``, ``"ll"`` (8-byte LL cells of 4
      bytes of data + a 4-byte flag, no separate signal), ``"simple"`` (data,
      then a flag) or, within one node (``"one_shot"``, ``"two_shot"``),
      ``"lamport"`` (data alone, into slots that read as an empty pattern
      until it arrives; a NaN input stays NaN, maybe with another payload).
    transport: ``"auto"`` or the runtime's transport: ``"nvshmem"`` (one
      process per GPU) or ``"peer"`` (one process driving several GPUs).

  Returns:
    An array of x's shape and dtype: the sum over all ranks, the same on each.
    ``jaxoverlap.decisions()`` says how it ran (a plan is made when the call
    is lowered).

  Raises:
    ValueError: unsupported dtype; an axis name that is not a manual axis of
      the enclosing ``shard_map``; an unknown or contradictory backend,
      algorithm, protocol or transport (values of version 0.1 such as
      ``"one_shot_ll"`` name their new spelling); at lowering, a CUDA-only
      choice for a group the kernels do not take (e.g. "one_shot" across
      nodes).
    RuntimeError: at lowering, backend "cuda" (or a CUDA-only choice) while
      the CUDA kernels cannot run in this process; the message says why.
      Errors of the kernels reach Python as XLA errors that carry the C++
      message.
    TypeError: a forward-mode tangent on ``x`` (``jax.jvp``,
      ``jax.jacfwd``): the op is a ``jax.custom_vjp``, with a reverse-mode
      rule only (``jaxoverlap._checks.refuse_forward_mode`` says when the
      message names the op). Reverse mode of any order and ``jax.hessian``
      work (README, "Known limits").

  Algorithm:
    "collective" is ``lax.psum``. "ppermute" flattens ``x``, zero-pads it to a
    multiple of the number of ranks, reduce-scatters it around a ring of
    ``num_ranks - 1`` ``ppermute`` steps and all-gathers the reduced chunks.
    The CUDA algorithms: "one_shot" (every rank pushes its buffer to every
    peer of its node, each sums all in rank order), "two_shot"
    (reduce-scatter then all-gather within a node) and "hierarchical" (NVRAR:
    intra-node reduce-scatter, inter-node recursive doubling, intra-node
    all-gather). Empty operands and a group of one rank take the xla
    expression, whatever the backend. Backward: the identity (the transpose
    of ``psum``).

  Source:
    NVRAR, arXiv 2511.09557 ("Understanding and Improving Communication
    Performance in Multi-node LLM Inference"), sec. 4 (the hierarchical
    all-reduce: intra-node reduce-scatter, inter-node recursive doubling,
    intra-node all-gather, with one-sided NVSHMEM puts); recursive doubling
    and its fold for node counts that are not powers of two: Thakur,
    Rabenseifner & Gropp, "Optimization of Collective Communication
    Operations in MPICH", IJHPCA 19(1), 2005; the LL protocol: NCCL's, as
    arXiv 2507.04786 ("Demystifying NCCL") describes it; one-shot, two-shot
    and the Lamport protocol: TensorRT-LLM's custom all-reduce kernels
    (docs/design.md, "References"); Megatron-LM, arXiv 1909.08053, for where
    TP all-reduces occur.
  """
  _checks.refuse_forward_mode(names.ALL_REDUCE, x)
  cfg = _checked_config(x, axis_name, backend, algorithm, protocol, transport)
  # The scope names the op in HLO metadata and profiles ("jaxoverlap.all_reduce/...").
  with jax.named_scope("jaxoverlap." + names.ALL_REDUCE):
    return _all_reduce(x, cfg)


def _checked_config(x, axis_name, backend, algorithm, protocol, transport) -> _Config:
  """``all_reduce``'s checks of its arguments, and its config."""
  op = names.ALL_REDUCE
  _checks.check_array(op, "x", x)
  num_ranks = _checks.axis_size(op, axis_name)
  _checks.check_options(op, backend=backend, algorithm=algorithm, protocol=protocol,
                        transport=transport)
  request = Request(op, axis_name, backend=backend, algorithm=algorithm, protocol=protocol,
                    transport=transport)
  return _Config(request, num_ranks, _xla.vma_checked(axis_name), _xla.varying_axes(x))


def all_reduce_in_rule(x, axis_name, *, backend="auto", algorithm="auto", protocol="auto"):
  """``all_reduce``'s value, for another op's differentiation rule (not public).

  A ``custom_vjp`` rule that all-reduces (Megatron's ``f``, whose backward is an
  all-reduce) calls this rather than ``all_reduce``: it binds the primitive
  directly, whose JVP rule carries a tangent, so that ``jax.hessian`` and
  Hessian-vector products (forward over reverse) go through the rule, where
  ``all_reduce``, itself a ``custom_vjp``, refuses the tangent. Same checks
  and kernels as ``all_reduce``; same errors but that one.
  """
  return _all_reduce_impl(x, _checked_config(x, axis_name, backend, algorithm, protocol,
                                             "auto"))


# ---------------------------------------------------------------------------- all_reduce_rms_norm


class _NormConfig(NamedTuple):
  request: Request
  num_ranks: int
  eps: float
  checked: bool  # shard_map(check_vma=True)
  vmas: tuple  # the varying axes of p, residual, weight


def _norm_impl(p, residual, weight, cfg: _NormConfig):
  p = _xla.to_varying(p, cfg.request.axis_name)
  h, y = _primitives.bind_all_reduce_rms_norm(p, residual, weight, cfg.request, cfg.num_ranks,
                                              cfg.eps)
  return h, y


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _all_reduce_rms_norm(p, residual, weight, cfg):
  return _norm_impl(p, residual, weight, cfg)


def _norm_fwd(p, residual, weight, cfg):
  h, y = _norm_impl(p, residual, weight, cfg)
  return (h, y), (h, weight)


def _norm_bwd(cfg, saved, cts):
  h, weight = saved
  ct_h, ct_y = cts
  # The VJP of the pure expression: y = norm(h, weight) (in closed form,
  # _xla.rms_norm_vjp), h = residual + psum(p), whose cotangent passes unchanged
  # to the residual and, through psum's transpose, to every rank's p.
  dh_norm, dw = _xla.rms_norm_vjp(h, weight, ct_y, cfg.eps)
  p_vma, r_vma, w_vma = cfg.vmas
  axis_name = cfg.request.axis_name
  if cfg.checked:
    # h varies over (p's axes less the reduced ones) and the residual's; dh_norm
    # also over the weight's. Where only the weight varies, h reached y through
    # pvary, whose transpose sums: sum dh_norm there before adding ct_h, which
    # is already h's cotangent (summing after would count ct_h once per rank).
    dh_norm = _xla.cast_to_vma(dh_norm, (frozenset(p_vma) - set(names.axis_names(axis_name)))
                               | frozenset(r_vma))
  dh = ct_h + dh_norm
  if cfg.checked:
    # psum(p) is invariant over the axis: a varying h (a varying residual)
    # received it through pvary, whose transpose sums; psum's own transpose
    # is the cast to varying.
    ds = _xla.cast_to_vma(dh, frozenset(p_vma) - set(names.axis_names(axis_name)))
    dp = _xla.cast_to_vma(_xla.to_varying(ds, axis_name), p_vma)
  else:  # every value counts as per-rank and psum transposes to psum
    alg = cfg.request.algorithm  # an XLA algorithm stays; one_shot and unfused become auto
    if names.backend_of_algorithm(names.ALL_REDUCE, alg) != names.XLA:
      alg = names.AUTO
    sub = Request(names.ALL_REDUCE, axis_name, backend=cfg.request.backend, algorithm=alg)
    dp = _primitives.bind_all_reduce(dh, sub, cfg.num_ranks)
  return dp, _xla.cast_to_vma(dh, r_vma), _xla.cast_to_vma(dw, w_vma)


_all_reduce_rms_norm.defvjp(_norm_fwd, _norm_bwd)


def _check_norm_operands(op, p, residual, weight, eps):
  p_dtype = _checks.check_array(op, "p", p)
  r_dtype = _checks.check_array(op, "residual", residual)
  w_dtype = _checks.check_array(op, "weight", weight)
  if not p_dtype == r_dtype == w_dtype:
    raise ValueError(f"{op}: p.dtype={p_dtype}, residual.dtype={r_dtype} and "
                     f"weight.dtype={w_dtype} must be one dtype; cast them alike")
  if len(p.shape) < 1:
    raise ValueError(f"{op}: p must have at least 1 dimension [..., hidden], got p.shape=()")
  if tuple(residual.shape) != tuple(p.shape):
    raise ValueError(f"{op}: residual.shape={tuple(residual.shape)} differs from "
                     f"p.shape={tuple(p.shape)}")
  if tuple(weight.shape) != (p.shape[-1],):
    raise ValueError(f"{op}: weight.shape={tuple(weight.shape)} must be (hidden,) = "
                     f"({p.shape[-1]},), the last dimension of p")
  if p.shape[-1] == 0:
    raise ValueError(f"{op}: the normalized dimension is empty (p.shape={tuple(p.shape)})")
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
    raise TypeError(f"{op}: eps must be a Python float, got {type(eps).__name__}")
  if not (math.isfinite(eps) and eps > 0):
    raise ValueError(f"{op}: eps must be positive and finite, got eps={eps!r}")


def all_reduce_rms_norm(p, residual, weight, axis_name, *, eps=1e-6, backend="auto",
                        algorithm="auto"):
  """``h = residual + all_reduce(p)``, ``y = rms_norm(h) * weight``; call inside ``shard_map``.

  The pattern after every row-parallel layer of a pre-norm transformer in
  decode: the layer's partial sums are all-reduced, added to the residual
  stream, and the sum is normalized for the next layer. Equals
  ``reference.all_reduce_rms_norm`` up to the order of summation (and, on
  backend "cuda", psum's intermediate rounding to the dtype, which the kernel
  skips: it sums the ranks and the residual in float32 and rounds h once).

  Args:
    p: this rank's partial sums, ``[..., hidden]``, float32, bfloat16 or
      float16, varying over ``axis_name`` like ``all_reduce``'s input.
    residual: ``[..., hidden]``, p's shape and dtype; normally invariant over
      the axis (the residual stream, the same on every rank).
    weight: ``[hidden]``, p's dtype: the RMSNorm scale.
    axis_name: the mesh axis to reduce over (str), or a tuple of axes.
    eps: added to the mean square before the reciprocal square root (> 0).
    backend: ``"auto"``, ``"xla"`` or ``"cuda"``. "auto" runs the CUDA
      kernels where they can run (GPUs, ``jaxoverlap.initialize()`` called,
      the group within one node) and the pure-JAX expression elsewhere;
      ``jaxoverlap.decisions()`` says why.
    algorithm: ``"auto"``; backend "xla": ``"collective"`` (``lax.psum``) or
      ``"ppermute"`` (the ring of ``all_reduce``), then the norm in JAX;
      backend "cuda": ``"one_shot"`` (the fused kernel: the message within
      one launch of the one-shot LL all-reduce, a row a whole number of LL8
      lines of 8 bytes of data) or ``"unfused"`` (``all_reduce`` with its
      own automatic choice, then the residual add and the norm in XLA).
      "auto" on backend "cuda" fuses rows of at most 8 KiB, where the fused
      kernel was measured faster (``jaxoverlap.tuning.policy.fuse_norm``),
      and runs "unfused" otherwise.

  Returns:
    ``(h, y)``, both of p's shape and dtype: ``h = residual + psum(p)`` (the
    new residual stream) and ``y = h * rsqrt(mean(h^2, -1) + eps) * weight``,
    computed in float32 from h as rounded to the dtype, rounded once. With an
    invariant residual and weight both are invariant over ``axis_name``, like
    ``all_reduce``'s output.

  Raises:
    ValueError: an unsupported dtype or dtypes that differ; ``residual`` not
      of p's shape, ``weight`` not ``[hidden]``, a scalar p or an empty last
      dimension; eps not positive and finite; an axis name that is not a
      manual axis of the enclosing ``shard_map``; an unknown or contradictory
      backend or algorithm; at lowering, ``backend="cuda"`` for a group across
      nodes, or ``algorithm="one_shot"`` for a call the fused kernel does not
      take (a message above one launch, a row that is not a whole number of
      LL8 lines of 8 bytes of data).
    TypeError: eps not a real number; a forward-mode tangent (the op is a
      ``jax.custom_vjp``; as for ``all_reduce``, reverse mode of any order and
      ``jax.hessian`` work).
    RuntimeError: at lowering, ``backend="cuda"`` while the CUDA kernels
      cannot run in this process; the message says why.

  Algorithm:
    Backend "cuda", "one_shot": one kernel. Every rank pushes its p to every
    peer of its node as LL8 lines (16 bytes: two 8-byte LL cells, each 4
    bytes of data + a 4-byte flag holding the call's epoch; the one-shot LL
    all-reduce of ``all_reduce``), and each block owns whole rows: it sums
    the ranks in rank order in float32, adds the residual, writes h, reduces
    the row's sum of squares across the block in float32 and writes y. The
    completion protocol (pair epochs, two slot parities) is the
    all-reduce's. "unfused": ``all_reduce``'s kernel, then the add and the
    norm as XLA fusions. Empty operands and a group of one rank take the xla
    expression, whatever the backend. Backward (both backends): the VJP of
    the pure expression; the cotangent of h (its own plus the norm's) goes
    to the residual and, as the transpose of ``psum``, to every rank's p.

  Example:
    In a pre-norm decoder each call takes the norm that follows it: the
    attention's all-reduce brings the MLP's norm weight, the MLP's brings
    the next layer's attention norm (the final norm after the last layer).
    Only the first layer's attention norm stays a plain RMSNorm. Per rank,
    inside ``shard_map`` over "tp", with ``weights`` stacked over layers:

    >>> def layer(carry, l):  # carry: (h, the normed input of this attention)
    ...   h, y = carry
    ...   h, y = all_reduce_rms_norm(attention_partial(y, l), h, l["mlp_norm"], "tp")
    ...   h, y = all_reduce_rms_norm(mlp_partial(y, l), h, l["next_norm"], "tp")
    ...   return (h, y), None
    >>> # l["next_norm"]: layer i + 1's attention norm; the final norm for the last
    >>> (h, y), _ = jax.lax.scan(layer, (h0, rms_norm(h0) * attn_norm_0), weights)

    ``jaxoverlap.nnx.apply_blocks`` does this for ``TransformerBlock`` layers
    (``ParallelConfig(fuse_norm=True)``).

  Source:
    RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization",
    NeurIPS 2019 (arXiv 1910.07467). The one-shot all-reduce: TensorRT-LLM's
    custom all-reduce; the LL protocol: NCCL's (arXiv 2507.04786); the fusion
    of the norm into the all-reduce: TensorRT-LLM's all-reduce fusion kernels
    (docs/design.md, "References"). Where the pattern occurs: Megatron-LM,
    arXiv 1909.08053 (the all-reduce after each row-parallel layer).
  """
  op = names.ALL_REDUCE_RMS_NORM
  _check_norm_operands(op, p, residual, weight, eps)
  _checks.refuse_forward_mode(op, p, residual, weight)
  num_ranks = _checks.axis_size(op, axis_name)
  _checks.check_options(op, backend=backend, algorithm=algorithm)
  request = Request(op, axis_name, backend=backend, algorithm=algorithm)
  cfg = _NormConfig(request, num_ranks, float(eps), _xla.vma_checked(axis_name),
                    (_xla.varying_axes(p), _xla.varying_axes(residual),
                     _xla.varying_axes(weight)))
  with jax.named_scope("jaxoverlap." + names.ALL_REDUCE_RMS_NORM):
    return _all_reduce_rms_norm(p, residual, weight, cfg)
