"""benchmarks/calibrate_fused.py on fixed overlap records: regrets, threshold, GEMM rate, CLI."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jaxoverlap import _cuda

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "calibrate_fused_benchmark", os.path.join(_ROOT, "benchmarks", "calibrate_fused.py"))
cal = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cal
_spec.loader.exec_module(cal)

MIB = 1 << 20


def rec(op, shape, impl, us, **extra):
  return {"op": op, "impl": impl, "dtype": "bfloat16", "shape": list(shape), "world": 2,
          "ranks_per_node": 2, "time_us": us, **extra}


def ar_rows(threshold_bytes):
  """matmul_all_reduce at 1, 4, 16 MiB per rank; the fused kernel wins from threshold_bytes."""
  out = []
  for m in (256, 1024, 4096):  # [M, 2048] bf16 = M * 4 KiB
    shape = (m, 4096, 2048)
    wins = m * 2048 * 2 >= threshold_bytes
    out += [rec("matmul_all_reduce", shape, "jaxoverlap:copy_engine", 90.0 if wins else 110.0,
                chunks=1),
            rec("matmul_all_reduce", shape, "jaxoverlap:gemm_all_reduce", 100.0)]
  return out


def records(rs_auto_us=101.0, threshold_bytes=4 * MIB):
  ag, rs = (16384, 4096, 4096), (16384, 4096, 8192)
  return [
      rec("all_gather_matmul", ag, "xla:local_gemm", 200.0),
      rec("all_gather_matmul", ag, "jaxoverlap:copy_engine", 100.0, chunks=1),
      rec("all_gather_matmul", ag, "jaxoverlap:copy_engine/c1", 100.5),
      rec("all_gather_matmul", ag, "jaxoverlap:copy_engine/c2", 98.0),
      rec("all_gather_matmul", ag, "jaxoverlap:copy_engine/c4", 110.0),
      rec("matmul_reduce_scatter", rs, "jaxoverlap:copy_engine", rs_auto_us, chunks=4),
      rec("matmul_reduce_scatter", rs, "jaxoverlap:copy_engine/c1", 100.0),
      rec("matmul_reduce_scatter", rs, "xla:ppermute", 90.0),  # not a chunk variant: ignored
  ] + ar_rows(threshold_bytes)


def test_auto_against_the_best_chunk_count():
  rows = {r["op"]: r for r in cal.chunk_rows(records(rs_auto_us=120.0))}
  ag, rs = rows["all_gather_matmul"], rows["matmul_reduce_scatter"]
  assert (ag["best_chunks"], ag["best_us"], ag["regret"]) == (2, 98.0, round(100 / 98 - 1, 4))
  assert (rs["best_chunks"], rs["regret"]) == (1, 0.2)
  assert ag["times_us"] == {"1": 100.5, "2": 98.0, "4": 110.0}
  # auto faster than every variant: its own chunk count is the best, regret 0
  fast = {r["op"]: r for r in cal.chunk_rows(records(rs_auto_us=95.0))}
  assert (fast["matmul_reduce_scatter"]["best_chunks"],
          fast["matmul_reduce_scatter"]["regret"]) == (4, 0.0)


@pytest.mark.parametrize("threshold", [1 * MIB, 4 * MIB, 16 * MIB])
def test_all_reduce_threshold_is_the_smallest_size_won_from_there_on(threshold):
  rows = cal.all_reduce_rows(records(threshold_bytes=threshold), world=2)
  assert [r["out_bytes"] for r in rows] == [1 * MIB, 4 * MIB, 16 * MIB]
  assert cal.all_reduce_threshold(rows) == threshold


def test_all_reduce_threshold_needs_a_win_at_every_larger_size():
  rows = cal.all_reduce_rows(records(threshold_bytes=1 * MIB), world=2)
  rows[1]["fused_wins"] = False  # loses at 4 MiB, wins at 1 and 16
  assert cal.all_reduce_threshold(rows) == 16 * MIB
  rows[2]["fused_wins"] = False
  assert cal.all_reduce_threshold(rows) is None


def test_gemm_rate_is_the_per_rank_rate_of_the_local_gemm():
  # 2 * 16384 * 4096 * 4096 / 2 ranks in 200 us
  assert cal.gemm_rate(records(), world=2) == pytest.approx(2 * 16384 * 4096 * 4096 / 2 / 200e-6)


def test_analyze_says_when_the_constants_need_to_change():
  current = _cuda.FUSED_ALL_REDUCE_MIN_BYTES
  good = cal.analyze([{"world": 2, "records": records(threshold_bytes=current)}], 0.05)
  assert not good["changes_needed"] and good["recommended"]["FUSED_ALL_REDUCE_MIN_BYTES"] == current
  slow = cal.analyze([{"world": 2, "records": records(rs_auto_us=120.0,
                                                       threshold_bytes=current)}], 0.05)
  assert slow["changes_needed"]
  assert slow["shapes_over_regret_limit"] == [("matmul_reduce_scatter", [16384, 4096, 8192])]
  other = cal.analyze([{"world": 2, "records": records(threshold_bytes=16 * MIB)}], 0.05)
  assert other["changes_needed"] and other["recommended"]["FUSED_ALL_REDUCE_MIN_BYTES"] == 16 * MIB
  with pytest.raises(ValueError, match="different world sizes"):
    cal.analyze([{"world": 2, "records": []}, {"world": 4, "records": []}], 0.05)


def test_command_line(tmp_path):
  current = _cuda.FUSED_ALL_REDUCE_MIN_BYTES
  base = {"benchmark": "overlap", "machine": "cpu test", "world": 2, "command": "c", "date": "d"}
  a, b = tmp_path / "a.json", tmp_path / "b.json"
  a.write_text(json.dumps({**base, "records": records(threshold_bytes=current)[:8]}))
  b.write_text(json.dumps({**base, "records": ar_rows(current)}))
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cmd = [sys.executable, os.path.join(_ROOT, "benchmarks", "calibrate_fused.py"),
         "--results", f"{a},{b}", "--out", str(tmp_path / "out")]
  ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
  assert ok.returncode == 0, ok.stdout + ok.stderr
  assert "| all_gather_matmul | 16384x4096x4096 | 1 | 100.0 | 2 | 98.0 | 2.0% |" in ok.stdout
  result = json.load(open(tmp_path / "out" / "fused_calibration-cpu_test.json"))
  assert result["benchmark"] == "fused_calibration" and len(result["sources"]) == 2
  assert result["recommended"]["FUSED_ALL_REDUCE_MIN_BYTES"] == current
  b.write_text(json.dumps({**base, "records": ar_rows(16 * MIB)}))
  changed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
  assert changed.returncode == 1 and "CHANGES NEEDED" in changed.stdout
