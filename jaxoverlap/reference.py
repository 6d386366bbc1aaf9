"""Pure-JAX definitions of every public op: what each op must equal.

Problem:
  Each op of jaxoverlap replaces a JAX collective next to a matmul by a faster
  implementation. Tests and users need the plain expression it stands for.

Algorithm:
  One function per public op, with the same name and the same arguments (less
  ``backend`` and ``algorithm``), written with ``lax`` collectives and ``@``.
  Call them inside ``jax.shard_map``, like the ops. jaxoverlap's results equal
  these up to rounding: in float32 the order of summation; in bfloat16 and
  float16 also where a cross-rank sum rounds to the input dtype (each op's
  Returns says where). Its matmuls accumulate in float32.

Example (8 devices; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=8
before jax is imported):
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> from jaxoverlap import reference
  >>> mesh = jax.make_mesh((8,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> f = jax.jit(jax.shard_map(lambda x, w: reference.all_gather_matmul(x, w, "tp"),
  ...                           mesh=mesh, in_specs=(P("tp"), P(None, "tp")),
  ...                           out_specs=P(None, "tp")))
  >>> f(jnp.ones((16, 4)), jnp.ones((4, 8))).shape   # every rank: AG(x) [16, 4] @ w [4, 1]
  (16, 8)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["all_reduce", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
           "all_reduce_rms_norm"]


def all_reduce(x, axis_name):
  """``lax.psum(x, axis_name)``: the sum of ``x`` over the ranks of the axis."""
  return lax.psum(x, axis_name)


def all_gather_matmul(x, w, axis_name, *, gather_dimension=0):
  """``lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True) @ w``."""
  gather_dimension %= x.ndim
  return lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True) @ w


def matmul_reduce_scatter(x, w, axis_name, *, scatter_dimension=0):
  """``lax.psum_scatter(x @ w, axis_name, scatter_dimension=..., tiled=True)``.

  ``scatter_dimension`` indexes the output ``x @ w`` (it may be its last one).
  """
  y = x @ w
  return lax.psum_scatter(y, axis_name, scatter_dimension=scatter_dimension % y.ndim,
                          tiled=True)


def matmul_all_reduce(x, w, axis_name):
  """``lax.psum(x @ w, axis_name)``."""
  return lax.psum(x @ w, axis_name)


def all_reduce_rms_norm(p, residual, weight, axis_name, *, eps=1e-6):
  """``h = residual + lax.psum(p, axis_name)``, ``y = rms_norm(h) * weight``; returns ``(h, y)``.

  The norm is over the last dimension, in float32, rounded to h's dtype:
  ``h * rsqrt(mean(h^2, -1) + eps) * weight``. Looser than the op about
  dtypes: it takes a weight of any float dtype (e.g. float32 beside bfloat16
  activations), where ``jaxoverlap.all_reduce_rms_norm`` raises unless p,
  residual and weight share one dtype (cast the weight to p's dtype, as Flax
  layers do with their parameters).
  """
  h = residual + lax.psum(p, axis_name)
  h32 = h.astype(jnp.float32)
  ms = jnp.mean(jnp.square(h32), axis=-1, keepdims=True)
  return h, (h32 * lax.rsqrt(ms + eps) * weight.astype(jnp.float32)).astype(h.dtype)
