"""Decode benchmark: per-token latency of a tensor-parallel Llama-style decoder, psum vs jaxoverlap.

Problem:
  In tensor-parallel (TP) decode every layer ends its attention and its MLP
  with an all-reduce of the [batch, 1, d_model] activations: 2 * num_layers
  small messages (batch * d_model * 2 bytes in bf16, 8 KiB - 512 KiB for
  d_model 4096 and batch 1-64) per generated token. This benchmark measures
  what the all-reduce implementation does to the latency of a whole decode
  step, and which share of the step the all-reduces take.

Model (RANDOM weights: no checkpoint is read; the JSON says "weights": "random"):
  A Llama-style decoder built from ``jaxoverlap.nnx`` (``Decoder``): a
  replicated token embedding, ``TransformerBlock``s (pre-RMSNorm
  grouped-query attention with RoPE, theta 500000 as in Llama 3; SwiGLU; no
  biases), a final ``RMSNorm`` and an untied LM head (``ColumnParallelLinear``
  over the vocabulary), tensor parallel over the mesh axis "tp" in the
  Megatron layout (arXiv 1909.08053). Each row-parallel projection (attention
  output, MLP down) is followed by an all-reduce of the [batch, 1, d_model]
  partial sums: ``ParallelConfig(row_reduction="all_reduce")`` with the
  implementation's backend, algorithm and protocol (``parallel_config``). The
  greedy token is a sharded argmax (``pmax`` then ``pmin`` of [batch], the same
  for every implementation). bf16 storage and activations; fp32 accumulation,
  RMSNorm, softmax and RoPE. The KV cache is the attention layers' (per layer
  [batch, max_len, num_kv_heads, head_dim], the KV heads sharded over "tp");
  all sequences of a batch are at the same position, and attention reads all
  ``max_len`` cached positions under a causal mask (static shapes), so a step
  costs the same at every position.

Method:
  For each batch size: a random prompt of ``--prompt_len`` tokens is
  prefilled (one jit'd call of the model on the whole prompt, with psum).
  Then each implementation is checked: it and psum run ``--check_steps``
  teacher-forced steps from the same cache, and the logits must agree within
  eps(dtype)**(2/3) * max|logit| on every rank's vocabulary block and every
  greedy token must agree (or be a tie within that tolerance). The same check
  first runs on a tiny model (``tiny_config``). An implementation that fails
  is not timed and is listed under "rejected" in the JSON.

  Timing: one jit'd ``lax.fori_loop`` of ``--tokens`` greedy decode steps
  (the KV cache donated and passed on from call to call; each call restarts
  at position ``prompt_len``, so every call does the same work). Per-token
  latency = median over ``--reps`` calls of (call wall time / tokens), us.
  The implementations and the floor are interleaved call by call
  (``harness.time_interleaved``), so all figures of one table come from the
  same run. The floor ("floor:no_all_reduce") is the same step with every
  all-reduce left out (``row_reduction="none"``: the result is wrong, the
  compute is the same), and all_reduce_share = (t_step - t_floor) / t_step
  for each implementation. psum is timed twice: ``xla:psum`` with XLA's
  default command-buffer types, under which every psum splits XLA's CUDA
  graphs, and ``xla:psum_graphs``, the same program compiled with
  ``COLLECTIVES`` added (``harness.compile_options``), as our
  command-buffer-compatible custom calls stay inside the graphs by default.
  Included in every figure alike: one host dispatch
  per call (amortised over the tokens), the loop's own per-iteration cost,
  the full-length masked attention and the sharded argmax.

Results (rank 0): ``<out>/decode-<machine>.json`` in the results format of
jaxoverlap.tuning.results, one record per (impl, batch): op "decode_token";
impl "xla:psum", "xla:psum_graphs" (with its ``xla_options``),
"jaxoverlap:<backend>:<algorithm>" or "floor:no_all_reduce";
shape a dict of the model and batch sizes (batch, d_model, d_ff, heads,
kv_heads, head_dim, layers, vocab, max_len, prompt_len); bytes = one
all-reduce message per rank; time_us per token (the median; time_us_p10 and
time_us_p90 the 10th and 90th percentiles over the calls); all_reduce_share (not on the
floor's records); auto_choices: the [bytes, algorithm, protocol] that
algorithm "auto" chose (``jaxoverlap.decisions()``). Also
``<out>/decode-<machine>.png`` (latency against batch) and a Markdown table on
stdout.

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

import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import harness
from jaxoverlap import nnx as jnnx
from jaxoverlap import tuning

AXIS = "tp"
PSUM = harness.PSUM
PSUM_GRAPHS = harness.PSUM_GRAPHS  # psum compiled with COLLECTIVES in XLA's command buffers
FLOOR = harness.NO_ALL_REDUCE
FUSE_NORM = "+fuse_norm"  # impl suffix: ParallelConfig.fuse_norm
BENCHMARK = "decode"


# ------------------------------------------------------------------ model


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Sizes of the Llama-style decoder (defaults: Llama-3-8B-like, 4 layers).

  Attributes:
    d_model: model width. d_ff: SwiGLU hidden width.
    num_heads, num_kv_heads: query and key/value heads (grouped-query
      attention when num_kv_heads < num_heads).
    head_features: features per head; None: d_model / num_heads (``head_dim``).
    num_layers: decoder blocks. vocab: vocabulary size.
    max_len: KV cache length, tokens. dtype: storage and activation type.
    rope_theta: RoPE base. norm_eps: RMSNorm epsilon.
    attention: the attention core of a decode step
      (``ParallelConfig.attention_implementation``: "xla" or "cudnn").
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
  head_features: int | None = None
  attention: str = "xla"

  @property
  def head_dim(self) -> int:
    return self.head_features or self.d_model // self.num_heads

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


def parallel_config(mesh, impl: str, min_matmul_rows: int = 1) -> jnnx.ParallelConfig:
  """The layers' ``ParallelConfig`` of an implementation: how the row-parallel sums run.

  Args:
    mesh: the (tp,) mesh.
    impl: ``"xla:psum"`` (``lax.psum``; ``"xla:psum_graphs"`` the same),
      ``"jaxoverlap:<backend>:<algorithm>"``
      (``jaxoverlap.all_reduce``; ``harness.impl_kwargs``), the same with the
      suffix ``FUSE_NORM`` (each all-reduce of a block, the residual add and
      the RMSNorm after it as one ``jaxoverlap.all_reduce_rms_norm``:
      ``fuse_norm``, with the blocks chained through ``next_norm``)
      or ``"floor:no_all_reduce"`` (no sum: wrong results, the same compute).
    min_matmul_rows: ``ParallelConfig.min_matmul_rows`` (the same for every
      implementation).

  Raises:
    ValueError: an unknown name.
  """
  if impl == FLOOR:
    return jnnx.ParallelConfig(mesh=mesh, dp_axis=None, tp_axis=AXIS, row_reduction="none",
                               min_matmul_rows=min_matmul_rows)
  if impl == PSUM_GRAPHS:  # the same program as psum's, compiled with other XLA options
    impl = PSUM
  fuse_norm = impl.endswith(FUSE_NORM)
  kw = harness.impl_kwargs("all_reduce", impl.removesuffix(FUSE_NORM))
  return jnnx.ParallelConfig(
      mesh=mesh, dp_axis=None, tp_axis=AXIS, backend=kw["backend"], row_reduction="all_reduce",
      all_reduce_algorithm=kw["algorithm"], all_reduce_protocol=kw.get("protocol", "auto"),
      fuse_norm=fuse_norm, min_matmul_rows=min_matmul_rows)


class Decoder(nnx.Module):
  """The Llama-style decoder of the module docstring, from ``jaxoverlap.nnx`` layers.

  Always decodes: ``__call__(tokens [b, s])`` takes the next ``s`` tokens of
  every sequence, at the position of the KV cache (``init_cache`` first), and
  returns their logits ``[b, s, vocab]`` float32, the vocabulary sharded over
  "tp".
  """

  def __init__(self, cfg: DecoderConfig, parallel: jnnx.ParallelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    common = dict(config=parallel, dtype=dtype, param_dtype=dtype, rngs=rngs)
    embed_init = nnx.initializers.normal(1.0)
    if parallel.mesh is not None:  # replicated over tp
      embed_init = nnx.with_partitioning(embed_init, (None, None), mesh=parallel.mesh)
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=dtype, param_dtype=dtype,
                           embedding_init=embed_init, rngs=rngs)
    self.layers = nnx.List([
        jnnx.TransformerBlock(cfg.d_model, cfg.num_heads, cfg.d_ff,
                              head_features=cfg.head_dim, num_kv_heads=cfg.num_kv_heads,
                              rope_theta=cfg.rope_theta,
                              activation="swiglu", norm="rms", use_bias=False,
                              epsilon=cfg.norm_eps, **common)
        for _ in range(cfg.num_layers)])
    self.final_norm = jnnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, **common)
    self.head = jnnx.ColumnParallelLinear(cfg.d_model, cfg.vocab, use_bias=False,
                                          kernel_axes=("embed", "vocab"), **common)
    self.max_len = cfg.max_len

  def init_cache(self, batch: int) -> None:
    """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens."""
    for layer in self.layers:
      layer.init_cache((batch, self.max_len))

  def set_position(self, pos) -> None:
    """Moves every layer's cache to position ``pos`` (the next token is written there)."""
    for layer in self.layers:
      layer.attn.cache_index[...] = jnp.asarray(pos, jnp.int32)

  def __call__(self, tokens_bs: jax.Array) -> jax.Array:
    """Logits [b, s, vocab] f32 of the next ``s`` tokens [b, s] of every sequence.

    The blocks run through ``jaxoverlap.nnx.apply_blocks``: with
    ``fuse_norm`` both reductions of every block run as one
    ``all_reduce_rms_norm`` with the residual add and the norm that follows.
    """
    normed_bsd = jnnx.apply_blocks(self.layers, self.embed(tokens_bs), self.final_norm,
                                   decode=True)
    return self.head(normed_bsd).astype(jnp.float32)


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


# ------------------------------------------------------------------ jit'd functions


@functools.cache
def _graphdef(cfg: DecoderConfig, mesh, impl: str, min_matmul_rows: int = 1):
  """The model's structure under ``impl``'s ParallelConfig (weights: ``make_params``)."""
  def build():
    parallel = dataclasses.replace(parallel_config(mesh, impl, min_matmul_rows),
                                   attention_implementation=cfg.attention)
    model = Decoder(cfg, parallel, rngs=nnx.Rngs(0))
    model.init_cache(1)
    return model

  return nnx.split(nnx.eval_shape(build), nnx.Param, nnx.Cache)[0]


def make_params(cfg: DecoderConfig, mesh, seed: int) -> nnx.State:
  """Random weights, created on the devices in their TP layout (``nnx.Param`` state)."""
  params = lambda: nnx.state(  # noqa: E731
      Decoder(cfg, parallel_config(mesh, PSUM), rngs=nnx.Rngs(seed)), nnx.Param)
  shardings = nnx.get_named_sharding(nnx.eval_shape(params), mesh)
  return jax.jit(params, out_shardings=shardings)()


def make_cache(cfg: DecoderConfig, mesh, batch: int) -> nnx.State:
  """An empty KV cache (``nnx.Cache`` state) for ``batch`` sequences, at position 0."""
  model = nnx.eval_shape(lambda: Decoder(cfg, parallel_config(mesh, PSUM), rngs=nnx.Rngs(0)))
  model.init_cache(batch)
  return nnx.state(model, nnx.Cache)


def _greedy(logits_bv, mesh):
  """The greedy token [b] of vocabulary-sharded logits [b, vocab] (``sharded_argmax``)."""
  return jax.shard_map(sharded_argmax, mesh=mesh, in_specs=P(None, AXIS),
                       out_specs=P())(logits_bv)


def _step(model: Decoder, tok_b, mesh):
  """One token per sequence: (logits [b, vocab] f32, vocabulary-sharded; greedy token [b])."""
  logits_bv = model(tok_b[:, None])[:, -1]
  return logits_bv, _greedy(logits_bv, mesh)


def _forced(graphdef, params, cache, inputs_nb, pos, *, mesh):
  """Teacher-forced steps over ``inputs_nb`` [n, batch] from ``pos``: (logits, tokens, cache)."""
  def one(cache, tok_b):
    model = nnx.merge(graphdef, params, cache)
    logits, nxt = _step(model, tok_b, mesh)
    return nnx.state(model, nnx.Cache), (logits, nxt)

  model = nnx.merge(graphdef, params, cache)
  model.set_position(pos)
  cache, (logits, toks) = lax.scan(one, nnx.state(model, nnx.Cache), inputs_nb)
  return logits, toks, cache


def make_forced_fn(cfg: DecoderConfig, mesh, impl: str):
  """jit'd teacher-forced decode steps (the check runs two of them; tests, one at a time).

  Returns:
    ``f(params, cache, inputs [n, batch] int32, pos) -> (logits [n, batch,
    vocab] f32, vocabulary-sharded; greedy tokens [n, batch]; cache)``: step
    ``i`` feeds ``inputs[i]`` at position ``pos + i``.
  """
  return jax.jit(functools.partial(_forced, _graphdef(cfg, mesh, impl), mesh=mesh))


def make_prefill_fn(cfg: DecoderConfig, mesh, impl: str = PSUM):
  """jit'd prefill: the model on the whole prompt, from position 0.

  Returns:
    ``f(params, cache, prompt [batch, prompt_len] int32) -> (cache, next token
    [batch])``; the cache is donated.
  """
  graphdef = _graphdef(cfg, mesh, impl)

  def body(params, cache, prompt_bn):
    model = nnx.merge(graphdef, params, cache)
    model.set_position(0)
    return nnx.state(model, nnx.Cache), _greedy(model(prompt_bn)[:, -1], mesh)

  return jax.jit(body, donate_argnums=1)


def make_generate_fn(cfg: DecoderConfig, mesh, impl: str, num_tokens: int, unroll: int = 1,
                     min_matmul_rows: int = 1):
  """jit'd greedy decode of ``num_tokens`` steps in one ``lax.fori_loop`` (timed).

  Returns:
    ``f(params, cache, tok [batch], pos) -> (cache, tokens [num_tokens,
    batch])``: the tokens generated after ``tok`` at positions ``pos .. pos +
    num_tokens - 1``; the cache is donated.
  """
  graphdef = _graphdef(cfg, mesh, impl, min_matmul_rows)

  def body(params, cache, tok_b, pos):
    def one(i, carry):
      cache, tok_b, toks = carry
      model = nnx.merge(graphdef, params, cache)
      _, tok_b = _step(model, tok_b, mesh)
      return nnx.state(model, nnx.Cache), tok_b, lax.dynamic_update_slice(toks, tok_b[None],
                                                                          (i, 0))

    model = nnx.merge(graphdef, params, cache)
    model.set_position(pos)
    toks = jnp.zeros((num_tokens, tok_b.shape[0]), jnp.int32)
    cache, _, toks = lax.fori_loop(0, num_tokens, one, (nnx.state(model, nnx.Cache), tok_b, toks),
                                   unroll=unroll)
    return cache, toks

  fn = jax.jit(body, donate_argnums=1)
  options = harness.compile_options(impl)  # xla:psum_graphs: psum inside XLA's CUDA graphs
  if not options:
    return fn
  compiled = []

  def with_options(*args):
    if not compiled:
      compiled.append(fn.lower(*args).compile(compiler_options=options))
    return compiled[0](*args)

  return with_options


def tolerance(dtype) -> float:
  """Relative logit tolerance of the check: eps(dtype)**(2/3), as tests/_helpers.py."""
  return float(jnp.finfo(jnp.dtype(dtype)).eps) ** (2.0 / 3.0)


def make_check_fn(cfg: DecoderConfig, mesh, impl: str, ref_impl: str = PSUM,
                  min_matmul_rows: int = 1):
  """jit'd comparison of ``impl`` with ``ref_impl`` over teacher-forced steps.

  Both run the same steps from the same cache; ``impl`` with
  ``min_matmul_rows`` (the reference never pads).

  Returns:
    ``f(params, cache, inputs [n, batch], pos0) -> dict`` of replicated
    arrays: ``err`` [n], the largest |logit - reference logit| of the step
    over the whole vocabulary; ``scale`` [n], the largest |reference logit|;
    ``flips`` and ``bad``, counts of tokens that differ from the reference's,
    and of those that are not a tie (the reference logit of the chosen token
    is below the maximum by more than tolerance(dtype) * scale).
  """
  graphdef = _graphdef(cfg, mesh, impl, min_matmul_rows)
  ref_graphdef = _graphdef(cfg, mesh, ref_impl)
  rtol = tolerance(cfg.dtype)

  def body(params, cache, inputs_nb, pos0):
    ref, tok_ref, _ = _forced(ref_graphdef, params, cache, inputs_nb, pos0, mesh=mesh)
    got, tok, _ = _forced(graphdef, params, cache, inputs_nb, pos0, mesh=mesh)
    diff = jnp.abs(got - ref)
    err = jnp.max(jnp.where(jnp.isnan(diff), jnp.inf, diff), axis=(1, 2))
    scale = jnp.max(jnp.abs(ref), axis=(1, 2))
    chosen = jnp.take_along_axis(ref, tok[..., None], axis=2)[..., 0]
    tie = chosen >= ref.max(-1) - rtol * scale[:, None]
    differ = tok != tok_ref
    return {"err": err, "scale": scale, "flips": jnp.sum(differ), "bad": jnp.sum(differ & ~tie)}

  replicated = NamedSharding(mesh, P())
  return jax.jit(body, out_shardings={k: replicated for k in ("err", "scale", "flips", "bad")})


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


def check_impl(cfg: DecoderConfig, mesh, params, cache, inputs_nb, pos0: int,
               impl: str, min_matmul_rows: int = 1) -> str | None:
  """Runs ``make_check_fn`` and returns ``check_result``'s verdict (None: passed)."""
  fn = make_check_fn(cfg, mesh, impl, min_matmul_rows=min_matmul_rows)
  stats = _replicated(fn(params, cache, _global(mesh, inputs_nb), _global(mesh, np.int32(pos0))))
  return check_result(stats, cfg.dtype)


def check_tiny(mesh, impl: str, dtype: str, seed: int, min_matmul_rows: int = 1) -> str | None:
  """The check on ``tiny_config``: 8 random forced tokens from an empty cache, batch 2."""
  cfg = tiny_config(mesh.shape[AXIS], dtype)
  params = make_params(cfg, mesh, seed)
  inputs = np.random.default_rng([seed, 1]).integers(0, cfg.vocab, (8, 2), dtype=np.int32)
  return check_impl(cfg, mesh, params, make_cache(cfg, mesh, 2), inputs, 0, impl,
                    min_matmul_rows)


def _refusal(check: Callable[..., str | None], *args) -> str | None:
  """``check(*args)``'s verdict; an exception (e.g. a backend that cannot run here) is one."""
  try:
    return check(*args)
  except Exception as e:  # noqa: BLE001: a refusal is a rejection, recorded with its reason
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def run(cfg: DecoderConfig, mesh, *, impls: list[str], batches: list[int], prompt_len: int,
        num_tokens: int, reps: int, warmup: int = 2, check_steps: int = 4, seed: int = 0,
        unroll: int = 1, topology: tuple[int, int] | None = None, min_matmul_rows: int = 1,
        log: Callable[[str], None] = print) -> tuple[list[dict], list[dict]]:
  """Checks, then times, every implementation and the floor for each batch size.

  Args:
    cfg: model sizes; mesh: a (tp,) mesh over all devices.
    impls: implementation names (see ``parallel_config``); the floor is added.
    batches: batch sizes (sequences).
    prompt_len: prefilled prompt tokens. num_tokens: decode steps per timed call.
    reps: timed calls (median). warmup: untimed calls per implementation.
    check_steps: teacher-forced steps of the per-batch check on this model
      (0: only the tiny-model check).
    seed: weights and prompts. unroll: ``lax.fori_loop`` unroll factor.
    topology: (num_nodes, ranks_per_node) for the records (default: one node).
    min_matmul_rows: ``ParallelConfig.min_matmul_rows`` of every timed
      implementation and its checks.
    log: where progress and check failures are printed.

  Returns:
    ``(records, rejected)``: records of the results format of
    jaxoverlap.tuning.results ("decode_token"; time_us per token), and
    ``{"impl", "batch", "reason"}`` for implementations that failed a check
    or raised in it (not timed).

  Raises:
    ValueError: sizes that do not fit (the layers' own checks of the config
      against the mesh, or prompt_len + tokens > max_len).
  """
  num_ranks = mesh.shape[AXIS]
  _graphdef(cfg, mesh, PSUM)  # builds the model abstractly: the layers check the sizes
  if prompt_len < 1 or prompt_len + max(num_tokens, check_steps) > cfg.max_len:
    raise ValueError(f"prompt_len {prompt_len} + max(tokens {num_tokens}, check_steps "
                     f"{check_steps}) must fit in max_len {cfg.max_len} (prompt_len >= 1)")
  num_nodes, ranks_per_node = topology or (1, num_ranks)
  rejected = []
  alive = []
  for impl in impls:
    why = None if impl in (PSUM, PSUM_GRAPHS) else _refusal(check_tiny, mesh, impl, cfg.dtype,
                                                            seed, min_matmul_rows)
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
    prompt = rng.integers(0, cfg.vocab, (batch, prompt_len), dtype=np.int32)
    cache, tok = prefill(params, make_cache(cfg, mesh, batch), _global(mesh, prompt))
    pos = _global(mesh, np.int32(prompt_len))
    timed = []
    for impl in alive:
      why = None
      if impl not in (PSUM, PSUM_GRAPHS) and check_steps:
        inputs = rng.integers(0, cfg.vocab, (check_steps, batch), dtype=np.int32)
        why = _refusal(check_impl, cfg, mesh, params, cache, inputs, prompt_len, impl,
                       min_matmul_rows)
      if why:
        log(f"CHECK FAILED: {impl} at batch {batch}: {why}; {impl} is not timed")
        rejected.append({"impl": impl, "batch": batch, "reason": why})
      else:
        timed.append(impl)
    timed.append(FLOOR)
    state = {"cache": cache}

    def call(fn):
      state["cache"], toks = fn(params, state["cache"], tok, pos)
      return toks

    calls = {impl: functools.partial(call, make_generate_fn(cfg, mesh, impl, num_tokens, unroll,
                                                            min_matmul_rows))
             for impl in timed}
    times = harness.time_interleaved(calls, reps=reps, warmup=warmup)
    floor_us = harness.median(times[FLOOR]) / num_tokens * 1e6
    line = []
    for impl in timed:
      spread = tuning.spread_us([t / num_tokens * 1e6 for t in times[impl]])
      us = spread["time_us"]
      rec = {"op": "decode_token", "impl": impl, "dtype": jnp.dtype(cfg.dtype).name,
             "shape": dict(batch=batch, **cfg.shape(), prompt_len=prompt_len,
                           min_matmul_rows=min_matmul_rows),
             "bytes": batch * cfg.d_model * itemsize, "world": num_ranks,
             "ranks_per_node": ranks_per_node, "num_nodes": num_nodes,
             "all_reduces_per_token": 0 if impl == FLOOR else 2 * cfg.num_layers,
             "time_us": round(us, 3), "time_us_p10": round(spread["p10_us"], 3),
             "time_us_p90": round(spread["p90_us"], 3),
             **({"xla_options": harness.compile_options(impl)}
                if harness.compile_options(impl) else {})}
      if impl != FLOOR:
        rec["all_reduce_share"] = round((us - floor_us) / us, 4)
      records.append(rec)
      line.append(f"{impl}={us:.1f}")
    log(f"batch {batch:>4}: us/token " + "  ".join(line))
  return records, rejected


def markdown_table(records: list[dict], ours: str | None) -> str:
  """batch | psum us/token (outside, inside XLA's graphs) | jaxoverlap | speed-ups | shares."""
  by = {(r["impl"], r["shape"]["batch"]): r for r in records}
  rows = ["| batch | psum us/token | psum in graphs us/token | jaxoverlap us/token | speed-up "
          "| vs psum in graphs | all-reduce share psum | all-reduce share ours |",
          "|---|---|---|---|---|---|---|---|"]

  def cell(impl, b, key, fmt):
    r = by.get((impl, b))
    return "-" if r is None or key not in r else fmt(r[key])

  def speed(base, b):
    a, o = by.get((base, b)), by.get((ours, b))
    return f"{a['time_us'] / o['time_us']:.2f}x" if a and o else "-"

  for b in sorted({r["shape"]["batch"] for r in records}):
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    us = lambda v: f"{v:.1f}"  # noqa: E731
    rows.append(f"| {b} | {cell(PSUM, b, 'time_us', us)} | {cell(PSUM_GRAPHS, b, 'time_us', us)} "
                f"| {cell(ours, b, 'time_us', us)} | {speed(PSUM, b)} | {speed(PSUM_GRAPHS, b)} "
                f"| {cell(PSUM, b, 'all_reduce_share', pct)} | "
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
                  command: str | None = None, method: str, extra: dict | None = None
                  ) -> tuple[str, str]:
  """Writes ``<out_dir>/decode-<machine>.json`` (``harness.write_result``) and the PNG.

  Returns:
    (json path, png path).
  """
  path = harness.path(out_dir, BENCHMARK, machine)
  harness.write_result(path, records, benchmark=BENCHMARK, machine=machine, method=method,
                       script="benchmarks/decode.py", command=command, rejected=rejected,
                       extra={"weights": "random", **(extra or {})})
  png = harness.path(out_dir, BENCHMARK, machine, ext="png")
  first = records[0]["shape"] if records else {}
  plot(records, png, f"decode, {machine}, world {records[0]['world'] if records else '?'}, "
       f"d={first.get('d_model')} L={first.get('layers')} (random weights)")
  return path, png


METHOD = ("per-token latency: median over {reps} calls of one jit'd lax.fori_loop of {tokens} "
          "greedy decode steps (KV cache donated; every call from position {prompt_len} after a "
          "{prompt_len}-token random prompt), divided by {tokens}; implementations and floor "
          "interleaved call by call; attention reads all max_len cached positions (masked); "
          "all_reduce_share = (t - t_floor) / t, floor = the same step with every all-reduce "
          "left out; every impl checked against psum before timing; xla:psum_graphs: psum "
          "compiled with COLLECTIVES added to XLA's command-buffer types")


# ------------------------------------------------------------------ main


def define_model_flags(layers: int) -> None:
  """The model-size and decode-length flags (sizes of the full model; ``config_from_flags``)."""
  from absl import flags

  module = harness.flag_module()  # under the --help of decode_floor.py too, which borrows them
  flags.DEFINE_integer("d_model", 4096, "model width", module_name=module)
  flags.DEFINE_integer("d_ff", 14336, "MLP hidden width", module_name=module)
  flags.DEFINE_integer("heads", 32, "query heads", module_name=module)
  flags.DEFINE_integer("kv_heads", 8, "key/value heads", module_name=module)
  flags.DEFINE_integer("layers", layers, "decoder layers", module_name=module)
  flags.DEFINE_integer("vocab", 32000, "vocabulary size", module_name=module)
  flags.DEFINE_integer("max_len", 1024, "KV cache length, tokens", module_name=module)
  flags.DEFINE_integer("prompt_len", 128, "prefilled prompt length, tokens", module_name=module)
  flags.DEFINE_integer("tokens", 32, "decode steps per timed call", module_name=module)
  flags.DEFINE_enum("attention", "xla", ["xla", "cudnn"], "attention core of a decode step "
                    "(ParallelConfig.attention_implementation)", module_name=module)


def config_from_flags(fl) -> DecoderConfig:
  """The DecoderConfig of ``define_model_flags``'s flags (and ``--dtype``)."""
  return DecoderConfig(d_model=fl.d_model, d_ff=fl.d_ff, num_heads=fl.heads,
                       num_kv_heads=fl.kv_heads, num_layers=fl.layers, vocab=fl.vocab,
                       max_len=fl.max_len, dtype=fl.dtype, attention=fl.attention)


def define_flags():
  """Defines the command-line flags (only when run as a script, so importing is free)."""
  from absl import flags

  flags.DEFINE_enum("impl", "both", ["both", "jaxoverlap", "psum"],
                    "all-reduce implementation(s), timed in one process group; psum twice: "
                    "with XLA's default command-buffer types (each psum splits XLA's CUDA "
                    "graphs) and with COLLECTIVES added (xla:psum_graphs)")
  flags.DEFINE_string("backend", "cuda", "jaxoverlap backend (cuda, xla or auto)")
  flags.DEFINE_string("algorithm", "auto", "jaxoverlap algorithm, with its protocol if any "
                      "(e.g. one_shot_ll)")
  flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32", "64"], "batch sizes")
  flags.DEFINE_bool("fuse_norm", False, "also time the jaxoverlap implementation with every "
                    "all-reduce fused with the residual add and the RMSNorm after it "
                    "(ParallelConfig.fuse_norm)")
  define_model_flags(layers=4)
  flags.DEFINE_integer("check_steps", 4, "teacher-forced steps of the per-batch check (0: off)")
  flags.DEFINE_integer("unroll", 1, "lax.fori_loop unroll factor of the timed loop")
  flags.DEFINE_integer("min_matmul_rows", 1, "ParallelConfig.min_matmul_rows of every "
                       "implementation (2 or 4: batch 1 reads the weights at the batch-4 speed)")
  harness.define_flags("out", "machine", "seed", "host_devices",
                       dtype=(("bfloat16", "weights and activations")),
                       reps=(20, "timed calls per implementation (median)"),
                       warmup=(2, "untimed calls per implementation"))


def ours_impl(backend: str, algorithm: str) -> str:
  """``"jaxoverlap:<backend>:<algorithm>"`` of ``--backend`` and ``--algorithm``.

  Raises:
    ValueError: naming the flag whose value is not one of the op's.
  """
  from jaxoverlap import names

  impl = f"jaxoverlap:{backend}:{algorithm}"
  if backend not in names.BACKENDS:
    raise ValueError(f"--backend: {backend!r} is not one of {', '.join(names.BACKENDS)}")
  try:
    harness.impl_kwargs(names.ALL_REDUCE, impl)
  except ValueError:
    algs = names.algorithms(names.ALL_REDUCE, None if backend == names.AUTO else backend)
    protocol = "" if backend == names.XLA else ", or a CUDA one with its protocol: one_shot_ll"
    raise ValueError(f"--algorithm: {algorithm!r} is no all_reduce algorithm of --backend "
                     f"{backend!r} (auto, {', '.join(algs)}{protocol})") from None
  return impl


def main(argv):
  del argv
  from absl import app, flags

  fl = flags.FLAGS
  ours = f"jaxoverlap:{fl.backend}:{fl.algorithm}"
  try:
    ours_impl(fl.backend, fl.algorithm)
    batches = harness.parse_ints("batches", fl.batches)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  harness.use_host_devices(fl.host_devices)
  run_ = harness.start(AXIS)
  cfg = config_from_flags(fl)
  impls = {"both": [PSUM, PSUM_GRAPHS, ours], "psum": [PSUM, PSUM_GRAPHS],
           "jaxoverlap": [ours]}[fl.impl]
  if fl.fuse_norm and fl.impl != "psum":
    impls.append(ours + FUSE_NORM)
  run_.log(f"decode: world {run_.world} ({run_.platform}), {cfg}, impls {impls}")
  records, rejected = run(
      cfg, run_.mesh, impls=impls, batches=batches,
      prompt_len=fl.prompt_len, num_tokens=fl.tokens, reps=fl.reps, warmup=fl.warmup,
      check_steps=fl.check_steps, seed=fl.seed, unroll=fl.unroll,
      min_matmul_rows=fl.min_matmul_rows,
      topology=(run_.num_nodes, run_.ranks_per_node), log=run_.log)
  if run_.rank == 0:
    extra = {"model": "Llama-style decoder from jaxoverlap.nnx: RMSNorm, RoPE, GQA, SwiGLU; "
                      "TP Megatron layout", "world": run_.world, "platform": run_.platform,
             "auto_choices": harness.auto_choices(),
             "xla_flags": os.environ.get("XLA_FLAGS", "")}
    method = METHOD.format(reps=fl.reps, tokens=fl.tokens, prompt_len=fl.prompt_len)
    path, png = write_results(fl.out, harness.machine_name(fl.machine), records, rejected,
                              method=method, extra=extra)
    print(markdown_table(records, ours if ours in impls else None))
    print(f"wrote {path} and {png}", flush=True)
  return 1 if rejected else 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
