"""benchmarks/decode_floor.py on CPU: sizes of one TP rank, variants, records and the table."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxoverlap.nnx import layers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import decode  # noqa: E402
import decode_floor  # noqa: E402

TINY = decode.DecoderConfig(d_model=64, d_ff=128, num_heads=4, num_kv_heads=2, num_layers=1,
                            vocab=128, max_len=16)


def test_shard_config_divides_the_sharded_sizes_and_keeps_head_dim():
  cfg = decode_floor.shard_config(decode.DecoderConfig(), 2)
  assert (cfg.d_ff, cfg.num_heads, cfg.num_kv_heads, cfg.vocab) == (7168, 16, 4, 16000)
  assert cfg.d_model == 4096 and cfg.head_dim == 128 and cfg.num_layers == 4
  with pytest.raises(ValueError, match="num_kv_heads 8 is not divisible by tp 16"):
    decode_floor.shard_config(decode.DecoderConfig(), 16)


def test_variants_and_their_errors():
  v = decode_floor.variants(["xla_default", "no_graphs", "graphs_while", "rows4", "rows4_cudnn",
                             "rows2zeros_cudnn"])
  assert v["xla_default"] == ({}, 1, "xla", "copies")
  assert v["no_graphs"] == ({decode_floor.CMDBUF: ""}, 1, "xla", "copies")
  assert "WHILE" in v["graphs_while"][0][decode_floor.CMDBUF].split(",")
  assert v["rows4"] == ({}, 4, "xla", "copies") and v["rows4_cudnn"] == ({}, 4, "cudnn", "copies")
  assert v["rows2zeros_cudnn"] == ({}, 2, "cudnn", "zeros")
  assert "FUSION" in decode_floor.default_command_buffer_types()
  with pytest.raises(ValueError, match="unknown variants"):
    decode_floor.variants(["fast"])


def test_variants_with_xla_option_sets():
  v = decode_floor.variants(["rows2_cudnn+block_level+triton_mof", "xla_default+unroll"])
  options, rows, attention, pad = v["rows2_cudnn+block_level+triton_mof"]
  assert (rows, attention, pad) == (2, "cudnn", "copies")
  assert options == {**decode_floor.FLAG_SETS["block_level"], **decode_floor.FLAG_SETS["triton_mof"]}
  options = v["xla_default+unroll"][0]
  assert options["xla_gpu_command_buffer_unroll_loops"] is True
  assert "WHILE" in options[decode_floor.CMDBUF].split(",")
  assert decode_floor.variants(["rows2_cudnn"])["rows2_cudnn"][0] == {}  # the table is not changed
  for bad in ("rows2_cudnn+fast", "fast+block_level", "rows2_cudnn+"):
    with pytest.raises(ValueError, match="unknown variants"):
      decode_floor.variants([bad])


def test_zero_padding_is_traced_inside_its_context_only():
  x, w = jnp.ones((1, 1, 8), jnp.float32), jnp.ones((8, 4), jnp.float32)
  def matmul():
    return str(jax.make_jaxpr(lambda x, w: layers._matmul(x, w, 2))(x, w))  # noqa: SLF001
  assert " pad[" not in matmul()
  with decode_floor.padding("zeros"):
    assert " pad[" in matmul()
    np.testing.assert_array_equal(layers._matmul(x, w, 2), x @ w)  # noqa: SLF001
  assert " pad[" not in matmul()


def test_count_fusions_skips_fused_bodies():
  text = """HloModule m

%fused_computation.3 (p: f32[2]) -> f32[2] {
  %inner_fusion.1 = f32[2] fusion(f32[2] %p), kind=kLoop, calls=%x
}

%body.12 (arg: (s32[])) -> (s32[]) {
  %loop_pad_fusion.4 = bf16[2,8] fusion(bf16[1,8] %a), kind=kLoop, calls=%fused_computation.3
  %loop_pad_fusion_2.1 = bf16[2,8] fusion(bf16[1,8] %b), kind=kLoop, calls=%fused_computation.3
  %gemm_fusion_dot.7 = bf16[2,4] fusion(bf16[2,8] %c, bf16[8,4] %d), kind=kCustom
  ROOT %custom-call.2 = (bf16[2,4]) custom-call(bf16[2,4] %e), custom_call_target="x"
}
"""
  assert decode_floor.count_fusions(text) == {"loop_pad_fusion": 2, "gemm_fusion_dot": 1,
                                              "custom-call": 1, "total": 4}


def test_kv_read_bytes():
  cfg = dataclasses.replace(TINY, num_layers=3)
  assert decode_floor.kv_read_bytes(cfg, 2) == 3 * 2 * 2 * 16 * 2 * 16 * 2


def test_run_times_every_variant_against_the_roofline(tmp_path):
  mesh = jax.make_mesh((1,), (decode.AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  cfg = decode_floor.shard_config(TINY, 2)
  records, extra = decode_floor.run(
      cfg, mesh, batches=[1, 2], variant_names=["xla_default", "rows4"], prompt_len=4,
      num_tokens=2, reps=2, warmup=1, seed=0, hbm_gib=0.001, profile_tokens=2,
      profile_variants=["rows4"], logdir=str(tmp_path), log=lambda *a: None)
  impls = {(r["impl"], r["shape"]["batch"]) for r in records}
  assert impls == {(i, b) for b in (1, 2) for i in (
      "step/xla_default", "step/rows4", "matmuls/xla_default", "matmuls/rows4", "roofline")}
  roof = {r["shape"]["batch"]: r["time_us"] for r in records if r["impl"] == "roofline"}
  for r in records:
    assert r["time_us"] > 0 and r["vs_roofline"] == pytest.approx(
        r["time_us"] / roof[r["shape"]["batch"]], rel=1e-2)
  assert extra["weight_bytes"] > 0 and extra["hbm_read_gbs"]["best"] > 0
  assert extra["variants"]["rows4"] == {"compile_options": {}, "min_matmul_rows": 4,
                                       "attention": "xla", "padding": "copies"}
  assert set(extra["fusions"]) == {"xla_default b1", "xla_default b2", "rows4 b1", "rows4 b2"}
  for f in extra["fusions"].values():  # the CPU's kernels, counted the same way
    assert f["total"] == sum(v for k, v in f.items() if k != "total") > 0
  assert set(extra["profile"]) == {"rows4 b1", "rows4 b2"}
  for p in extra["profile"].values():  # host threads on CPU; the fields are there
    assert "error" in p or p["kernels_per_token"] > 0
  table = decode_floor.markdown_table(records)
  assert table.count("\n") == 3 and "step/rows4 us" in table


def test_run_leaves_out_a_variant_that_does_not_compile(tmp_path, monkeypatch):
  monkeypatch.setitem(decode_floor.FLAG_SETS, "bogus", {"xla_no_such_option": True})
  mesh = jax.make_mesh((1,), (decode.AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  records, extra = decode_floor.run(
      decode_floor.shard_config(TINY, 2), mesh, batches=[1],
      variant_names=["xla_default", "xla_default+bogus", "xla_default+same_shape_mof"],
      prompt_len=4, num_tokens=2, reps=1, warmup=0, seed=0, hbm_gib=0.001, profile_tokens=2,
      profile_variants=["xla_default+bogus"], logdir=str(tmp_path), log=lambda *a: None)
  assert {r["impl"] for r in records} == {"step/xla_default", "step/xla_default+same_shape_mof",
                                          "matmuls/xla_default",
                                          "matmuls/xla_default+same_shape_mof", "roofline"}
  assert list(extra["compile_errors"]) == ["xla_default+bogus b1"]
  assert "xla_no_such_option" in extra["compile_errors"]["xla_default+bogus b1"]
  assert extra["profile"] == {}
  # The same program on the CPU: the greedy tokens agree with the first variant's.
  assert extra["tokens_match_first"] == {"xla_default b1": 1.0,
                                         "xla_default+same_shape_mof b1": 1.0}
  assert "| - |" not in decode_floor.markdown_table(records)


def test_run_refuses_a_profile_variant_that_is_not_timed(tmp_path):
  mesh = jax.make_mesh((1,), (decode.AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  with pytest.raises(ValueError, match=r"profile variants \['rows4'\] are not among"):
    decode_floor.run(decode_floor.shard_config(TINY, 2), mesh, batches=[1],
                     variant_names=["xla_default"], prompt_len=4, num_tokens=2, reps=1, warmup=0,
                     seed=0, hbm_gib=0.001, profile_tokens=2, profile_variants=["rows4"],
                     logdir=str(tmp_path), log=lambda *a: None)


@pytest.mark.parametrize("script", ["decode_floor.py", "decode.py"])
def test_help_lists_the_model_flags(script):
  """--help (not only --helpfull) shows the model-size flags decode_floor.py borrows."""
  import subprocess
  here = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
  run = subprocess.run([sys.executable, script, "--help"], cwd=here, capture_output=True,
                       text=True, timeout=120, check=False)
  out = run.stdout + run.stderr  # absl prints the help and exits with 1
  assert "Traceback" not in out, out
  for flag in ("--d_model", "--kv_heads", "--layers", "--attention", "--reps"):
    assert flag in out, (script, flag)
