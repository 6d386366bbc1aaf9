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
  static arguments and the bound mesh axes are read. What depends on the
  devices and the runtime is checked by the dispatcher (``jaxoverlap.dispatch``)
  when the call is lowered.

Example:
  >>> num_ranks = axis_size("all_reduce", "tp")          # inside shard_map
  >>> check_options("all_reduce", backend="auto", algorithm="one_shot", protocol="ll")
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxoverlap import names

__all__ = [
    "DTYPES",
    "axis_size",
    "check_array",
    "check_matmul_operands",
    "check_divisible",
    "check_options",
    "as_int",
    "normalize_chunks",
    "normalize_dimension",
]

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The fused kernels' chunks per shard transfer at most (kMaxChunks in
# ffi/include/jaxoverlap/runtime.h; tests/test_extension.py checks that they agree).
MAX_CHUNKS = 32


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
  """Number of ranks along ``axis_name``, which must be a manual axis of ``shard_map``.

  Args:
    op: the public op's name, for the message.
    axis_name: a mesh axis name, or a tuple of distinct names.

  Returns:
    The size of the axis (the product of the sizes, for a tuple).

  Raises:
    ValueError: ``axis_name`` is not a str or tuple of str; names an axis of
      no mesh in scope (the message lists the mesh's axes); or names a mesh
      axis outside ``jax.shard_map`` (e.g. under ``jax.set_mesh`` only), where
      the op cannot run.
  """
  names_ = _axis_names(op, axis_name)
  mesh = jax.sharding.get_abstract_mesh()
  mesh_axes = tuple(getattr(mesh, "axis_names", ()) or ())
  manual = {a for a, t in zip(mesh_axes, getattr(mesh, "axis_types", ()) or ())
            if t == jax.sharding.AxisType.Manual}
  missing = [a for a in names_ if a not in mesh_axes]
  if missing and not mesh_axes:
    raise ValueError(
        f"{op}: axis_name={axis_name!r}, but no jax.shard_map mesh axis is in scope: {op} "
        "must be called inside jax.shard_map (a per-rank function over a mesh with that axis), "
        "not under jit alone, eagerly or in jax.vmap(axis_name=...)")
  if missing:
    raise ValueError(
        f"{op}: axis_name={axis_name!r} names {tuple(missing)}, which the mesh in scope "
        f"(axes {mesh_axes}) does not have; call {op} inside jax.shard_map over a mesh "
        "with that axis")
  outside = [a for a in names_ if a not in manual]
  if outside and manual:
    raise ValueError(
        f"{op}: axis {tuple(outside)} of the mesh is not manual here: the enclosing "
        f"jax.shard_map is manual over {tuple(a for a in mesh_axes if a in manual)} only; "
        f"add {', '.join(map(repr, outside))} to its axis_names (or leave axis_names out: "
        "all mesh axes)")
  if outside:
    raise ValueError(
        f"{op}: axis {tuple(outside)} of the mesh is not manual here: {op} must be called "
        f"inside jax.shard_map (a per-rank function over mesh axes {mesh_axes}), not under "
        "jax.set_mesh or jit alone")
  return int(lax.axis_size(axis_name))


def _check_not_unreduced(op: str, name: str, a) -> None:
  """Refuses a value typed unreduced or reduced over mesh axes (jax's manual axis types).

  The ops take per-rank values (varying, or invariant) and sum them. An
  unreduced value is a pending sum that only jax's own collectives resolve
  (``lax.psum`` of it), and a reduced one is a sum already taken, which
  ``lax.psum`` refuses; neither can enter the ops' casts to varying.
  """
  mat = getattr(jax.typeof(a), "manual_axis_type", None)  # None: an aval of another kind
  for kind in ("unreduced", "reduced"):
    axes = sorted(getattr(mat, kind, None) or ())
    if axes:
      raise ValueError(
          f"{op}: {name} is typed {kind} over mesh axes {axes} ({jax.typeof(a).str_short()}); "
          f"{op} takes per-rank values: "
          + ("reduce it with lax.psum, or pass per-rank values (e.g. the product computed "
             "without out_sharding=P(..., unreduced=...))"
             if kind == "unreduced" else "it is a sum already; pass the per-rank values"))


def check_array(op: str, name: str, a) -> jnp.dtype:
  """Checks that ``a`` is an array of a supported dtype and returns its dtype.

  Raises:
    ValueError: ``a`` has no shape/dtype, its dtype is not float32,
      bfloat16 or float16 (a PRNG key array included), it is typed unreduced or
      reduced over mesh axes (jax's manual axis types), or a dimension is
      symbolic (``jax.export`` with shape polymorphism: the ops plan and lower
      for concrete sizes).
  """
  if not (hasattr(a, "shape") and hasattr(a, "dtype")):
    raise ValueError(f"{op}: {name} must be an array, got {type(a).__name__}")
  if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):  # PRNG keys: no NumPy dtype
    raise ValueError(f"{op}: {name}.dtype={a.dtype} is not supported; use one of "
                     f"{', '.join(str(d) for d in DTYPES)}")
  _check_not_unreduced(op, name, a)
  symbolic = [d for d in a.shape if not isinstance(d, (int, np.integer))]
  if symbolic:
    raise ValueError(
        f"{op}: {name} has the symbolic dimensions {symbolic} (shape {tuple(a.shape)}); "
        f"{op} plans its kernels and chunks for concrete sizes, so it cannot be exported "
        "shape-polymorphically (jax.export.symbolic_shape): export with concrete shapes")
  dtype = jnp.dtype(a.dtype)
  if dtype not in DTYPES:
    raise ValueError(
        f"{op}: {name}.dtype={dtype} is not supported; use one of "
        f"{', '.join(str(d) for d in DTYPES)}")
  return dtype


def refuse_forward_mode(op: str, *arrays) -> None:
  """Raises ``TypeError`` when an input carries forward-mode tangents.

  The message names the op where the op itself meets the tangent (``jax.jvp``
  inside the jitted function, or an eager ``shard_map``); ``jax.jvp`` of a
  jitted function gets JAX's own message about a ``custom_vjp`` first. Reverse
  mode of any order works, and so does ``jax.hessian`` (forward over reverse):
  the primitives' JVP rules (``jaxoverlap._primitives``) carry the
  second-order terms on XLA's collectives.

  The ops define a reverse-mode rule only (``jax.custom_vjp``). Under ``jax.jit``
  JAX itself refuses forward mode, but later and without naming the op; in
  eager ``shard_map`` it fails inside JAX with "unhashable type". Reverse mode
  (``jax.grad``, ``jax.vjp``, ``jax.jacrev``) traces with linearize tracers,
  not forward-mode ones, where JAX linearizes directly
  (``jax_use_direct_linearize``, the default of the jax versions tested, 0.11
  and 0.12); without it the check is skipped and the error left to JAX.
  """
  if not getattr(jax.config, "jax_use_direct_linearize", False):
    return
  from jax.interpreters import ad

  if any(isinstance(a, ad.JVPTracer) for a in arrays):
    raise TypeError(
        f"{op}: forward-mode differentiation (jax.jvp, jax.jacfwd) cannot go through "
        "jaxoverlap's ops: they define a reverse-mode rule only (jax.custom_vjp); use "
        "jax.grad, jax.vjp or jax.jacrev (jax.hessian, forward over reverse, works)")


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
        f"(the contracted dimension k; inside jax.shard_map these are the per-rank shards: "
        f"check that in_specs shard x's last and w's first dimension alike)")


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


def as_int(value) -> int | None:
  """``value`` as an int where it is an integer (Python or NumPy), not a bool; else None."""
  if isinstance(value, bool):  # NumPy's bool has no __index__
    return None
  try:
    return int(operator.index(value))
  except TypeError:
    return None


def normalize_chunks(op: str, chunks) -> int | None:
  """``chunks`` as a Python int (NumPy integers too), or None.

  Raises:
    ValueError: ``chunks`` is a bool or not an integer (the range is checked by
      ``check_options``).
  """
  if chunks is None:
    return None
  value = as_int(chunks)
  if value is None:
    raise ValueError(f"{op}: chunks must be None or an int from 1 to {MAX_CHUNKS}, got "
                     f"{chunks!r}")
  return value


def _valid(op: str) -> str:
  return (f"valid: 'auto'; {names.algorithms(op, names.XLA)} (backend 'xla'); "
          f"{names.algorithms(op, names.CUDA)} (backend 'cuda')")


def check_options(op: str, *, backend, algorithm, protocol=names.AUTO, transport=names.AUTO,
                  chunks=None) -> None:
  """Checks the op's choices against the vocabulary (``jaxoverlap.names``) and each other.

  Only what is wrong whatever the runtime is checked here; what needs the
  devices (a CUDA-only choice where the kernels cannot run, a group that spans
  nodes, workspace) is checked by ``jaxoverlap.dispatch`` at lowering.

  Args:
    op: the public op's name.
    backend, algorithm, protocol, transport: as passed to the op ("auto" or a
      name of ``jaxoverlap.names``).
    chunks: the fused ops' chunks per shard transfer, or None.

  Raises:
    ValueError: an unknown value (with the new spelling of a value of version
      0.1, where there is one), a choice of one backend with the other backend
      requested, or a protocol, transport or chunks that the algorithm lacks.
  """
  if backend not in names.BACKENDS:
    raise ValueError(f"{op}: backend={backend!r} is not one of {names.BACKENDS}")
  for key, value in (("algorithm", algorithm), ("protocol", protocol), ("transport", transport)):
    if not isinstance(value, str):
      raise ValueError(f"{op}: {key} must be a str, got {value!r}")
  if algorithm != names.AUTO and algorithm not in names.algorithms(op):
    renamed = names.renamed_value(op, algorithm)
    if renamed is not None:
      raise ValueError(f"{op}: algorithm={algorithm!r} is now spelled {renamed}")
    raise ValueError(f"{op}: algorithm={algorithm!r} is unknown; {_valid(op)}")
  on = names.backend_of_algorithm(op, algorithm)
  if backend != names.AUTO and on not in (None, backend):
    raise ValueError(f"{op}: algorithm={algorithm!r} belongs to backend {on!r}, but "
                     f"backend={backend!r} was requested; {_valid(op)}")
  xla_only = backend == names.XLA or on == names.XLA
  if protocol != names.AUTO:
    valid = names.PROTOCOLS if op == names.ALL_REDUCE else ()
    if protocol not in valid:
      raise ValueError(f"{op}: protocol={protocol!r} is unknown; valid: 'auto'" +
                       (f", {valid} (backend 'cuda')" if valid else " (no protocols)"))
    if xla_only:
      raise ValueError(f"{op}: protocol={protocol!r} applies to backend 'cuda' only")
    if on == names.CUDA and protocol not in names.protocols(algorithm):
      raise ValueError(f"{op}: algorithm={algorithm!r} has no protocol {protocol!r}; valid: "
                       f"{names.protocols(algorithm)}")
  if transport != names.AUTO:
    if transport not in names.transports(op):
      raise ValueError(f"{op}: transport={transport!r} is unknown; valid: 'auto', "
                       f"{names.transports(op)} (backend 'cuda')")
    if xla_only:
      raise ValueError(f"{op}: transport={transport!r} applies to backend 'cuda' only")
    if algorithm == names.UNFUSED:
      raise ValueError(f"{op}: transport={transport!r} applies to the fused algorithm, not to "
                       "'unfused' (whose all-reduce uses its own)")
  if chunks is not None:
    if not 1 <= normalize_chunks(op, chunks) <= MAX_CHUNKS:
      raise ValueError(f"{op}: chunks must be None or an int from 1 to {MAX_CHUNKS}, got "
                       f"{chunks!r}")
    if xla_only:
      raise ValueError(f"{op}: chunks={chunks} applies to backend 'cuda' only")
    if algorithm == names.UNFUSED:
      raise ValueError(f"{op}: chunks={chunks} applies to the fused algorithm, not to "
                       "'unfused'")
