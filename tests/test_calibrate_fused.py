"""benchmarks/calibrate_fused.py on fixed overlap records: regrets, threshold, GEMM rate, CLI."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jaxoverlap import dispatch
from jaxoverlap.tuning import policy

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))  # the scripts import their harness
_spec = importlib.util.spec_from_file_location(
    "calibrate_fused_benchmark", os.path.join(_ROOT, "benchmarks", "calibrate_fused.py"))
cal = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cal
_spec.loader.exec_module(cal)

MIB = 1 << 20
AG, RS = (16384, 4096, 4096), (16384, 4096, 8192)


def rec(op, shape, impl, us, **extra):
  return {"op": op, "impl": impl, "dtype": "bfloat16", "shape": list(shape), "world": 2,
          "ranks_per_node": 2, "time_us": us, **extra}


AR_SIZES = sorted({1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, policy.FUSED_ALL_REDUCE_MIN_BYTES})


def ar_rows(threshold_bytes, tie_bytes=None):
  """matmul_all_reduce at AR_SIZES per rank, one chunk; the fused kernel wins from threshold_bytes.

  At tie_bytes the two are 2% apart (fused slower), within the 5% limit.
  """
  out = []
  for m in (b // 4096 for b in AR_SIZES):  # [M, 2048] bf16 = M * 4 KiB
    shape = (m, 4096, 2048)
    wins = m * 2048 * 2 >= threshold_bytes
    fused = 102.0 if m * 4096 == tie_bytes else 90.0 if wins else 110.0
    out += [rec("matmul_all_reduce", shape, "jaxoverlap:copy_engine", fused, chunks=1),
            rec("matmul_all_reduce", shape, "jaxoverlap:gemm_all_reduce", 100.0)]
  return out


def records(rs_auto_us=101.0, threshold_bytes=4 * MIB):
  return [
      rec("all_gather_matmul", AG, "xla:local_gemm", 200.0),
      rec("all_gather_matmul", AG, "jaxoverlap:copy_engine", 100.0, chunks=1),
      rec("all_gather_matmul", AG, "jaxoverlap:copy_engine/c1", 100.5),
      rec("all_gather_matmul", AG, "jaxoverlap:copy_engine/c2", 98.0),
      rec("all_gather_matmul", AG, "jaxoverlap:copy_engine/c4", 110.0),
      rec("matmul_reduce_scatter", RS, "jaxoverlap:copy_engine", rs_auto_us, chunks=4),
      rec("matmul_reduce_scatter", RS, "jaxoverlap:copy_engine/c1", 100.0),
      rec("matmul_reduce_scatter", RS, "xla:ppermute", 90.0),  # not a chunk variant: ignored
  ] + ar_rows(threshold_bytes)


@pytest.fixture
def rule(monkeypatch):
  """Pins policy.fused_chunks to {op: chunks} (default AG 1, RS 4, AR 1); returns the dict."""
  picks = {"all_gather_matmul": 1, "matmul_reduce_scatter": 4, "matmul_all_reduce": 1}
  monkeypatch.setattr(policy, "fused_chunks",
                      lambda op, payload_bytes, pieces, gemm_flops: picks[op])
  return picks


def test_measurements_count_auto_under_its_chunk_count():
  m = cal.measurements(records() + records(rs_auto_us=120.0))
  assert m[("all_gather_matmul", AG)]["chunks"] == {1: [100.0, 100.5] * 2, 2: [98.0] * 2,
                                                   4: [110.0] * 2}
  assert m[("matmul_reduce_scatter", RS)]["chunks"] == {4: [101.0, 120.0], 1: [100.0, 100.0]}
  assert m[("matmul_reduce_scatter", RS)]["xla:ppermute"] == [90.0, 90.0]


def test_rule_against_the_best_chunk_count(rule):
  rows = {r["op"]: r for r in cal.chunk_rows(records(rs_auto_us=120.0), world=2)}
  ag, rs = rows["all_gather_matmul"], rows["matmul_reduce_scatter"]
  # AG's one chunk: the median of auto's 100.0 and c1's 100.5; the best is c2
  assert ag["times_us"] == {"1": 100.25, "2": 98.0, "4": 110.0}
  assert ag["counts"] == {"1": 2, "2": 1, "4": 1}
  assert (ag["rule_chunks"], ag["rule_us"]) == (1, 100.25)
  assert (ag["best_chunks"], ag["best_us"]) == (2, 98.0)
  assert ag["regret"] == round(100.25 / 98 - 1, 4)
  assert (rs["rule_chunks"], rs["rule_us"], rs["best_chunks"], rs["regret"]) == (4, 120.0, 1, 0.2)
  rule["all_gather_matmul"] = 2  # the best: no regret
  assert {r["op"]: r["regret"] for r in cal.chunk_rows(records(), world=2)}[
      "all_gather_matmul"] == 0.0
  rule["all_gather_matmul"] = 8  # never measured
  ag8 = {r["op"]: r for r in cal.chunk_rows(records(), world=2)}["all_gather_matmul"]
  assert ag8["rule_us"] is None and ag8["regret"] is None


def test_times_are_medians_over_runs(rule):
  runs = records(rs_auto_us=120.0) + records(rs_auto_us=101.0) + records(rs_auto_us=103.0)
  rs = {r["op"]: r for r in cal.chunk_rows(runs, world=2)}["matmul_reduce_scatter"]
  assert (rs["rule_us"], rs["counts"]) == (103.0, {"1": 3, "4": 3})


def test_rule_inputs_are_the_dispatchers_values():
  # AG 16384x4096x4096 on 2 ranks: shard [8192, 4096], local GEMM 8192x4096x2048
  assert cal.rule_inputs("all_gather_matmul", (16384, 4096, 4096), 2) == {
      "payload_bytes": 64 * MIB, "pieces": 8192, "gemm_flops": 2.0 * 8192 * 4096 * 2048}
  # RS/AR 2048x14336x4096: x [2048, 7168], block [1024, 4096] (8 MiB), its GEMM 1024x7168x4096
  for op in ("matmul_reduce_scatter", "matmul_all_reduce"):
    assert cal.rule_inputs(op, (2048, 14336, 4096), 2) == {
        "payload_bytes": 8 * MIB, "pieces": 1024, "gemm_flops": 2.0 * 1024 * 7168 * 4096}
  # The same as dispatch.geometry of the per-rank operands a call of the op would see.
  geo = dispatch.geometry("matmul_reduce_scatter", (2048, 7168), (7168, 4096), 0, 2, 2)
  assert (geo.chunk_bytes, geo.pieces, geo.gemm_flops) == (8 * MIB, 1024, 2.0 * 1024 * 7168 * 4096)


def test_chunk_rows_use_the_real_rule():
  rows = {r["op"]: r for r in cal.chunk_rows(records(), world=2)}
  for op, shape in (("all_gather_matmul", AG), ("matmul_reduce_scatter", RS)):
    assert rows[op]["rule_chunks"] == policy.fused_chunks(op, **cal.rule_inputs(op, shape, 2))


def test_repeat_spread_is_per_configuration():
  # AG c1: auto 100.0 and c1 100.5; RS c4 101 and 120 over two runs; RS c1 100 twice
  runs = [r for r in records() + records(rs_auto_us=120.0) if r["op"] != "matmul_all_reduce"]
  assert sorted(cal.repeat_spread(runs)) == sorted([
      round(100.5 / 100 - 1, 4),  # AG one chunk (4 measurements)
      0.0, 0.0,                   # AG c2 and c4, twice each
      round(120 / 101 - 1, 4),    # RS four chunks
      0.0])                       # RS c1


@pytest.mark.parametrize("threshold", [1 * MIB, 4 * MIB, 16 * MIB])
def test_all_reduce_threshold_is_the_smallest_size_won_from_there_on(rule, threshold):
  recs = records(threshold_bytes=threshold)
  rows = cal.all_reduce_rows(cal.chunk_rows(recs, world=2), recs)
  assert [r["out_bytes"] for r in rows] == AR_SIZES
  assert cal.all_reduce_threshold(rows) == threshold


def test_all_reduce_rows_need_the_rules_chunk_count(rule):
  rule["matmul_all_reduce"] = 2  # the sweep measured one chunk only
  recs = records()
  assert cal.all_reduce_rows(cal.chunk_rows(recs, world=2), recs) == []


def test_all_reduce_threshold_needs_a_win_at_every_larger_size(rule):
  recs = records(threshold_bytes=1 * MIB)
  rows = cal.all_reduce_rows(cal.chunk_rows(recs, world=2), recs)
  rows[1]["fused_wins"] = False  # loses at 4 MiB, wins at 1 and from 16 on
  assert cal.all_reduce_threshold(rows) == 16 * MIB
  rows[-1]["fused_wins"] = False  # loses at the largest size
  assert cal.all_reduce_threshold(rows) is None


def test_gemm_rate_is_the_per_rank_rate_of_the_local_gemm():
  # 2 * 16384 * 4096 * 4096 / 2 ranks in 200 us
  assert cal.gemm_rate(records(), world=2) == pytest.approx(2 * 16384 * 4096 * 4096 / 2 / 200e-6)


def _other_threshold(current):
  return 4 * MIB if current != 4 * MIB else 16 * MIB


def test_analyze_says_when_the_constants_need_to_change(rule):
  current = policy.FUSED_ALL_REDUCE_MIN_BYTES
  good = cal.analyze([{"world": 2, "records": records(threshold_bytes=current)}], 0.05)
  assert not good["changes_needed"] and good["recommended"]["FUSED_ALL_REDUCE_MIN_BYTES"] == current
  assert good["rule_unmeasured"] == [] and good["repeat_spread"]["configurations"] == 1
  slow = cal.analyze([{"world": 2, "records": records(rs_auto_us=120.0,
                                                       threshold_bytes=current)}], 0.05)
  assert slow["changes_needed"]
  assert slow["shapes_over_regret_limit"] == [("matmul_reduce_scatter", list(RS))]
  other = _other_threshold(current)
  moved = cal.analyze([{"world": 2, "records": records(threshold_bytes=other)}], 0.05)
  assert moved["changes_needed"] and moved["recommended"]["FUSED_ALL_REDUCE_MIN_BYTES"] == other
  # A size just below the current threshold where the two tie (2% apart) fits either way.
  below = max(b for b in AR_SIZES if b < current)
  tie = [r for r in records(threshold_bytes=current) if r["op"] != "matmul_all_reduce"]
  tie += ar_rows(current, tie_bytes=below)
  tied = cal.analyze([{"world": 2, "records": tie}], 0.05)
  assert not tied["changes_needed"]
  assert [r["out_bytes"] for r in tied["all_reduce"] if r["tie"]] == [below]
  # A rule that picks a count no sweep measured is listed, not counted as a regret.
  rule.update({"all_gather_matmul": 8, "matmul_reduce_scatter": 8})
  blind = cal.analyze([{"world": 2, "records": records(threshold_bytes=current)}], 0.05)
  assert len(blind["rule_unmeasured"]) == 2 and blind["shapes_over_regret_limit"] == []
  with pytest.raises(ValueError, match="different world sizes"):
    cal.analyze([{"world": 2, "records": []}, {"world": 4, "records": []}], 0.05)


def test_command_line(tmp_path):
  """The real rule on records that measure every chunk count it can pick (1 and 2)."""
  current = policy.FUSED_ALL_REDUCE_MIN_BYTES
  base = {"benchmark": "overlap", "machine": "cpu test", "world": 2, "command": "c", "date": "d"}
  chunked = [rec("matmul_reduce_scatter", RS, "jaxoverlap:copy_engine/c2", 99.0)]
  ar = ar_rows(current)
  ar += [dict(r, impl="jaxoverlap:copy_engine/c2") for r in ar if "copy_engine" in r["impl"]]
  a, b = tmp_path / "a.json", tmp_path / "b.json"
  a.write_text(json.dumps({**base, "records": records(threshold_bytes=current)[:8] + chunked}))
  b.write_text(json.dumps({**base, "records": ar}))
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = [sys.executable, os.path.join(_ROOT, "benchmarks", "calibrate_fused.py"),
         "--results", f"{a},{b}", "--out", str(tmp_path / "out")]
  ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
  k = policy.fused_chunks("all_gather_matmul", **cal.rule_inputs("all_gather_matmul", AG, 2))
  us = {1: 100.25, 2: 98.0}[k]
  assert (f"| all_gather_matmul | 16384x4096x4096 | {k} | {us:.1f} | 2 | 98.0 | "
          f"{100 * (us / 98.0 - 1):.1f}% |") in ok.stdout, ok.stdout + ok.stderr
  assert "repeat spread" in ok.stdout
  result = json.load(open(tmp_path / "out" / "fused_calibration-cpu_test.json"))
  assert result["benchmark"] == "fused_calibration" and len(result["sources"]) == 2
  assert result["recommended"]["FUSED_ALL_REDUCE_MIN_BYTES"] == current
  assert ok.returncode == (1 if result["shapes_over_regret_limit"] else 0), ok.stdout
  b.write_text(json.dumps({**base, "records": ar_rows(_other_threshold(current))}))
  changed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
  assert changed.returncode == 1 and "CHANGES NEEDED" in changed.stdout


def test_losing_everywhere_below_the_threshold_is_consistent(rule):
  """Decode-size sweeps only: the fused kernel loses at every size, all below the constant."""
  current = policy.FUSED_ALL_REDUCE_MIN_BYTES
  small = [r for r in ar_rows(current) if r["shape"][0] * 4096 < current]
  report = cal.analyze([{"world": 2, "records": small}], 0.05)
  assert report["recommended"]["FUSED_ALL_REDUCE_MIN_BYTES"] is None
  assert not report["changes_needed"]
  assert report["constants_from"] == policy.__file__
  assert report["current"]["FUSED_ALL_REDUCE_MIN_BYTES"] == policy.FUSED_ALL_REDUCE_MIN_BYTES


def test_rule_inputs_follow_the_records_dtype(monkeypatch):
  seen = []
  monkeypatch.setattr(policy, "fused_chunks",
                      lambda op, payload_bytes, pieces, gemm_flops: seen.append(payload_bytes) or 1)
  f32 = [dict(r, dtype="float32") for r in records() if r["op"] == "all_gather_matmul"]
  cal.chunk_rows(f32, world=2)
  assert seen == [8192 * 4096 * 4]  # the shard [8192, 4096] in float32


@pytest.mark.parametrize("content", [
    {"benchmark": "all_reduce", "machine": "m", "world": 2,
     "records": [{"op": "all_reduce", "impl": "xla:psum", "time_us": 5.0, "bytes": 8192}]},
    {"benchmark": "overlap", "machine": "m", "world": 2,
     "records": [rec("all_gather_matmul", (16384, 4096, 4096), "xla:local_gemm", 90.0)]},
], ids=["no_overlap_records", "nothing_measured"])
def test_command_line_refuses_an_empty_analysis(tmp_path, content):
  """Not "consistent" (exit 0) where nothing was checked: an error, and no JSON written."""
  a = tmp_path / "a.json"
  a.write_text(json.dumps(content))
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.join(_ROOT, "benchmarks", "calibrate_fused.py"),
                         "--results", str(a), "--out", str(tmp_path / "out")], env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert ("no overlap records" if content["benchmark"] == "all_reduce"
          else "nothing measured") in proc.stderr, proc.stderr[-2000:]
  assert str(a) in proc.stderr and not (tmp_path / "out").exists()
