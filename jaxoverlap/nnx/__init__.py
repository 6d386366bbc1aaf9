"""Flax NNX tensor-parallel (Megatron-LM) and sequence-parallel layers on jaxoverlap's ops.

See ``jaxoverlap.nnx.layers`` for the layouts and collectives of each layer
(including grouped-query attention, RoPE and the KV cache for decoding) and
``jaxoverlap.nnx.config`` for the mesh, the logical-axis rules and the choice
of all-reduce.
"""

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
