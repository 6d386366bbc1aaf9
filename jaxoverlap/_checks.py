"""Trace-time validation of the public ops' arguments.

Problem:
  Bad input to a collective shows up late and far from its cause: a shape
  mismatch inside a ring of ``ppermute`` steps, an unbound axis deep inside
  XLA, a CUDA kernel reading past a buffer. Every public op therefore checks
  its arguments when it is traced, before it emits any operation.

Algorithm:
  Each check raises ``ValueError`` whose message starts with the op's name and
  states the offending values, e.g. ``all_gather_matmul: x.shape[-1]=96 does
  not match w.shape[0]=64 (the contracted dimension k)``. Only shapes, dtypes,
  static arguments and the sizes of the bound mesh axes are read.

Example:
  >>> num_ranks = axis_size("all_reduce", "tp")          # inside shard_map
  >>> backend, algorithm = resolve_algorithm("all_reduce", "auto", "auto")
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jax import lax

from jaxoverlap import backend as _backend

__all__ = [
    "DTYPES",
    "XLA_ALGORITHMS",
    "CUDA_ALGORITHMS",
    "axis_size",
    "check_array",
    "check_matmul_operands",
    "normalize_dimension",
    "resolve_algorithm",
]

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

XLA_ALGORITHMS = ("auto", "collective", "ppermute")

# Algorithms of the CUDA kernels, per op (ops without a kernel have none).
CUDA_ALGORITHMS = {
    "all_reduce": ("auto", "one_shot", "one_shot_ll", "one_shot_simple", "two_shot",
                   "hierarchical", "hierarchical_ll", "hierarchical_simple"),
    "all_gather_matmul": ("auto", "copy_engine", "nvshmem"),
    "matmul_reduce_scatter": ("auto", "copy_engine", "nvshmem"),
    "matmul_all_reduce": ("auto", "copy_engine", "nvshmem", "gemm_all_reduce"),
}


def _axis_names(op: str, axis_name) -> tuple[str, ...]:
  if isinstance(axis_name, str):
    return (axis_name,)
  if (isinstance(axis_name, tuple) and axis_name
      and all(isinstance(a, str) for a in axis_name)
      and len(set(axis_name)) == len(axis_name)):
    return axis_name
  raise ValueError(
      f"{op}: axis_name must be a mesh axis name (str) or a tuple of distinct "
      f"names, got axis_name={axis_name!r}")


def axis_size(op: str, axis_name) -> int:
  """Number of ranks along ``axis_name``, which must be bound by ``shard_map``.

  Args:
    op: the public op's name, for the message.
    axis_name: a mesh axis name, or a tuple of distinct names.

  Returns:
    The size of the axis (the product of the sizes, for a tuple).

  Raises:
    ValueError: ``axis_name`` is not a str or tuple of str, or names an axis
      that is not bound here (the message lists the bound mesh axes).
  """
  names = _axis_names(op, axis_name)
  try:
    return int(lax.axis_size(axis_name))
  except NameError:
    bound = tuple(jax.sharding.get_abstract_mesh().axis_names)
    missing = [a for a in names if a not in bound]
    raise ValueError(
        f"{op}: axis_name={axis_name!r} is not a mesh axis bound here "
        f"(unbound: {tuple(missing) or names}; bound mesh axes: {bound}); call "
        f"{op} inside jax.shard_map over a mesh that has that axis") from None


def check_array(op: str, name: str, a) -> jnp.dtype:
  """Checks that ``a`` is an array of a supported dtype and returns its dtype.

  Raises:
    ValueError: ``a`` has no shape/dtype, or its dtype is not float32,
      bfloat16 or float16.
  """
  if not (hasattr(a, "shape") and hasattr(a, "dtype")):
    raise ValueError(f"{op}: {name} must be an array, got {type(a).__name__}")
  dtype = jnp.dtype(a.dtype)
  if dtype not in DTYPES:
    raise ValueError(
        f"{op}: {name}.dtype={dtype} is not supported; use one of "
        f"{', '.join(str(d) for d in DTYPES)}")
  return dtype


def check_matmul_operands(op: str, x, w) -> None:
  """Checks ``x: [..., k]`` and ``w: [k, n]`` for ``x @ w``.

  Raises:
    ValueError: unsupported dtype, x/w dtype mismatch, x a scalar, w not
      2-D, or ``x.shape[-1] != w.shape[0]``.
  """
  x_dtype = check_array(op, "x", x)
  w_dtype = check_array(op, "w", w)
  if x_dtype != w_dtype:
    raise ValueError(
        f"{op}: x.dtype={x_dtype} and w.dtype={w_dtype} differ; cast both to "
        f"one dtype")
  if len(w.shape) != 2:
    raise ValueError(f"{op}: w must be 2-D [k, n], got w.shape={tuple(w.shape)}")
  if len(x.shape) < 1:
    raise ValueError(f"{op}: x must have at least 1 dimension [..., k], got x.shape=()")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(
        f"{op}: x.shape[-1]={x.shape[-1]} does not match w.shape[0]={w.shape[0]} "
        f"(the contracted dimension k)")


def normalize_dimension(op: str, name: str, dim, ndim: int, what: str) -> int:
  """Returns ``dim`` in ``[0, ndim)``; negative values count from the end.

  Raises:
    ValueError: ``dim`` is not an int, or is outside ``[-ndim, ndim)``.
  """
  if isinstance(dim, bool):
    raise ValueError(f"{op}: {name} must be an int, got {dim!r}")
  try:
    dim = operator.index(dim)
  except TypeError:
    raise ValueError(f"{op}: {name} must be an int, got {dim!r}") from None
  if not -ndim <= dim < ndim:
    raise ValueError(
        f"{op}: {name}={dim} is out of range for {what} of ndim={ndim} "
        f"(valid: {-ndim}..{ndim - 1})")
  return dim % ndim


def check_divisible(op: str, name: str, dim: int, size: int, axis_name,
                    num_ranks: int, what: str) -> None:
  """Checks that ``size`` (the length of ``what`` along ``dim``) divides evenly.

  Raises:
    ValueError: ``size % num_ranks != 0``.
  """
  if size % num_ranks:
    raise ValueError(
        f"{op}: {what} has size {size} along {name}={dim}, which is not "
        f"divisible by the size {num_ranks} of axis {axis_name!r}")


def resolve_algorithm(op: str, backend: str, algorithm: str) -> tuple[str, str]:
  """Resolves ``backend`` and checks ``algorithm`` against it.

  Args:
    op: the public op's name, one of ``jaxoverlap.backend.OPS``.
    backend: ``"auto"``, ``"xla"`` or ``"cuda"``.
    algorithm: ``"auto"`` or an algorithm of the resolved backend.

  Returns:
    ``(backend, algorithm)`` with backend ``"xla"`` or ``"cuda"``; for
    ``"xla"``, ``"auto"`` becomes ``"collective"``. CUDA's ``"auto"`` is passed
    on to the kernel's own choice.

  Raises:
    ValueError: unknown backend, or an algorithm that the resolved backend
      does not have (the message lists the valid ones).
    RuntimeError: ``backend="cuda"`` but the CUDA path is not usable
      (from ``jaxoverlap.backend.select_backend``).
  """
  if backend not in _backend.BACKENDS:
    raise ValueError(f"{op}: backend={backend!r} is not one of {_backend.BACKENDS}")
  cuda_algorithms = CUDA_ALGORITHMS[op]
  if not isinstance(algorithm, str) or (
      algorithm not in XLA_ALGORITHMS and algorithm not in cuda_algorithms):
    raise ValueError(
        f"{op}: algorithm={algorithm!r} is unknown; valid: {XLA_ALGORITHMS} "
        f"(backend 'xla')" + (f", {cuda_algorithms} (backend 'cuda')"
                              if cuda_algorithms else ""))
  resolved = _backend.select_backend(op, backend)
  valid = XLA_ALGORITHMS if resolved == "xla" else cuda_algorithms
  if algorithm not in valid:
    how = (f"backend='auto' resolved to {resolved!r}" if backend == "auto"
           else f"backend={resolved!r}")
    raise ValueError(
        f"{op}: algorithm={algorithm!r} is not available with {how}; valid: {valid}")
  if resolved == "xla" and algorithm == "auto":
    algorithm = "collective"
  return resolved, algorithm
