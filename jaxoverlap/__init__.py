"""jaxoverlap: latency-optimal all-reduce and fused compute-communication for JAX on NVIDIA GPUs.

Public ops (call inside ``jax.shard_map``; each a ``jax.custom_vjp``):

* ``all_reduce(x, axis_name)`` == ``lax.psum(x, axis_name)``
* ``all_gather_matmul(x, w, axis_name, gather_dimension=0)``
  == ``lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True) @ w``
* ``matmul_reduce_scatter(x, w, axis_name, scatter_dimension=0)``
  == ``lax.psum_scatter(x @ w, axis_name, scatter_dimension=..., tiled=True)``
* ``matmul_all_reduce(x, w, axis_name)`` == ``lax.psum(x @ w, axis_name)``
* ``all_reduce_rms_norm(p, residual, weight, axis_name)`` == ``(h, rms_norm(h) * weight)``
  with ``h = residual + lax.psum(p, axis_name)``

Runtime: ``initialize()`` (NVSHMEM, for ``backend="cuda"``), ``finalize()``,
``runtime_info()``. How each call ran: ``decisions()`` (``jaxoverlap.dispatch``).
The names of backends, algorithms, protocols and transports: ``jaxoverlap.names``.
Importing the package needs no GPU and loads no extension.
"""

from jaxoverlap.collectives import all_reduce, all_reduce_rms_norm
from jaxoverlap.dispatch import Plan, clear_decisions, decisions
from jaxoverlap.overlap import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from jaxoverlap.runtime import finalize, initialize, is_initialized, runtime_info

__version__ = "0.1.0"

__all__ = [
    "Plan",
    "all_gather_matmul",
    "all_reduce",
    "all_reduce_rms_norm",
    "clear_decisions",
    "decisions",
    "finalize",
    "initialize",
    "is_initialized",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "runtime_info",
]
