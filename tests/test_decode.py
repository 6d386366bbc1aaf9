"""benchmarks/decode.py: the TP decoder built from jaxoverlap.nnx, its checks and its JSON.

Two simulated devices, mesh ("tp",) of 2, a tiny config. The reference below
is written independently of the module and of jaxoverlap.nnx (separate Q/K/V
and gate/up matrices cut out of the fused kernels, GQA by repeating the KV
heads, RoPE in the HF rotate_half form), in float32 on one device, with the
same weights: fresh random values (seeded by the test id) loaded into every
parameter. Every logit of every step is compared within
eps(dtype)**(2/3) * max|logit|.
"""

import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxoverlap import tuning
from jaxoverlap.nnx import layers

from _helpers import make_mesh

_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "benchmarks")
sys.path.insert(0, _BENCHMARKS)  # the scripts import their harness
_spec = importlib.util.spec_from_file_location("decode_benchmark",
                                              os.path.join(_BENCHMARKS, "decode.py"))
decode = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = decode  # dataclasses look their module up
_spec.loader.exec_module(decode)

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")

OURS = ("jaxoverlap:xla:collective", "jaxoverlap:xla:ppermute")


def tiny(dtype):
  return decode.DecoderConfig(d_model=64, d_ff=128, num_heads=4, num_kv_heads=2, num_layers=2,
                              vocab=128, max_len=32, dtype=dtype)


@pytest.fixture
def seed(request):
  """A seed from the test's id: fresh weights and tokens for every test."""
  return zlib.crc32(request.node.nodeid.encode())


# ------------------------------------------------------------------ reference


def _ref_rms(x, w, eps):
  return x / jnp.sqrt(jnp.mean(x ** 2, axis=-1, keepdims=True) + eps) * w


def _ref_rope(x, pos, theta):
  """HF Llama form: x * cos + rotate_half(x) * sin, frequencies repeated over halves."""
  k = x.shape[-1]
  inv_freq = jnp.asarray(1.0 / (theta ** (np.arange(0, k, 2, dtype=np.float64) / k)), jnp.float32)
  ang = jnp.concatenate([pos * inv_freq] * 2)
  rotated = jnp.concatenate([-x[..., k // 2:], x[..., :k // 2]], axis=-1)
  return x * jnp.cos(ang) + rotated * jnp.sin(ang)


@functools.partial(jax.jit, static_argnums=5)
def ref_step(p, ck, cv, tok, pos, cfg):
  """Unsharded float32 decode step. ``p``: ``plain_weights``; caches [layers, b, t, kv, k]."""
  b, k = tok.shape[0], cfg.head_dim
  h, kvh = cfg.num_heads, cfg.num_kv_heads
  x = p["embed"][tok]
  for layer, lp in enumerate(p["layers"]):
    hn = _ref_rms(x, lp["attn_norm"], cfg.norm_eps)
    q = _ref_rope((hn @ lp["w_q"]).reshape(b, h, k), pos, cfg.rope_theta)
    kk = _ref_rope((hn @ lp["w_k"]).reshape(b, kvh, k), pos, cfg.rope_theta)
    ck = ck.at[layer, :, pos].set(kk)
    cv = cv.at[layer, :, pos].set((hn @ lp["w_v"]).reshape(b, kvh, k))
    keys = jnp.repeat(ck[layer], h // kvh, axis=2)  # [b, t, h, k]: head i uses kv head i // g
    vals = jnp.repeat(cv[layer], h // kvh, axis=2)
    s = jnp.einsum("bhk,bthk->bht", q, keys) / math.sqrt(k)
    s = jnp.where(jnp.arange(cfg.max_len) <= pos, s, -jnp.inf)  # causal
    x = x + jnp.einsum("bht,bthk->bhk", jax.nn.softmax(s, -1), vals).reshape(b, h * k) @ lp["w_o"]
    hn = _ref_rms(x, lp["mlp_norm"], cfg.norm_eps)
    x = x + (jax.nn.silu(hn @ lp["w_gate"]) * (hn @ lp["w_up"])) @ lp["w_down"]
  logits = _ref_rms(x, p["final_norm"], cfg.norm_eps) @ p["w_head"]
  return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32), ck, cv


def ref_cache(cfg, batch):
  shape = (cfg.num_layers, batch, cfg.max_len, cfg.num_kv_heads, cfg.head_dim)
  return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)


def plain_weights(pure, cfg):
  """Separate float32 matrices out of the model's fused kernels (the layouts the layers document).

  qkv: columns [kv head, g queries + key + value, head_dim]; up: gate and up
  interleaved per hidden unit.
  """
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  d, g, k = cfg.d_model, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
  layers_ = []
  for i in range(cfg.num_layers):
    lp = pure["layers"][i]
    qkv = f32(lp["attn"]["qkv"]["kernel"]).reshape(d, cfg.num_kv_heads, g + 2, k)
    up = f32(lp["mlp"]["up"]["kernel"])
    layers_.append({"attn_norm": f32(lp["attn_norm"]["scale"]),
                    "w_q": qkv[:, :, :g].reshape(d, -1), "w_k": qkv[:, :, g].reshape(d, -1),
                    "w_v": qkv[:, :, g + 1].reshape(d, -1), "w_o": f32(lp["attn"]["out"]["kernel"]),
                    "mlp_norm": f32(lp["mlp_norm"]["scale"]), "w_gate": up[:, 0::2],
                    "w_up": up[:, 1::2], "w_down": f32(lp["mlp"]["down"]["kernel"])})
  return {"embed": f32(pure["embed"]["embedding"]), "final_norm": f32(pure["final_norm"]["scale"]),
          "w_head": f32(pure["head"]["kernel"]), "layers": layers_}


def setup(cfg, seed):
  """(mesh, the weights as float32 matrices for the reference, the model's sharded params).

  Every parameter gets fresh values from NumPy (matrices N(0, 1/fan_in), the
  embedding N(0, 1), norm scales 1 + 0.1 N(0, 1)), rounded to cfg.dtype.
  """
  mesh = make_mesh((2,), ("tp",))
  params = decode.make_params(cfg, mesh, seed % 1000)
  rng = np.random.default_rng(seed)
  pure = nnx.to_pure_dict(params)

  def fresh(path, a):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      v = 1 + 0.1 * rng.standard_normal(a.shape)
    else:
      v = rng.standard_normal(a.shape) / (1.0 if "embedding" in name else math.sqrt(a.shape[0]))
    return jax.device_put(jnp.asarray(v, cfg.dtype), a.sharding)

  pure = jax.tree_util.tree_map_with_path(fresh, pure)
  nnx.replace_by_pure_dict(params, pure)
  return mesh, plain_weights(pure, cfg), params


def assert_logits(got, want, dtype, what):
  """Every element within eps(dtype)**(2/3) * max|want|."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  lim = decode.tolerance(dtype) * np.abs(want).max()
  err = np.abs(got - want)
  assert (err <= lim).all(), f"{what}: {(~(err <= lim)).sum()} of {err.size} logits off; " \
                             f"max error {err.max():.3g} > {lim:.3g}"


def assert_tokens(tok, want_tok, want_logits, dtype, what):
  """Equal, or (bf16 against f32 only) a tie within the tolerance in the reference."""
  tok, want_tok = np.asarray(tok), np.asarray(want_tok)
  want_logits = np.asarray(want_logits, np.float64)
  lim = decode.tolerance(dtype) * np.abs(want_logits).max()
  chosen = np.take_along_axis(want_logits, tok[:, None], axis=1)[:, 0]
  ok = (tok == want_tok) | (chosen >= want_logits.max(-1) - lim)
  assert ok.all(), f"{what}: tokens {tok} != reference {want_tok}"


# ------------------------------------------------------------------ tests


def test_sharded_argmax_matches_argmax(seed):
  """First index of the maximum, with ties across the two vocabulary halves."""
  mesh = make_mesh((2,), ("tp",))
  rng = np.random.default_rng(seed)
  logits = rng.integers(0, 4, (6, 16)).astype(np.float32)  # many ties
  f = jax.jit(jax.shard_map(decode.sharded_argmax, mesh=mesh, in_specs=P(None, "tp"),
                            out_specs=P()))
  np.testing.assert_array_equal(np.asarray(f(jnp.asarray(logits))), logits.argmax(-1))


def test_tp_step_equals_float32_reference(seed):
  """float32: forced prompt, then greedy steps; every logit and token, step by step."""
  cfg = tiny("float32")
  mesh, ref_p, params = setup(cfg, seed)
  batch = 3
  rng = np.random.default_rng(seed)
  prompt = rng.integers(0, cfg.vocab, (5, batch)).astype(np.int32)
  step = decode.make_forced_fn(cfg, mesh, decode.PSUM)
  cache = decode.make_cache(cfg, mesh, batch)
  rk, rv = ref_cache(cfg, batch)
  tok = ref_tok = None
  for pos in range(prompt.shape[0] + 6):
    forced = pos < prompt.shape[0]
    inp = prompt[pos] if forced else tok
    ref_inp = prompt[pos] if forced else ref_tok
    logits, tok, cache = step(params, cache, jnp.asarray(inp)[None], jnp.int32(pos))
    logits, tok = logits[0], tok[0]
    ref_logits, ref_tok, rk, rv = ref_step(ref_p, rk, rv, jnp.asarray(ref_inp), pos, cfg)
    assert_logits(logits, ref_logits, cfg.dtype, f"step {pos}")
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok), err_msg=f"step {pos}")
  # Each layer's cache holds the reference's keys and values, KV heads sharded over tp.
  for i in range(cfg.num_layers):
    attn = nnx.to_pure_dict(cache)["layers"][i]["attn"]
    assert int(attn["cache_index"]) == prompt.shape[0] + 6
    assert attn["cached_key"].sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "tp")), 4)
    np.testing.assert_allclose(np.asarray(attn["cached_key"]), np.asarray(rk[i]), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(attn["cached_value"]), np.asarray(rv[i]), rtol=1e-5,
                               atol=1e-5)


def test_prefill_and_timed_loop_equal_reference_greedy(seed):
  """The paths the benchmark times: the prompt in one call, then the fori_loop, float32."""
  cfg = tiny("float32")
  mesh, ref_p, params = setup(cfg, seed)
  batch, num_tokens = 2, 7
  prompt = np.random.default_rng(seed).integers(0, cfg.vocab, (batch, 6)).astype(np.int32)
  cache, tok = decode.make_prefill_fn(cfg, mesh)(params, decode.make_cache(cfg, mesh, batch),
                                                 jnp.asarray(prompt))
  gen = decode.make_generate_fn(cfg, mesh, decode.PSUM, num_tokens)
  _, toks = gen(params, cache, tok, jnp.int32(prompt.shape[1]))

  rk, rv = ref_cache(cfg, batch)
  for pos in range(prompt.shape[1]):
    _, ref_tok, rk, rv = ref_step(ref_p, rk, rv, jnp.asarray(prompt[:, pos]), pos, cfg)
  np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
  want = []
  for i in range(num_tokens):
    _, ref_tok, rk, rv = ref_step(ref_p, rk, rv, ref_tok, prompt.shape[1] + i, cfg)
    want.append(np.asarray(ref_tok))
  np.testing.assert_array_equal(np.asarray(toks), np.stack(want))


@pytest.mark.parametrize("impl", (decode.PSUM,) + OURS)
def test_bf16_tp_step_near_float32_reference(seed, impl):
  """bf16 weights and activations against the float32 reference on the same weights."""
  cfg = tiny("bfloat16")
  mesh, ref_p, params = setup(cfg, seed)
  batch = 4
  inputs = np.random.default_rng(seed).integers(0, cfg.vocab, (8, batch)).astype(np.int32)
  forced = decode.make_forced_fn(cfg, mesh, impl)
  logits, toks, _ = forced(params, decode.make_cache(cfg, mesh, batch), jnp.asarray(inputs),
                           jnp.int32(0))  # teacher-forced, all steps in one call
  rk, rv = ref_cache(cfg, batch)
  for pos, inp in enumerate(inputs):
    ref_logits, ref_tok, rk, rv = ref_step(ref_p, rk, rv, jnp.asarray(inp), pos, cfg)
    assert_logits(logits[pos], ref_logits, cfg.dtype, f"{impl} step {pos}")
    assert_tokens(toks[pos], ref_tok, ref_logits, cfg.dtype, f"{impl} step {pos}")


def test_all_reduce_choices_give_the_same_tokens(seed):
  """psum and jaxoverlap (xla: collective, ppermute): same greedy tokens, bf16."""
  cfg = tiny("bfloat16")
  mesh, _, params = setup(cfg, seed)
  batch, num_tokens = 4, 10
  prompt = np.random.default_rng(seed).integers(0, cfg.vocab, (batch, 5)).astype(np.int32)
  prefill = decode.make_prefill_fn(cfg, mesh)
  out = {}
  for impl in (decode.PSUM,) + OURS:
    cache, tok = prefill(params, decode.make_cache(cfg, mesh, batch), jnp.asarray(prompt))
    gen = decode.make_generate_fn(cfg, mesh, impl, num_tokens)
    out[impl] = np.asarray(gen(params, cache, tok, jnp.int32(prompt.shape[1]))[1])
  for impl in OURS:
    np.testing.assert_array_equal(out[impl], out[decode.PSUM], err_msg=impl)


def test_impl_names_give_the_layers_all_reduce():
  mesh = make_mesh((2,), ("tp",))
  psum = decode.parallel_config(mesh, decode.PSUM)
  assert (psum.row_reduction, psum.backend, psum.all_reduce_algorithm) == (
      "all_reduce", "xla", "collective")
  ours = decode.parallel_config(mesh, "jaxoverlap:cuda:one_shot_ll")
  assert (ours.backend, ours.all_reduce_algorithm, ours.all_reduce_protocol) == (
      "cuda", "one_shot", "ll")
  assert decode.parallel_config(mesh, decode.FLOOR).row_reduction == "none"


@pytest.mark.parametrize("impl", OURS)
def test_check_passes_ours(seed, impl):
  """The benchmark's pre-timing check (tiny model and a prefilled cache) passes."""
  mesh = make_mesh((2,), ("tp",))
  assert decode.check_tiny(mesh, impl, "bfloat16", seed % 1000) is None
  cfg = tiny("bfloat16")
  _, _, params = setup(cfg, seed)
  rng = np.random.default_rng(seed)
  prompt = rng.integers(0, cfg.vocab, (2, 6)).astype(np.int32)
  cache = decode.make_prefill_fn(cfg, mesh)(params, decode.make_cache(cfg, mesh, 2),
                                            jnp.asarray(prompt))[0]
  inputs = rng.integers(0, cfg.vocab, (4, 2)).astype(np.int32)
  assert decode.check_impl(cfg, mesh, params, cache, inputs, 6, impl) is None


WRONG = "jaxoverlap:xla:ppermute"


@pytest.fixture
def wrong_impl(monkeypatch, request):
  """Breaks the layers' all-reduce for algorithm "ppermute" (WRONG); "floor" is decode.FLOOR."""
  kind = getattr(request, "param", "double")
  if kind == "floor":  # no communication: each rank keeps its partial sum
    return decode.FLOOR
  real = layers.all_reduce

  def broken(x, axis_name, *, algorithm="auto", **kw):
    y = real(x, axis_name, algorithm=algorithm, **kw)
    if algorithm != "ppermute":
      return y
    if kind == "double":  # rank 0's contribution counted twice
      return y + jax.lax.psum(jnp.where(jax.lax.axis_index(axis_name) == 0, x, 0), axis_name)
    return y.at[..., 0].set(jnp.nan)  # "nan" in one element

  monkeypatch.setattr(layers, "all_reduce", broken)
  return WRONG


@pytest.mark.parametrize("wrong_impl", ["floor", "double", "nan"], indirect=True)
def test_check_rejects_a_wrong_all_reduce(seed, wrong_impl):
  why = decode.check_tiny(make_mesh((2,), ("tp",)), wrong_impl, "bfloat16", seed % 1000)
  assert why is not None and "logits differ" in why, why


def test_run_writes_valid_records_and_drops_a_wrong_impl(seed, tmp_path, wrong_impl):
  """run() + write_results(): records of the results format, the PNG and the table.

  The wrong implementation fails its check: it is reported, not timed, not recorded.
  """
  cfg = dataclasses.replace(tiny("bfloat16"), num_layers=1)
  mesh = make_mesh((2,), ("tp",))
  ours = OURS[0]
  logs = []
  records, rejected = decode.run(cfg, mesh, impls=[decode.PSUM, decode.PSUM_GRAPHS, ours,
                                                   wrong_impl],
                                 batches=[1, 2], prompt_len=4, num_tokens=2, reps=2, warmup=1,
                                 check_steps=2, seed=seed % 1000, log=logs.append)
  assert [r["impl"] for r in rejected] == [wrong_impl]
  assert any(line.startswith(f"CHECK FAILED: {wrong_impl}") for line in logs), logs
  path, png = decode.write_results(str(tmp_path), "test machine", records, rejected,
                                   command="pytest", method="test")
  assert path.endswith("decode-test_machine.json") and os.path.getsize(png) > 0
  result = json.load(open(path))
  tuning.validate_result(result, "decode results")
  assert result["benchmark"] == "decode" and result["weights"] == "random"
  assert [r["impl"] for r in result["rejected"]] == [wrong_impl]
  assert len(result["records"]) == 8
  for r in result["records"]:
    assert r["op"] == "decode_token" and r["world"] == 2 and r["time_us"] > 0
    assert r["time_us_p10"] <= r["time_us"] <= r["time_us_p90"]  # the spread over the calls
    assert r["impl"] in (decode.PSUM, decode.PSUM_GRAPHS, ours, decode.FLOOR)
    # psum inside XLA's CUDA graphs: the same program, compiled with COLLECTIVES added.
    assert ("xla_options" in r) == (r["impl"] == decode.PSUM_GRAPHS)
    assert r["shape"] == dict(batch=r["shape"]["batch"], **cfg.shape(), prompt_len=4,
                              min_matmul_rows=1)
    assert r["bytes"] == r["shape"]["batch"] * cfg.d_model * 2
    if r["impl"] == decode.FLOOR:
      assert "all_reduce_share" not in r and r["all_reduces_per_token"] == 0
    else:
      assert isinstance(r["all_reduce_share"], float) and r["all_reduce_share"] < 1
      assert r["all_reduces_per_token"] == 2 * cfg.num_layers
  table = decode.markdown_table(records, ours).splitlines()
  assert len(table) == 4 and table[2].startswith("| 1 |") and table[3].startswith("| 2 |")
  assert "psum in graphs us/token" in table[0] and table[2].count("x |") == 2


def test_config_errors():
  mesh = make_mesh((2,), ("tp",))
  for cfg, match in ((dataclasses.replace(tiny("bfloat16"), num_heads=6, num_kv_heads=3,
                                          d_model=96), "num_kv_heads=3 must be divisible by tp"),
                     (dataclasses.replace(tiny("bfloat16"), vocab=127), "out_features=127"),
                     (dataclasses.replace(tiny("bfloat16"), d_model=36, num_heads=4,
                                          num_kv_heads=2), "RoPE needs an even head_features")):
    with pytest.raises(ValueError, match=match):
      decode.run(cfg, mesh, impls=[decode.PSUM], batches=[1], prompt_len=4, num_tokens=2,
                 reps=1)
  with pytest.raises(ValueError, match="must fit in max_len"):
    decode.run(tiny("bfloat16"), make_mesh((2,), ("tp",)), impls=[decode.PSUM], batches=[1],
               prompt_len=30, num_tokens=8, reps=1)
  with pytest.raises(ValueError, match="unknown impl"):
    decode.parallel_config(make_mesh((2,), ("tp",)), "jaxoverlap:collective")


def test_run_records_a_raising_impl_as_rejected():
  """An implementation that raises in its check (backend "cuda" on CPU) is rejected, not fatal."""
  cfg = dataclasses.replace(tiny("bfloat16"), num_layers=1)
  logs = []
  records, rejected = decode.run(cfg, make_mesh((2,), ("tp",)),
                                 impls=[decode.PSUM, "jaxoverlap:cuda:one_shot"], batches=[1],
                                 prompt_len=4, num_tokens=2, reps=1, warmup=0, check_steps=2,
                                 log=logs.append)
  assert [(r["impl"], r["batch"]) for r in rejected] == [("jaxoverlap:cuda:one_shot", None)]
  assert rejected[0]["reason"].startswith("tiny model: RuntimeError: ")
  assert {r["impl"] for r in records} == {decode.PSUM, decode.FLOOR}
  assert any(line.startswith("CHECK FAILED: jaxoverlap:cuda:one_shot") for line in logs)


def test_flag_errors_name_the_flag():
  assert decode.ours_impl("xla", "ppermute") == "jaxoverlap:xla:ppermute"
  assert decode.ours_impl("cuda", "one_shot_ll") == "jaxoverlap:cuda:one_shot_ll"
  with pytest.raises(ValueError, match="^--backend: 'bogus' is not one of auto, xla, cuda$"):
    decode.ours_impl("bogus", "auto")
  with pytest.raises(ValueError, match="^--algorithm: 'one_shot' is no all_reduce algorithm of "
                                       "--backend 'xla' \\(auto, collective, ppermute\\)$"):
    decode.ours_impl("xla", "one_shot")
  with pytest.raises(ValueError, match="--algorithm: 'bogus'"):
    decode.ours_impl("cuda", "bogus")
  with pytest.raises(ValueError, match="^--batches: 'x' is not an integer"):
    decode.harness.parse_ints("batches", ["1", "x"])
  assert decode.harness.parse_ints("chunks", "1, 2") == [1, 2]
