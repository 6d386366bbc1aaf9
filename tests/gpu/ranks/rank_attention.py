"""Rank side: decode steps of NNX blocks on one GPU (tests/gpu/test_gpu_attention.py).

One process, one GPU (no collective runs). A stack of two Llama-style
``TransformerBlock``s, bfloat16, on a mesh of one device (so the layers'
``shard_map`` path runs), decodes a prompt of 5 tokens and then 3 single
tokens twice, from the same weights:
* with ``ParallelConfig(attention_implementation="cudnn")`` and with the
  default XLA expression. Checked: every element of every step's output
  against the XLA one (bfloat16 tolerance), and that the compiled step holds
  cuDNN's fused attention call;
* at batch 1 with ``min_matmul_rows=2`` (the one-row GEMMs padded with a copy
  of the row) and without. Checked: every element against the unpadded step,
  and that the compiled padded step runs no pad kernel (XLA fused the copy
  into the GEMMs).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxoverlap import nnx as jnnx

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a GPU")

D, HEADS, KV, FF, LAYERS, B, MAX_LEN = 256, 4, 2, 512, 2, 3, 16


def _stack(attention: str, batch: int = B, min_matmul_rows: int = 1):
  mesh = jax.make_mesh((1, 1), ("dp", "tp"), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  config = jnnx.ParallelConfig(mesh=mesh, row_reduction="all_reduce", backend="xla",
                               attention_implementation=attention,
                               min_matmul_rows=min_matmul_rows)
  blocks = nnx.List([
      jnnx.TransformerBlock(D, HEADS, FF, config=config, num_kv_heads=KV, rope_theta=10000.0,
                            activation="swiglu", norm="rms", use_bias=False,
                            dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(i))
      for i in range(LAYERS)])
  for block in blocks:
    block.init_cache((batch, MAX_LEN))
  return blocks


def test_cudnn_decode_step_equals_xla():
  hlo = _decode_alike(_stack("cudnn"), _stack("xla"), B, seed=7)
  assert "cudnn$fmha" in hlo, "no cuDNN fused attention call in the compiled decode step"


def test_padded_one_row_decode_step_equals_unpadded():
  hlo = _decode_alike(_stack("cudnn", 1, min_matmul_rows=2), _stack("cudnn", 1), 1, seed=8)
  pad_kernels = re.findall(r"%?([\w.\-]*pad[\w.\-]*fusion[\w.\-]*) = ", hlo)
  assert not pad_kernels, f"the padded step still runs pad kernels: {pad_kernels[:3]}"


def _decode_alike(ours, theirs, batch: int, seed: int) -> str:
  """Both stacks decode a 5-token prompt, then 3 tokens; every step's output of ``ours``
  equals ``theirs``'s within bfloat16 tolerance. Returns ``ours``'s compiled one-token step."""
  step = nnx.jit(lambda blocks, x: _run(blocks, x))
  x = jnp.asarray(np.random.default_rng(seed).standard_normal((batch, 8, D)), jnp.bfloat16)
  failures = []
  for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8)):
    got = np.asarray(step(ours, x[:, lo:hi]), np.float64)
    want = np.asarray(step(theirs, x[:, lo:hi]), np.float64)
    err = np.abs(got - want).max() / (np.abs(want).max() + 1e-30)
    if not err <= 2e-2:
      failures.append(f"tokens {lo}:{hi}: max |diff| / max |want| = {err:.3g}")
  assert not failures, failures
  graphdef, state = nnx.split(ours)
  return jax.jit(lambda s, x: _run(nnx.merge(graphdef, s), x)).lower(
      state, x[:, :1]).compile().as_text()


def _run(blocks, x):
  for block in blocks:
    x = block(x, decode=True)
  return x
