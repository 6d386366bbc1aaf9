"""Training step time and loss curves of the training example, backend xla against cuda, one run.

Run one process per GPU through the launcher:

  python -m jaxoverlap.launch --nproc 2 benchmarks/train_step.py
  # one preset per run (each well under 10 minutes), into one JSON:
  python -m jaxoverlap.launch --nproc 2 benchmarks/train_step.py --presets gpu_small
  python -m jaxoverlap.launch --nproc 2 benchmarks/train_step.py --presets gpu_large --merge
  # CPU smoke run (8 simulated devices, dp=4 x tp=2; "auto" resolves to xla on CPU):
  python benchmarks/train_step.py --presets tiny --steps 4 --backends xla,auto --mesh 4,2 \\
      --workdir /tmp/ts --out /tmp/ts_out

What is measured: for each preset of examples/train/config.py in --presets,
``train.train_and_evaluate`` runs once per backend in --backends (default
"xla,cuda": the jaxoverlap layers with lax collectives, then with the fused
CUDA kernels), in this process group, one after the other, with the same
seed, so the same initial parameters and the same batches in the same order.
Each run starts from an empty workdir (``<--workdir>/<preset>-<i>-<backend>``,
deleted first, so nothing is resumed). Only the backend (and --mesh, --steps)
differs from the preset, plus three overrides that keep evaluation and
checkpointing out of the way: eval_every = ckpt_every = steps (evaluation at
step 0 and at the end only; the example always writes one checkpoint at the
end), eval_batches = 1. The checkpoints are deleted after each run (pass
--keep_checkpoints to keep them): gpu_large's is about 36 GB.

step time: the example's ``step_time_ms``: wall time of steps 2..N (the first
step, which compiles, is timed apart) divided by N - 1, measured on each
process's host clock with the loss fetched every ``log_every`` steps (rank 0's
figure is reported). Evaluation and checkpoints fall outside it.

Loss comparison: ``history.json`` holds the mean training loss of each
``log_every``-step window, at the window's last step. The first backend is the
reference; for every other backend and every step both curves have, the
difference |loss - loss_ref| is compared with 0.02 * max(1, |loss_ref|): 0.02
nats below a loss of 1, 2 % above. That is about 5 bf16 roundings (unit
roundoff 2**-8 = 0.4 %) of the loss: the backends run the same maths in a
different order (chunked GEMMs, other reduction orders), so bf16 activations
round differently and the trajectories drift apart over the optimizer steps,
but a wrong result (a missing or doubled shard, a stale buffer) moves the
loss by far more. A float32 preset would allow a tighter bound; this one is
meant for the bf16 GPU presets.

Results (rank 0): ``<out>/train_step-<machine>.json`` in the results format
of jaxoverlap.tuning.results: one record per run (op "train_step"; impl
"jaxoverlap:<backend>" when any jaxoverlap op ran the CUDA kernels, after the
example's ``metrics["backend"]["resolved"]``, else "xla:<backend>"; dtype;
shape = the model and batch sizes; world = process count; time_us =
step_time_ms * 1000; time_us_median, time_us_p10, time_us_p90 over the log
windows' per-step times (history.json's step_ms), time_us_windows their
number; final_train_loss; steps; loss_curve = the history.json
points; fused_decisions = the distinct fused-kernel plans of the step, from
``jaxoverlap.decisions()``) and a
top-level "comparison" list, one entry per preset and non-reference backend:
max_abs_loss_diff, within_tolerance, final losses, step times and speedup =
t_ref / t (for the defaults, t_xla / t_cuda: above 1 means cuda is faster).
With --merge, the records of presets not run this time are kept from the
existing file. ``<out>/train_step-<machine>.png``: per preset, the loss
curves overlaid and, below, their difference with the tolerance band. A
summary table goes to stdout. Exit code 1 when a curve is out of tolerance.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
from typing import Any, Mapping, Sequence

import harness

BENCHMARK = "train_step"
REL_TOL = 0.02  # tolerance per point: REL_TOL * max(1, |loss_ref|)
METHOD = ("train.train_and_evaluate of examples/train once per backend, same seed and data, "
          "fresh workdir; overrides eval_every = ckpt_every = steps, eval_batches = 1; time_us = "
          "step_time_ms * 1000 = wall time of steps 2..N / (N - 1) on rank 0 (the compiling "
          "first step excluded; loss fetched every log_every steps), its spread over the log "
          "windows in time_us_p10/p90; loss curves = history.json "
          "(mean train loss per log_every window), compared with the first backend within "
          f"{REL_TOL} * max(1, |loss_ref|) per point")


# ------------------------------------------------------------------ pure helpers


def tolerance(loss_ref: float, rel_tol: float = REL_TOL) -> float:
  """The allowed |loss - loss_ref| at one point: ``rel_tol * max(1, |loss_ref|)``."""
  return rel_tol * max(1.0, abs(loss_ref))


def compare_curves(ref: Sequence[Sequence[float]], other: Sequence[Sequence[float]],
                   rel_tol: float = REL_TOL) -> dict[str, Any]:
  """Compares two loss curves on the steps both have.

  Args:
    ref: reference curve, ``(step, loss)`` points.
    other: the curve to check, ``(step, loss)`` points.
    rel_tol: tolerance factor, see ``tolerance``.

  Returns:
    dict: ``common_steps`` (count), ``max_abs_loss_diff`` (None without common
    steps), ``step_of_max_diff``, ``worst_diff_over_tolerance`` (max over the
    points of |diff| / tolerance), ``within_tolerance`` (False without common
    steps or with a non-finite loss), ``final_step``, ``final_loss_ref`` and
    ``final_loss`` (at the last common step).
  """
  a = {int(s): float(v) for s, v in ref}
  b = {int(s): float(v) for s, v in other}
  steps = sorted(set(a) & set(b))
  out: dict[str, Any] = {"common_steps": len(steps), "max_abs_loss_diff": None,
                         "step_of_max_diff": None, "worst_diff_over_tolerance": None,
                         "within_tolerance": False, "final_step": None,
                         "final_loss_ref": None, "final_loss": None}
  if not steps:
    return out
  diffs = [abs(b[s] - a[s]) for s in steps]
  ratios = [d / tolerance(a[s], rel_tol) for d, s in zip(diffs, steps)]
  finite = all(d == d and d != float("inf") for d in diffs)  # NaN != NaN
  worst = max(range(len(steps)), key=lambda i: diffs[i] if diffs[i] == diffs[i] else 1e300)
  out.update(max_abs_loss_diff=diffs[worst] if finite else float("nan"),
             step_of_max_diff=steps[worst],
             worst_diff_over_tolerance=max(ratios) if finite else float("nan"),
             within_tolerance=bool(finite and all(r <= 1.0 for r in ratios)),
             final_step=steps[-1], final_loss_ref=a[steps[-1]], final_loss=b[steps[-1]])
  return out


def window_spread_us(step_ms: Sequence[Sequence[float]]) -> dict[str, Any]:
  """The spread of the step time over the log windows of a run.

  Args:
    step_ms: ``history.json``'s ``step_ms`` points, ``(step, ms per step of
      the log window ending there)``; empty for a run that trained no timed
      step, or for a history written before windows were timed.

  Returns:
    ``time_us_windows`` (their number) and, given any, ``time_us_median``,
    ``time_us_p10`` and ``time_us_p90`` over the windows' per-step times, in
    us (one window: all three equal it). The windows differ in length where
    a run does not end on a multiple of ``log_every``; each counts once.
  """
  import numpy as np

  per_step = np.array([float(ms) * 1e3 for _, ms in step_ms])
  out: dict[str, Any] = {"time_us_windows": int(per_step.size)}
  if per_step.size:
    for key, q in (("time_us_median", 50), ("time_us_p10", 10), ("time_us_p90", 90)):
      out[key] = round(float(np.percentile(per_step, q)), 1)
  return out


def make_record(preset: str, metrics: Mapping[str, Any], history: Mapping[str, Any],
                fused: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
  """One record of the results format from a run's metrics (``train_and_evaluate``'s value).

  Args:
    preset: the preset's name.
    metrics: the run's metrics (``config``, ``mesh``, ``backend``, ``step_time_ms``, ...).
    history: the run's ``history.json`` (``train``: ``(step, loss)`` points;
      ``step_ms``: the windows' ms per step, see ``window_spread_us``).
    fused: the distinct fused-kernel plans of the run (``harness.fused_choices``).

  Returns:
    The record; ``loss_curve`` holds the ``(step, loss)`` points of ``history["train"]``.
  """
  cfg, mesh = metrics["config"], metrics["mesh"]
  resolved = dict(metrics["backend"].get("resolved") or {})
  step_ms = metrics.get("step_time_ms")
  curve = [[int(st), float(v)] for st, v in history.get("train") or []]
  spread = window_spread_us(history.get("step_ms") or [])
  return {
      "op": "train_step",
      "impl": harness.run_impl(cfg["backend"], resolved),
      "dtype": cfg["dtype"],
      "shape": harness.run_shape(preset, cfg, mesh["dp"], mesh["tp"]),
      "world": mesh["processes"],
      "devices": mesh["devices"],
      "platform": mesh["platform"],
      "time_us": round(step_ms * 1e3, 1) if step_ms else None,
      **spread,
      "tokens_per_s": metrics.get("tokens_per_s"),
      "first_step_s": metrics.get("first_step_s"),
      "final_train_loss": curve[-1][1] if curve else metrics.get("train_loss"),
      "val_loss": metrics.get("val_loss"),
      "steps": metrics["steps"],
      "num_params": metrics.get("num_params"),
      "backend": cfg["backend"],
      "algorithm": cfg["algorithm"],
      "resolved": resolved,
      "fused_decisions": [dict(d) for d in fused],
      "loss_curve": curve,
  }


def group_by_preset(records: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
  """Records by ``shape["preset"]``, in order (each preset's first record is its reference)."""
  out: dict[str, list[Mapping[str, Any]]] = {}
  for r in records:
    out.setdefault(r["shape"]["preset"], []).append(r)
  return out


def compare_runs(runs: Sequence[Mapping[str, Any]],
                 rel_tol: float = REL_TOL) -> list[dict[str, Any]]:
  """Comparison entries of one preset's runs: every run against the first.

  Args:
    runs: ``make_record`` records of one preset, reference first.
    rel_tol: tolerance factor, see ``tolerance``.

  Returns:
    One dict per run after the first: ``preset``, ``reference`` and ``impl``
    (impl names), the fields of ``compare_curves``, ``step_time_ms`` of both,
    ``speedup`` = t_ref / t (None when a time is missing), ``tolerance`` (text).
  """
  out = []
  if not runs:
    return out
  ref = runs[0]
  for run in runs[1:]:
    c = compare_curves(ref["loss_curve"], run["loss_curve"], rel_tol)
    t_ref, t = ref["time_us"], run["time_us"]
    out.append({
        "preset": ref["shape"]["preset"],
        "reference": ref["impl"],
        "impl": run["impl"],
        **c,
        "final_train_loss_ref": ref["final_train_loss"],
        "final_train_loss": run["final_train_loss"],
        "step_time_ms_ref": t_ref / 1e3 if t_ref else None,
        "step_time_ms": t / 1e3 if t else None,
        "speedup": t_ref / t if t_ref and t else None,
        "tolerance": f"|loss - loss_ref| <= {rel_tol} * max(1, |loss_ref|) at every common step",
    })
  return out


def compare_all(records: Sequence[Mapping[str, Any]],
                rel_tol: float = REL_TOL) -> list[dict[str, Any]]:
  """``compare_runs`` of every preset of ``records``."""
  return [c for runs in group_by_preset(records).values() for c in compare_runs(runs, rel_tol)]


def merge_records(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]
                  ) -> list[dict[str, Any]]:
  """The records of ``old`` whose preset ``new`` does not measure, then those of ``new``."""
  presets = {r["shape"]["preset"] for r in new}
  return ([dict(r) for r in old if r["shape"]["preset"] not in presets]
          + [dict(r) for r in new])


def summary_table(records: Sequence[Mapping[str, Any]],
                  comparison: Sequence[Mapping[str, Any]]) -> str:
  """A Markdown table: one row per run, with its comparison against the reference."""
  by_impl = {(c["preset"], c["impl"]): c for c in comparison}
  lines = ["| preset | impl | step ms | step ms p10-p90 (windows) | speed-up vs ref "
           "| final train loss | max abs loss diff | within tol |",
           "|---|---|---|---|---|---|---|---|"]
  for r in records:
    preset = r["shape"]["preset"]
    c = by_impl.get((preset, r["impl"]))
    t = f"{r['time_us'] / 1e3:.2f}" if r["time_us"] else "-"
    spread = (f"{r['time_us_p10'] / 1e3:.2f}-{r['time_us_p90'] / 1e3:.2f} "
              f"({r['time_us_windows']})" if r.get("time_us_p10") is not None else "-")
    if c is None:
      speedup, diff, ok = "(ref)", "-", "-"
    else:
      speedup = f"{c['speedup']:.3f}x" if c["speedup"] else "-"
      diff = f"{c['max_abs_loss_diff']:.4g}" if c["max_abs_loss_diff"] is not None else "-"
      ok = "yes" if c["within_tolerance"] else "NO"
    loss = f"{r['final_train_loss']:.4f}" if r["final_train_loss"] is not None else "-"
    lines.append(f"| {preset} | {r['impl']} | {t} | {spread} | {speedup} | {loss} | {diff} "
                 f"| {ok} |")
  return "\n".join(lines)


def plot(path: str, records: Sequence[Mapping[str, Any]], title: str,
         rel_tol: float = REL_TOL) -> None:
  """Per preset (a column), the loss curves overlaid (top) and their difference (bottom).

  Args:
    path: the PNG to write.
    records: ``make_record`` records; per preset, the first is the reference.
    title: the figure's title.
    rel_tol: tolerance factor for the band drawn around 0 in the bottom row.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  by_preset = group_by_preset(records)
  ncol = max(1, len(by_preset))
  fig = Figure(figsize=(6.0 * ncol, 6.5))
  FigureCanvasAgg(fig)
  axes = fig.subplots(2, ncol, squeeze=False, sharex="col",
                      gridspec_kw={"height_ratios": [2, 1]})
  for col, (preset, runs) in enumerate(by_preset.items()):
    top, bottom = axes[0][col], axes[1][col]
    times = []
    for i, rec in enumerate(runs):
      pts = rec["loss_curve"]
      t = rec["time_us"]
      label = f"{rec['impl']} ({t / 1e3:.1f} ms/step)" if t else rec["impl"]
      times.append(f"{rec['impl']} {t / 1e3:.1f} ms" if t else f"{rec['impl']} -")
      if pts:
        steps, losses = zip(*pts)
        top.plot(steps, losses, label=label, linestyle="-" if i == 0 else "--",
                 marker="." if len(pts) <= 50 else None, alpha=0.85)
    ref_map = {int(st): float(v) for st, v in runs[0]["loss_curve"]}
    band_steps = sorted(ref_map)
    if band_steps:
      band = [tolerance(ref_map[st], rel_tol) for st in band_steps]
      bottom.fill_between(band_steps, [-b for b in band], band, color="gray", alpha=0.2,
                          label=f"tolerance {rel_tol} * max(1, |loss|)")
    for rec in runs[1:]:
      pts = [(int(st), float(v)) for st, v in rec["loss_curve"] if int(st) in ref_map]
      if pts:
        steps, losses = zip(*pts)
        bottom.plot(steps, [v - ref_map[st] for st, v in pts], marker=".",
                    label=f"{rec['impl']} - {runs[0]['impl']}")
    bottom.axhline(0.0, color="black", linewidth=0.6)
    top.set_title(f"{preset}: " + ", ".join(times), fontsize=9)
    top.set_ylabel("train loss (nats/byte)")
    bottom.set_ylabel("loss difference")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
      ax.grid(alpha=0.3)
      if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def write_results(out_dir: str, machine: str, records: Sequence[Mapping[str, Any]], *,
                  command: str | None = None, extra: Mapping[str, Any] | None = None,
                  merge: bool = False) -> tuple[str, str, dict[str, Any]]:
  """Writes ``<out_dir>/train_step-<machine>.json`` (``harness.write_result``) and the PNG.

  Args:
    out_dir, machine: where, and the machine's name (spaces become "_" in the file name).
    records: this run's ``make_record`` records, per preset the reference first.
    command: stored in the JSON (default: the reproduce command).
    extra: more top-level fields.
    merge: keep the records of the presets this run did not measure from an
      existing file (the comparison and the PNG cover them all).

  Returns:
    (json path, png path, the JSON object written).

  Raises:
    ValueError: ``merge`` into a file of another machine, platform, world or
      jax version (``harness.check_merge``).
  """
  path = harness.path(out_dir, BENCHMARK, machine)
  old = harness.load_json(path, missing_ok=True) if merge else None
  harness.check_merge(old, path, machine=machine, platform=(extra or {}).get("platform"),
                      world=(extra or {}).get("world"), jax=harness.jax_version())
  if old:
    records = merge_records(old.get("records", []), records)
  result = harness.write_result(
      path, records, benchmark=BENCHMARK, machine=machine, method=METHOD, command=command,
      script="benchmarks/train_step.py", latency=False,
      extra={"comparison": compare_all(records), **(extra or {})})
  png = harness.path(out_dir, BENCHMARK, machine, ext="png")
  world = records[0]["world"] if records else "?"
  plot(png, records, f"training example, {machine}, {world} process(es)\n"
       "train loss per backend (same seed and data)")
  return path, png, result


# ------------------------------------------------------------------ main


def define_flags():
  """Defines the command-line flags (only when run as a script, so importing is free)."""
  from absl import flags

  flags.DEFINE_list("presets", ["gpu_small", "gpu_large"], "presets of examples/train/config.py")
  flags.DEFINE_integer("steps", 200, "optimizer steps per run (>= 2: the first one compiles)")
  flags.DEFINE_list("backends", ["xla", "cuda"], "jaxoverlap backends, one run each; the "
                    "first is the reference of the loss comparison and of the speed-up")
  flags.DEFINE_string("workdir", "/tmp/jaxoverlap_train_step",
                      "parent of the runs' workdirs (each deleted before its run)")
  flags.DEFINE_bool("keep_checkpoints", False, "keep each run's final orbax checkpoint")
  harness.define_flags("out", "machine", "mesh", "distributed",
                       merge=(False, "keep the records of other presets from an existing "
                              "<out>/train_step-<machine>.json (to measure the presets in "
                              "separate runs)"),
                       host_devices=8)


def main(argv):
  del argv
  from absl import app, flags

  fl = flags.FLAGS
  if fl.steps < 2:
    raise app.UsageError("--steps must be >= 2 (the first step compiles and is timed apart)")
  backends = [b.strip() for b in fl.backends if b.strip()]
  if not backends:
    raise app.UsageError("--backends is empty")
  try:
    mesh = tuple(harness.parse_ints("mesh", fl.mesh)) if fl.mesh else None
  except ValueError as e:
    raise app.UsageError(str(e)) from e

  config_lib, _, train = harness.start_training_example(
      distributed=fl.distributed, cuda="cuda" in backends, host_devices=fl.host_devices)
  import jax
  from jax.experimental import multihost_utils

  import jaxoverlap

  rank = jax.process_index()
  records: list[dict] = []
  for preset in fl.presets:
    base = config_lib.get_config(preset)
    overrides: dict[str, Any] = {"steps": fl.steps, "eval_every": fl.steps,
                                 "ckpt_every": fl.steps, "eval_batches": 1}
    if mesh:
      overrides["mesh"] = mesh
    for i, backend in enumerate(backends):
      config = dataclasses.replace(base, backend=backend, **overrides)
      workdir = os.path.join(os.path.abspath(fl.workdir), f"{preset}-{i}-{backend}")
      if rank == 0 and os.path.exists(workdir):
        shutil.rmtree(workdir)
      multihost_utils.sync_global_devices(f"train_step:{preset}:{i}:start")
      if rank == 0:
        print(f"=== {preset}, backend {backend}: {fl.steps} steps into {workdir}", flush=True)
      jaxoverlap.clear_decisions()
      metrics = train.train_and_evaluate(config, workdir)
      multihost_utils.sync_global_devices(f"train_step:{preset}:{i}:end")
      if rank == 0:
        with open(os.path.join(workdir, train.HISTORY_FILE)) as f:
          records.append(make_record(preset, metrics, json.load(f), harness.fused_choices()))
        if not fl.keep_checkpoints:
          shutil.rmtree(os.path.join(workdir, train.CHECKPOINT_DIR), ignore_errors=True)
      del metrics
      gc.collect()
      jax.clear_caches()

  code = 0
  if rank == 0:
    extra = {"world": jax.process_count(), "platform": jax.devices()[0].platform,
             "steps": fl.steps, "backends": backends}
    try:
      path, png, result = write_results(fl.out, harness.machine_name(fl.machine), records,
                                        extra=extra, merge=fl.merge)
    except ValueError as e:  # --merge into another machine's file
      raise app.UsageError(str(e)) from e
    print(summary_table(result["records"], result["comparison"]))
    print(f"wrote {path} and {png}", flush=True)
    if not all(c["within_tolerance"] for c in compare_all(records)):
      print("LOSS CURVES DIFFER beyond the tolerance (see 'comparison')", flush=True)
      code = 1
  # No process leaves (and shuts jax.distributed and NVSHMEM down) before rank 0 is done.
  multihost_utils.sync_global_devices("train_step:end")
  return code


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
