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

from jaxoverlap import _checks, _xla

__all__ = ["all_reduce"]


class _Config(NamedTuple):
  axis_name: str | tuple[str, ...]
  backend: str
  algorithm: str
  checked: bool  # shard_map(check_vma=True)
  x_vma: frozenset


def _all_reduce_impl(x, cfg: _Config):
  if cfg.backend == "cuda":
    from jaxoverlap import _cuda  # lazy: loads the extension only when used
    return _cuda.all_reduce(x, cfg.axis_name, algorithm=cfg.algorithm)
  return _xla.all_reduce(x, cfg.axis_name, cfg.algorithm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_reduce(x, cfg):
  return _all_reduce_impl(x, cfg)


def _all_reduce_fwd(x, cfg):
  return _all_reduce_impl(x, cfg), None


def _all_reduce_bwd(cfg, _, ct):
  if cfg.checked:
    # psum's output is invariant over the axis; its transpose is the cast to
    # varying. An x that was itself invariant entered psum through pvary,
    # whose transpose (in cast_to_vma) sums: d psum(x) / dx = num_ranks.
    return (_xla.cast_to_vma(_xla.to_varying(ct, cfg.axis_name), cfg.x_vma),)
  # check_vma=False: every value counts as per-rank and psum transposes to psum.
  return (_all_reduce_impl(ct, cfg),)


_all_reduce.defvjp(_all_reduce_fwd, _all_reduce_bwd)


def all_reduce(x, axis_name, *, backend="auto", algorithm="auto"):
  """Sums ``x`` over the ranks of ``axis_name``; call inside ``jax.shard_map``.

  Equals ``reference.all_reduce(x, axis_name)``, i.e. ``lax.psum(x,
  axis_name)``, up to the order of summation; the result has psum's type
  (invariant over ``axis_name``).

  Args:
    x: this rank's array, any shape, float32, bfloat16 or float16. Its size
      in bytes is the message size.
    axis_name: the mesh axis to reduce over (str), or a tuple of axes.
    backend: ``"auto"``, ``"xla"`` or ``"cuda"`` (see ``jaxoverlap.backend``).
    algorithm: ``"auto"``; with backend "xla" also ``"collective"`` or
      ``"ppermute"``; with backend "cuda" also ``"one_shot"``, ``"two_shot"``
      or ``"hierarchical"``, the first and last with a protocol suffix
      ``"_ll"`` or ``"_simple"`` (default: chosen by size). "auto" on cuda
      asks the tuning policy (``jaxoverlap.tuning``), which may hand over to
      ``lax.psum`` where NCCL is faster; the choice is logged.

  Returns:
    An array of x's shape and dtype: the sum over all ranks, the same on each.

  Raises:
    ValueError: unsupported dtype, an axis name not bound by the enclosing
      ``shard_map``, unknown backend, or an algorithm the resolved backend
      lacks.
    RuntimeError: ``backend="cuda"`` while the CUDA path is not usable (the
      message says why). Errors of the CUDA kernels reach Python as XLA errors
      that carry the C++ message.

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
  _checks.check_array("all_reduce", "x", x)
  _checks.axis_size("all_reduce", axis_name)
  backend, algorithm = _checks.resolve_algorithm("all_reduce", backend, algorithm)
  cfg = _Config(axis_name, backend, algorithm, _xla.vma_checked(axis_name),
                _xla.varying_axes(x))
  return _all_reduce(x, cfg)
