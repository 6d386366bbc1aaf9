"""benchmarks/compare_loss_curves.py on small train_step files: pairs, differences, CLI."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))  # the scripts import their harness
_spec = importlib.util.spec_from_file_location(
    "compare_loss_curves", os.path.join(_ROOT, "benchmarks", "compare_loss_curves.py"))
clc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(clc)


def _record(preset, impl, losses, dp=1, tp=2):
  return {"impl": impl, "shape": {"preset": preset, "dp": dp, "tp": tp},
          "loss_curve": [[10 * (i + 1), v] for i, v in enumerate(losses)]}


def _files():
  main = {"benchmark": "train_step",
          "records": [_record("small", "xla:xla", [5.0, 4.0, 3.0]),
                      _record("small", "jaxoverlap:cuda", [5.0, 4.05, 3.01]),
                      _record("large", "xla:xla", [6.0, 5.0])]}
  repeat = {"benchmark": "train_step", "records": [_record("small", "xla:xla", [5.0, 4.2, 3.0])]}
  return {"main": main, "repeat": repeat}


def test_file_tag():
  assert clc.file_tag("r/train_step-2x_H200_NV18.json") == "main"
  assert clc.file_tag("r/train_step_dp2_control-2x_H200_NV18.json") == "dp2_control"


def test_every_pair_of_one_preset():
  rows = clc.pair_rows(clc.runs_by_preset(_files()))
  assert [(r["a"], r["b"]) for r in rows] == [
      ("main:xla:xla (dp1 tp2)", "main:jaxoverlap:cuda (dp1 tp2)"),
      ("main:xla:xla (dp1 tp2)", "repeat:xla:xla (dp1 tp2)"),
      ("main:jaxoverlap:cuda (dp1 tp2)", "repeat:xla:xla (dp1 tp2)")]
  first, second, third = rows
  assert first["max_abs_loss_diff"] == pytest.approx(0.05) and first["step_of_max_diff"] == 20
  # tolerance at loss 4.0: 0.02 * 4.0 = 0.08; 0.05 is within, 0.2 and 0.15 are not
  assert (first["points_over_tolerance"], second["points_over_tolerance"],
          third["points_over_tolerance"]) == (0, 1, 1)
  assert second["max_abs_loss_diff"] == pytest.approx(0.2)


def test_command_line(tmp_path):
  paths = []
  for tag, content in _files().items():
    name = "train_step-x.json" if tag == "main" else f"train_step_{tag}-x.json"
    (tmp_path / name).write_text(json.dumps(content))
    paths.append(str(tmp_path / name))
  cmd = [sys.executable, os.path.join(_ROOT, "benchmarks", "compare_loss_curves.py"),
         "--files", ",".join(paths)]
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "| small | main:xla:xla (dp1 tp2) | repeat:xla:xla (dp1 tp2) | 0.200 (20) | 1 of 3 |" \
      in out.stdout
  twice = subprocess.run(cmd[:-1] + [f"{paths[0]},{paths[0]}"], env=env, capture_output=True,
                         text=True, timeout=120)
  assert twice.returncode != 0 and "two files with the tag 'main'" in twice.stderr
