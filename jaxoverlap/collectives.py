"""all_reduce: the sum of an array over the ranks of a mesh axis.

Problem:
  Tensor-parallel decode all-reduces small activations (8 KB - 4 MB) once or
  twice per layer; NCCL's latency for such messages costs a large part of a
  step, across nodes most of all.

Algorithm:
  ``backend="cuda"`` runs the NVSHMEM kernels of this package (one-shot,
  two-shot, or NVRAR's hierarchical reduce-scatter / recursive doubling /
  all-gather). ``backend="xla"`` runs ``lax.psum`` ("collective") or a ring
  reduce-scatter by ``lax.ppermute`` followed by an all-gather ("ppermute").
  Which one runs is planned when the call is lowered (``jaxoverlap.dispatch``).
  The op is a ``jax.custom_vjp``: its backward pass is the transpose of
  ``psum`` (a cast to varying under ``check_vma=True``).

Example:
  >>> import jax, jaxoverlap
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> f = jax.shard_map(lambda x: jaxoverlap.all_reduce(x, "tp"), mesh=mesh,
  ...                   in_specs=P("tp"), out_specs=P())
  >>> f(jnp.ones((8, 16))).shape   # each rank's [2, 16] summed over 4 ranks
  (2, 16)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from jaxoverlap import _checks, _primitives, _xla, names
from jaxoverlap.dispatch import Request

__all__ = ["all_reduce"]


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
    protocol: backend "cuda": ``"auto"``, ``"ll"`` (8-byte cells of data and
      flag, no separate signal) or ``"simple"`` (data, then a flag).
    transport: ``"auto"`` or the runtime's transport, ``"nvshmem"``.

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

  Forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) is not
  available: the op is a ``jax.custom_vjp``, and a forward-mode tangent on
  ``x`` raises ``TypeError`` naming the op.

  Algorithm:
    "collective" is ``lax.psum``. "ppermute" flattens ``x``, zero-pads it to a
    multiple of the number of ranks, reduce-scatters it around a ring of
    ``num_ranks - 1`` ``ppermute`` steps and all-gathers the reduced chunks.
    The CUDA algorithms: "one_shot" (every rank pushes its buffer to every
    peer of its node, each sums all in rank order), "two_shot"
    (reduce-scatter then all-gather within a node) and "hierarchical" (NVRAR:
    intra-node reduce-scatter, inter-node recursive doubling, intra-node
    all-gather). Backward: the identity (the transpose of ``psum``).

  Source:
    NVRAR, arXiv 2511.09557 ("Understanding and Improving Communication
    Performance in Multi-node LLM Inference"), sections on the hierarchical
    all-reduce; Megatron-LM, arXiv 1909.08053, for where TP all-reduces
    occur.
  """
  op = names.ALL_REDUCE
  _checks.check_array(op, "x", x)
  _checks.refuse_forward_mode(op, x)
  num_ranks = _checks.axis_size(op, axis_name)
  _checks.check_options(op, backend=backend, algorithm=algorithm, protocol=protocol,
                        transport=transport)
  request = Request(op, axis_name, backend=backend, algorithm=algorithm, protocol=protocol,
                    transport=transport)
  cfg = _Config(request, num_ranks, _xla.vma_checked(axis_name), _xla.varying_axes(x))
  return _all_reduce(x, cfg)
