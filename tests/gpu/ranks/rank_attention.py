"""Rank side: ParallelAttention's cuDNN core of a decode step (tests/gpu/test_gpu_attention.py).

One process, one GPU (no collective runs). A stack of two Llama-style
``TransformerBlock``s, bfloat16, on a mesh of one device (so the layers'
``shard_map`` path runs), decodes a prompt of 5 tokens and then 3 single
tokens twice: with ``ParallelConfig(attention_implementation="cudnn")`` and
with the default XLA expression, from the same weights. Checked: every element
of every step's output against the XLA one (bfloat16 tolerance), and that the
compiled step holds cuDNN's fused attention call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxoverlap import nnx as jnnx

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a GPU")

D, HEADS, KV, FF, LAYERS, B, MAX_LEN = 256, 4, 2, 512, 2, 3, 16


def _stack(attention: str):
  mesh = jax.make_mesh((1, 1), ("dp", "tp"), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  config = jnnx.ParallelConfig(mesh=mesh, row_reduction="all_reduce", backend="xla",
                               attention_implementation=attention)
  blocks = nnx.List([
      jnnx.TransformerBlock(D, HEADS, FF, config=config, num_kv_heads=KV, rope_theta=10000.0,
                            activation="swiglu", norm="rms", use_bias=False,
                            dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(i))
      for i in range(LAYERS)])
  for block in blocks:
    block.init_cache((B, MAX_LEN))
  return blocks


def test_cudnn_decode_step_equals_xla():
  step = nnx.jit(lambda blocks, x: _run(blocks, x))
  ours, theirs = _stack("cudnn"), _stack("xla")
  x = jnp.asarray(np.random.default_rng(7).standard_normal((B, 8, D)), jnp.bfloat16)
  failures = []
  for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8)):
    got = np.asarray(step(ours, x[:, lo:hi]), np.float64)
    want = np.asarray(step(theirs, x[:, lo:hi]), np.float64)
    err = np.abs(got - want).max() / (np.abs(want).max() + 1e-30)
    if not err <= 2e-2:
      failures.append(f"tokens {lo}:{hi}: max |diff| / max |want| = {err:.3g}")
  assert not failures, failures
  graphdef, state = nnx.split(ours)
  hlo = jax.jit(lambda s, x: _run(nnx.merge(graphdef, s), x)).lower(
      state, x[:, :1]).compile().as_text()
  assert "cudnn$fmha" in hlo, "no cuDNN fused attention call in the compiled decode step"


def _run(blocks, x):
  for block in blocks:
    x = block(x, decode=True)
  return x
