"""benchmarks/decode.py: the TP decoder against an unsharded reference, checks and JSON.

Two simulated devices, mesh ("tp",) of 2, a tiny config. The reference below
is written independently of the module (separate Q/K/V and gate/up
matrices, GQA by repeating the KV heads, RoPE in the HF rotate_half form), in
float32 on one device, with the same weights (fresh, seeded by the test id). Every
logit of every step is compared within eps(dtype)**(2/3) * max|logit|.
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoverlap import tuning

from _helpers import make_mesh

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "benchmarks", "decode.py")
_spec = importlib.util.spec_from_file_location("decode_benchmark", _PATH)
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
  """Unsharded float32 decode step. ``p``: init_params layout, float32."""
  b, k = tok.shape[0], cfg.head_dim
  h, kvh = cfg.num_heads, cfg.num_kv_heads
  x = p["embed"][tok]
  for layer, lp in enumerate(p["layers"]):
    hn = _ref_rms(x, lp["attn_norm"], cfg.norm_eps)
    q = _ref_rope((hn @ lp["w_q"]).reshape(b, h, k), pos, cfg.rope_theta)
    kk = _ref_rope((hn @ lp["w_k"]).reshape(b, kvh, k), pos, cfg.rope_theta)
    ck = ck.at[layer, :, pos].set(kk)
    cv = cv.at[layer, :, pos].set((hn @ lp["w_v"]).reshape(b, kvh, k))
    keys = jnp.repeat(ck[layer], h // kvh, axis=2)  # [b, t, h, k]
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


# ------------------------------------------------------------------ helpers


def random_params(cfg, seed):
  """Weights in init_params's layout from NumPy (fast), rounded to cfg.dtype."""
  rng = np.random.default_rng(seed)
  d, f, k = cfg.d_model, cfg.d_ff, cfg.head_dim

  def mat(n, m):
    return jnp.asarray(rng.standard_normal((n, m)) / math.sqrt(n), cfg.dtype)

  def scale(n):
    return jnp.asarray(1 + 0.1 * rng.standard_normal(n), cfg.dtype)

  layers = [{"attn_norm": scale(d), "w_q": mat(d, cfg.num_heads * k),
             "w_k": mat(d, cfg.num_kv_heads * k), "w_v": mat(d, cfg.num_kv_heads * k),
             "w_o": mat(cfg.num_heads * k, d), "mlp_norm": scale(d), "w_gate": mat(d, f),
             "w_up": mat(d, f), "w_down": mat(f, d)} for _ in range(cfg.num_layers)]
  return {"embed": jnp.asarray(rng.standard_normal((cfg.vocab, d)), cfg.dtype),
          "final_norm": scale(d), "w_head": mat(d, cfg.vocab), "layers": layers}


def setup(cfg, seed):
  """(mesh, the weights as float32 for the reference, TP params sharded) from one seed."""
  mesh = make_mesh((2,), ("tp",))
  plain = random_params(cfg, seed)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), decode.param_specs(cfg))
  tp = jax.device_put(decode.to_tp_layout(plain, 2), shardings)
  return mesh, jax.tree.map(lambda a: a.astype(jnp.float32), plain), tp


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
  mesh, ref_p, tp_p = setup(cfg, seed)
  batch = 3
  rng = np.random.default_rng(seed)
  prompt = rng.integers(0, cfg.vocab, (5, batch)).astype(np.int32)
  step = decode.make_step_fn(cfg, mesh, decode.PSUM)
  ck, cv = decode.make_cache(cfg, mesh, batch)
  rk, rv = ref_cache(cfg, batch)
  tok = ref_tok = None
  for pos in range(prompt.shape[0] + 6):
    forced = pos < prompt.shape[0]
    inp = prompt[pos] if forced else tok
    ref_inp = prompt[pos] if forced else ref_tok
    logits, tok, ck, cv = step(tp_p, ck, cv, jnp.asarray(inp), jnp.int32(pos))
    ref_logits, ref_tok, rk, rv = ref_step(ref_p, rk, rv, jnp.asarray(ref_inp), pos, cfg)
    assert_logits(logits, ref_logits, cfg.dtype, f"step {pos}")
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok), err_msg=f"step {pos}")
  # The cache holds the reference's keys and values (rank blocks of KV heads).
  np.testing.assert_allclose(np.asarray(ck), np.asarray(rk), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(cv), np.asarray(rv), rtol=1e-5, atol=1e-5)


def test_prefill_and_timed_loop_equal_reference_greedy(seed):
  """The paths the benchmark times: scan prefill, then the fori_loop, float32."""
  cfg = tiny("float32")
  mesh, ref_p, tp_p = setup(cfg, seed)
  batch, num_tokens = 2, 7
  prompt = np.random.default_rng(seed).integers(0, cfg.vocab, (6, batch)).astype(np.int32)
  ck, cv, tok = decode.make_prefill_fn(cfg, mesh)(tp_p, *decode.make_cache(cfg, mesh, batch),
                                                  jnp.asarray(prompt))
  gen = decode.make_generate_fn(cfg, mesh, decode.PSUM, num_tokens)
  _, _, toks = gen(tp_p, ck, cv, tok, jnp.int32(prompt.shape[0]))

  rk, rv = ref_cache(cfg, batch)
  for pos in range(prompt.shape[0]):
    _, ref_tok, rk, rv = ref_step(ref_p, rk, rv, jnp.asarray(prompt[pos]), pos, cfg)
  np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
  want = []
  for i in range(num_tokens):
    _, ref_tok, rk, rv = ref_step(ref_p, rk, rv, ref_tok, prompt.shape[0] + i, cfg)
    want.append(np.asarray(ref_tok))
  np.testing.assert_array_equal(np.asarray(toks), np.stack(want))


@pytest.mark.parametrize("impl", (decode.PSUM,) + OURS)
def test_bf16_tp_step_near_float32_reference(seed, impl):
  """bf16 weights and activations against the float32 reference on the same weights."""
  cfg = tiny("bfloat16")
  mesh, ref_p, tp_p = setup(cfg, seed)
  batch = 4
  inputs = np.random.default_rng(seed).integers(0, cfg.vocab, (8, batch)).astype(np.int32)
  step = decode.make_step_fn(cfg, mesh, impl)
  ck, cv = decode.make_cache(cfg, mesh, batch)
  rk, rv = ref_cache(cfg, batch)
  for pos, inp in enumerate(inputs):  # teacher-forced
    logits, tok, ck, cv = step(tp_p, ck, cv, jnp.asarray(inp), jnp.int32(pos))
    ref_logits, ref_tok, rk, rv = ref_step(ref_p, rk, rv, jnp.asarray(inp), pos, cfg)
    assert_logits(logits, ref_logits, cfg.dtype, f"{impl} step {pos}")
    assert_tokens(tok, ref_tok, ref_logits, cfg.dtype, f"{impl} step {pos}")


def test_all_reduce_choices_give_the_same_tokens(seed):
  """psum and jaxoverlap (xla: collective, ppermute): same greedy tokens, bf16."""
  cfg = tiny("bfloat16")
  mesh, _, tp_p = setup(cfg, seed)
  batch, num_tokens = 4, 10
  prompt = np.random.default_rng(seed).integers(0, cfg.vocab, (5, batch)).astype(np.int32)
  prefill = decode.make_prefill_fn(cfg, mesh)
  out = {}
  for impl in (decode.PSUM,) + OURS:
    ck, cv, tok = prefill(tp_p, *decode.make_cache(cfg, mesh, batch), jnp.asarray(prompt))
    gen = decode.make_generate_fn(cfg, mesh, impl, num_tokens)
    out[impl] = np.asarray(gen(tp_p, ck, cv, tok, jnp.int32(prompt.shape[0]))[2])
  for impl in OURS:
    np.testing.assert_array_equal(out[impl], out[decode.PSUM], err_msg=impl)


@pytest.mark.parametrize("impl", OURS)
def test_check_passes_ours(seed, impl):
  """The benchmark's pre-timing check (tiny model and a prefilled cache) passes."""
  mesh = make_mesh((2,), ("tp",))
  assert decode.check_tiny(mesh, impl, "bfloat16", seed % 1000) is None
  cfg = tiny("bfloat16")
  _, _, tp_p = setup(cfg, seed)
  rng = np.random.default_rng(seed)
  prompt = rng.integers(0, cfg.vocab, (6, 2)).astype(np.int32)
  cache = decode.make_prefill_fn(cfg, mesh)(tp_p, *decode.make_cache(cfg, mesh, 2),
                                            jnp.asarray(prompt))[:2]
  inputs = rng.integers(0, cfg.vocab, (4, 2)).astype(np.int32)
  assert decode.check_impl(cfg, mesh, tp_p, cache, inputs, 6, impl) is None


def _wrong_all_reduce(kind):
  if kind == "floor":  # no communication: each rank keeps its partial sum
    return decode.all_reduce_fn(decode.FLOOR)
  if kind == "double":  # one rank's contribution counted twice
    return lambda x: jax.lax.psum(x, "tp") + jnp.where(jax.lax.axis_index("tp") == 0, x, 0)
  return lambda x: jax.lax.psum(x, "tp").at[..., 0].set(jnp.nan)  # "nan" in one element


@pytest.fixture
def wrong_impl(monkeypatch, request):
  """Registers the implementation name "wrong" as a broken all-reduce."""
  real = decode.all_reduce_fn
  kind = getattr(request, "param", "floor")
  monkeypatch.setattr(decode, "all_reduce_fn",
                      lambda impl: _wrong_all_reduce(kind) if impl == "wrong" else real(impl))
  return "wrong"


@pytest.mark.parametrize("wrong_impl", ["floor", "double", "nan"], indirect=True)
def test_check_rejects_a_wrong_all_reduce(seed, wrong_impl):
  why = decode.check_tiny(make_mesh((2,), ("tp",)), wrong_impl, "bfloat16", seed % 1000)
  assert why is not None and "logits differ" in why, why


def test_run_writes_valid_records_and_drops_a_wrong_impl(seed, tmp_path, wrong_impl):
  """run() + write_results(): BRIEF section 7 records, the PNG and the table.

  The wrong implementation fails its check: it is reported, not timed, not recorded.
  """
  cfg = dataclasses.replace(tiny("bfloat16"), num_layers=1)
  mesh = make_mesh((2,), ("tp",))
  ours = OURS[1]
  logs = []
  records, rejected = decode.run(cfg, mesh, impls=[decode.PSUM, ours, wrong_impl],
                                 batches=[1, 2], prompt_len=4, num_tokens=2, reps=2, warmup=1,
                                 check_steps=2, seed=seed % 1000, log=logs.append)
  assert [r["impl"] for r in rejected] == [wrong_impl]
  assert any(line.startswith("CHECK FAILED: wrong") for line in logs), logs
  path, png = decode.write_results(str(tmp_path), "test machine", records, rejected,
                                   command="pytest", method="test")
  assert path.endswith("decode-test_machine.json") and os.path.getsize(png) > 0
  result = json.load(open(path))
  tuning.validate_result(result, "decode results")
  assert result["benchmark"] == "decode" and result["weights"] == "random"
  assert [r["impl"] for r in result["rejected"]] == [wrong_impl]
  assert len(result["records"]) == 6
  for r in result["records"]:
    assert r["op"] == "decode_token" and r["world"] == 2 and r["time_us"] > 0
    assert r["impl"] in (decode.PSUM, ours, decode.FLOOR)
    assert r["shape"] == dict(batch=r["shape"]["batch"], **cfg.shape(), prompt_len=4)
    assert r["bytes"] == r["shape"]["batch"] * cfg.d_model * 2
    if r["impl"] == decode.FLOOR:
      assert "all_reduce_share" not in r and r["all_reduces_per_token"] == 0
    else:
      assert isinstance(r["all_reduce_share"], float) and r["all_reduce_share"] < 1
      assert r["all_reduces_per_token"] == 2 * cfg.num_layers
  table = decode.markdown_table(records, ours).splitlines()
  assert len(table) == 4 and table[2].startswith("| 1 |") and table[3].startswith("| 2 |")


def test_config_errors():
  with pytest.raises(ValueError, match="kv_heads 3 is not a multiple of the 2 TP ranks"):
    decode.DecoderConfig(d_model=96, d_ff=128, num_heads=6, num_kv_heads=3, vocab=128,
                         max_len=32).validate(2)
  with pytest.raises(ValueError, match="must fit in max_len"):
    decode.run(tiny("bfloat16"), make_mesh((2,), ("tp",)), impls=[decode.PSUM], batches=[1],
               prompt_len=30, num_tokens=8, reps=1)
  with pytest.raises(ValueError, match="unknown impl"):
    decode.all_reduce_fn("jaxoverlap:collective")
