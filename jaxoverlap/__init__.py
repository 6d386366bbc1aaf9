"""jaxoverlap: low-latency all-reduce and fused compute-communication for JAX on NVIDIA GPUs.

Public ops (call inside ``jax.shard_map``; each a ``jax.custom_vjp``):

* ``all_reduce(x, axis_name)`` == ``lax.psum(x, axis_name)``
* ``all_gather_matmul(x, w, axis_name, gather_dimension=0)``
  == ``lax.all_gather(x, axis_name, axis=gather_dimension, tiled=True) @ w``
* ``matmul_reduce_scatter(x, w, axis_name, scatter_dimension=0)``
  == ``lax.psum_scatter(x @ w, axis_name, scatter_dimension=..., tiled=True)``
* ``matmul_all_reduce(x, w, axis_name)`` == ``lax.psum(x @ w, axis_name)``
* ``all_reduce_rms_norm(p, residual, weight, axis_name)`` == ``(h, rms_norm(h) * weight)``
  with ``h = residual + lax.psum(p, axis_name)``

Runtime (for ``backend="cuda"``): ``initialize()`` brings up the kernels' runtime (NVSHMEM
with a process per GPU, CUDA peer access with one process driving its GPUs), ``finalize()``,
``is_initialized()``, ``runtime_info()``. How each call ran: ``decisions()``, a ``Plan``
per op and compilation, and ``clear_decisions()`` (``jaxoverlap.dispatch``).

Modules: ``jaxoverlap.nnx`` (Flax NNX tensor- and sequence-parallel layers),
``jaxoverlap.reference`` (the ops as plain JAX expressions), ``jaxoverlap.launch``
(processes and SLURM: ``initialize_from_env()``; ``python -m jaxoverlap.launch``),
``jaxoverlap.tuning`` (how ``algorithm="auto"`` chooses: measured tables and the N-node
cost model), ``jaxoverlap.names`` (the names of backends, algorithms, protocols and
transports). The README has the install, the quickstarts and the results.
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
