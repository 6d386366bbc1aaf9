"""benchmarks/overlap.py, plot_overlap.py and the shared harness on CPU: helpers, a tiny run.

The CUDA impls need GPUs; here the xla impls run on 2 simulated devices with
tiny shapes, which covers the chain, the check and the records. Shape
parsing, impl lists, exposed/hidden arithmetic, merging and the tables are
checked on fixed inputs, and so are the harness's pieces every script uses:
the mapping from impl names to the ops' keywords, the on-device check, the
interleaved timer, what a record says about a plan, and the results file.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import make_mesh
from jaxoverlap import dispatch, tuning

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))  # the scripts import their harness
import harness  # noqa: E402


def _load(name):
  spec = importlib.util.spec_from_file_location(f"{name}_benchmark",
                                                os.path.join(_ROOT, "benchmarks", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod
  spec.loader.exec_module(mod)
  return mod


ovl = _load("overlap")
plot_overlap = _load("plot_overlap")


# ------------------------------------------------------------------ shapes


def test_default_shapes():
  shapes = ovl.parse_shapes(ovl.DEFAULT_SHAPES)
  # The 4 shapes of docs/results.md's baseline table + 18 Llama projections, one duplicate
  # (ag:8192,8192,28672).
  assert len(shapes) == 21
  assert shapes[:4] == [("ag", (16384, 4096, 4096)), ("rs", (16384, 4096, 4096)),
                        ("ag", (8192, 8192, 28672)), ("rs", (8192, 8192, 28672))]
  for m in (2048, 8192, 32768):
    for entry in (("ag", (m, 4096, 14336)), ("ag", (m, 8192, 28672)), ("rs", (m, 14336, 4096)),
                  ("rs", (m, 28672, 8192)), ("ar", (m, 14336, 4096)), ("ar", (m, 28672, 8192))):
      assert entry in shapes
  quick = ovl.parse_shapes(ovl.QUICK_SHAPES)
  assert 1 <= len(quick) <= 8 and {op for op, _ in quick} == {"ag", "rs", "ar"}
  for op, mkn in shapes:
    ovl.check_divisible(op, mkn, 2)


def test_parse_shapes_forms():
  assert ovl.parse_shapes(" ag : 8, 4,2 ;; rs:4,4,4;ag:8,4,2; ") == [("ag", (8, 4, 2)),
                                                                      ("rs", (4, 4, 4))]


@pytest.mark.parametrize("text, match", [
    ("ag16,4,4", "expected 'op:M,K,N'"),
    ("mm:16,4,4", "unknown op 'mm'"),
    ("ag:16,4", "three integers"),
    ("ag:16,4,4,4", "three integers"),
    ("rs:16,x,4", "three integers"),
    ("ar:0,4,4", ">= 1"),
    (" ; ", "no shapes"),
])
def test_parse_shapes_errors(text, match):
  with pytest.raises(ValueError, match=match):
    ovl.parse_shapes(text)


def test_check_divisible_and_local_shapes():
  with pytest.raises(ValueError, match="N=6 does not divide by the 4 ranks"):
    ovl.check_divisible("ag", (8, 3, 6), 4)
  with pytest.raises(ValueError, match="K=3 does not divide"):
    ovl.check_divisible("rs", (8, 3, 8), 2)
  ovl.check_divisible("ag", (8, 3, 4), 2)  # K need not divide for ag
  assert ovl.local_shapes("ag", (8, 6, 4), 2) == {"x": (4, 6), "w": (6, 2), "y": (8, 2),
                                                  "gemm": (8, 2), "comm": (4, 6)}
  assert ovl.local_shapes("rs", (8, 6, 4), 2) == {"x": (8, 3), "w": (3, 4), "y": (4, 4),
                                                  "gemm": (8, 4), "comm": (8, 4)}
  assert ovl.local_shapes("ar", (8, 6, 4), 2)["y"] == (8, 4)


# ------------------------------------------------------------------ impls


@pytest.mark.parametrize("op, impl, kwargs", [
    ("all_gather_matmul", "xla:naive", dict(backend="xla", algorithm="collective")),
    ("matmul_reduce_scatter", "xla:ppermute", dict(backend="xla", algorithm="ppermute")),
    ("all_gather_matmul", "jaxoverlap:copy_engine",
     dict(backend="cuda", algorithm="fused", transport="copy_engine")),
    ("matmul_all_reduce", "jaxoverlap:nvshmem/c8",
     dict(backend="cuda", algorithm="fused", transport="nvshmem", chunks=8)),
    ("matmul_all_reduce", "jaxoverlap:gemm_all_reduce", dict(backend="cuda", algorithm="unfused")),
    ("all_reduce", "jaxoverlap:one_shot_ll", dict(backend="cuda", algorithm="one_shot",
                                                  protocol="ll")),
    ("all_reduce", "jaxoverlap:two_shot", dict(backend="cuda", algorithm="two_shot")),
    ("all_reduce", "jaxoverlap:hierarchical_simple",
     dict(backend="cuda", algorithm="hierarchical", protocol="simple")),
    ("all_reduce", "jaxoverlap:auto", dict(backend="cuda", algorithm="auto")),
    ("all_reduce", "xla:psum", dict(backend="xla", algorithm="collective")),
    ("all_reduce", "jaxoverlap:cuda:auto", dict(backend="cuda", algorithm="auto")),
    ("all_reduce", "jaxoverlap:xla:ppermute", dict(backend="xla", algorithm="ppermute")),
    ("all_reduce", "jaxoverlap:cuda:one_shot_ll",
     dict(backend="cuda", algorithm="one_shot", protocol="ll")),
])
def test_impl_kwargs_are_the_ops_keywords(op, impl, kwargs):
  """Every impl name of the results files maps to keywords the public op accepts."""
  assert harness.impl_kwargs(op, impl) == kwargs
  from jaxoverlap import _checks

  chunks = kwargs.get("chunks")
  _checks.check_options(op, **{k: v for k, v in kwargs.items() if k != "chunks"},
                        **({"chunks": chunks} if op != "all_reduce" else {}))


@pytest.mark.parametrize("op, impl", [
    ("all_gather_matmul", "xla:psum"), ("all_gather_matmul", "jaxoverlap:auto"),
    ("all_gather_matmul", "jaxoverlap:copy_engine/c0"),
    ("all_gather_matmul", "jaxoverlap:copy_engine/4"),
    ("matmul_all_reduce", "jaxoverlap:gemm_all_reduce/c2"),
    ("all_gather_matmul", "jaxoverlap:gemm_all_reduce"), ("all_gather_matmul", "naive"),
    ("all_gather_matmul", "xla:local_gemm"), ("all_reduce", "xla:naive"),
    ("all_reduce", "jaxoverlap:collective"), ("all_reduce", "jaxoverlap:xla:one_shot"),
    ("all_reduce", "jaxoverlap:psum"), ("all_reduce", "floor:launch"),
])
def test_impl_kwargs_refuses_other_names(op, impl):
  with pytest.raises(ValueError, match="unknown impl"):
    harness.impl_kwargs(op, impl)


def test_chunks_of():
  assert ovl.chunks_of("jaxoverlap:copy_engine/c4") == 4
  assert ovl.chunks_of("jaxoverlap:nvshmem") is None
  assert ovl.chunks_of("xla:windowed_einsum") is None
  with pytest.raises(ValueError, match="unknown impl 'xla:psum'"):
    ovl.chunks_of("xla:psum")
  # The op a bad name was asked for, not matmul_all_reduce's; another op's name is left out.
  with pytest.raises(ValueError, match="unknown impl 'xla:bogus' for all_gather_matmul"):
    ovl.impls_for("ag", requested=["xla:bogus"])
  assert ovl.chunks_of("jaxoverlap:gemm_all_reduce", "ag") is None
  assert ovl.impls_for("ag", requested=["xla:naive", "jaxoverlap:gemm_all_reduce"]) == [
      "xla:naive"]


@pytest.mark.parametrize("script, args, flag", [
    ("overlap.py", ["--shapes", "ag:16,8,8", "--chunks", "x"], "chunks"),
    ("overlap.py", ["--shapes", "rs:16,8,8", "--impls", "xla:bogus"], None),
    ("all_reduce_rms_norm.py", ["--rows", "x"], "rows"),
    ("decode.py", ["--batches", "1,x"], "batches"),
    ("decode.py", ["--backend", "xla", "--algorithm", "one_shot"], "algorithm"),
    ("train_step.py", ["--mesh", "a,b"], "mesh"),
])
def test_bad_flag_values_name_the_flag(script, args, flag):
  """A usage error naming the flag, before any device work; no int() traceback."""
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(_ROOT, "benchmarks", script),
                         "--host_devices", "2", "--out", "/nonexistent"] + args, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  want = (f"--{flag}: '" if flag else
          "unknown impl 'xla:bogus' for matmul_reduce_scatter")
  assert want in proc.stderr, proc.stderr[-3000:]


def test_impls_for():
  base = ["xla:local_gemm", "xla:collective", "xla:naive", "xla:ppermute"]
  assert ovl.impls_for("ag") == base + ["jaxoverlap:copy_engine", "jaxoverlap:nvshmem"]
  assert ovl.impls_for("ar", chunks=[2, 4]) == base + [
      "jaxoverlap:copy_engine", "jaxoverlap:copy_engine/c2", "jaxoverlap:copy_engine/c4",
      "jaxoverlap:nvshmem", "jaxoverlap:gemm_all_reduce"]
  assert ovl.impls_for("rs", windowed=True) == ["xla:local_gemm", "xla:collective",
                                                "xla:windowed_einsum"]
  # Requested: run order kept, other-mode names and ar-only names dropped, chunked variants kept.
  req = ["jaxoverlap:nvshmem", "xla:local_gemm", "jaxoverlap:gemm_all_reduce",
         "xla:windowed_einsum", "jaxoverlap:nvshmem/c2"]
  assert ovl.impls_for("rs", requested=req) == ["xla:local_gemm", "jaxoverlap:nvshmem",
                                                "jaxoverlap:nvshmem/c2"]
  assert ovl.impls_for("ar", requested=req) == ["xla:local_gemm", "jaxoverlap:nvshmem",
                                                "jaxoverlap:gemm_all_reduce",
                                                "jaxoverlap:nvshmem/c2"]
  assert ovl.impls_for("ag", windowed=True, requested=["xla:windowed_einsum", "xla:naive"]) == [
      "xla:naive", "xla:windowed_einsum"]
  with pytest.raises(ValueError, match="unknown impl 'xla:psum'"):
    ovl.impls_for("ag", requested=["xla:psum"])


# ------------------------------------------------------------------ what ran


GEO = dispatch.Geometry(outer=1, rows=512, k=4096, n=2048, payload_bytes=4 << 20, pieces=512,
                        chunk_bytes=4 << 20, gemm_flops=8.6e9)


def _plan(op, backend, algorithm, why=(), **kw):
  return dispatch.Plan(op=op, axis_name="x", shapes=((1024, 4096),), dtype="bfloat16",
                       nbytes=kw.pop("nbytes", 8192), num_ranks=2, backend=backend,
                       algorithm=algorithm, why=tuple(why), **kw)


def test_plan_fields_auto_choices_and_fused_choices():
  ag = _plan("all_gather_matmul", "cuda", "fused", [("chunks", "rule: from the shapes")],
             transport="copy_engine", chunks=2, geometry=GEO)
  rs = _plan("matmul_reduce_scatter", "cuda", "fused",
             [("chunks", "requested 4, at most 2 pieces")], transport="nvshmem", chunks=2,
             geometry=GEO)
  sub = _plan("all_reduce", "cuda", "one_shot", [("algorithm", "measured")], protocol="ll")
  ar = _plan("matmul_all_reduce", "cuda", "unfused", all_reduce=sub)
  psum = _plan("all_reduce", "xla", "collective", [("algorithm", "lax.psum")], nbytes=1 << 24)
  asked = _plan("all_reduce", "cuda", "two_shot", [("algorithm", "requested")], protocol="simple")
  assert harness.plan_fields(ag) == {"transport": "copy_engine", "chunks": 2,
                                     "chunks_source": "auto"}
  assert harness.plan_fields(rs)["chunks_source"] == "requested 4, at most 2 pieces"
  assert harness.plan_fields(ar) == {"all_reduce_algorithm": "one_shot/ll"}
  assert harness.plan_fields(psum) == {} and harness.plan_fields(None) == {}
  # Only the calls whose algorithm auto chose; lax.psum as ("psum", "auto").
  assert harness.auto_choices([asked, psum, sub, sub]) == [[8192, "one_shot", "ll"],
                                                          [1 << 24, "psum", "auto"]]
  shape = {"outer": 1, "rows": 512, "k": 4096, "n": 2048}
  assert harness.fused_choices([ag, rs, ag, ar, psum]) == [
      {"op": "all_gather_matmul", "transport": "copy_engine", "chunks": 2,
       "chunks_source": "auto", "shape": shape},
      {"op": "matmul_reduce_scatter", "transport": "nvshmem", "chunks": 2,
       "chunks_source": "requested 4, at most 2 pieces", "shape": shape}]
  assert harness.resolved_backends([ag, psum, sub]) == {"all_gather_matmul": "cuda",
                                                        "all_reduce": "cuda+xla"}
  assert harness.run_impl("auto", {"all_reduce": "cuda+xla"}) == "jaxoverlap:auto"
  assert harness.run_impl("auto", {"all_reduce": "xla"}) == "xla:auto"


def test_time_interleaved_runs_every_call_in_turn():
  order = []
  calls = {k: (lambda k=k: order.append(k)) for k in ("a", "b")}
  times = harness.time_interleaved(calls, reps=3, warmup=2, before=lambda: order.append("|"))
  assert order == ["a", "a", "b", "b"] + ["|", "a", "|", "b"] * 3
  assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
  assert all(t >= 0 for v in times.values() for t in v)


def test_write_result_validates_latency_tables(tmp_path):
  rec = {"op": "all_reduce", "impl": "xla:psum", "dtype": "bfloat16", "bytes": 8, "shape": [4],
         "world": 2, "ranks_per_node": 2, "time_us": 1.5}
  path = harness.path(str(tmp_path), "bench", "a b", "-1x2")
  assert path == os.path.join(str(tmp_path), "bench-a_b-1x2.json")
  out = harness.write_result(path, [rec], benchmark="bench", machine="a b", method="m",
                             command="c", extra={"note": 1})
  on_disk = harness.load_json(path)
  assert on_disk == json.loads(json.dumps(out)) and on_disk["benchmark"] == "bench"
  assert on_disk["note"] == 1 and "params" not in on_disk and on_disk["rejected"] == []
  tuning.validate_result(on_disk)
  with pytest.raises(ValueError, match="time_us"):
    harness.write_result(path, [dict(rec, time_us=None)], benchmark="bench", machine="m",
                         method="m", command="c")
  whole = harness.write_result(path, [dict(rec, time_us=None)], benchmark="bench",
                               machine="m", method="m", command="c", latency=False)
  assert harness.load_json(path)["records"] == whole["records"]
  analysis = harness.write_result(path, None, benchmark="x", machine="m", method="m",
                                  command="c", latency=False)
  assert "records" not in analysis and "rejected" not in analysis
  assert harness.load_json(str(tmp_path / "none.json"), missing_ok=True) is None
  with pytest.raises(FileNotFoundError):
    harness.load_json(str(tmp_path / "none.json"))


# ------------------------------------------------------------------ records


def _rec(op, impl, t, shape=(64, 32, 32)):
  return {"op": op, "impl": impl, "dtype": "bfloat16", "shape": list(shape), "world": 2,
          "ranks_per_node": 2, "time_us": t}


def test_add_overlap_metrics():
  ag, rs = "all_gather_matmul", "matmul_reduce_scatter"
  recs = [_rec(ag, "xla:local_gemm", 500.0), _rec(ag, "xla:collective", 400.0),
          _rec(ag, "xla:naive", 950.0), _rec(ag, "jaxoverlap:copy_engine", 540.0),
          _rec(ag, "xla:ppermute", 1000.0),
          # another shape with no collective measured, and one with no floor
          _rec(ag, "xla:local_gemm", 100.0, (8, 8, 8)), _rec(ag, "xla:naive", 130.0, (8, 8, 8)),
          _rec(rs, "xla:naive", 130.0)]
  ovl.add_overlap_metrics(recs)
  assert "exposed_us" not in recs[0] and "hidden_fraction" not in recs[1]
  assert recs[2]["exposed_us"] == 450.0 and recs[2]["hidden_fraction"] == pytest.approx(-0.125)
  assert recs[3]["exposed_us"] == 40.0 and recs[3]["hidden_fraction"] == pytest.approx(0.9)
  assert recs[4]["hidden_fraction"] == pytest.approx(-0.25)  # raw, not clipped
  assert recs[6]["exposed_us"] == 30.0 and "hidden_fraction" not in recs[6]
  assert "exposed_us" not in recs[7]
  row = ovl.progress_row("ag", (64, 32, 32), recs[:4], {"jaxoverlap:nvshmem": "WRONG"})
  assert row == ("ag 64x32x32  local_gemm=500.0  collective=400.0  naive=950.0 (exposed 450, "
                 "hidden -12%)  copy_engine=540.0 (exposed 40, hidden 90%)  nvshmem=WRONG")


def test_merge_results_and_paths():
  old = {"records": [_rec("all_gather_matmul", "xla:naive", 1.0),
                     _rec("matmul_reduce_scatter", "xla:naive", 2.0)],
         "rejected": [{"op": "all_gather_matmul", "impl": "x", "shape": [64, 32, 32],
                       "reason": "r"}]}
  new = [_rec("all_gather_matmul", "xla:naive", 3.0)]
  recs, rej = ovl.merge_results(old, new, [], [("ag", (64, 32, 32))])
  assert [r["time_us"] for r in recs] == [2.0, 3.0] and rej == []
  assert ovl.merge_results(None, new, [], [("ag", (64, 32, 32))]) == (new, [])
  assert ovl.result_path("o", "2x H200 NV18", False) == os.path.join(
      "o", "overlap-2x_H200_NV18.json")
  assert ovl.result_path("o", "m", True) == os.path.join("o", "overlap_windowed_einsum-m.json")


# ------------------------------------------------------------------ the JAX part on CPU

needs2 = pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (simulated) devices")


@needs2
def test_close():
  mesh = make_mesh((2,), ("x",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  a = jax.device_put(jnp.linspace(-4, 4, 64, dtype=jnp.float32).reshape(8, 8), sh)
  assert harness.close(a, a)[0]
  assert harness.close(a * 1.01, a)[0]
  # RTOL is 2%: 5% off at an element far above the atol (1% of the largest) is refused.
  big = a.at[3, 3].set(100.0)
  assert harness.close(big * 1.01, big)[0] and not harness.close(big * 1.05, big)[0]
  ok, err, atol = harness.close(a.at[7, 7].add(1.0), a)  # rank 1's block
  assert not ok and err == pytest.approx(1.0) and atol == pytest.approx(0.04)
  assert not harness.close(a.at[0, 0].set(jnp.nan), a)[0]


@needs2
@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_run_case_cpu(op):
  mesh = make_mesh((2,), ("x",))
  impls = ovl.impls_for(op) [:4] + ["xla:windowed_einsum"]
  logs = []
  recs, rejected, failed = ovl.run_case(op, (16, 8, 12), impls, mesh=mesh, dtype="bfloat16",
                                        chain=3, reps=2, warmup=1, log=logs.append)
  assert rejected == [] and failed == {} and logs == []
  assert [r["impl"] for r in recs] == impls
  comm = {"ag": 8 * 8, "rs": 16 * 12, "ar": 16 * 12}[op] * 2  # bf16 bytes per rank
  for r in recs:
    assert r["op"] == ovl.OPS[op] and r["shape"] == [16, 8, 12] and r["world"] == 2
    assert r["dtype"] == "bfloat16" and r["time_us"] >= 0.01 and r["bytes"] == comm
    assert r["time_us_p10"] <= r["time_us_p90"]  # the spread over the runs
    assert ("exposed_us" in r) == (r["impl"] not in ovl.BASELINES)
    assert ("hidden_fraction" in r) == (r["impl"] not in ovl.BASELINES)


@needs2
def test_chain_output_matches_reference():
  """Link i's output is the op on the original inputs with STEP x i added to column 0 of each
  rank's shard: the links add exact zeros times the output, and a step of their own."""
  mesh = make_mesh((2,), ("x",))
  case = ovl._Case("rs", (8, 4, 6), mesh, jnp.dtype(jnp.float32), 4)
  fn, carrier, rest = case.chain_fn("xla:ppermute")
  case.build((carrier, "zero", "step") + rest)
  x, w = np.asarray(case.arrays["x"]), np.asarray(case.arrays["w"])
  ys = case.call(fn, carrier, rest)
  assert len(ys) == 4

  def shifted(links):  # x is column-sharded (rs): each rank's column 0 is x[:, 2 * rank]
    xi = x.copy()
    xi[:, [0, 2]] += ovl.STEP * links
    return xi

  for i, y in enumerate(ys):
    np.testing.assert_allclose(np.asarray(y), shifted(i) @ w, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(case.arrays["x"]), shifted(4), rtol=1e-6)  # carried on


@needs2
def test_run_case_flags_a_kernel_that_repeats_stale_results(monkeypatch):
  """Trial 36: the check compared only the last link, and every link had the same input, so a
  kernel that skipped its transfers after the first link passed. Now each link's input
  differs and every link of two runs is checked."""
  mesh = make_mesh((2,), ("x",))
  real = ovl._Case.kernel

  def kernel(self, impl):  # ppermute computed once per chain, then its result repeated
    fn, carrier, rest, spec = real(self, impl)
    if impl != "xla:ppermute":
      return fn, carrier, rest, spec
    first = []

    def stale(x, w):
      if not first:
        first.append(fn(x, w))
      return first[0]
    return stale, carrier, rest, spec

  monkeypatch.setattr(ovl._Case, "kernel", kernel)
  recs, rejected, failed = ovl.run_case("ag", (16, 8, 12), ["xla:ppermute"], mesh=mesh,
                                        dtype="bfloat16", chain=3, reps=1, warmup=0,
                                        log=lambda s: None)
  assert recs == [] and failed == {"xla:ppermute": "WRONG"}
  assert "at run 1, link 2" in rejected[0]["reason"], rejected


@needs2
@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_run_case_flags_stale_rows_beyond_the_first(monkeypatch, op):
  """Trial 37: the step went to element [0, 0] only, so rows of the product other than those
  built from a shard's first row never changed from link to link: a kernel that kept them
  stale passed. The step now goes to column 0, which every row of the product reads."""
  mesh = make_mesh((2,), ("x",))
  real = ovl._Case.kernel

  def kernel(self, impl):  # row 0 fresh, every other row the first link's
    fn, carrier, rest, spec = real(self, impl)
    if impl != "xla:ppermute":
      return fn, carrier, rest, spec
    first = []

    def stale_rows(x, w):
      y = fn(x, w)
      if not first:
        first.append(y)
      return jnp.concatenate([y[:1], first[0][1:]])
    return stale_rows, carrier, rest, spec

  monkeypatch.setattr(ovl._Case, "kernel", kernel)
  recs, rejected, failed = ovl.run_case(op, (16, 8, 12), ["xla:ppermute"], mesh=mesh,
                                        dtype="bfloat16", chain=3, reps=1, warmup=0,
                                        log=lambda s: None)
  assert recs == [] and failed == {"xla:ppermute": "WRONG"}, rejected
  assert "at run 1, link 2" in rejected[0]["reason"], rejected


@needs2
def test_run_case_flags_wrong(monkeypatch):
  mesh = make_mesh((2,), ("x",))
  real = ovl._Case.kernel

  def kernel(self, impl):  # ppermute made wrong: twice the product
    fn, carrier, rest, spec = real(self, impl)
    return ((lambda x, w: fn(x, w) * 2) if impl == "xla:ppermute" else fn), carrier, rest, spec

  monkeypatch.setattr(ovl._Case, "kernel", kernel)
  logs = []
  recs, rejected, failed = ovl.run_case("ag", (16, 8, 12), ["xla:ppermute"], mesh=mesh,
                                        dtype="bfloat16", chain=2, reps=1, warmup=0,
                                        log=logs.append)
  assert recs == [] and failed == {"xla:ppermute": "WRONG"}
  assert rejected[0]["impl"] == "xla:ppermute" and "differs from xla:naive" in rejected[0][
      "reason"]
  assert "WRONG" in logs[0]


def test_script_cpu_merge(tmp_path):
  """The script end to end on 2 simulated CPU devices; --merge keeps the other shape's rows."""
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  script = os.path.join(_ROOT, "benchmarks", "overlap.py")
  base = [sys.executable, script, "--host_devices", "2", "--out", str(tmp_path), "--reps", "2",
          "--chain", "2", "--machine", "cpu test", "--impls", "xla:local_gemm,xla:naive"]
  for shapes in ("ag:16,8,8;rs:16,8,8", "rs:16,8,8"):
    proc = subprocess.run(base + ["--shapes", shapes, "--merge"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
  assert "rs 16x8x8  local_gemm=" in proc.stdout
  result = json.load(open(tmp_path / "overlap-cpu_test.json"))
  tuning.validate_result(result)
  assert result["benchmark"] == "overlap" and result["machine"] == "cpu test"
  assert len(result["commands"]) == 2
  keys = [(r["op"], r["impl"]) for r in result["records"]]
  assert keys == [("all_gather_matmul", "xla:local_gemm"), ("all_gather_matmul", "xla:naive"),
                  ("matmul_reduce_scatter", "xla:local_gemm"),
                  ("matmul_reduce_scatter", "xla:naive")]
  bad = subprocess.run(base + ["--shapes", "ag:15,8,8"], env=env, capture_output=True,
                       text=True, timeout=300)
  assert bad.returncode != 0 and "M=15 does not divide by the 2 ranks" in bad.stderr


def test_script_cpu_machine_from_devices_and_merge_refusal(tmp_path):
  """Without --machine the file is named after the devices; --merge refuses another machine's."""
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  script = os.path.join(_ROOT, "benchmarks", "overlap.py")
  base = [sys.executable, script, "--host_devices", "2", "--out", str(tmp_path), "--reps", "2",
          "--chain", "2", "--impls", "xla:naive", "--shapes", "rs:16,8,8"]
  proc = subprocess.run(base, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.listdir(tmp_path) == ["overlap-2x_cpu.json"]
  path = tmp_path / "overlap-2x_cpu.json"
  result = json.load(open(path))
  assert result["machine"] == "2x cpu" and result["platform"] == "cpu"
  # A GPU run's file under this name (say, --machine given the same on both): not pooled.
  gpu = dict(result, platform="gpu", versions=dict(result["versions"], jax="0.11.2"))
  path.write_text(json.dumps(gpu))
  bad = subprocess.run(base + ["--merge"], env=env, capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0
  assert "platform 'gpu' there, 'cpu' in this run" in bad.stderr, bad.stderr[-3000:]
  assert "jax '0.11.2' there" in bad.stderr and str(path) in bad.stderr
  assert json.load(open(path)) == gpu  # untouched


_TOPO_2 = ("\x1b[4m\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
           "GPU0\t X \tNV18\t0-47\t0\t\tN/A\n"
           "GPU1\tNV18\t X \t48-95\t1\t\tN/A\n\nLegend:\n\n  X    = Self\n")


def test_parse_topology():
  assert harness.parse_topology(_TOPO_2) == {(0, 1): "NV18", (1, 0): "NV18"}
  four = ("\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\n"
          "GPU0\t X \tNV12\tSYS\tSYS\tPIX\t0-7\n"
          "GPU1\tNV12\t X \tSYS\tSYS\tSYS\t0-7\n"
          "GPU2\tSYS\tSYS\t X \tNV12\tSYS\t8-15\n"
          "GPU3\tSYS\tSYS\tNV12\t X \tSYS\t8-15\n"
          "NIC0\tPIX\tSYS\tSYS\tSYS\t X \n")
  links = harness.parse_topology(four)
  assert links[(0, 1)] == "NV12" and links[(0, 2)] == "SYS" and links[(3, 2)] == "NV12"
  assert len(links) == 12 and harness.parse_topology("") == {}


def test_machine_name(monkeypatch):
  """--machine, else "<count>x <kind>" of every device, with the link nvidia-smi reports
  between the GPUs used; processes sharing GPUs are named so (trial 36: every 2x H200 run was
  labelled NV18, one GPU shared by two processes included)."""
  assert harness.machine_name("my box") == "my box"
  assert harness.machine_name(None) == f"{jax.device_count()}x cpu"

  class Dev:
    platform = "gpu"

    def __init__(self, kind):
      self.device_kind = kind

  smi = {"topo": _TOPO_2, "gpus": 2}
  monkeypatch.setattr(harness, "_nvidia_smi", lambda *a: smi["topo"] if a[0] == "topo" else None)
  monkeypatch.setattr(harness, "host_gpus", lambda: [{"index": str(i)} for i in range(smi["gpus"])])
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  for n, kind, gpus, want in ((2, "NVIDIA H200", 2, "2x H200 NV18"),
                              (2, "NVIDIA H200", 1, "2x H200 on 1 GPU"),
                              (4, "NVIDIA H200", 2, "4x H200 on 2 GPUs"),
                              (2, "NVIDIA H100 80GB HBM3", 2, "2x H100 80GB HBM3 NV18"),
                              (2, "NVIDIA H200", 0, "2x H200 NV18")):  # no query: the link
    smi["gpus"] = gpus
    monkeypatch.setattr(jax, "devices", lambda n=n, kind=kind: [Dev(kind)] * n)
    assert harness.machine_name(None) == want
    assert harness.machine_name("") == want
  smi["gpus"], smi["topo"] = 2, None  # no nvidia-smi: the devices alone
  assert harness.machine_name(None) == "2x H200"
  smi["topo"] = _TOPO_2
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
  monkeypatch.setattr(jax, "devices", lambda: [Dev("NVIDIA H200")])
  assert harness.machine_name(None) == "1x H200"  # one GPU: no link to name


def test_machine_name_from_the_gpus_each_process_uses(monkeypatch):
  """Trial 37: with 2 processes on GPU 0 of a 2-GPU host (--share_gpu) the name was "2x H200
  NV18", that of the timing results; a one-node SLURM job whose tasks each see only their own
  GPU was "on 1 GPU". The PCI bus ids each process's driver gives decide."""
  class Dev:
    platform = "gpu"
    device_kind = "NVIDIA H200"

  monkeypatch.setattr(jax, "devices", lambda: [Dev()] * 2)
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  monkeypatch.setattr(harness, "_nvidia_smi", lambda *a: _TOPO_2 if a[0] == "topo" else None)
  monkeypatch.setattr(harness, "host_gpus", lambda: [
      {"index": "0", "pci_bus_id": "00000000:19:00.0"},
      {"index": "1", "pci_bus_id": "00000000:3B:00.0"}])
  for gpus, want in (([("h", "0000:19:00.0"), ("h", "0000:19:00.0")], "2x H200 on 1 GPU"),
                     ([("h", "0000:19:00.0"), ("h", "0000:3b:00.0")], "2x H200 NV18"),
                     ([("a", "0000:19:00.0"), ("b", "0000:19:00.0")], "2x H200"),  # 2 hosts
                     ([("h", "0000:19:00.0"), ("h", None)], None)):  # unknown: the fallback
    monkeypatch.setattr(harness, "_RUN_GPUS", gpus)
    if want is not None:
      assert harness.machine_name(None) == want
  assert harness.machine_name(None) == "2x H200 NV18"  # fallback: the first 2 visible GPUs
  assert harness._bus_id("00000000:3B:00.0") == "0000:3b:00.0" == harness._bus_id("0000:3b:00.0")


class _FakeDriver:
  """libcuda's calls as ctypes makes them: two GPUs, and a bus id per ordinal."""
  BUSES = (b"00000000:19:00.0", b"00000000:3B:00.0")

  def cuDeviceGetCount(self, count_ref):
    count_ref._obj.value = len(self.BUSES)
    return 0

  def cuDeviceGet(self, dev_ref, ordinal):
    dev_ref._obj.value = ordinal
    return 0 if ordinal < len(self.BUSES) else 101  # CUDA_ERROR_INVALID_DEVICE

  def cuDeviceGetPCIBusId(self, buf, size, dev):
    buf.value = self.BUSES[dev.value][:size - 1]
    return 0


def test_bus_ids_and_gpu_count_come_from_one_driver_opener(monkeypatch):
  """harness._cuda_bus_ids and launch._driver_gpu_count share launch._cuda_driver."""
  from jaxoverlap import launch

  monkeypatch.setattr(launch, "_cuda_driver", _FakeDriver)
  assert harness._cuda_bus_ids([1, 0, 7]) == ["0000:3b:00.0", "0000:19:00.0", None]
  assert launch._driver_gpu_count() == 2
  monkeypatch.setattr(launch, "_cuda_driver", lambda: None)  # no driver, or cuInit failed
  assert harness._cuda_bus_ids([0, 1]) == [None, None]
  assert launch._driver_gpu_count() is None


def test_processes_sharing_a_gpu_are_refused_before_any_collective(monkeypatch):
  """Seen on one H200: all_reduce.py under --share_gpu waited 60 s for NCCL at every size
  ("Duplicate GPU detected") and rejected every implementation, exit status 1."""
  class Dev:
    def __init__(self, process_index):
      self.process_index = process_index

  monkeypatch.setattr(jax, "devices", lambda: [Dev(0), Dev(1), Dev(2)])
  monkeypatch.setattr(harness, "_RUN_GPUS", [("h", "0000:19:00.0"), ("h", "0000:3b:00.0"),
                                             ("h", "0000:19:00.0")])
  with pytest.raises(SystemExit, match="processes 0 and 2 both drive GPU 0000:19:00.0 on h"):
    harness.refuse_shared_gpus()
  for fine in ([("h", "0000:19:00.0"), ("h", "0000:3b:00.0"), ("h", "0000:5d:00.0")],
               [("a", "0000:19:00.0"), ("b", "0000:19:00.0"), ("c", "0000:19:00.0")],  # hosts
               [("h", None), ("h", None), ("h", None)],  # unknown: nothing to say
               None):  # not gathered (CPU)
    monkeypatch.setattr(harness, "_RUN_GPUS", fine)
    harness.refuse_shared_gpus()
  # One process driving two GPUs that the driver reports alike is not two processes.
  monkeypatch.setattr(jax, "devices", lambda: [Dev(0), Dev(0)])
  monkeypatch.setattr(harness, "_RUN_GPUS", [("h", "0000:19:00.0"), ("h", "0000:19:00.0")])
  harness.refuse_shared_gpus()


def test_results_record_their_provenance(tmp_path, monkeypatch):
  """Trial 36: most files had no commit, no environment (XLA_FLAGS, NCCL_NVLS_ENABLE) and
  nothing on the GPUs, clocks or the libraries loaded."""
  import subprocess

  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
  monkeypatch.setenv("SOME_SECRET_TOKEN", "x")
  result = harness.write_result(str(tmp_path / "r.json"), None, benchmark="probe",
                                machine="2x cpu", method="m", command="c", latency=False)
  prov = json.load(open(tmp_path / "r.json"))["provenance"]
  assert prov == result["provenance"]
  assert set(prov) == {"git", "environment", "host_gpus", "topology", "loaded_versions",
                       "processes", "runtime"}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                        text=True)
  if head.returncode == 0:  # a git checkout (CI's clean clone is one)
    assert prov["git"]["commit"] == head.stdout.strip()
    assert isinstance(prov["git"]["dirty"], bool)
    # The files' tree hash: HEAD's tree where nothing differs from HEAD (CI's clean clone).
    clean = subprocess.run(["git", "-C", root, "status", "--porcelain"], capture_output=True,
                           text=True).stdout.strip() == ""
    tree = subprocess.run(["git", "-C", root, "rev-parse", "HEAD^{tree}"], capture_output=True,
                          text=True).stdout.strip()
    assert len(prov["git"]["tree"]) == 40
    assert (prov["git"]["tree"] == tree) == clean, (prov["git"], clean)
    # The library's folders alone: an untracked results file does not change them.
    for folder in ("ffi", "jaxoverlap"):
      head_folder = subprocess.run(["git", "-C", root, "rev-parse", f"HEAD:{folder}"],
                                   capture_output=True, text=True).stdout.strip()
      same = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", folder],
                            capture_output=True, text=True).stdout.strip() == ""
      assert (prov["git"]["subtrees"][folder] == head_folder) == same, (folder, prov["git"])
  assert prov["environment"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
  assert prov["environment"]["NCCL_NVLS_ENABLE"] == "0"
  assert "SOME_SECRET_TOKEN" not in prov["environment"]
  assert prov["processes"] == 1 and isinstance(prov["host_gpus"], list)


def test_check_merge():
  old = {"machine": "2x H200 NV18", "platform": "gpu", "world": 2,
         "versions": {"jax": "0.11.2"}}
  same = dict(machine="2x H200 NV18", platform="gpu", world=2, jax="0.11.2")
  harness.check_merge(None, "f.json", **same)  # nothing to merge into
  harness.check_merge(old, "f.json", **same)  # a split run of one machine
  for key, value in (("machine", "2x cpu"), ("platform", "cpu"), ("world", 4),
                     ("jax", "0.12.0")):
    with pytest.raises(ValueError, match=f"f.json .*{key} .* there, {value!r} in this run"):
      harness.check_merge(old, "f.json", **dict(same, **{key: value}))
  with pytest.raises(ValueError, match="platform None there"):
    harness.check_merge({k: v for k, v in old.items() if k != "platform"}, "f.json", **same)


# ------------------------------------------------------------------ all_reduce.py


def test_all_reduce_script_cpu_smoke_and_refusal(tmp_path):
  """XLA impls run on CPU devices; CUDA ones are refused in one line before anything runs."""
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  base = [sys.executable, os.path.join(_ROOT, "benchmarks", "all_reduce.py"), "--host_devices",
          "2", "--out", str(tmp_path), "--sizes", "8K", "--reps", "2", "--chain", "2"]
  ok = subprocess.run(base + ["--impls", "xla:psum,jaxoverlap:xla:ppermute"], env=env,
                      capture_output=True, text=True, timeout=300)
  assert ok.returncode == 0, ok.stderr[-3000:]
  result = json.load(open(tmp_path / "all_reduce-2x_cpu-1x2.json"))
  assert result["machine"] == "2x cpu" and not result["rejected"]
  assert {r["impl"] for r in result["records"]} == {"xla:psum", "jaxoverlap:xla:ppermute"}
  for impls, named in ((None, "the default impls"), ("xla:psum,floor:launch", "floor:launch"),
                       ("xla:psum,jaxoverlap:one_shot_ll", "jaxoverlap:one_shot_ll")):
    proc = subprocess.run(base + (["--impls", impls] if impls else []), env=env,
                          capture_output=True, text=True, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith(f"all_reduce.py: {named} run the CUDA extension") and "'cpu'" in last
  assert os.listdir(tmp_path) == ["all_reduce-2x_cpu-1x2.json"]


# ------------------------------------------------------------------ plot_overlap


def _fake_results():
  ag, ar = "all_gather_matmul", "matmul_all_reduce"
  s1, s2 = (16384, 4096, 4096), (2048, 14336, 4096)
  main = [_rec(ag, "xla:local_gemm", 500.0, s1), _rec(ag, "xla:collective", 400.0, s1),
          _rec(ag, "xla:naive", 1000.0, s1), _rec(ag, "xla:ppermute", 900.0, s1),
          _rec(ag, "jaxoverlap:copy_engine", 560.0, s1),
          _rec(ag, "jaxoverlap:copy_engine/c4", 550.0, s1),
          _rec(ag, "jaxoverlap:nvshmem", 600.0, s1),
          _rec(ar, "xla:local_gemm", 200.0, s2), _rec(ar, "xla:naive", 330.0, s2),
          _rec(ar, "jaxoverlap:gemm_all_reduce", 300.0, s2)]
  windowed = [_rec(ag, "xla:local_gemm", 400.0, s1), _rec(ag, "xla:collective", 400.0, s1),
              _rec(ag, "xla:windowed_einsum", 640.0, s1)]
  wrap = lambda recs, name: {"benchmark": name, "machine": "2x H200 NV18", "command": "c",  # noqa
                             "date": "d", "versions": {}, "records": recs}
  return (ovl.add_overlap_metrics(main) and wrap(main, "overlap"),
          wrap(ovl.add_overlap_metrics(windowed), "overlap_windowed_einsum"))


def test_markdown_tables():
  main, windowed = _fake_results()
  text = plot_overlap.markdown_tables(main, windowed)
  lines = text.splitlines()
  ag = next(line for line in lines if line.startswith("| 16384,4096,4096 "))
  # windowed: 640 / 400 = 1.6 x floor, the best XLA variant (naive 2.0, ppermute 1.8); ours
  # copy_engine/c4: 550 / 500 = 1.1 -> 1.6 / 1.1 = 1.45x.
  assert ag == ("| 16384,4096,4096 | 0.500 | 0.400 | 1.000 | 0.900 | 0.640 | 0.550 "
                "(copy_engine/c4) | 0.050 | 88% | 1.45x |")
  ar = next(line for line in lines if line.startswith("| 2048,14336,4096 "))
  assert ar == ("| 2048,14336,4096 | 0.200 | - | 0.330 | - | - | 0.300 (gemm_all_reduce) | "
                "0.100 | - | 1.10x |")
  assert text.index("all_gather_matmul") < text.index("matmul_all_reduce")
  # Without the windowed run, the column is "-" and the best XLA variant is ppermute.
  ag = next(line for line in plot_overlap.markdown_tables(main).splitlines()
            if line.startswith("| 16384"))
  assert "| 0.900 | - | 0.550" in ag and ag.endswith("| 1.64x |")


def test_plot_png(tmp_path):
  main, windowed = _fake_results()
  for result in (main, windowed):
    with open(tmp_path / f"{result['benchmark']}-2x_H200_NV18.json", "w") as f:
      json.dump(result, f)
  loaded, loaded_w = plot_overlap.load(str(tmp_path), "2x H200 NV18")
  assert loaded["records"] == main["records"] and loaded_w["records"] == windowed["records"]
  out = plot_overlap.plot(loaded, loaded_w, str(tmp_path / "sub" / "overlap.png"))
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  os.remove(tmp_path / "overlap_windowed_einsum-2x_H200_NV18.json")
  assert plot_overlap.load(str(tmp_path), "2x_H200_NV18")[1] is None
  with pytest.raises(FileNotFoundError):
    plot_overlap.load(str(tmp_path), "other")


def test_pallas_impls_join_ag_only_and_parse():
  """The Pallas collective matmul: ag's defaults where it applies, named configs only."""
  pallas = ovl.pallas_impls()
  assert pallas and all(ovl.is_pallas(i) and i.startswith(ovl.PALLAS + "/") for i in pallas)
  assert ovl.impls_for("ag", pallas=True)[-len(pallas):] == pallas
  assert not any(ovl.is_pallas(i) for i in ovl.impls_for("ag"))
  assert not any(ovl.is_pallas(i) for i in ovl.impls_for("rs", pallas=True))
  assert ovl.impls_for("ag", requested=[pallas[0], "xla:local_gemm"]) == ["xla:local_gemm",
                                                                          pallas[0]]
  assert ovl.impls_for("ar", requested=[pallas[0], "xla:local_gemm"]) == ["xla:local_gemm"]
  assert ovl.chunks_of(pallas[0]) is None
  with pytest.raises(ValueError, match="unknown Pallas configuration"):
    ovl.impls_for("ag", requested=[ovl.PALLAS + "/m1n1"])
  for impl in pallas:  # every configuration is a valid TuningConfig of this jax
    cfg = ovl.pallas_config(impl)
    assert cfg.tile_k == 64 and cfg.max_concurrent_steps == 4
  with pytest.raises(ValueError, match="unknown Pallas configuration"):
    ovl.pallas_config(ovl.PALLAS + "/m1n1")


def test_pallas_on_cpu_is_an_error_not_a_crash():
  """Off GPUs the Pallas kernel cannot run: run_case records it under rejected."""
  import jax

  mesh = jax.make_mesh((2,), (ovl.AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  impl = ovl.pallas_impls()[0]
  records, rejected, failed = ovl.run_case("ag", (256, 64, 128), ["xla:local_gemm", impl],
                                           mesh=mesh, dtype="bfloat16", chain=2, reps=1,
                                           warmup=0, log=lambda *a: None)
  assert failed == {impl: "ERROR"} and rejected[0]["impl"] == impl
  assert [r["impl"] for r in records] == ["xla:local_gemm"]


def test_plot_all_reduce_out_png_missing_files_and_rejected_sizes(tmp_path):
  """plot_all_reduce.py: --out_png, the benchmarks' machine spelling, a clear error, '-' rows."""
  results = os.path.join(_ROOT, "benchmarks", "results")
  script = os.path.join(_ROOT, "benchmarks", "plot_all_reduce.py")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.path.join(_ROOT, "benchmarks")]))
  png = tmp_path / "a.png"
  ok = subprocess.run([sys.executable, script, "--results", results, "--machine", "2x H200 NV18",
                       "--out_png", str(png)], env=env, capture_output=True, text=True,
                      timeout=300)
  assert ok.returncode == 0 and png.stat().st_size > 0, ok.stderr[-2000:]
  empty = subprocess.run([sys.executable, script, "--results", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
  assert empty.returncode != 0 and "Traceback" not in empty.stderr
  assert f"no all_reduce-2x_H200_NV18-<nodes>x<ranks>.json in {tmp_path}" in empty.stderr
  # A run whose jaxoverlap impls were all rejected: psum alone at its sizes.
  (tmp_path / "all_reduce-2x_cpu-1x2.json").write_text(json.dumps({
      "machine": "2x cpu", "records": [{"impl": "xla:psum", "bytes": 8192, "time_us": 9.5}]}))
  only_psum = subprocess.run([sys.executable, script, "--results", str(tmp_path), "--machine",
                              "2x cpu", "--out_png", str(tmp_path / "b.png")], env=env,
                             capture_output=True, text=True, timeout=300)
  assert only_psum.returncode == 0, only_psum.stderr[-2000:]
  assert "| 8 KiB | - | 9.5 | - |" in only_psum.stdout


@pytest.mark.parametrize("script,args,want", [
    ("all_reduce_floors.py", ["--results", "benchmarks/results/overlap-2x_H200_NV18.json",
                              "--out", "{tmp}"],
     "overlap-2x_H200_NV18.json is a results file of benchmark 'overlap'; this needs one of "
     "benchmark 'all_reduce'"),
    ("compare_loss_curves.py", ["--files", "benchmarks/results/overlap-2x_H200_NV18.json"],
     "this needs one of benchmark 'train_step'"),
    ("plot_decode_floor.py", ["--decode", "nolabel", "--png", "{tmp}/x.png"],
     "--decode: ['nolabel'] are not label=path"),
    ("plot_decode_floor.py", ["--decode", "a=benchmarks/results/overlap-2x_H200_NV18.json",
                              "--png", "{tmp}/x.png"],
     "this needs one of benchmark 'decode'"),
    ("all_reduce_floors.py", ["--results", "{tmp}/missing.json", "--out", "{tmp}"],
     "missing.json: not a readable JSON results file"),
])
def test_analysis_scripts_name_a_wrong_file(tmp_path, script, args, want):
  """The wrong kind of file stops the analysis and plot scripts with one line naming it."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.path.join(_ROOT, "benchmarks")]))
  proc = subprocess.run([sys.executable, os.path.join(_ROOT, "benchmarks", script)]
                        + [a.replace("{tmp}", str(tmp_path)) for a in args], env=env, cwd=_ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert want in proc.stderr, proc.stderr[-2000:]
  assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("*.json"))


def test_all_reduce_check_sees_calls_back_to_back():
  """Trial 36: the all-reduce benchmark checked single calls, never the back-to-back calls of
  the chain it times. An op right on every single call of the check's inputs but wrong on the
  inputs a chain hands it (already summed: the same on every rank) now fails the check."""
  spec = importlib.util.spec_from_file_location(
      "all_reduce_benchmark", os.path.join(_ROOT, "benchmarks", "all_reduce.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  axis = bench.AXIS
  mesh = make_mesh((2,), (axis,))
  x = jax.device_put(np.random.default_rng().standard_normal(2 * 512).astype(np.float32),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis)))
  psum = lambda y: jax.lax.psum(y, axis)  # noqa: E731
  assert bench.check_op(psum, x, mesh) is None

  def skips_when_equal(y):  # no transfer where every rank holds the same data
    same = jax.lax.pmin(jnp.all(jax.lax.pmax(y, axis) == jax.lax.pmin(y, axis)), axis)
    return jnp.where(same, y, psum(y))

  assert "calls back to back in one jit" in bench.check_op(skips_when_equal, x, mesh)
  assert "call 1 of 3" in bench.check_op(lambda y: psum(y) * 1.5, x, mesh)
  assert bench.check_op(lambda y: 1 / 0, x, mesh).startswith("ZeroDivisionError")


def test_psum_in_graphs_follows_command_buffers_turned_off():
  """Trial 39: with XLA_FLAGS turning command buffers off, xla:psum_graphs fell back to a fixed
  list of types and ran inside CUDA graphs while everything else of the run did not."""
  code = ("import harness; print(harness.compile_options('xla:psum_graphs')); "
          "print(harness.compile_options('xla:psum+norm/graphs') is not None, "
          "harness.compile_options('xla:psum'))")
  env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu")
  run = lambda flags: subprocess.run(  # noqa: E731
      [sys.executable, "-c", code], cwd=os.path.join(_ROOT, "benchmarks"), capture_output=True,
      text=True, timeout=120, env=dict(env, XLA_FLAGS=flags))
  off = run("--xla_gpu_enable_command_buffer=")
  assert off.returncode == 0, off.stderr
  assert off.stdout.splitlines() == ["{'xla_gpu_enable_command_buffer': ''}", "True None"]
  on = run("")
  types = eval(on.stdout.splitlines()[0])["xla_gpu_enable_command_buffer"].split(",")  # noqa
  assert "COLLECTIVES" in types and "FUSION" in types and "CUSTOM_CALL" in types
