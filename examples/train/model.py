"""A GPT-style byte-level decoder built from jaxoverlap's NNX layers.

Token and position embeddings (replicated: the vocabulary is 256 bytes), N
pre-norm ``jaxoverlap.nnx.TransformerBlock``s (attention heads and MLP hidden
units sharded over tp; with sequence parallelism the activations between
blocks are sharded on the sequence over tp), a final RMSNorm and an untied LM
head that is itself a ``ColumnParallelLinear`` (vocabulary sharded over tp, so
with SP its input all-gather is fused with the GEMM).

Shapes are global (jit-level); the layers call ``shard_map`` inside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxoverlap import nnx as jnnx

from config import Config
from data import VOCAB_SIZE


class GPT(nnx.Module):
  """Decoder-only transformer: ``tokens: int32 [b, s]`` -> ``logits: f32 [b, s, 256]``."""

  def __init__(self, config: Config, parallel: jnnx.ParallelConfig, *, rngs: nnx.Rngs):
    """Creates the model.

    Args:
      config: model sizes and dtype (``d_model``, ``n_layers``, ``n_heads``,
        ``d_ff``, ``seq_len``, ``dtype``).
      parallel: the mesh and layout for the jaxoverlap layers.
      rngs: random number streams for the initializers.
    """
    dtype = jnp.dtype(config.dtype)
    self.parallel = parallel
    # Embeddings with std 1/sqrt(d) (nnx.Embed's default), like the kernels.
    embed_init = nnx.initializers.normal(stddev=config.d_model ** -0.5)
    self.embed = nnx.Embed(VOCAB_SIZE, config.d_model, dtype=dtype,
                           embedding_init=embed_init, rngs=rngs)
    self.pos_embed = nnx.Param(embed_init(rngs.params(), (config.seq_len, config.d_model)))
    self.blocks = nnx.List([
        jnnx.TransformerBlock(config.d_model, config.n_heads, config.d_ff, config=parallel,
                              activation="gelu", norm="rms", dtype=dtype, rngs=rngs)
        for _ in range(config.n_layers)
    ])
    self.final_norm = jnnx.RMSNorm(config.d_model, config=parallel, dtype=dtype, rngs=rngs)
    self.lm_head = jnnx.ColumnParallelLinear(
        config.d_model, VOCAB_SIZE, config=parallel, use_bias=False, dtype=dtype,
        kernel_axes=("embed", "vocab"), rngs=rngs)

  def _constrain(self, x_bsd: jax.Array) -> jax.Array:
    """Lays out ``x_bsd`` as the activations between blocks (SP: ``s`` over tp)."""
    p = self.parallel
    if p.mesh is None:
      return x_bsd
    sharding = jax.sharding.NamedSharding(p.mesh, p.spec("batch", "seq", "embed"))
    return jax.lax.with_sharding_constraint(x_bsd, sharding)

  def __call__(self, tokens_bs: jax.Array) -> jax.Array:
    """Next-byte logits.

    Args:
      tokens_bs: int32 ``[b, s]`` byte ids, ``s <= seq_len``; ``b`` sharded
        over dp.

    Returns:
      float32 ``[b, s, 256]`` logits, vocabulary sharded over tp.
    """
    s = tokens_bs.shape[1]
    x_bsd = self.embed(tokens_bs) + self.pos_embed[:s].astype(self.embed.dtype)
    x_bsd = self._constrain(x_bsd)
    for block in self.blocks:
      x_bsd = block(x_bsd)
    return self.lm_head(self.final_norm(x_bsd)).astype(jnp.float32)
