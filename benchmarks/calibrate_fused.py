"""Checks the fused ops' automatic choices against a chunk sweep of benchmarks/overlap.py.

Input: overlap JSON files (benchmarks/overlap.py) of a run with chunk variants
(``--chunks 1,2,4,8``) and, for matmul_all_reduce, ``jaxoverlap:gemm_all_reduce``.
The sweep is one command per part on the 2-GPU machine:

  CAL_PART=ag_rs bash scripts/gpu_check.sh ovcalibrate
  CAL_PART=ar bash scripts/gpu_check.sh ovcalibrate

and then, wherever the JSON files are:

  python benchmarks/calibrate_fused.py --results a.json,b.json --out benchmarks/results

What it reports (rank 0's times from the files; nothing is re-measured):

* chunks: for every (op, shape), the time of ``jaxoverlap:copy_engine`` (the
  chunk count auto chose in that run, recorded in the file) against the
  fastest measured ``jaxoverlap:copy_engine/c<k>``: the best k and auto's
  regret = t_auto / t_best - 1.
* the current rule: the chunk count ``_cuda.auto_chunks`` picks NOW for each
  shape (computed here from the shape, as the lowering does; the constants may
  have changed since the run) and the measured time of that count from the
  sweep. Its regret above --regret_limit (5 %) is a shape where the rule
  should change; a pick the sweep did not measure is listed as unmeasured.
* repeat spread: ``jaxoverlap:copy_engine`` and ``copy_engine/c<k>`` with the
  same k are the same configuration measured twice in one run; their
  relative difference is the run's noise, printed beside the regrets.
* matmul_all_reduce's threshold: per shape, the fused kernel against the GEMM
  then jaxoverlap.all_reduce, with the output bytes per rank; the smallest
  size from which the fused kernel wins at every measured size is the value
  ``_cuda.FUSED_ALL_REDUCE_MIN_BYTES`` should have (below it auto takes the
  GEMM then the all-reduce). A size where the two are within --regret_limit
  of each other is a tie: the current value is consistent with it either way.
* the GEMM rate behind auto_chunks' cost model: per shape, the per-rank GEMM
  flops (2 M K N / P for all three ops) over the time of xla:local_gemm; the
  median against ``_cuda._GEMM_FLOPS_PER_S``.

Output: a table on stdout and <out>/fused_calibration-<machine>.json (the rows,
the recommended values beside the current ones, the source files). Exit code
1 when a recommendation differs from the current value (auto's regret above
the limit on some shape, or a different all-reduce threshold), so a run says
at once whether the constants in jaxoverlap/_cuda.py need to change.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
from typing import Any, Mapping, Sequence

BENCHMARK = "fused_calibration"
AUTO = "jaxoverlap:copy_engine"
GEMM_AR = "jaxoverlap:gemm_all_reduce"
FLOOR = "xla:local_gemm"
_CHUNKED = re.compile(r"^jaxoverlap:copy_engine/c(\d+)$")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _key(r: Mapping[str, Any]) -> tuple[str, tuple[int, ...]]:
  return r["op"], tuple(r["shape"])


def _by_shape(records: Sequence[Mapping[str, Any]]) -> dict:
  out: dict = {}
  for r in records:
    out.setdefault(_key(r), {})[r["impl"]] = r
  return out


def chunk_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Per (op, shape) with auto and at least one chunk variant: auto against the best.

  Returns rows ``{"op", "shape", "auto_chunks", "auto_us", "best_chunks",
  "best_us", "regret", "times_us": {k: us}}``, regret = auto_us / best_us - 1
  (0 when auto is the best; the best includes auto itself).
  """
  rows = []
  for (op, shape), impls in _by_shape(records).items():
    auto = impls.get(AUTO)
    times = {int(m.group(1)): r["time_us"] for impl, r in impls.items()
             if (m := _CHUNKED.match(impl))}
    if auto is None or not times:
      continue
    best_k = min(times, key=times.get)
    best_us = min(times[best_k], auto["time_us"])
    if auto["time_us"] <= times[best_k]:
      best_k = auto.get("chunks", best_k)
    rows.append({"op": op, "shape": list(shape), "auto_chunks": auto.get("chunks"),
                 "auto_us": auto["time_us"], "best_chunks": best_k, "best_us": best_us,
                 "regret": round(auto["time_us"] / best_us - 1.0, 4),
                 "times_us": {str(k): times[k] for k in sorted(times)}})
  return rows


def rule_inputs(op: str, shape: Sequence[int], world: int, itemsize: int = 2) -> dict[str, Any]:
  """``_cuda.auto_chunks``' arguments for a benchmarks/overlap.py (op, [M, K, N]).

  The benchmark's per-rank shapes (no batch dims): all_gather_matmul x [M/P, K],
  w [K, N/P]; matmul_reduce_scatter and matmul_all_reduce x [M, K/P], w [K/P, N]
  with a block of M/P rows. The values are those jaxoverlap/_cuda.py's
  lowerings compute for these shapes (AG: the shard and the local shard's
  GEMM; RS/AR: one block and its GEMM).
  """
  m, k, n = shape
  rows = m // world
  if op == "all_gather_matmul":
    return {"payload_bytes": rows * k * itemsize, "rows": rows,
            "gemm_flops": 2.0 * rows * k * (n // world)}
  return {"payload_bytes": rows * n * itemsize, "rows": rows,
          "gemm_flops": 2.0 * rows * (k // world) * n}


def rule_rows(chunks: Sequence[Mapping[str, Any]], world: int) -> list[dict[str, Any]]:
  """The current ``_cuda.auto_chunks`` pick per chunk row, with its measured time.

  Returns ``{"op", "shape", "rule_chunks", "rule_us", "best_us", "regret"}``;
  rule_us (and regret) None where the sweep has no time for that chunk count.
  """
  from jaxoverlap import _cuda

  out = []
  for r in chunks:
    k = _cuda.auto_chunks(r["op"], **rule_inputs(r["op"], r["shape"], world))
    us = r["times_us"].get(str(k))
    if us is None and r["auto_chunks"] == k:
      us = r["auto_us"]
    out.append({"op": r["op"], "shape": r["shape"], "rule_chunks": k, "rule_us": us,
                "best_us": r["best_us"],
                "regret": None if us is None else round(us / r["best_us"] - 1.0, 4)})
  return out


def repeat_spread(chunks: Sequence[Mapping[str, Any]]) -> list[float]:
  """|t_auto / t_c<k> - 1| for the rows where auto ran with a measured k (same config twice)."""
  out = []
  for r in chunks:
    again = r["times_us"].get(str(r["auto_chunks"]))
    if again:
      out.append(round(abs(r["auto_us"] / again - 1.0), 4))
  return out


def all_reduce_rows(records: Sequence[Mapping[str, Any]], world: int,
                    tie_limit: float = 0.05) -> list[dict[str, Any]]:
  """matmul_all_reduce shapes with both the fused kernel and gemm_all_reduce, by output size.

  Output bytes per rank = M * N * itemsize (the full [M, N] result on every
  rank). Returns rows ``{"shape", "out_bytes", "fused_us", "gemm_all_reduce_us",
  "fused_wins", "tie"}`` sorted by out_bytes; tie: the two within tie_limit
  of each other (either choice costs at most that much).
  """
  del world
  rows = []
  for (op, shape), impls in _by_shape(records).items():
    if op != "matmul_all_reduce" or AUTO not in impls or GEMM_AR not in impls:
      continue
    m, _, n = shape
    itemsize = _ITEMSIZE.get(impls[AUTO].get("dtype", "bfloat16"), 2)
    fused, plain = impls[AUTO]["time_us"], impls[GEMM_AR]["time_us"]
    rows.append({"shape": list(shape), "out_bytes": m * n * itemsize, "fused_us": fused,
                 "gemm_all_reduce_us": plain, "fused_wins": fused < plain,
                 "tie": abs(fused / plain - 1.0) <= tie_limit})
  return sorted(rows, key=lambda r: (r["out_bytes"], r["shape"]))


def all_reduce_threshold(rows: Sequence[Mapping[str, Any]]) -> int | None:
  """The smallest out_bytes from which the fused kernel wins at every larger measured size.

  None when it loses at the largest measured size (or there are no rows).
  A size with several shapes counts as won only if it wins at all of them.
  """
  threshold = None
  for r in sorted(rows, key=lambda r: r["out_bytes"], reverse=True):
    if not all(o["fused_wins"] for o in rows if o["out_bytes"] == r["out_bytes"]):
      break
    threshold = r["out_bytes"]
  return threshold


def gemm_rate(records: Sequence[Mapping[str, Any]], world: int) -> float | None:
  """Median per-rank GEMM rate (flop/s) of xla:local_gemm over the shapes; None without any."""
  rates = [2.0 * r["shape"][0] * r["shape"][1] * r["shape"][2] / world / (r["time_us"] * 1e-6)
           for r in records if r["impl"] == FLOOR and r["time_us"] > 0]
  return statistics.median(rates) if rates else None


def _fmt_bytes(b: int | None) -> str:
  if b is None:
    return "none"
  return f"{b / (1 << 20):.3g} MiB"


def analyze(results: Sequence[Mapping[str, Any]], regret_limit: float) -> dict[str, Any]:
  """The calibration of the files ``results`` (loaded overlap JSON dicts)."""
  from jaxoverlap import _cuda

  records = [r for res in results for r in res["records"]]
  worlds = {res.get("world") for res in results}
  if len(worlds) != 1:
    raise ValueError(f"the files come from runs with different world sizes: {sorted(worlds)}")
  world = worlds.pop()
  chunks = chunk_rows(records)
  ar = all_reduce_rows(records, world, regret_limit)
  threshold = all_reduce_threshold(ar)
  rate = gemm_rate(records, world)
  rule = rule_rows(chunks, world)
  over = [r for r in rule if r["regret"] is not None and r["regret"] > regret_limit]
  spread = repeat_spread(chunks)
  current = {"FUSED_ALL_REDUCE_MIN_BYTES": _cuda.FUSED_ALL_REDUCE_MIN_BYTES,
             "_GEMM_FLOPS_PER_S": _cuda._GEMM_FLOPS_PER_S}
  # The current threshold is consistent with the data if no measured size
  # below it wins and none above it loses, by more than the regret limit (a
  # tie fits either side).
  consistent_threshold = (not ar) or (
      threshold is not None
      and all(r["tie"]
              or r["fused_wins"] == (r["out_bytes"] >= current["FUSED_ALL_REDUCE_MIN_BYTES"])
              for r in ar))
  return {
      "world": world, "chunks": chunks, "rule": rule, "all_reduce": ar,
      "regret_limit": regret_limit,
      "repeat_spread": {"max": max(spread), "median": statistics.median(spread),
                        "pairs": len(spread)} if spread else None,
      "shapes_over_regret_limit": [(r["op"], r["shape"]) for r in over],
      "rule_unmeasured": [(r["op"], r["shape"], r["rule_chunks"]) for r in rule
                          if r["regret"] is None],
      "recommended": {"FUSED_ALL_REDUCE_MIN_BYTES": threshold, "_GEMM_FLOPS_PER_S": rate},
      "current": current,
      "changes_needed": bool(over) or not consistent_threshold,
  }


def table(report: Mapping[str, Any]) -> str:
  lines = ["| op | shape | run's auto chunks | us | best chunks | best us | regret | "
           "rule now | its us | its regret |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r, n in zip(report["chunks"], report["rule"]):
    now = ("unmeasured", "-") if n["regret"] is None else (f"{n['rule_us']:.1f}",
                                                          f"{100 * n['regret']:.1f}%")
    lines.append(f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['auto_chunks']} | "
                 f"{r['auto_us']:.1f} | {r['best_chunks']} | {r['best_us']:.1f} | "
                 f"{100 * r['regret']:.1f}% | {n['rule_chunks']} | {now[0]} | {now[1]} |")
  if report["all_reduce"]:
    lines += ["", "| matmul_all_reduce shape | out per rank | fused us | GEMM + all_reduce us | "
              "faster |", "|---|---|---|---|---|"]
    for r in report["all_reduce"]:
      faster = "tie" if r["tie"] else "fused" if r["fused_wins"] else "GEMM + all_reduce"
      lines.append(f"| {'x'.join(map(str, r['shape']))} | {_fmt_bytes(r['out_bytes'])} | "
                   f"{r['fused_us']:.1f} | {r['gemm_all_reduce_us']:.1f} | {faster} |")
  rec, cur = report["recommended"], report["current"]
  rate = rec["_GEMM_FLOPS_PER_S"]
  lines += ["",
            f"FUSED_ALL_REDUCE_MIN_BYTES: measured {_fmt_bytes(rec['FUSED_ALL_REDUCE_MIN_BYTES'])}"
            f", current {_fmt_bytes(cur['FUSED_ALL_REDUCE_MIN_BYTES'])}",
            "_GEMM_FLOPS_PER_S: measured "
            + (f"{rate / 1e12:.0f} TF/s" if rate else "n/a")
            + f", current {cur['_GEMM_FLOPS_PER_S'] / 1e12:.0f} TF/s",
            f"shapes where the rule's chunks cost > {100 * report['regret_limit']:.0f}%: "
            f"{len(report['shapes_over_regret_limit'])}; rule picks not measured: "
            f"{len(report['rule_unmeasured'])}"]
  spread = report["repeat_spread"]
  if spread:
    lines.append(f"repeat spread (the same configuration twice in the run): median "
                 f"{100 * spread['median']:.1f}%, max {100 * spread['max']:.1f}% over "
                 f"{spread['pairs']} pairs")
  return "\n".join(lines)


def main(argv):
  from absl import flags

  from jaxoverlap import launch, tuning

  del argv
  fl = flags.FLAGS
  paths = [p for p in fl.results if p]
  if not paths:
    raise SystemExit("--results: no files given")
  results = []
  for p in paths:
    with open(p) as f:
      results.append(json.load(f))
  report = analyze(results, fl.regret_limit)
  print(table(report))
  machine = results[0].get("machine", "unknown")
  out = {"benchmark": BENCHMARK, "machine": machine,
         "command": launch.reproduce_command("benchmarks/calibrate_fused.py"),
         "method": "analysis of the overlap JSON files in 'sources' (rank 0's times); see "
                   "benchmarks/calibrate_fused.py",
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "versions": tuning.package_versions(),
         "sources": [{"path": p, "command": r.get("command"), "date": r.get("date")}
                     for p, r in zip(paths, results)],
         **report}
  os.makedirs(fl.out, exist_ok=True)
  path = os.path.join(fl.out, f"{BENCHMARK}-{machine.replace(' ', '_')}.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
  print(f"wrote {path}")
  if report["changes_needed"]:
    print("CHANGES NEEDED: the measured values differ from jaxoverlap/_cuda.py's constants")
    return 1
  return 0


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_list("results", [], "overlap JSON files of the chunk sweep")
  flags.DEFINE_string("out", "benchmarks/results", "folder for the JSON")
  flags.DEFINE_float("regret_limit", 0.05, "auto's allowed excess over the best chunk count")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(lambda argv: sys.exit(main(argv)))
