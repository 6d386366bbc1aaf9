"""Checks the fused ops' automatic choices against chunk sweeps of benchmarks/overlap.py.

Input: overlap JSON files (benchmarks/overlap.py) of runs with chunk variants
(``jaxoverlap:copy_engine/c<k>``) and, for matmul_all_reduce,
``jaxoverlap:gemm_all_reduce``. One sweep is one command per part on the
2-GPU machine:

  CAL_PART=ag_rs bash scripts/gpu_check.sh ovcalibrate
  CAL_PART=ar bash scripts/gpu_check.sh ovcalibrate

and then, over the files of one or several runs:

  python benchmarks/calibrate_fused.py --results a.json,b.json,... --out benchmarks/results

Every time of one configuration (op, shape, chunk count) counts as one
measurement: ``copy_engine/c<k>``, and ``copy_engine`` (auto) under the chunk
count it ran with (recorded in the file). Times are rank 0's; nothing is
re-measured. Where a configuration was measured more than once (the same run,
or several runs), its time is the median of its measurements.

What it reports:

* chunks: per (op, shape), the chunk count the rule picks NOW
  (``jaxoverlap.tuning.policy.fused_chunks`` of ``jaxoverlap.dispatch.geometry``
  of the benchmark's per-rank shapes: the functions the dispatcher calls, so a
  changed rule is checked against old sweeps) and its time, against the
  fastest measured count: regret = t_rule / t_best - 1. A regret above --regret_limit (5 %) is
  a shape where the rule should change; a pick no sweep measured is listed.
* repeat spread: max / min - 1 over the measurements of one configuration,
  the noise the regrets stand beside.
* matmul_all_reduce's threshold: per shape, the fused kernel (the rule's
  chunk count) against the GEMM then jaxoverlap.all_reduce, with the output
  bytes per rank; the smallest size from which the fused kernel wins at every
  measured size is the value ``policy.FUSED_ALL_REDUCE_MIN_BYTES`` should have
  (below it auto takes the GEMM then the all-reduce). A size where the two are
  within --regret_limit of each other is a tie: the current value is
  consistent with it either way.
* the GEMM rate behind fused_chunks' cost model: per shape, the per-rank GEMM
  flops (2 M K N / P for all three ops) over the time of xla:local_gemm; the
  median against the rate the rule assumes (``policy.GEMM_FLOPS_PER_S``, a
  calibration constant with no public name).

Output: tables on stdout and <out>/fused_calibration-<machine>.json (the rows,
the recommended values beside the current ones, the source files, and
``constants_from``: the policy.py whose constants were checked, which is the
installed jaxoverlap's). Exit code 1 when the data contradict
jaxoverlap/tuning/policy.py: the rule's regret above the limit on some shape,
or a measured size on the wrong side of ``FUSED_ALL_REDUCE_MIN_BYTES`` by more
than a tie. The measured threshold and GEMM rate are printed beside the current
values for information; a different but consistent threshold (e.g. 16 MiB
where 16 MiB is a tie) does not count.
It stops with a message (a non-zero exit, nothing written) when no file
holds overlap records or no configuration of the fused kernel was measured:
an empty analysis is no check.

One sweep alone is noisy (see the repeat spread): a regret or a threshold near
the limit can flip between runs, so check a change against several sweeps
pooled (pass all their files) before changing a constant.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

import harness
import overlap
from harness import GEMM_ALL_REDUCE as GEMM_AR, LOCAL_GEMM as FLOOR

BENCHMARK = "fused_calibration"
AUTO = "jaxoverlap:copy_engine"  # the chunk count chosen by the rule (recorded as "chunks")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _chunks(op: str, impl: str) -> int | None:
  """k of ``jaxoverlap:copy_engine/c<k>`` (``harness.impl_kwargs``), else None."""
  return harness.impl_kwargs(op, impl)["chunks"] if impl.startswith(AUTO + "/") else None


def _key(r: Mapping[str, Any]) -> tuple[str, tuple[int, ...]]:
  return r["op"], tuple(r["shape"])


def measurements(records: Sequence[Mapping[str, Any]]) -> dict:
  """``{(op, shape): {"chunks": {k: [us, ...]}, "itemsize", impl: [us, ...]}}`` over records.

  Auto's records count as measurements of the chunk count they ran with.
  """
  out: dict = {}
  for r in records:
    entry = out.setdefault(_key(r), {
        "chunks": {}, "itemsize": _ITEMSIZE.get(r.get("dtype", "bfloat16"), 2)})
    k = _chunks(r["op"], r["impl"])
    if k is not None:
      entry["chunks"].setdefault(k, []).append(r["time_us"])
    elif r["impl"] == AUTO and r.get("chunks"):
      entry["chunks"].setdefault(int(r["chunks"]), []).append(r["time_us"])
    else:
      entry.setdefault(r["impl"], []).append(r["time_us"])
  return out


def rule_inputs(op: str, shape: Sequence[int], world: int, itemsize: int = 2) -> dict[str, Any]:
  """``policy.fused_chunks``' arguments for a benchmarks/overlap.py (op, [M, K, N]).

  As the dispatcher computes them: ``dispatch.geometry`` of the benchmark's
  per-rank shapes (``overlap.local_shapes``: all_gather_matmul x [M/P, K],
  w [K, N/P]; matmul_reduce_scatter and matmul_all_reduce x [M, K/P],
  w [K/P, N], a block of M/P rows), dimension 0.
  """
  from jaxoverlap import dispatch, names

  ab = {name: ab for ab, name in overlap.OPS.items()}[op]
  shapes = overlap.local_shapes(ab, tuple(shape), world)
  dim = None if op == names.MATMUL_ALL_REDUCE else 0
  geo = dispatch.geometry(op, shapes["x"], shapes["w"], dim, world, itemsize)
  return {"payload_bytes": geo.chunk_bytes, "pieces": geo.pieces, "gemm_flops": geo.gemm_flops}


def chunk_rows(records: Sequence[Mapping[str, Any]], world: int) -> list[dict[str, Any]]:
  """Per (op, shape) with a measured chunk count: the current rule's pick against the best.

  Returns rows ``{"op", "shape", "times_us": {k: median us}, "counts": {k: n},
  "best_chunks", "best_us", "rule_chunks", "rule_us", "regret"}`` (keys of
  times_us and counts are strings, as in JSON); rule_us and regret are None
  where no measurement has the rule's chunk count.
  """
  from jaxoverlap.tuning import policy

  rows = []
  for (op, shape), entry in measurements(records).items():
    if not entry["chunks"]:
      continue
    times = {k: statistics.median(v) for k, v in sorted(entry["chunks"].items())}
    best_k = min(times, key=times.get)
    rule_k = policy.fused_chunks(op, **rule_inputs(op, shape, world, entry["itemsize"]))
    rule_us = times.get(rule_k)
    rows.append({"op": op, "shape": list(shape),
                 "times_us": {str(k): round(t, 2) for k, t in times.items()},
                 "counts": {str(k): len(v) for k, v in sorted(entry["chunks"].items())},
                 "best_chunks": best_k, "best_us": times[best_k],
                 "rule_chunks": rule_k, "rule_us": rule_us,
                 "regret": None if rule_us is None else round(rule_us / times[best_k] - 1.0, 4)})
  return rows


def repeat_spread(records: Sequence[Mapping[str, Any]]) -> list[float]:
  """max / min - 1 of every fused configuration (op, shape, chunks) measured more than once.

  The baselines (local GEMM, GEMM then all-reduce) are not included.
  """
  out = []
  for entry in measurements(records).values():
    for times in entry["chunks"].values():
      if len(times) > 1:
        out.append(round(max(times) / min(times) - 1.0, 4))
  return out


def all_reduce_rows(chunks: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]],
                    tie_limit: float = 0.05) -> list[dict[str, Any]]:
  """matmul_all_reduce shapes with the fused kernel (at the rule's chunks) and gemm_all_reduce.

  Output bytes per rank = M * N * itemsize (the full [M, N] result on every
  rank). Returns rows ``{"shape", "out_bytes", "fused_us", "gemm_all_reduce_us",
  "fused_wins", "tie"}`` sorted by out_bytes (medians over the measurements);
  tie: the two within tie_limit of each other (either choice costs at most
  that much).
  """
  meas = measurements(records)
  dtypes = {_key(r): r.get("dtype", "bfloat16") for r in records}
  rows = []
  for r in chunks:
    key = (r["op"], tuple(r["shape"]))
    plain = meas[key].get(GEMM_AR)
    if r["op"] != "matmul_all_reduce" or not plain or r["rule_us"] is None:
      continue
    m, _, n = r["shape"]
    fused, plain = r["rule_us"], statistics.median(plain)
    rows.append({"shape": r["shape"], "out_bytes": m * n * _ITEMSIZE.get(dtypes[key], 2),
                 "fused_us": fused, "gemm_all_reduce_us": plain, "fused_wins": fused < plain,
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
  """The calibration of the files ``results`` (loaded overlap JSON dicts, one or more runs)."""
  from jaxoverlap.tuning import policy

  records = [r for res in results for r in res["records"]]
  worlds = {res.get("world") for res in results}
  if len(worlds) != 1:
    raise ValueError(f"the files come from runs with different world sizes: {sorted(worlds)}")
  world = worlds.pop()
  chunks = chunk_rows(records, world)
  ar = all_reduce_rows(chunks, records, regret_limit)
  threshold = all_reduce_threshold(ar)
  rate = gemm_rate(records, world)
  over = [r for r in chunks if r["regret"] is not None and r["regret"] > regret_limit]
  spread = repeat_spread(records)
  current = {"FUSED_ALL_REDUCE_MIN_BYTES": policy.FUSED_ALL_REDUCE_MIN_BYTES,
             "_GEMM_FLOPS_PER_S": policy.GEMM_FLOPS_PER_S}
  # The current threshold is consistent with the data if no measured size
  # below it wins and none above it loses, by more than the regret limit (a
  # tie fits either side).
  consistent_threshold = all(
      r["tie"] or r["fused_wins"] == (r["out_bytes"] >= current["FUSED_ALL_REDUCE_MIN_BYTES"])
      for r in ar)
  return {
      "world": world, "chunks": chunks, "all_reduce": ar, "regret_limit": regret_limit,
      "repeat_spread": {"max": max(spread), "median": statistics.median(spread),
                        "configurations": len(spread)} if spread else None,
      "shapes_over_regret_limit": [(r["op"], r["shape"]) for r in over],
      "rule_unmeasured": [(r["op"], r["shape"], r["rule_chunks"]) for r in chunks
                          if r["regret"] is None],
      "recommended": {"FUSED_ALL_REDUCE_MIN_BYTES": threshold, "_GEMM_FLOPS_PER_S": rate},
      "current": current, "constants_from": policy.__file__,
      "changes_needed": bool(over) or not consistent_threshold,
  }


def table(report: Mapping[str, Any]) -> str:
  lines = ["| op | shape | rule's chunks | its us | best chunks | best us | regret | "
           "us per chunk count (measurements) |", "|---|---|---|---|---|---|---|---|"]
  for r in report["chunks"]:
    its = ("unmeasured", "-") if r["regret"] is None else (f"{r['rule_us']:.1f}",
                                                          f"{100 * r['regret']:.1f}%")
    per = ", ".join(f"{k}: {t:.0f} ({r['counts'][k]})" for k, t in r["times_us"].items())
    lines.append(f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['rule_chunks']} | "
                 f"{its[0]} | {r['best_chunks']} | {r['best_us']:.1f} | {its[1]} | {per} |")
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
    lines.append("repeat spread (max / min - 1 of one fused configuration's measurements): "
                 f"median {100 * spread['median']:.1f}%, max {100 * spread['max']:.1f}% over "
                 f"{spread['configurations']} configurations")
  return "\n".join(lines)


def main(argv):
  from absl import flags

  del argv
  fl = flags.FLAGS
  paths = [p for p in fl.results if p]
  if not paths:
    raise SystemExit("--results: no files given")
  try:
    results = [harness.load_json(p) for p in paths]
  except (OSError, ValueError) as e:
    raise SystemExit(f"calibrate_fused.py: --results: {e}") from e
  fused_ops = set(overlap.OPS.values())
  if not any(isinstance(r, Mapping) and r.get("op") in fused_ops
             for res in results for r in (res.get("records") or [])):
    raise SystemExit(f"calibrate_fused.py: no overlap records (ops {', '.join(sorted(fused_ops))})"
                     f" in {', '.join(paths)}: nothing to check (want the JSON files of "
                     "benchmarks/overlap.py's chunk sweeps)")
  report = analyze(results, fl.regret_limit)
  if not report["chunks"] and not report["all_reduce"]:
    raise SystemExit(f"calibrate_fused.py: nothing measured in {', '.join(paths)}: no "
                     f"{AUTO} or {AUTO}/c<k> times of any shape; the policy is not checked")
  print(table(report))
  machine = results[0].get("machine", "unknown")
  path = harness.path(fl.out, BENCHMARK, machine)
  harness.write_result(
      path, None, benchmark=BENCHMARK, machine=machine, script="benchmarks/calibrate_fused.py",
      method="analysis of the overlap JSON files in 'sources' (rank 0's times); see "
             "benchmarks/calibrate_fused.py", latency=False,
      extra={"sources": [{"path": p, "command": r.get("command"), "date": r.get("date")}
                         for p, r in zip(paths, results)], **report})
  print(f"wrote {path}")
  if report["changes_needed"]:
    print("CHANGES NEEDED: the measured values differ from jaxoverlap/tuning/policy.py's "
          "constants")
    return 1
  return 0


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_list("results", [], "overlap JSON files of the chunk sweep")
  flags.DEFINE_float("regret_limit", 0.05, "auto's allowed excess over the best chunk count")
  harness.define_flags("out")
  app.run(main)
