"""Flax NNX tensor-parallel (Megatron-LM) and sequence-parallel layers on jaxoverlap's ops.

See ``jaxoverlap.nnx.layers`` for the layouts and collectives of each layer and
``jaxoverlap.nnx.config`` for the mesh and logical-axis rules.
"""

from jaxoverlap.nnx.config import LOGICAL_AXES, ParallelConfig
from jaxoverlap.nnx.layers import (
    ColumnParallelLinear,
    LayerNorm,
    ParallelAttention,
    ParallelMLP,
    RMSNorm,
    RowParallelLinear,
    TransformerBlock,
)

__all__ = [
    "LOGICAL_AXES",
    "ParallelConfig",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "RMSNorm",
    "LayerNorm",
    "ParallelMLP",
    "ParallelAttention",
    "TransformerBlock",
]
