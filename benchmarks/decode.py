"""Decode benchmark: per-token latency of a tensor-parallel Llama-style decoder, psum vs jaxoverlap.

Problem:
  In tensor-parallel (TP) decode every layer ends its attention and its MLP
  with an all-reduce of the [batch, 1, d_model] activations: 2 * num_layers
  small messages (batch * d_model * 2 bytes in bf16, 8 KiB - 512 KiB for
  d_model 4096 and batch 1-64) per generated token. This benchmark measures
  what the all-reduce implementation does to the latency of a whole decode
  step, and which share of the step the all-reduces take.

Model (RANDOM weights: no checkpoint is read; the JSON says "weights": "random"):
  Llama-style decoder: token embedding (replicated), ``num_layers`` blocks of
  pre-RMSNorm grouped-query attention with rotary positions (RoPE, rotate-half
  form, theta 500000 as in Llama 3) and pre-RMSNorm SwiGLU MLP, a final
  RMSNorm and an untied LM head. TP over the mesh axis "tp" in the Megatron
  layout (arXiv 1909.08053): column-parallel fused QKV (each rank holds its
  ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads) and fused
  gate/up; row-parallel attention output and down projections, each followed
  by an all-reduce of the [batch, 1, d_model] partial sums; the LM head is
  column-parallel over the vocabulary and the greedy token is a sharded
  argmax (two tiny [batch] reductions, ``pmax`` then ``pmin``, the same for
  every implementation). The whole step is one per-rank function inside
  ``jax.shard_map`` over a (tp,) mesh with local weight shards, so the
  per-layer all-reduces are explicit calls. bf16 storage and activations,
  fp32 accumulation, RMSNorm, softmax and RoPE in fp32.

  KV cache: two preallocated arrays per rank, [num_layers, batch, max_len,
  num_kv_heads / tp, head_dim], updated in place with
  ``lax.dynamic_update_slice``. All sequences of a batch are at the same
  position. Attention reads all ``max_len`` cached positions with a causal
  mask (static shapes), so a step costs the same at every position.

Method:
  For each batch size: a random prompt of ``--prompt_len`` tokens is
  prefilled by running the decode step over it (one jit'd ``lax.scan``,
  teacher-forced, with psum). Then each implementation is checked: it and
  psum run ``--check_steps`` teacher-forced steps from the same cache, and
  every rank's logits must agree within eps(dtype)**(2/3) * max|logit| and
  every greedy token must agree (or be a tie within that tolerance). The same
  check first runs on a tiny model (``tiny_config``). An implementation that
  fails is not timed and is listed under "rejected" in the JSON.

  Timing: one jit'd ``lax.fori_loop`` of ``--tokens`` greedy decode steps
  (the KV cache donated and passed on from call to call; each call restarts
  at position ``prompt_len``, so every call does the same work). Per-token
  latency = median over ``--reps`` calls of (call wall time / tokens), us.
  The implementations and the floor are interleaved call by call, so all
  figures of one table come from the same run. The floor
  ("floor:no_all_reduce") is the same step with every all-reduce replaced by
  the identity (the result is wrong, the compute is the same), and
  all_reduce_share = (t_step - t_floor) / t_step for each implementation.
  Included in every figure alike: one host dispatch per call (amortised over
  the tokens), the loop's own per-iteration cost, the full-length masked
  attention and the sharded argmax.

Results (rank 0): ``<out>/decode-<machine>.json`` in BRIEF section 7 form,
one record per (impl, batch): op "decode_token"; impl "xla:psum",
"jaxoverlap:<backend>:<algorithm>" or "floor:no_all_reduce"; shape a dict of
the model and batch sizes (batch, d_model, d_ff, heads, kv_heads, head_dim,
layers, vocab, max_len, prompt_len); bytes = one all-reduce message per rank;
time_us per token; all_reduce_share (not on the floor's records). Also
``<out>/decode-<machine>.png`` (latency against batch) and a Markdown table
on stdout.

Example:
  python -m jaxoverlap.launch --nproc 2 benchmarks/decode.py
  python -m jaxoverlap.launch --nproc 2 benchmarks/decode.py --impl jaxoverlap \\
      --algorithm one_shot_ll --batches 1,8,64
  # CPU smoke run on simulated devices (no CUDA):
  python benchmarks/decode.py --host_devices 2 --backend xla --batches 1,2 --layers 1 \\
      --d_model 64 --d_ff 128 --heads 4 --kv_heads 2 --vocab 128 --max_len 32 \\
      --prompt_len 8 --tokens 4 --reps 3 --out /tmp/decode
"""

from __future__ import annotations

import os
import sys


def _host_devices_from_argv(argv: list[str]) -> int:
  """The value of ``--host_devices`` in ``argv`` (0 when absent)."""
  for i, arg in enumerate(argv):
    if arg.startswith("--host_devices="):
      return int(arg.split("=", 1)[1])
    if arg == "--host_devices" and i + 1 < len(argv):
      return int(argv[i + 1])
  return 0


if __name__ == "__main__":
  # XLA reads the device count when jax is imported, before absl parses flags.
  _num_host_devices = _host_devices_from_argv(sys.argv)
  if _num_host_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_num_host_devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

AXIS = "tp"
PSUM = "xla:psum"
FLOOR = "floor:no_all_reduce"
BENCHMARK = "decode"


# ------------------------------------------------------------------ model


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Sizes of the Llama-style decoder (defaults: Llama-3-8B-like, 4 layers).

  Attributes:
    d_model: model width. d_ff: SwiGLU hidden width.
    num_heads, num_kv_heads: query and key/value heads (grouped-query
      attention when num_kv_heads < num_heads); head_dim = d_model / num_heads.
    num_layers: decoder blocks. vocab: vocabulary size.
    max_len: KV cache length, tokens. dtype: storage and activation type.
    rope_theta: RoPE base. norm_eps: RMSNorm epsilon.
  """
  d_model: int = 4096
  d_ff: int = 14336
  num_heads: int = 32
  num_kv_heads: int = 8
  num_layers: int = 4
  vocab: int = 32000
  max_len: int = 1024
  dtype: str = "bfloat16"
  rope_theta: float = 500000.0
  norm_eps: float = 1e-5

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def validate(self, num_ranks: int) -> None:
    """Raises ValueError when the sizes do not fit TP over ``num_ranks`` ranks."""
    problems = []
    if self.d_model % self.num_heads:
      problems.append(f"d_model {self.d_model} is not a multiple of heads {self.num_heads}")
    elif self.head_dim % 2:
      problems.append(f"head_dim {self.head_dim} must be even (RoPE)")
    if self.num_heads % self.num_kv_heads:
      problems.append(f"heads {self.num_heads} is not a multiple of kv_heads "
                      f"{self.num_kv_heads}")
    for name, value in (("kv_heads", self.num_kv_heads), ("d_ff", self.d_ff),
                        ("vocab", self.vocab)):
      if value % num_ranks:
        problems.append(f"{name} {value} is not a multiple of the {num_ranks} TP ranks")
    if problems:
      raise ValueError("decoder config: " + "; ".join(problems))

  def shape(self) -> dict[str, int]:
    """The model sizes as recorded in the JSON ``shape`` (batch added per record)."""
    return {"d_model": self.d_model, "d_ff": self.d_ff, "heads": self.num_heads,
            "kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "layers": self.num_layers, "vocab": self.vocab, "max_len": self.max_len}


def tiny_config(num_ranks: int, dtype: str = "bfloat16") -> DecoderConfig:
  """A tiny decoder for the correctness check that fits any ``num_ranks``."""
  return DecoderConfig(d_model=32 * num_ranks, d_ff=64 * num_ranks, num_heads=2 * num_ranks,
                       num_kv_heads=num_ranks, num_layers=2, vocab=64 * num_ranks,
                       max_len=16, dtype=dtype)


def init_params(key: jax.Array, cfg: DecoderConfig) -> dict[str, Any]:
  """Random weights in the plain (unsharded) layout.

  Returns:
    ``{"embed": [vocab, d], "final_norm": [d], "w_head": [d, vocab],
    "layers": [per layer {"attn_norm": [d], "w_q": [d, heads * head_dim],
    "w_k", "w_v": [d, kv_heads * head_dim], "w_o": [heads * head_dim, d],
    "mlp_norm": [d], "w_gate", "w_up": [d, d_ff], "w_down": [d_ff, d]}]}``,
    all in ``cfg.dtype``. Matrices are N(0, 1/fan_in), the embedding N(0, 1),
    norm scales 1 + 0.1 N(0, 1). Query head i uses KV head i // (heads /
    kv_heads).
  """
  d, f, k = cfg.d_model, cfg.d_ff, cfg.head_dim
  hk, kvk = cfg.num_heads * k, cfg.num_kv_heads * k
  dtype = jnp.dtype(cfg.dtype)
  keys = iter(jax.random.split(key, 3 + 9 * cfg.num_layers))

  def mat(shape):
    return (jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[0])).astype(dtype)

  def scale(n):
    return (1.0 + 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dtype)

  params = {"embed": jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32).astype(dtype),
            "final_norm": scale(d), "w_head": mat((d, cfg.vocab)), "layers": []}
  for _ in range(cfg.num_layers):
    params["layers"].append({
        "attn_norm": scale(d), "w_q": mat((d, hk)), "w_k": mat((d, kvk)), "w_v": mat((d, kvk)),
        "w_o": mat((hk, d)), "mlp_norm": scale(d), "w_gate": mat((d, f)), "w_up": mat((d, f)),
        "w_down": mat((f, d))})
  return params


def to_tp_layout(params: dict[str, Any], num_ranks: int) -> dict[str, Any]:
  """The Megatron layout: fused column-parallel QKV and gate/up, blocked by rank.

  ``w_qkv`` [d, R * (h_r + 2 kv_r) * head_dim] is, rank block after rank
  block, [rank r's query heads | its KV heads (keys) | its KV heads (values)],
  so that sharding the last dimension over "tp" gives each rank its fused
  block; ``w_gu`` [d, R * 2 * d_ff / R] likewise [gate_r | up_r]. Row-parallel
  ``w_o`` and ``w_down`` keep their layout (sharded on dimension 0).
  """
  def blocks(w):  # [d, n] -> [d, R, n / R]
    return w.reshape(w.shape[0], num_ranks, w.shape[1] // num_ranks)

  layers = []
  for lp in params["layers"]:
    d = lp["w_q"].shape[0]
    qkv = jnp.concatenate([blocks(lp["w_q"]), blocks(lp["w_k"]), blocks(lp["w_v"])], axis=2)
    gu = jnp.concatenate([blocks(lp["w_gate"]), blocks(lp["w_up"])], axis=2)
    layers.append({"attn_norm": lp["attn_norm"], "w_qkv": qkv.reshape(d, -1), "w_o": lp["w_o"],
                   "mlp_norm": lp["mlp_norm"], "w_gu": gu.reshape(d, -1),
                   "w_down": lp["w_down"]})
  return {"embed": params["embed"], "final_norm": params["final_norm"],
          "w_head": params["w_head"], "layers": layers}


def param_specs(cfg: DecoderConfig) -> dict[str, Any]:
  """PartitionSpecs of the TP layout (a pytree like ``to_tp_layout``'s result)."""
  layer = {"attn_norm": P(), "w_qkv": P(None, AXIS), "w_o": P(AXIS, None), "mlp_norm": P(),
           "w_gu": P(None, AXIS), "w_down": P(AXIS, None)}
  return {"embed": P(), "final_norm": P(), "w_head": P(None, AXIS),
          "layers": [dict(layer) for _ in range(cfg.num_layers)]}


CACHE_SPEC = P(None, None, None, AXIS, None)  # [layers, batch, max_len, kv_heads, head_dim]


def _rms_norm(x, w, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def _rope(x_bhk, pos, theta):
  """Rotate-half RoPE (Llama) of [..., head_dim] at the scalar position ``pos``."""
  half = x_bhk.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / x_bhk.shape[-1])
  angle = pos.astype(jnp.float32) * inv_freq
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1 = x_bhk[..., :half].astype(jnp.float32)
  x2 = x_bhk[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_bhk.dtype)


def _dot(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32)


def sharded_argmax(logits_bv, axis_name: str = AXIS):
  """Greedy token from vocabulary-sharded logits, equal to argmax of the full row.

  Args:
    logits_bv: [batch, vocab / R] this rank's logits (rank r holds the
      contiguous block r of the vocabulary).

  Returns:
    [batch] int32, the first index of the maximum over the whole vocabulary,
    the same on every rank (invariant over ``axis_name``): ``pmax`` of the
    local maxima, then ``pmin`` of the global indices that reach it.
  """
  vocab_r = logits_bv.shape[-1]
  best = lax.pmax(logits_bv.max(-1), axis_name)
  local = jnp.argmax(logits_bv == best[:, None], axis=-1).astype(jnp.int32)
  hit = jnp.any(logits_bv == best[:, None], axis=-1)
  index = lax.axis_index(axis_name).astype(jnp.int32) * vocab_r + local
  return lax.pmin(jnp.where(hit, index, jnp.iinfo(jnp.int32).max), axis_name)


def decode_step(p, cache_k, cache_v, tok_b, pos, *, cfg: DecoderConfig,
                all_reduce: Callable, axis_name: str = AXIS):
  """One greedy token per sequence; per-rank code, call inside ``shard_map``.

  Args:
    p: this rank's weight shards (``to_tp_layout`` sharded by ``param_specs``).
    cache_k, cache_v: [layers, batch, max_len, kv_heads / R, head_dim] this
      rank's KV cache.
    tok_b: [batch] int32, the current token of each sequence.
    pos: int32 scalar, its position (0-based); the same for every sequence.
    cfg: the model sizes.
    all_reduce: ``f(x)`` summing the [batch, 1, d_model] partial sums over
      ``axis_name`` (``lax.psum``, ``jaxoverlap.all_reduce`` or, for the
      floor, the identity); called 2 * layers times.

  Returns:
    ``(logits [batch, vocab / R] float32 (this rank's vocabulary block),
    next token [batch] int32, cache_k, cache_v)`` with position ``pos``
    written.
  """
  dtype = jnp.dtype(cfg.dtype)
  k = cfg.head_dim
  group = cfg.num_heads // cfg.num_kv_heads
  kv_r = cache_k.shape[3]
  h_r = kv_r * group
  b, t = tok_b.shape[0], cache_k.shape[2]
  valid_t = jnp.arange(t) <= pos
  x_bsd = jnp.take(p["embed"], tok_b, axis=0)[:, None, :]  # [b, 1, d]
  for layer, lp in enumerate(p["layers"]):
    h = _rms_norm(x_bsd, lp["attn_norm"], cfg.norm_eps)
    qkv = _dot(h, lp["w_qkv"]).astype(dtype)[:, 0]  # [b, (h_r + 2 kv_r) k]
    q = _rope(qkv[:, :h_r * k].reshape(b, h_r, k), pos, cfg.rope_theta)
    k_new = _rope(qkv[:, h_r * k:(h_r + kv_r) * k].reshape(b, kv_r, k), pos, cfg.rope_theta)
    v_new = qkv[:, (h_r + kv_r) * k:].reshape(b, kv_r, k)
    start = (layer, 0, pos, 0, 0)
    cache_k = lax.dynamic_update_slice(cache_k, k_new[None, :, None], start)
    cache_v = lax.dynamic_update_slice(cache_v, v_new[None, :, None], start)
    q_bngk = q.reshape(b, kv_r, group, k)
    s = jnp.einsum("bngk,btnk->bngt", q_bngk, cache_k[layer],
                   preferred_element_type=jnp.float32) / math.sqrt(k)
    s = jnp.where(valid_t, s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1).astype(dtype)
    o = jnp.einsum("bngt,btnk->bngk", w, cache_v[layer], preferred_element_type=jnp.float32)
    o = o.astype(dtype).reshape(b, 1, h_r * k)
    x_bsd = x_bsd + all_reduce(_dot(o, lp["w_o"]).astype(dtype))  # row-parallel
    h = _rms_norm(x_bsd, lp["mlp_norm"], cfg.norm_eps)
    gu = _dot(h, lp["w_gu"])
    f_r = gu.shape[-1] // 2
    act = (jax.nn.silu(gu[..., :f_r]) * gu[..., f_r:]).astype(dtype)
    x_bsd = x_bsd + all_reduce(_dot(act, lp["w_down"]).astype(dtype))  # row-parallel
  h = _rms_norm(x_bsd, p["final_norm"], cfg.norm_eps)
  logits = _dot(h[:, 0], p["w_head"])  # [b, vocab / R] f32
  return logits, sharded_argmax(logits, axis_name), cache_k, cache_v


# ------------------------------------------------------------------ implementations


def all_reduce_fn(impl: str) -> Callable:
  """The per-layer all-reduce of an implementation name.

  Args:
    impl: ``"xla:psum"`` (``lax.psum``), ``"jaxoverlap:<backend>:<algorithm>"``
      (``jaxoverlap.all_reduce``) or ``"floor:no_all_reduce"`` (the identity:
      wrong results, the same compute).

  Raises:
    ValueError: an unknown name.
  """
  if impl == PSUM:
    return lambda x: lax.psum(x, AXIS)
  if impl == FLOOR:
    return lambda x: x
  parts = impl.split(":")
  if len(parts) == 3 and parts[0] == "jaxoverlap":
    import jaxoverlap

    backend, algorithm = parts[1], parts[2]
    return lambda x: jaxoverlap.all_reduce(x, AXIS, backend=backend, algorithm=algorithm)
  raise ValueError(f"unknown impl {impl!r}: expected {PSUM!r}, {FLOOR!r} or "
                   "'jaxoverlap:<backend>:<algorithm>'")


def _shard_map(body, mesh, in_specs, out_specs):
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def make_step_fn(cfg: DecoderConfig, mesh, impl: str):
  """jit'd single decode step on global arrays (for tests and debugging).

  Returns:
    ``f(params, cache_k, cache_v, tok [batch], pos) -> (logits [batch, vocab]
    f32 sharded over the vocabulary, token [batch], cache_k, cache_v)``.
  """
  ar = all_reduce_fn(impl)

  def body(p, ck, cv, tok, pos):
    return decode_step(p, ck, cv, tok, pos, cfg=cfg, all_reduce=ar)

  return jax.jit(_shard_map(body, mesh, (param_specs(cfg), CACHE_SPEC, CACHE_SPEC, P(), P()),
                            (P(None, AXIS), P(), CACHE_SPEC, CACHE_SPEC)))


def _forced(p, ck, cv, inputs_nb, pos0, cfg, ar, with_logits):
  """Teacher-forced steps over ``inputs_nb`` [n, batch] from position ``pos0``."""
  def body(carry, tok):
    ck, cv, pos = carry
    logits, nxt, ck, cv = decode_step(p, ck, cv, tok, pos, cfg=cfg, all_reduce=ar)
    return (ck, cv, pos + 1), ((logits if with_logits else None), nxt)

  (ck, cv, _), (logits, toks) = lax.scan(body, (ck, cv, pos0), inputs_nb)
  return logits, toks, ck, cv


def make_prefill_fn(cfg: DecoderConfig, mesh, impl: str = PSUM):
  """jit'd prefill: the decode step run over a prompt, teacher-forced.

  Returns:
    ``f(params, cache_k, cache_v, prompt [prompt_len, batch] int32) ->
    (cache_k, cache_v, next token [batch])`` (prompt positions 0 .. n - 1).
  """
  ar = all_reduce_fn(impl)

  def body(p, ck, cv, prompt):
    _, toks, ck, cv = _forced(p, ck, cv, prompt, jnp.int32(0), cfg, ar, False)
    return ck, cv, toks[-1]

  return jax.jit(_shard_map(body, mesh, (param_specs(cfg), CACHE_SPEC, CACHE_SPEC, P()),
                            (CACHE_SPEC, CACHE_SPEC, P())), donate_argnums=(1, 2))


def make_generate_fn(cfg: DecoderConfig, mesh, impl: str, num_tokens: int, unroll: int = 1):
  """jit'd greedy decode of ``num_tokens`` steps in one ``lax.fori_loop`` (timed).

  The KV cache arguments are donated.

  Returns:
    ``f(params, cache_k, cache_v, tok [batch], pos) -> (cache_k, cache_v,
    tokens [num_tokens, batch])``: the tokens generated after ``tok`` at
    positions ``pos .. pos + num_tokens - 1``.
  """
  ar = all_reduce_fn(impl)

  def body(p, ck, cv, tok, pos):
    def step(i, carry):
      ck, cv, tok, toks = carry
      _, tok, ck, cv = decode_step(p, ck, cv, tok, pos + i, cfg=cfg, all_reduce=ar)
      return ck, cv, tok, lax.dynamic_update_slice(toks, tok[None], (i, 0))

    toks = jnp.zeros((num_tokens, tok.shape[0]), jnp.int32)
    ck, cv, _, toks = lax.fori_loop(0, num_tokens, step, (ck, cv, tok, toks), unroll=unroll)
    return ck, cv, toks

  return jax.jit(_shard_map(body, mesh, (param_specs(cfg), CACHE_SPEC, CACHE_SPEC, P(), P()),
                            (CACHE_SPEC, CACHE_SPEC, P())), donate_argnums=(1, 2))


def tolerance(dtype) -> float:
  """Relative logit tolerance of the check: eps(dtype)**(2/3) (STYLE, TransformerEngine)."""
  return float(jnp.finfo(jnp.dtype(dtype)).eps) ** (2.0 / 3.0)


def make_check_fn(cfg: DecoderConfig, mesh, impl: str, ref_impl: str = PSUM):
  """jit'd comparison of ``impl`` with ``ref_impl`` over teacher-forced steps.

  Both run the same steps from the same cache, inside one ``shard_map``.

  Returns:
    ``f(params, cache_k, cache_v, inputs [n, batch], pos0) -> dict`` of
    arrays, each the same on every rank: ``err`` [n], the largest
    |logit - reference logit| of the step over every rank's vocabulary block;
    ``scale`` [n], the largest |reference logit|; ``flips`` and ``bad``,
    counts of tokens that differ from the reference's, and of those that are
    not a tie (the reference logit of the chosen token is below the maximum
    by more than tolerance(dtype) * scale).
  """
  ar, ar_ref = all_reduce_fn(impl), all_reduce_fn(ref_impl)
  rtol = tolerance(cfg.dtype)

  def body(p, ck, cv, inputs, pos0):
    ref, tok_ref, _, _ = _forced(p, ck, cv, inputs, pos0, cfg, ar_ref, True)
    got, tok, _, _ = _forced(p, ck, cv, inputs, pos0, cfg, ar, True)
    diff = jnp.abs(got - ref)
    diff = jnp.where(jnp.isnan(diff), jnp.inf, diff)  # pmax may drop NaN; inf it keeps
    err = lax.pmax(jnp.max(diff, axis=(1, 2)), AXIS)
    scale = lax.pmax(jnp.max(jnp.abs(ref), axis=(1, 2)), AXIS)
    full = lax.all_gather(ref, AXIS, axis=2, tiled=True)  # [n, b, vocab]
    chosen = jnp.take_along_axis(full, tok[..., None], axis=2)[..., 0]
    tie = chosen >= full.max(-1) - rtol * scale[:, None]
    differ = tok != tok_ref
    bad = lax.pmax(jnp.sum(differ & ~tie), AXIS)
    return {"err": err, "scale": scale, "flips": jnp.sum(differ), "bad": bad}

  return jax.jit(_shard_map(body, mesh, (param_specs(cfg), CACHE_SPEC, CACHE_SPEC, P(), P()),
                            {"err": P(), "scale": P(), "flips": P(), "bad": P()}))


def check_result(stats: dict[str, Any], dtype) -> str | None:
  """None if ``make_check_fn``'s stats pass, else a message saying what differs."""
  err, scale = np.asarray(stats["err"]), np.asarray(stats["scale"])
  lim = tolerance(dtype) * scale
  over = ~(err <= lim)  # NaN counts as over
  problems = []
  if over.any():
    s = int(np.argmax(over))
    problems.append(f"logits differ beyond eps**(2/3) * max|logit| at {int(over.sum())} of "
                    f"{over.size} steps (step {s}: max error {err[s]:.4g} > {lim[s]:.4g})")
  if int(stats["bad"]):
    problems.append(f"{int(stats['bad'])} greedy tokens differ (not ties)")
  return "; ".join(problems) or None


# ------------------------------------------------------------------ host side


def _replicated(x):
  """The host value of an output replicated over the mesh (this process's copy)."""
  return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), x)


def _global(mesh, host, spec=P()):
  """A global array from a host array that every process holds whole."""
  host = np.asarray(host)
  return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec),
                                      lambda idx: host[idx])


def make_params(cfg: DecoderConfig, mesh, seed: int):
  """Random weights in the TP layout, generated on the devices, sharded."""
  num_ranks = mesh.shape[AXIS]
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg))
  init = jax.jit(lambda key: to_tp_layout(init_params(key, cfg), num_ranks),
                 out_shardings=shardings)
  return init(jax.random.key(seed))


def make_cache(cfg: DecoderConfig, mesh, batch: int):
  """Zeroed (cache_k, cache_v), each [layers, batch, max_len, kv_heads, head_dim] global."""
  shape = (cfg.num_layers, batch, cfg.max_len, cfg.num_kv_heads, cfg.head_dim)
  sharding = NamedSharding(mesh, CACHE_SPEC)
  zeros = jax.jit(lambda: jnp.zeros(shape, cfg.dtype), out_shardings=sharding)
  return zeros(), zeros()


def check_impl(cfg: DecoderConfig, mesh, params, cache, inputs_nb, pos0: int, impl: str):
  """Runs ``make_check_fn`` and returns ``check_result``'s verdict (None: passed)."""
  fn = make_check_fn(cfg, mesh, impl)
  stats = _replicated(fn(params, cache[0], cache[1], _global(mesh, inputs_nb),
                         _global(mesh, np.int32(pos0))))
  return check_result(stats, cfg.dtype)


def check_tiny(mesh, impl: str, dtype: str, seed: int) -> str | None:
  """The check on ``tiny_config``: 8 random forced tokens from an empty cache, batch 2."""
  cfg = tiny_config(mesh.shape[AXIS], dtype)
  params = make_params(cfg, mesh, seed)
  inputs = np.random.default_rng([seed, 1]).integers(0, cfg.vocab, (8, 2), dtype=np.int32)
  return check_impl(cfg, mesh, params, make_cache(cfg, mesh, 2), inputs, 0, impl)


def run(cfg: DecoderConfig, mesh, *, impls: list[str], batches: list[int], prompt_len: int,
        num_tokens: int, reps: int, warmup: int = 2, check_steps: int = 4, seed: int = 0,
        unroll: int = 1, topology: tuple[int, int] | None = None,
        log: Callable[[str], None] = print) -> tuple[list[dict], list[dict]]:
  """Checks, then times, every implementation and the floor for each batch size.

  Args:
    cfg: model sizes; mesh: a (tp,) mesh over all devices.
    impls: implementation names (see ``all_reduce_fn``); the floor is added.
    batches: batch sizes (sequences).
    prompt_len: prefilled prompt tokens. num_tokens: decode steps per timed call.
    reps: timed calls (median). warmup: untimed calls per implementation.
    check_steps: teacher-forced steps of the per-batch check on this model
      (0: only the tiny-model check).
    seed: weights and prompts. unroll: ``lax.fori_loop`` unroll factor.
    topology: (num_nodes, ranks_per_node) for the records (default: one node).
    log: where progress and check failures are printed.

  Returns:
    ``(records, rejected)``: BRIEF section 7 records ("decode_token"; time_us
    per token), and ``{"impl", "batch", "reason"}`` for implementations that
    failed a check (not timed).

  Raises:
    ValueError: sizes that do not fit (config, or prompt_len + tokens >
      max_len).
  """
  num_ranks = mesh.shape[AXIS]
  cfg.validate(num_ranks)
  if prompt_len < 1 or prompt_len + max(num_tokens, check_steps) > cfg.max_len:
    raise ValueError(f"prompt_len {prompt_len} + max(tokens {num_tokens}, check_steps "
                     f"{check_steps}) must fit in max_len {cfg.max_len} (prompt_len >= 1)")
  num_nodes, ranks_per_node = topology or (1, num_ranks)
  rejected = []
  alive = []
  for impl in impls:
    why = None if impl == PSUM else check_tiny(mesh, impl, cfg.dtype, seed)
    if why:
      log(f"CHECK FAILED: {impl} on the tiny model: {why}; {impl} is not timed")
      rejected.append({"impl": impl, "batch": None, "reason": "tiny model: " + why})
    else:
      alive.append(impl)

  params = make_params(cfg, mesh, seed)
  prefill = make_prefill_fn(cfg, mesh)
  itemsize = jnp.dtype(cfg.dtype).itemsize
  records = []
  for batch in batches:
    rng = np.random.default_rng([seed, batch])
    prompt = rng.integers(0, cfg.vocab, (prompt_len, batch), dtype=np.int32)
    ck, cv, tok = prefill(params, *make_cache(cfg, mesh, batch), _global(mesh, prompt))
    pos = _global(mesh, np.int32(prompt_len))
    timed = []
    for impl in alive:
      why = None
      if impl != PSUM and check_steps:
        inputs = rng.integers(0, cfg.vocab, (check_steps, batch), dtype=np.int32)
        why = check_impl(cfg, mesh, params, (ck, cv), inputs, prompt_len, impl)
      if why:
        log(f"CHECK FAILED: {impl} at batch {batch}: {why}; {impl} is not timed")
        rejected.append({"impl": impl, "batch": batch, "reason": why})
      else:
        timed.append(impl)
    timed.append(FLOOR)
    fns = {impl: make_generate_fn(cfg, mesh, impl, num_tokens, unroll) for impl in timed}
    for impl in timed:
      for _ in range(warmup):
        ck, cv, _ = jax.block_until_ready(fns[impl](params, ck, cv, tok, pos))
    times: dict[str, list[float]] = {impl: [] for impl in timed}
    for _ in range(reps):
      for impl in timed:  # interleaved: drift hits every implementation alike
        t0 = time.perf_counter()
        ck, cv, _ = jax.block_until_ready(fns[impl](params, ck, cv, tok, pos))
        times[impl].append((time.perf_counter() - t0) / num_tokens * 1e6)
    floor_us = statistics.median(times[FLOOR])
    line = []
    for impl in timed:
      us = statistics.median(times[impl])
      rec = {"op": "decode_token", "impl": impl, "dtype": jnp.dtype(cfg.dtype).name,
             "shape": dict(batch=batch, **cfg.shape(), prompt_len=prompt_len),
             "bytes": batch * cfg.d_model * itemsize, "world": num_ranks,
             "ranks_per_node": ranks_per_node, "num_nodes": num_nodes,
             "all_reduces_per_token": 0 if impl == FLOOR else 2 * cfg.num_layers,
             "time_us": round(us, 3)}
      if impl != FLOOR:
        rec["all_reduce_share"] = round((us - floor_us) / us, 4)
      records.append(rec)
      line.append(f"{impl}={us:.1f}")
    log(f"batch {batch:>4}: us/token " + "  ".join(line))
  return records, rejected


def markdown_table(records: list[dict], ours: str | None) -> str:
  """batch | psum us/token | jaxoverlap us/token | speed-up | shares, one row per batch."""
  by = {(r["impl"], r["shape"]["batch"]): r for r in records}
  rows = ["| batch | psum us/token | jaxoverlap us/token | speed-up | all-reduce share psum "
          "| all-reduce share ours |", "|---|---|---|---|---|---|"]

  def cell(impl, b, key, fmt):
    r = by.get((impl, b))
    return "-" if r is None or key not in r else fmt(r[key])

  for b in sorted({r["shape"]["batch"] for r in records}):
    a, o = by.get((PSUM, b)), by.get((ours, b))
    speed = f"{a['time_us'] / o['time_us']:.2f}x" if a and o else "-"
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    us = lambda v: f"{v:.1f}"  # noqa: E731
    rows.append(f"| {b} | {cell(PSUM, b, 'time_us', us)} | {cell(ours, b, 'time_us', us)} | "
                f"{speed} | {cell(PSUM, b, 'all_reduce_share', pct)} | "
                f"{cell(ours, b, 'all_reduce_share', pct)} |")
  return "\n".join(rows)


def plot(records: list[dict], path: str, title: str) -> None:
  """Per-token latency against batch size, one line per implementation (PNG)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for impl in sorted({r["impl"] for r in records}):
    pts = sorted((r["shape"]["batch"], r["time_us"]) for r in records if r["impl"] == impl)
    style = {PSUM: dict(color="black", lw=2), FLOOR: dict(color="gray", ls=":")}.get(impl, {})
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=4, label=impl, **style)
  ax.set_xscale("log", base=2)
  batches = sorted({r["shape"]["batch"] for r in records})
  ax.set_xticks(batches, [str(b) for b in batches])  # the measured batch sizes only
  ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
  ax.set_xlabel("batch (sequences)")
  ax.set_ylabel("latency per token, us")
  ax.set_title(title, fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_results(out_dir: str, machine: str, records: list[dict], rejected: list[dict], *,
                  command: str, method: str, versions: dict | None = None,
                  extra: dict | None = None) -> tuple[str, str]:
  """Writes ``<out_dir>/decode-<machine>.json`` (BRIEF section 7) and the PNG.

  Returns:
    (json path, png path).
  """
  os.makedirs(out_dir, exist_ok=True)
  tag = machine.replace(" ", "_")
  result = {"benchmark": BENCHMARK, "machine": machine, "command": command, "method": method,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": dict(versions or {}), "weights": "random",
            "records": [dict(r) for r in records], "rejected": [dict(r) for r in rejected]}
  result.update(extra or {})
  path = os.path.join(out_dir, f"{BENCHMARK}-{tag}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  png = os.path.join(out_dir, f"{BENCHMARK}-{tag}.png")
  first = records[0]["shape"] if records else {}
  plot(records, png, f"decode, {machine}, world {records[0]['world'] if records else '?'}, "
       f"d={first.get('d_model')} L={first.get('layers')} (random weights)")
  return path, png


METHOD = ("per-token latency: median over {reps} calls of one jit'd lax.fori_loop of {tokens} "
          "greedy decode steps (KV cache donated; every call from position {prompt_len} after a "
          "{prompt_len}-token random prompt), divided by {tokens}; implementations and floor "
          "interleaved call by call; attention reads all max_len cached positions (masked); "
          "all_reduce_share = (t - t_floor) / t, floor = the same step with every all-reduce "
          "replaced by the identity; every impl checked against psum before timing")


# ------------------------------------------------------------------ main


def define_flags():
  """Defines the command-line flags (only when run as a script, so importing is free)."""
  from absl import flags

  flags.DEFINE_enum("impl", "both", ["both", "jaxoverlap", "psum"],
                    "all-reduce implementation(s); both are timed in one process group")
  flags.DEFINE_string("backend", "cuda", "jaxoverlap backend (cuda, xla or auto)")
  flags.DEFINE_string("algorithm", "auto", "jaxoverlap algorithm")
  flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32", "64"], "batch sizes")
  flags.DEFINE_integer("d_model", 4096, "model width")
  flags.DEFINE_integer("d_ff", 14336, "MLP hidden width")
  flags.DEFINE_integer("heads", 32, "query heads")
  flags.DEFINE_integer("kv_heads", 8, "key/value heads")
  flags.DEFINE_integer("layers", 4, "decoder layers")
  flags.DEFINE_integer("vocab", 32000, "vocabulary size")
  flags.DEFINE_integer("max_len", 1024, "KV cache length, tokens")
  flags.DEFINE_integer("prompt_len", 128, "prefilled prompt length, tokens")
  flags.DEFINE_string("dtype", "bfloat16", "weights and activations")
  flags.DEFINE_integer("tokens", 32, "decode steps per timed call")
  flags.DEFINE_integer("reps", 20, "timed calls per implementation (median)")
  flags.DEFINE_integer("warmup", 2, "untimed calls per implementation")
  flags.DEFINE_integer("check_steps", 4, "teacher-forced steps of the per-batch check (0: off)")
  flags.DEFINE_integer("unroll", 1, "lax.fori_loop unroll factor of the timed loop")
  flags.DEFINE_integer("seed", 0, "weights and prompts")
  flags.DEFINE_integer("host_devices", 0, "simulate this many CPU devices (sets XLA_FLAGS "
                       "and JAX_PLATFORMS=cpu before jax starts)")
  flags.DEFINE_string("out", "benchmarks/results", "folder for the JSON and PNG")
  flags.DEFINE_string("machine", "2x H200 NV18", "machine name for the results")


def main(argv):
  del argv
  from absl import flags

  from jaxoverlap import launch, tuning

  flags_ = flags.FLAGS
  info = launch.initialize_from_env()
  rank = info["process_id"]
  num_ranks = jax.device_count()
  mesh = jax.make_mesh((num_ranks,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  rt = (info.get("runtime") or {})
  topology = (rt.get("num_nodes", 1), rt.get("ranks_per_node", num_ranks))
  cfg = DecoderConfig(d_model=flags_.d_model, d_ff=flags_.d_ff, num_heads=flags_.heads,
                      num_kv_heads=flags_.kv_heads, num_layers=flags_.layers,
                      vocab=flags_.vocab, max_len=flags_.max_len, dtype=flags_.dtype)
  ours = f"jaxoverlap:{flags_.backend}:{flags_.algorithm}"
  impls = {"both": [PSUM, ours], "psum": [PSUM], "jaxoverlap": [ours]}[flags_.impl]
  log = print if rank == 0 else (lambda s: None)
  log(f"decode: world {num_ranks} ({jax.devices()[0].platform}), {cfg}, impls {impls}")
  records, rejected = run(
      cfg, mesh, impls=impls, batches=[int(b) for b in flags_.batches],
      prompt_len=flags_.prompt_len, num_tokens=flags_.tokens, reps=flags_.reps,
      warmup=flags_.warmup, check_steps=flags_.check_steps, seed=flags_.seed,
      unroll=flags_.unroll, topology=topology, log=log)
  if rank == 0:
    extra = {"model": "Llama-style decoder: RMSNorm, RoPE, GQA, SwiGLU; TP Megatron layout",
             "world": num_ranks, "platform": jax.devices()[0].platform}
    cuda = sys.modules.get("jaxoverlap._cuda")
    if cuda is not None:
      extra["auto_choices"] = sorted({(d["bytes"], d["algorithm"], d["protocol"])
                                      for d in cuda.decisions})
    command = launch.reproduce_command("benchmarks/decode.py")
    method = METHOD.format(reps=flags_.reps, tokens=flags_.tokens, prompt_len=flags_.prompt_len)
    path, png = write_results(flags_.out, flags_.machine, records, rejected, command=command,
                              method=method, versions=tuning.package_versions(), extra=extra)
    print(markdown_table(records, ours if ours in impls else None))
    print(f"wrote {path} and {png}", flush=True)
  return 1 if rejected else 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
