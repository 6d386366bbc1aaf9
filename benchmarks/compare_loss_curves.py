"""Loss-curve differences between training runs of several train_step JSON files.

The loss comparison of benchmarks/train_step.py holds one backend against the
other within one run. Whether a difference is a defect or the ordinary spread
of bf16 training needs the spread between runs that should agree: the same
backend run twice, or the same model under another parallel layout (a
different reduction order). This script lays every pair of runs of one preset
side by side, across and within files:

  python benchmarks/compare_loss_curves.py \
      --files benchmarks/results/train_step-2x_H200_NV18.json,\
benchmarks/results/train_step_repeat-2x_H200_NV18.json,\
benchmarks/results/train_step_dp2_control-2x_H200_NV18.json

Per pair: the largest |loss difference| over the common logged steps (and its
step), and how many points exceed train_step's tolerance (0.02 * max(1, loss)
of the first run of the pair). Runs are named ``<file tag>:<impl>`` with the
mesh, e.g. ``repeat:xla:xla (dp1 tp2)``. Nothing is re-measured.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any, Mapping, Sequence

import harness
import train_step as ts


def file_tag(path: str) -> str:
  """``train_step_repeat-2x_H200_NV18.json`` -> ``repeat``; the main file -> ``main``."""
  stem = os.path.basename(path).split("-", 1)[0]
  return stem[len("train_step_"):] if stem.startswith("train_step_") else "main"


def runs_by_preset(files: Mapping[str, Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
  """``{preset: [{"name", "curve"}]}`` over the records of the loaded files (tag -> JSON)."""
  out: dict[str, list[dict[str, Any]]] = {}
  for tag, result in files.items():
    for r in result.get("records", []):
      shape = r["shape"]
      name = f"{tag}:{r['impl']} (dp{shape['dp']} tp{shape['tp']})"
      out.setdefault(shape["preset"], []).append({"name": name, "curve": r["loss_curve"]})
  return out


def pair_rows(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
  """Every pair of runs of one preset: max |diff|, its step, points over the tolerance."""
  rows = []
  for preset, group in runs.items():
    for a, b in itertools.combinations(group, 2):
      cmp = ts.compare_curves(a["curve"], b["curve"])
      ref = {int(s): float(v) for s, v in a["curve"]}
      other = {int(s): float(v) for s, v in b["curve"]}
      over = sum(1 for s in set(ref) & set(other)
                 if abs(other[s] - ref[s]) > ts.tolerance(ref[s]))
      rows.append({"preset": preset, "a": a["name"], "b": b["name"],
                   "common_steps": cmp["common_steps"],
                   "max_abs_loss_diff": cmp["max_abs_loss_diff"],
                   "step_of_max_diff": cmp["step_of_max_diff"], "points_over_tolerance": over})
  return rows


def table(rows: Sequence[Mapping[str, Any]]) -> str:
  lines = ["| preset | run a | run b | max abs loss difference (step) | points over tolerance |",
           "|---|---|---|---|---|"]
  for r in rows:
    diff = ("-" if r["max_abs_loss_diff"] is None
            else f"{r['max_abs_loss_diff']:.3f} ({r['step_of_max_diff']})")
    lines.append(f"| {r['preset']} | {r['a']} | {r['b']} | {diff} | "
                 f"{r['points_over_tolerance']} of {r['common_steps']} |")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--files", required=True, help="comma-separated train_step JSON files")
  args = parser.parse_args(argv)
  files = {}
  for path in (p for p in args.files.split(",") if p):
    tag = file_tag(path)
    if tag in files:
      raise SystemExit(f"two files with the tag {tag!r}; rename one ({path})")
    files[tag] = harness.load_results(path, "train_step")
  print(table(pair_rows(runs_by_preset(files))))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
