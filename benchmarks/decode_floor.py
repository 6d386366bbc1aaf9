"""Where one GPU's decode step goes: the weights-read roofline, the matmuls alone, CUDA graphs.

Problem:
  In benchmarks/decode.py the tensor-parallel step without any all-reduce
  (its floor) took about twice the time it needs to read the weights once
  from HBM (batch 1, 32 layers, TP=2, before docs/decode.md's fix). An
  all-reduce can only win back its own share of a step, so what bounds the
  end-to-end gain is this floor. This benchmark takes the floor apart on one
  GPU: how close the step is to the weights-read roofline, how much of it
  the weight matmuls alone take, whether XLA's CUDA graphs (command buffers)
  cover the loop, and how many kernels a token runs.

What runs (one GPU, one process, no communication):
  The decoder of benchmarks/decode.py at the sizes of ONE rank of TP=--tp
  (d_ff, heads, kv_heads and vocab divided by tp; head_dim that of the full
  model), so one step here is the local compute of one GPU of the TP run:
  decode.py's floor ("floor:no_all_reduce") without its sharded argmax's two
  tiny cross-rank reductions. Random weights, bf16.

  For each batch size:
    * step/<variant>: per-token time of decode.make_generate_fn (one jit'd
      lax.fori_loop of --tokens greedy steps, the KV cache donated) for each
      variant of ``variants()``: XLA's compile options
      (``jax.jit(...).lower(...).compile(compiler_options=...)``, the same
      options a user passes through XLA_FLAGS), the layers'
      ``min_matmul_rows``, or the attention core (XLA's or cuDNN's).
    * matmuls/<variant>: the same loop over tokens with only the weight matmuls of each
      layer (qkv, attention output, MLP up, MLP down) and the LM head, on the
      model's own weight arrays: what XLA's GEMMs take to read the weights
      (not for the cuDNN-attention variants: their matmuls are those of the
      variant without it).
    * roofline: (weight bytes + KV-cache bytes read per token) / the HBM read
      bandwidth measured in the same run (the faster of two float32 sums over
      a --hbm_gib GiB bf16 array, all elements or rows of 8192; best of
      --reps).
  Timing: harness.time_interleaved (every implementation in turn within each
  rep, median of --reps), per token = call time / tokens.

  Profile (--profile_tokens > 0): one call of that many tokens, default
  variant compiled with xla_enable_command_buffers_during_profiling=true (so
  the graphs stay as in the timed runs), under jax.profiler.trace. From the
  device rows: kernels per token, GPU busy time per token (the union of the
  kernel intervals), busy share of the window (1 - busy share = the GPU idle
  between kernels: launch and dependency gaps), and the kernels that take
  the most time.

Results: ``<out>/decode_floor-<machine>.json`` (records: op
"decode_floor_token", impl "step/<variant>", "matmuls/<variant>" or "roofline",
time_us per token, with batch and the shard's sizes; the profile per batch
under "profile"; the kernels of each variant's compiled step by kind, from
its optimized HLO, under "fusions"; a variant whose options this jaxlib does
not know or cannot compile is left out, its error under "compile_errors";
the share of each variant's greedy tokens equal to the first variant's under
"tokens_match_first") and a Markdown table on stdout.

Example:
  python benchmarks/decode_floor.py --layers 32 --batches 1,4,16
  # CPU smoke run (no roofline meaning; checks the script):
  python benchmarks/decode_floor.py --host_devices 1 --layers 1 --d_model 64 --d_ff 128 \\
      --heads 4 --kv_heads 2 --vocab 128 --max_len 32 --prompt_len 8 --tokens 4 --reps 2 \\
      --hbm_gib 0.01 --profile_tokens 0 --out /tmp/decode_floor
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import re
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

import decode
import harness
import profile_step

BENCHMARK = "decode_floor"
AXIS = decode.AXIS
CMDBUF = harness.CMDBUF
SHORT_US = 5.0  # the profile counts kernels shorter than this apart (launch-sized work)
default_command_buffer_types = harness.default_command_buffer_types


# XLA options that change how the step's small kernels are fused, each off by
# default in jaxlib 0.11/0.12 (docs/decode.md, "XLA's fusion options"); a
# variant "<base>+<set>[+<set>...]" adds them to a base variant's options.
FLAG_SETS = {
    # Triton fusions for normalisations and other reductions (one kernel a norm).
    "block_level": {"xla_gpu_experimental_enable_fusion_block_level_rewriter": True},
    "all_triton": {"xla_gpu_experimental_all_fusions_with_triton": True},
    "heroless": {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
    # Multi-output fusions: e.g. the residual add and the norm that reads it.
    "triton_mof": {"xla_gpu_unsupported_enable_triton_multi_output_fusion": True},
    "same_shape_mof": {"xla_gpu_experimental_enable_same_shape_multi_output_fusion": True},
    "cudnn_norm": {"xla_gpu_enable_cudnn_layer_norm": True},
    # The whole loop in one graph, its body unrolled into it.
    "unroll": {"xla_gpu_command_buffer_unroll_loops": True},
}


def variants(names: list[str]) -> dict[str, tuple[dict[str, Any], int, str, str]]:
  """Compile options, ``min_matmul_rows`` and attention core of each variant name.

  ``xla_default``: none; ``no_graphs``: no command buffers at all;
  ``graphs_while``: the defaults plus WHILE (the whole fori_loop becomes one
  graph with a conditional node, no host round trip per token);
  ``cublas``: XLA's Triton GEMM fusions off (``xla_gpu_enable_triton_gemm``),
  so the autotuner picks among cuBLAS/cuBLASLt algorithms only;
  ``rows4``: XLA's defaults, the layers' GEMMs padded to at least 4 rows
  (``ParallelConfig.min_matmul_rows=4``); ``cudnn`` and ``rows4_cudnn``: as
  ``xla_default`` and ``rows4`` with the attention core of each decode step
  as one cuDNN kernel (``ParallelConfig.attention_implementation="cudnn"``);
  ``rows2_cudnn``: the GEMMs padded to 2 rows (copies of the real row),
  cuDNN attention; ``rows2zeros_cudnn``: the same with zero rows, as the
  layers padded before commit a27c677 (XLA runs the zero pad as a kernel of
  its own, and fuses the copies into the GEMM).

  ``<base>+<set>[+<set>...]``: the base variant with the XLA options of each
  set of ``FLAG_SETS`` added (``unroll`` also adds WHILE to the command-buffer
  types, since only a loop inside a graph can be unrolled into it).

  Returns:
    name -> (compile options, min_matmul_rows, attention implementation,
    padding: "copies" or "zeros").

  Raises:
    ValueError: an unknown name or set.
  """
  types = default_command_buffer_types()
  table = {"xla_default": ({}, 1, "xla"), "no_graphs": ({CMDBUF: ""}, 1, "xla"),
           "graphs_while": ({CMDBUF: ",".join(sorted(set(types) | {"WHILE"}))}, 1, "xla"),
           "cublas": ({"xla_gpu_enable_triton_gemm": False}, 1, "xla"), "rows4": ({}, 4, "xla"),
           "cudnn": ({}, 1, "cudnn"), "rows4_cudnn": ({}, 4, "cudnn"),
           "rows2_cudnn": ({}, 2, "cudnn"), "rows2zeros_cudnn": ({}, 2, "cudnn", "zeros")}
  unknown = [n for n in names if n.split("+")[0] not in table
             or any(f not in FLAG_SETS for f in n.split("+")[1:])]
  if unknown:
    raise ValueError(f"unknown variants {unknown}; known: {sorted(table)}, each optionally "
                     f"followed by +<set> of {sorted(FLAG_SETS)}")
  out = {}
  for n in names:
    base, *sets = n.split("+")
    options, rows, attention, pad = (table[base] + ("copies",))[:4]
    options = dict(options)
    for f in sets:
      options.update(FLAG_SETS[f])
      if f == "unroll":
        options[CMDBUF] = ",".join(sorted(set(types) | {"WHILE"}))
    out[n] = (options, rows, attention, pad)
  return out


def _matmul_zero_padding(x: jax.Array, w: jax.Array, min_rows: int = 1) -> jax.Array:
  """``jaxoverlap.nnx.layers._matmul`` as it was: the pad rows zeros, not copies of the rows."""
  rows = int(np.prod(x.shape[:-1]))
  if rows >= min_rows:
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
  x_rk = jnp.pad(x.reshape(rows, x.shape[-1]), ((0, min_rows - rows), (0, 0)))
  y_rn = jnp.matmul(x_rk, w, preferred_element_type=jnp.float32)[:rows]
  return y_rn.reshape(*x.shape[:-1], w.shape[-1]).astype(x.dtype)


def count_fusions(hlo_text: str) -> dict[str, int]:
  """Kernel launches of a compiled module by kind, from its optimized HLO text.

  Counts the ``fusion`` and ``custom-call`` instructions of every computation
  that is not itself the body of a fusion, keyed by the instruction's name
  without its numeric suffix (``loop_pad_fusion``, ``gemm_fusion_dot``,
  ``input_reduce_fusion``, ...); "total" is their sum. A decode loop's body
  runs once per token, so its counts are kernels per token, give or take the
  few kernels outside the loop (copies are not counted).
  """
  counts: collections.Counter[str] = collections.Counter()
  for block in re.split(r"\n\s*\n", hlo_text):
    name = block.lstrip().split("\n", 1)[0].split("(", 1)[0]
    if "fused" in name or "_computation" in name:
      continue
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = [^\n]*?\b(fusion|custom-call)\(",
                         block, re.M):
      counts[re.sub(r"(?:[._]\d+)+$", "", m.group(1))] += 1
  counts["total"] = sum(counts.values())
  return dict(counts)


@contextlib.contextmanager
def padding(kind: str):
  """The layers pad their short GEMMs with ``kind`` while tracing ("copies": the library's)."""
  from jaxoverlap.nnx import layers

  if kind not in ("copies", "zeros"):
    raise ValueError(f"padding: kind must be 'copies' or 'zeros', got {kind!r}")
  saved = layers._matmul  # noqa: SLF001
  if kind == "zeros":
    layers._matmul = _matmul_zero_padding  # noqa: SLF001
  try:
    yield
  finally:
    layers._matmul = saved  # noqa: SLF001


def shard_config(cfg: decode.DecoderConfig, tp: int) -> decode.DecoderConfig:
  """The sizes of one rank of TP=``tp``: d_ff, heads, kv_heads and vocab divided by tp.

  Raises:
    ValueError: a size not divisible by tp.
  """
  for name in ("d_ff", "num_heads", "num_kv_heads", "vocab"):
    if getattr(cfg, name) % tp:
      raise ValueError(f"{name} {getattr(cfg, name)} is not divisible by tp {tp}")
  return dataclasses.replace(cfg, d_ff=cfg.d_ff // tp, num_heads=cfg.num_heads // tp,
                             num_kv_heads=cfg.num_kv_heads // tp, vocab=cfg.vocab // tp,
                             head_features=cfg.head_dim)


def weight_matrices(cfg: decode.DecoderConfig, mesh, params) -> list[jax.Array]:
  """The model's weight matrices in the order a token reads them (4 per layer, then the head)."""
  model = nnx.merge(decode._graphdef(cfg, mesh, decode.FLOOR), params,  # noqa: SLF001
                    decode.make_cache(cfg, mesh, 1))
  mats = []
  for layer in model.layers:
    mats += [layer.attn.qkv.kernel[...], layer.attn.out.kernel[...], layer.mlp.up.kernel[...],
             layer.mlp.down.kernel[...]]
  return mats + [model.head.kernel[...]]


def make_matmuls_fn(num_tokens: int, min_rows: int = 1):
  """jit'd loop of ``num_tokens`` passes of x @ W over the weight matrices, chained.

  Each product's leading columns (zero-padded where short) feed the next
  matrix, so no product can be skipped or hoisted out of the loop. x is
  padded with zero rows to ``min_rows`` (as the layers' ``min_matmul_rows``).

  Returns:
    ``f(mats, x [b, d]) -> [b, d]``.
  """
  def chain(mats, x_bd):
    if x_bd.shape[0] < min_rows:
      x_bd = jnp.pad(x_bd, ((0, min_rows - x_bd.shape[0]), (0, 0)))

    def one(_, x):
      for w in mats:
        k = w.shape[0]
        x_in = x[:, :k] if x.shape[1] >= k else jnp.pad(x, ((0, 0), (0, k - x.shape[1])))
        x = jnp.dot(x_in, w, preferred_element_type=jnp.float32).astype(w.dtype)
      return x[:, :x_bd.shape[1]] if x.shape[1] >= x_bd.shape[1] else jnp.pad(
          x, ((0, 0), (0, x_bd.shape[1] - x.shape[1])))
    return lax.fori_loop(0, num_tokens, one, x_bd)

  return jax.jit(chain)


def hbm_read_gbs(gib: float, reps: int) -> dict[str, float]:
  """HBM read bandwidth, GB/s, of two float32 sums over a ``gib`` GiB bf16 array (best of reps).

  Returns:
    ``{"sum_all": ..., "row_sums": ..., "best": ...}``: the sum of every
    element, and the sums of rows of 8192 (the reduction a GEMV does).
  """
  n = int(gib * 2**30) // 2 // 8192 * 8192
  x = jnp.ones((n // 8192, 8192), jnp.bfloat16)
  probes = {"sum_all": jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)),
            "row_sums": jax.jit(lambda a: jnp.sum(a, axis=1, dtype=jnp.float32))}
  out = {}
  for name, f in probes.items():
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(max(reps, 3)):
      t0 = time.perf_counter()
      jax.block_until_ready(f(x))
      best = min(best, time.perf_counter() - t0)
    out[name] = round(2 * n / best / 1e9, 1)
  del x
  out["best"] = max(out.values())
  return out


def kv_read_bytes(cfg: decode.DecoderConfig, batch: int) -> int:
  """KV-cache bytes one token's attention reads: every layer's keys and values, all max_len."""
  item = jnp.dtype(cfg.dtype).itemsize
  return cfg.num_layers * 2 * batch * cfg.max_len * cfg.num_kv_heads * cfg.head_dim * item


def profile_call(call, num_tokens: int, logdir: str) -> dict[str, Any]:
  """Kernels per token, GPU busy time and the top kernels of one traced call.

  Returns:
    dict: ``window_us``, ``kernels_per_token``, ``busy_us_per_token`` (union
    of the device events), ``busy_share`` (busy / window), ``source`` (which
    trace rows), ``top`` (the longest kernels: name, us per token, count per
    token); or ``{"error": ...}`` where the trace holds no device events.
  """
  jax.block_until_ready(call())  # compiled and warm before tracing
  os.makedirs(logdir, exist_ok=True)
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    with jax.profiler.StepTraceAnnotation(profile_step.STEP_NAME, step_num=0):
      jax.block_until_ready(call())
  path = profile_step.find_trace_file(logdir)
  if path is None:
    return {"error": f"no perfetto trace under {logdir}"}
  try:
    a = profile_step.analyze(profile_step.load_trace(path), max_rows=64)
  except ValueError as e:
    return {"error": str(e)}
  events = a["events"]
  busy = profile_step._union_us([(e.start, e.end) for e in events])  # noqa: SLF001
  window = a["summary"]["window_us"]
  totals: dict[str, list[float]] = {}
  for e in events:
    t = totals.setdefault(e.name, [0.0, 0])
    t[0] += e.end - e.start
    t[1] += 1
  short = [e.end - e.start for e in events if e.end - e.start < SHORT_US]
  top = [{"name": n[:120], "us_per_token": round(v[0] / num_tokens, 2),
          "per_token": round(v[1] / num_tokens, 2)}
         for n, v in sorted(totals.items(), key=lambda kv: -kv[1][0])[:12]]
  return {"source": a["source"], "window_us": round(window, 1),
          "kernels_per_token": round(len(events) / num_tokens, 1),
          "busy_us_per_token": round(busy / num_tokens, 1),
          "window_us_per_token": round(window / num_tokens, 1),
          "busy_share": round(busy / window, 4) if window else None,
          "gap_us_per_token": round((window - busy) / num_tokens, 1),
          f"kernels_under_{SHORT_US:g}us_per_token": round(len(short) / num_tokens, 1),
          f"kernels_under_{SHORT_US:g}us_us_per_token": round(sum(short) / num_tokens, 1),
          "top": top}


def run(cfg: decode.DecoderConfig, mesh, *, batches: list[int], variant_names: list[str],
        prompt_len: int, num_tokens: int, reps: int, warmup: int, seed: int, hbm_gib: float,
        profile_tokens: int, profile_variants: list[str], logdir: str,
        log=print) -> tuple[list[dict], dict[str, Any]]:
  """Times the variants, the matmuls and the roofline for each batch (module docstring).

  Returns:
    (records, extra): the records and ``{"hbm_read_gbs", "weight_bytes",
    "command_buffer_types", "variants", "profile": {"<variant> b<batch>":
    profile_call's dict}, "fusions", "compile_errors": {"<variant> b<batch>":
    the error of a variant that did not compile (left out of the timing)},
    "tokens_match_first": {"<variant> b<batch>": share of its greedy tokens
    equal to the first variant's}}``.

  Raises:
    ValueError: an unknown variant, or (with ``profile_tokens`` > 0) a
      profile variant that is not among the variants.
  """
  opts = variants(variant_names)
  unknown = [n for n in profile_variants if n not in opts]
  if unknown and profile_tokens > 0:
    raise ValueError(f"profile variants {unknown} are not among the variants {list(opts)}")
  params = decode.make_params(cfg, mesh, seed)
  weight_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(params))
  mats = weight_matrices(cfg, mesh, params)
  hbm = hbm_read_gbs(hbm_gib, reps)
  gbs = hbm["best"]
  log(f"weights {weight_bytes / 1e9:.3f} GB, HBM read {hbm} GB/s "
      f"(roofline of the weights alone {weight_bytes / gbs / 1e3:.1f} us per token)")
  prefill = decode.make_prefill_fn(cfg, mesh)
  records, profiles, fusions, compile_errors, tokens_match = [], {}, {}, {}, {}
  for batch in batches:
    rng = np.random.default_rng([seed, batch])
    prompt = rng.integers(0, cfg.vocab, (batch, prompt_len), dtype=np.int32)
    cache, tok = prefill(params, decode.make_cache(cfg, mesh, batch),
                         decode._global(mesh, prompt))  # noqa: SLF001
    pos = decode._global(mesh, np.int32(prompt_len))  # noqa: SLF001
    lowered = {}
    for rows, attention, pad in sorted({v[1:] for v in opts.values()}):
      gen = decode.make_generate_fn(dataclasses.replace(cfg, attention=attention), mesh,
                                    decode.FLOOR, num_tokens, min_matmul_rows=rows)
      with padding(pad):
        lowered[rows, attention, pad] = gen.lower(params, cache, tok, pos)
    state = {"cache": cache}

    def call(fn):
      state["cache"], toks = fn(params, state["cache"], tok, pos)
      return toks

    calls, first_tokens = {}, None
    for name, (o, rows, attention, pad) in opts.items():
      t0 = time.perf_counter()
      try:
        compiled = lowered[rows, attention, pad].compile(compiler_options=o)
      except Exception as e:  # noqa: BLE001 (an option this jaxlib lacks or cannot compile)
        compile_errors[f"{name} b{batch}"] = f"{type(e).__name__}: {e}"[:600]
        log(f"batch {batch}: step/{name} did not compile, left out: {str(e)[:300]}")
        continue
      calls[f"step/{name}"] = functools.partial(call, compiled)
      fusions[f"{name} b{batch}"] = count_fusions(compiled.as_text())
      # The greedy tokens against the first variant's: 1.0 where the options change
      # nothing numerically (a reordered bf16 sum can flip an argmax of random weights).
      toks = np.asarray(calls[f"step/{name}"]())
      first_tokens = toks if first_tokens is None else first_tokens
      tokens_match[f"{name} b{batch}"] = float(np.mean(toks == first_tokens))
      log(f"batch {batch}: compiled step/{name} in {time.perf_counter() - t0:.1f} s "
          f"(tokens equal to the first variant's: {tokens_match[f'{name} b{batch}']:.2f})")
    x = jnp.asarray(rng.standard_normal((batch, cfg.d_model)), cfg.dtype)
    for name, (o, rows, attention, pad) in opts.items():
      if attention != "xla" or pad != "copies" or f"step/{name}" not in calls:
        continue  # the same matmuls as the variant without it, or no step to compare
      mm = make_matmuls_fn(num_tokens, rows).lower(mats, x).compile(compiler_options=o)
      calls[f"matmuls/{name}"] = functools.partial(mm, mats, x)
    times = harness.time_interleaved(calls, reps=reps, warmup=warmup)
    roof_us = (weight_bytes + kv_read_bytes(cfg, batch)) / gbs / 1e3
    shape = dict(batch=batch, **cfg.shape(), prompt_len=prompt_len)
    line = []
    for impl, ts in times.items():
      us = harness.median(ts) / num_tokens * 1e6
      records.append({"op": "decode_floor_token", "impl": impl, "dtype": cfg.dtype,
                      "shape": shape, "time_us": round(us, 2),
                      "vs_roofline": round(us / roof_us, 3)})
      line.append(f"{impl}={us:.1f}")
    records.append({"op": "decode_floor_token", "impl": "roofline", "dtype": cfg.dtype,
                    "shape": shape, "time_us": round(roof_us, 2), "vs_roofline": 1.0})
    log(f"batch {batch:>3}: us/token roofline={roof_us:.1f} " + " ".join(line))
    for name in opts:
      if f"{name} b{batch}" not in fusions:
        continue
      f = fusions[f"{name} b{batch}"]
      log(f"batch {batch:>3}: step/{name} compiles to {f['total']} kernels ("
          + ", ".join(f"{k} {v}" for k, v in sorted(f.items(), key=lambda kv: -kv[1])
                      if k != "total")[:400] + ")")
    for name in profile_variants if profile_tokens > 0 else []:
      if f"step/{name}" not in calls:
        continue
      o, rows, attention, pad = opts[name]
      prof_gen = decode.make_generate_fn(dataclasses.replace(cfg, attention=attention), mesh,
                                         decode.FLOOR, profile_tokens, min_matmul_rows=rows)
      with padding(pad):
        prof_lowered = prof_gen.lower(params, state["cache"], tok, pos)
      compiled = prof_lowered.compile(
          compiler_options={**o, "xla_enable_command_buffers_during_profiling": True})
      key = f"{name} b{batch}"
      p = profiles[key] = profile_call(functools.partial(call, compiled), profile_tokens,
                                       os.path.join(logdir, f"{name}_b{batch}"))
      log(f"batch {batch:>3}: profile of {name}: {p.get('error') or ''}"
          f"{p.get('kernels_per_token', '')} kernels/token, busy "
          f"{p.get('busy_us_per_token', '')} of {p.get('window_us_per_token', '')} us/token "
          f"({p.get('source', '')})")
  extra = {"hbm_read_gbs": hbm, "weight_bytes": weight_bytes,
           "command_buffer_types": default_command_buffer_types(),
           "variants": {n: {"compile_options": o, "min_matmul_rows": r, "attention": a,
                            "padding": pad}
                        for n, (o, r, a, pad) in opts.items()},
           "profile": profiles, "fusions": fusions, "compile_errors": compile_errors,
           "tokens_match_first": tokens_match}
  return records, extra


def markdown_table(records: list[dict]) -> str:
  """batch | roofline | matmuls | step per variant (us per token, and x roofline)."""
  impls = [i for i in dict.fromkeys(r["impl"] for r in records) if i != "roofline"]
  rows = ["| batch | roofline us | " + " | ".join(f"{i} us" for i in impls) + " |",
          "|---|---|" + "---|" * len(impls)]
  by = {(r["impl"], r["shape"]["batch"]): r for r in records}
  for b in sorted({r["shape"]["batch"] for r in records}):
    cells = [f"{by[(i, b)]['time_us']:.1f} ({by[(i, b)]['vs_roofline']:.2f}x)"
             if (i, b) in by else "-" for i in impls]
    rows.append(f"| {b} | {by[('roofline', b)]['time_us']:.1f} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def define_flags():
  """Defines the command-line flags (only when run as a script)."""
  from absl import flags

  flags.DEFINE_integer("tp", 2, "the step is that of one rank of this TP size")
  flags.DEFINE_list("batches", ["1", "4", "16"], "batch sizes")
  flags.DEFINE_list("variants", ["xla_default", "no_graphs", "graphs_while", "cublas", "rows4"],
                    "XLA compile-option variants of the step and the matmuls (see variants())")
  flags.DEFINE_list("profile_variants", None,
                    "variants to profile, each one of --variants (default: xla_default and rows4 "
                    "where they are among them)")
  flags.DEFINE_string("logdir", None, "where the profiles go (default: a temporary folder)")
  decode.define_model_flags(layers=32)  # the full model's sizes; shard_config divides them
  flags.DEFINE_integer("profile_tokens", 8, "decode steps of the profiled call (0: no profile)")
  flags.DEFINE_float("hbm_gib", 4.0, "size of the bandwidth probe, GiB")
  harness.define_flags("out", "seed", "host_devices",
                       machine=(None, "machine name (default: '1x <device kind>')"),
                       dtype=("bfloat16", "weights and activations"),
                       reps=(10, "timed calls per implementation (median)"),
                       warmup=(2, "untimed calls per implementation"))


def main(argv):
  del argv
  from absl import flags

  fl = flags.FLAGS
  harness.use_host_devices(fl.host_devices)
  full = decode.config_from_flags(fl)
  cfg = shard_config(full, fl.tp)
  mesh = jax.make_mesh((1,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  print(f"decode_floor: one rank of TP={fl.tp} on {jax.devices()[0].device_kind}: {cfg}",
        flush=True)
  records, extra = run(cfg, mesh, batches=[int(b) for b in fl.batches],
                       variant_names=list(fl.variants), prompt_len=fl.prompt_len,
                       num_tokens=fl.tokens, reps=fl.reps, warmup=fl.warmup, seed=fl.seed,
                       hbm_gib=fl.hbm_gib, profile_tokens=fl.profile_tokens,
                       profile_variants=(list(fl.profile_variants)
                                         if fl.profile_variants is not None else
                                         [v for v in ("xla_default", "rows4")
                                          if v in fl.variants]),
                       logdir=fl.logdir or tempfile.mkdtemp(prefix="decode_floor_"))
  method = (f"one GPU, one rank of TP={fl.tp} (no all-reduce); per token = median over "
            f"{fl.reps} calls of a jit'd fori_loop of {fl.tokens} greedy steps / {fl.tokens}, "
            "implementations interleaved; roofline = (weights + KV cache read per token) / HBM "
            "read bandwidth measured in the same run")
  kind, machine = harness.one_gpu_machine(fl.machine)
  path = harness.path(fl.out, BENCHMARK, machine)
  harness.write_result(path, records, benchmark=BENCHMARK, machine=machine, method=method,
                       script="benchmarks/decode_floor.py", latency=False,
                       extra={"weights": "random", "tp": fl.tp, "full_model": full.shape(),
                              "device_kind": kind,
                              "xla_flags": os.environ.get("XLA_FLAGS", ""), **extra})
  print(markdown_table(records))
  print(f"wrote {path}", flush=True)
  return 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
