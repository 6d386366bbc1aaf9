"""Flax NNX tensor-parallel (Megatron-LM) and sequence-parallel layers on jaxoverlap's ops.

See ``jaxoverlap.nnx.layers`` for the layouts and collectives of each layer
(including grouped-query attention, RoPE and the KV cache for decoding) and
``jaxoverlap.nnx.config`` for the mesh, the logical-axis rules and the choice
of all-reduce.

Needs Flax, which the package installs only with its ``nnx`` extra
(``pip install "jaxoverlap[nnx]"``; ``examples`` and ``test`` include it).
"""

try:
  import flax  # noqa: F401
except ImportError as e:
  raise ImportError("jaxoverlap.nnx needs Flax (flax>=0.12), which is not installed: "
                    "pip install \"jaxoverlap[nnx]\" (from a checkout: pip install \".[nnx]\"); "
                    "jaxoverlap's ops themselves need no Flax") from e

from jaxoverlap.nnx.config import LOGICAL_AXES, ROW_REDUCTIONS, ParallelConfig
from jaxoverlap.nnx.layers import (
    ColumnParallelLinear,
    LayerNorm,
    ParallelAttention,
    ParallelMLP,
    RMSNorm,
    RowParallelLinear,
    TransformerBlock,
    apply_blocks,
)

__all__ = [
    "LOGICAL_AXES",
    "ROW_REDUCTIONS",
    "ParallelConfig",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "RMSNorm",
    "LayerNorm",
    "ParallelMLP",
    "ParallelAttention",
    "TransformerBlock",
    "apply_blocks",
]
