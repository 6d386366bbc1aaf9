"""benchmarks/train_step.py: the loss-curve comparison, the records, and a CPU run of the script.

The end-to-end run trains the "tiny" preset for 4 steps twice with the same
backend ("xla,xla"): the two runs are the same program on the same data, so
their loss curves must be identical (difference 0, within tolerance).
"""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import pytest

from jaxoverlap import dispatch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))  # the scripts import their harness
_PATH = os.path.join(_ROOT, "benchmarks", "train_step.py")
_spec = importlib.util.spec_from_file_location("train_step_benchmark", _PATH)
ts = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ts
_spec.loader.exec_module(ts)


def _curve(losses, every=10):
  return [[every * (i + 1), v] for i, v in enumerate(losses)]


# ------------------------------------------------------------------ comparison


def test_tolerance_is_absolute_below_one_and_relative_above():
  assert ts.tolerance(0.5) == pytest.approx(0.02)
  assert ts.tolerance(1.0) == pytest.approx(0.02)
  assert ts.tolerance(4.0) == pytest.approx(0.08)
  assert ts.tolerance(-3.0) == pytest.approx(0.06)


def test_identical_curves_differ_by_zero():
  ref = _curve([5.5, 4.0, 3.1, 2.5])
  c = ts.compare_curves(ref, [list(p) for p in ref])
  assert c["common_steps"] == 4
  assert c["max_abs_loss_diff"] == 0.0 and c["worst_diff_over_tolerance"] == 0.0
  assert c["within_tolerance"]
  assert c["final_step"] == 40 and c["final_loss"] == c["final_loss_ref"] == 2.5


def test_small_bf16_like_drift_is_within_tolerance():
  ref = _curve([5.5, 4.0, 3.1, 2.5, 0.8])
  # 1.5 % at loss >= 1, 0.015 absolute below 1: inside 0.02 * max(1, |loss|).
  other = _curve([5.5 * 1.015, 4.0 * 0.985, 3.1 * 1.015, 2.5 * 0.99, 0.8 + 0.015])
  c = ts.compare_curves(ref, other)
  assert c["within_tolerance"]
  assert c["max_abs_loss_diff"] == pytest.approx(5.5 * 0.015)
  assert c["step_of_max_diff"] == 10
  assert 0.7 < c["worst_diff_over_tolerance"] <= 1.0


def test_one_point_beyond_tolerance_fails():
  ref = _curve([5.5, 4.0, 3.1, 0.5])
  other = _curve([5.5, 4.0, 3.1, 0.5 + 0.03])  # 0.03 > 0.02 (loss below 1: absolute)
  c = ts.compare_curves(ref, other)
  assert not c["within_tolerance"]
  assert c["step_of_max_diff"] == 40
  assert c["max_abs_loss_diff"] == pytest.approx(0.03)
  assert c["worst_diff_over_tolerance"] == pytest.approx(1.5)


def test_only_common_steps_are_compared():
  ref = [[1, 5.0], [2, 4.0], [3, 3.0]]
  other = [[2, 4.01], [3, 3.02], [4, 100.0]]  # step 4 has no reference point
  c = ts.compare_curves(ref, other)
  assert c["common_steps"] == 2 and c["final_step"] == 3
  assert c["within_tolerance"]
  assert c["max_abs_loss_diff"] == pytest.approx(0.02)


def test_no_common_step_or_nan_is_not_within_tolerance():
  assert not ts.compare_curves([[1, 5.0]], [[2, 5.0]])["within_tolerance"]
  assert ts.compare_curves([[1, 5.0]], [[2, 5.0]])["common_steps"] == 0
  c = ts.compare_curves([[1, 5.0], [2, 4.0]], [[1, 5.0], [2, math.nan]])
  assert not c["within_tolerance"] and math.isnan(c["max_abs_loss_diff"])


def _metrics(backend, resolved, step_ms, tp=2):
  return {
      "config": {"backend": backend, "algorithm": "auto", "dtype": "bfloat16", "d_model": 64,
                 "n_layers": 2, "n_heads": 4, "d_ff": 256, "seq_len": 32, "batch_size": 8,
                 "sequence_parallel": True},
      "mesh": {"dp": 1, "tp": tp, "devices": tp, "platform": "gpu", "processes": tp},
      "backend": {"requested": backend, "resolved": resolved},
      "step_time_ms": step_ms, "tokens_per_s": 1.0, "first_step_s": 2.0, "train_loss": 3.0,
      "val_loss": 3.1, "steps": 30, "num_params": 1000,
  }


def _two_records(preset="gpu_small"):
  xla = {op: "xla" for op in ("all_reduce", "all_gather_matmul")}
  cuda = {"all_reduce": "cuda+xla", "all_gather_matmul": "cuda"}  # the example's resolved
  h_ref = {"train": _curve([5.0, 4.0, 3.0]), "val": [[0, 5.6]]}
  h_new = {"train": _curve([5.0, 4.01, 3.02]), "val": [[0, 5.6]]}
  return (ts.make_record(preset, _metrics("xla", xla, 120.0), h_ref),
          ts.make_record(preset, _metrics("cuda", cuda, 100.0), h_new))


def test_records_and_comparison_of_two_runs():
  r_ref, r_new = _two_records()
  assert r_ref["impl"] == "xla:xla" and r_new["impl"] == "jaxoverlap:cuda"
  assert r_ref["op"] == "train_step" and r_ref["dtype"] == "bfloat16"
  assert r_ref["time_us"] == pytest.approx(120000.0) and r_ref["world"] == 2
  assert r_ref["final_train_loss"] == 3.0 and r_new["final_train_loss"] == 3.02
  assert r_new["loss_curve"] == _curve([5.0, 4.01, 3.02])
  for key in ("preset", "d_model", "n_layers", "seq_len", "batch_size", "tp",
              "sequence_parallel"):
    assert key in r_ref["shape"], key
  assert r_ref["shape"]["preset"] == "gpu_small" and r_ref["shape"]["tp"] == 2
  assert r_new["resolved"] == {"all_reduce": "cuda+xla", "all_gather_matmul": "cuda"}
  auto = ts.make_record("p", _metrics("auto", {"all_reduce": "xla"}, 1.0), {"train": []})
  assert auto["impl"] == "xla:auto" and auto["fused_decisions"] == []

  (c,) = ts.compare_runs([r_ref, r_new])
  assert c["preset"] == "gpu_small"
  assert c["reference"] == "xla:xla" and c["impl"] == "jaxoverlap:cuda"
  assert c["speedup"] == pytest.approx(1.2)
  assert c["within_tolerance"] and c["max_abs_loss_diff"] == pytest.approx(0.02)
  assert c["step_time_ms_ref"] == pytest.approx(120.0) and c["step_time_ms"] == 100.0
  table = ts.summary_table([r_ref, r_new], [c])
  assert "1.200x" in table and "(ref)" in table and "| yes |" in table
  assert ts.compare_runs([]) == [] and ts.compare_runs([r_ref]) == []


def test_merge_keeps_other_presets_and_replaces_rerun_ones():
  small, large = _two_records("gpu_small"), _two_records("gpu_large")
  newer = ts.make_record("gpu_small", {**_metrics("xla", {}, 90.0)}, {"train": _curve([4.0])})
  merged = ts.merge_records(list(small) + list(large), [newer])
  assert [(r["shape"]["preset"], r["time_us"]) for r in merged] == [
      ("gpu_large", 120000.0), ("gpu_large", 100000.0), ("gpu_small", 90000.0)]
  assert [c["preset"] for c in ts.compare_all(list(small) + list(large))] == [
      "gpu_small", "gpu_large"]


def test_write_results_and_merge(tmp_path):
  small, large = _two_records("gpu_small"), _two_records("gpu_large")
  path, png, result = ts.write_results(str(tmp_path), "a b", list(small), command="c")
  assert path.endswith("train_step-a_b.json") and os.path.getsize(png) > 1000
  assert [c["preset"] for c in result["comparison"]] == ["gpu_small"]
  _, _, result = ts.write_results(str(tmp_path), "a b", list(large), command="c", merge=True)
  with open(path) as f:
    on_disk = json.load(f)
  assert on_disk == json.loads(json.dumps(result))
  assert [r["shape"]["preset"] for r in on_disk["records"]] == ["gpu_small"] * 2 + [
      "gpu_large"] * 2
  assert [c["preset"] for c in on_disk["comparison"]] == ["gpu_small", "gpu_large"]
  _, _, result = ts.write_results(str(tmp_path), "a b", list(large), command="c")
  assert [c["preset"] for c in result["comparison"]] == ["gpu_large"]  # no merge: replaced


def test_plot_writes_a_png(tmp_path):
  r_ref, r_new = _two_records()
  r_new["time_us"] = None
  lone = ts.make_record("tiny", _metrics("xla", {}, 5.0), {"train": []})
  path = str(tmp_path / "p.png")
  ts.plot(path, [r_ref, r_new, lone], "title")
  assert os.path.getsize(path) > 1000


# ------------------------------------------------------------------ end to end


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_script_end_to_end_on_cpu(tmp_path):
  out, workdir = tmp_path / "out", tmp_path / "work"
  (workdir / "tiny-0-xla" / "stale").mkdir(parents=True)  # must be deleted: no resume
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXOVERLAP_")}
  env.setdefault("JAX_PLATFORMS", "cpu")
  cmd = [sys.executable, _PATH, "--presets", "tiny", "--steps", "4", "--backends", "xla,xla",
         "--mesh", "4,2", "--workdir", str(workdir), "--out", str(out), "--machine", "cpu test"]
  proc = subprocess.run(cmd, env=env, cwd=_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "| tiny | xla:xla |" in proc.stdout

  path = out / "train_step-cpu_test.json"
  png = out / "train_step-cpu_test.png"
  assert png.stat().st_size > 1000
  result = json.loads(path.read_text())
  for key in ("benchmark", "machine", "command", "date", "versions", "method", "records",
              "comparison"):
    assert key in result, key
  assert result["benchmark"] == "train_step" and result["machine"] == "cpu test"
  records = result["records"]
  assert [r["impl"] for r in records] == ["xla:xla", "xla:xla"]
  for r in records:
    assert r["op"] == "train_step" and r["steps"] == 4 and r["world"] == 1
    assert r["dtype"] == "float32" and r["time_us"] > 0
    assert r["shape"]["preset"] == "tiny" and r["shape"]["tp"] == 2 and r["shape"]["dp"] == 4
    assert math.isfinite(r["final_train_loss"])
    # What ran, from the plans of the run: every op on xla, no fused kernel.
    assert r["resolved"] and set(r["resolved"].values()) == {"xla"}, r["resolved"]
    assert r["fused_decisions"] == []
    # Steps 2-4, one log window each (tiny logs every step; step 1 compiles, untimed).
    assert r["time_us_windows"] == 3
    assert 0 < r["time_us_p10"] <= r["time_us_median"] <= r["time_us_p90"]
  (c,) = result["comparison"]
  assert c["preset"] == "tiny" and c["common_steps"] == 4  # log_every 1 in tiny
  assert records[0]["loss_curve"] == records[1]["loss_curve"]
  assert [st for st, _ in records[0]["loss_curve"]] == [1, 2, 3, 4]
  assert c["max_abs_loss_diff"] == 0.0 and c["within_tolerance"]
  assert c["speedup"] > 0
  assert not (workdir / "tiny-0-xla" / "stale").exists()
  assert not (workdir / "tiny-0-xla" / "checkpoints").exists()  # deleted after the run
  history = json.loads((workdir / "tiny-1-xla" / "history.json").read_text())
  assert [st for st, _ in history["step_ms"]] == [2, 3, 4]
  assert all(ms > 0 for _, ms in history["step_ms"])
  # Trial 41: the fetch right after the compiling step (a window without steps) went into the
  # mean, which then lay above its windows' p90. The mean is now the windows' own (one step
  # each here).
  mean_ms = sum(ms for _, ms in history["step_ms"]) / 3
  assert records[1]["time_us"] == pytest.approx(mean_ms * 1e3, abs=0.06)


def test_window_spread_over_the_log_windows():
  """Trial 36: the training benchmark kept one mean per run and no spread."""
  spread = ts.window_spread_us([[10, 2.0], [20, 1.0], [30, 3.0], [40, 4.0], [50, 5.0]])
  assert spread == {"time_us_windows": 5, "time_us_median": 3000.0, "time_us_p10": 1400.0,
                    "time_us_p90": 4600.0}
  assert ts.window_spread_us([[7, 0.25]]) == {"time_us_windows": 1, "time_us_median": 250.0,
                                               "time_us_p10": 250.0, "time_us_p90": 250.0}
  # No timed window (nothing trained after the first step, or an older history.json).
  assert ts.window_spread_us([]) == {"time_us_windows": 0}
  record = ts.make_record("gpu_small", _metrics("xla", {}, 90.0), {"train": _curve([4.0])})
  assert record["time_us_windows"] == 0 and "time_us_p10" not in record
  assert "| - |" in ts.summary_table([record], [])
  timed = ts.make_record("gpu_small", _metrics("xla", {}, 90.0),
                         {"train": _curve([4.0]), "step_ms": [[2, 80.0], [3, 100.0]]})
  assert "| 82.00-98.00 (2) |" in ts.summary_table([timed], [])


def test_record_keeps_each_distinct_fused_plan_once():
  """The run's plans (jaxoverlap.decisions()) as the record's fused_decisions."""
  import harness

  geo = dispatch.Geometry(outer=16, rows=1024, k=4096, n=6144, payload_bytes=1, pieces=16,
                          chunk_bytes=1, gemm_flops=1.0)
  ag = dispatch.Plan(op="all_gather_matmul", axis_name="tp", shapes=((16, 1024, 4096),),
                     dtype="bfloat16", nbytes=1, num_ranks=2, backend="cuda", algorithm="fused",
                     why=(("chunks", "rule: from the shapes"),), transport="copy_engine",
                     chunks=2, geometry=geo)
  rs = dataclasses.replace(ag, op="matmul_reduce_scatter", chunks=1, why=(("chunks", "requested"),))
  xla = dataclasses.replace(ag, backend="xla", algorithm="collective", transport=None)
  record = ts.make_record("gpu_small", _metrics("cuda", {}, 100.0), {"train": _curve([4.0])},
                          harness.fused_choices([ag, rs, ag, dataclasses.replace(ag, axis_name="o"),
                                                 xla]))
  shape = {"outer": 16, "rows": 1024, "k": 4096, "n": 6144}
  assert record["fused_decisions"] == [
      {"op": "all_gather_matmul", "transport": "copy_engine", "chunks": 2,
       "chunks_source": "auto", "shape": shape},
      {"op": "matmul_reduce_scatter", "transport": "copy_engine", "chunks": 1,
       "chunks_source": "requested", "shape": shape}]
