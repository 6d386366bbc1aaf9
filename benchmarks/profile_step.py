"""A profile of one training step of the training example, and a picture of its streams.

Run one process per GPU through the launcher (rank 0 writes the files):

  python -m jaxoverlap.launch --nproc 2 benchmarks/profile_step.py --backend cuda
  python -m jaxoverlap.launch --nproc 2 benchmarks/profile_step.py --backend xla
  python -m jaxoverlap.launch --nproc 2 benchmarks/profile_step.py --preset gpu_large
  # CPU smoke run (8 simulated devices; only host threads are traced there):
  python benchmarks/profile_step.py --preset tiny --backend xla --mesh 4,2 \\
      --logdir /tmp/prof --out /tmp/prof_out

What is done: the training step of a preset of examples/train/config.py is
built with ``train.build`` (the same jit'd step as ``train.train_and_evaluate``,
with --backend and --mesh in place of the preset's), run --warmup times
(compilation and autotuning), and then --steps_traced more steps run under
``jax.profiler.trace(<logdir>/rank<r>, create_perfetto_trace=True)``, every
process tracing itself. The batches are placed on the devices before the trace
starts; each traced step is wrapped in a ``jax.profiler.StepTraceAnnotation``
named "profile_step" and ends with a wait for its outputs, so one annotation
spans one step from dispatch to completion.

What is measured (rank 0, from ``perfetto_trace.json.gz``): the window is the
last traced step's annotation, shrunk to the first start and last end of the
events of the rows drawn. Rows: the GPU streams of rank 0's device (threads
named "Stream ..." of the "/device:..." processes); failing that, the other
device lines; failing that (CPU, or a GPU trace without device activity), the
host threads. Every event is classified by its name (``classify``):
  comm  nccl, jaxoverlap, nvshmem, peer/device-to-device memcpy (P2P, PtoP,
        D2D, DtoD), all-reduce, all-gather, reduce-scatter, collective-permute,
        all-to-all (any case), or "Signal", "Wait", "Put" (this case: the
        jaxoverlap kernels' names);
  gemm  gemm, cutlass, xmma, nvjet, cublas, dot (any case);
  other everything else.
Communication is tested first: a jaxoverlap kernel is communication even when
it sits inside a fused GEMM op. Within the window, gemm_us and comm_us are the
time at least one GEMM (communication) event is active on any row (the union,
so nested or concurrent events count once); gemm_sum_us and comm_sum_us add up
the event durations; overlap_us is the time during which a GEMM event and a
communication event are active on DIFFERENT rows (on one stream nothing runs
concurrently). overlap_fraction = overlap_us / comm_us: the share of the
communication hidden under GEMMs.

Results (rank 0): ``<out>/profile_step-<backend>-<machine>.json`` (the
results format of jaxoverlap.tuning.results, one record: op "train_step",
time_us = the window, resolved = the backend each op ran on, from
``jaxoverlap.decisions()`` after the first step; plus the summary and per-row
busy times) and ``<out>/profile_step-<backend>-<machine>.png``:
the timeline of the window, one row per stream/thread, GEMMs blue,
communication red, other grey. The raw trace stays in --logdir (open it in
https://ui.perfetto.dev).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
import shutil
from typing import Any, Iterable, Mapping, Sequence

import harness

BENCHMARK = "profile_step"
STEP_NAME = "profile_step"  # the StepTraceAnnotation around each traced step
GEMM, COMM, OTHER = "gemm", "comm", "other"
COLORS = {GEMM: "tab:blue", COMM: "tab:red", OTHER: "0.6"}
NO_TRACE_EXIT = 3  # exit code when the profiler wrote no perfetto trace

_COMM_ANY_CASE = re.compile(
    r"nccl|jaxoverlap|nvshmem|memcpy[\w ]*?(p2p|ptop|d2d|dtod|peer)|all[-_ ]?reduce|"
    r"all[-_ ]?gather|reduce[-_ ]?scatter|collective[-_ ]?permute|all[-_ ]?to[-_ ]?all",
    re.IGNORECASE)
_COMM_CASED = re.compile(r"Signal|Wait|Put")
_GEMM_ANY_CASE = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|dot", re.IGNORECASE)
# Lines of a device that repeat the streams' events at another granularity.
_DERIVED_LINES = re.compile(
    r"^(XLA Modules|XLA Ops|Async XLA Ops|XLA TraceMe|Framework Ops|Framework Name Scope|"
    r"TensorFlow Ops|TensorFlow Name Scope|Steps|Source code|Launch Stats)", re.IGNORECASE)


# ------------------------------------------------------------------ classification and overlap


def classify(name: str) -> str:
  """The category of an event by its name: ``"comm"``, ``"gemm"`` or ``"other"``."""
  if _COMM_ANY_CASE.search(name) or _COMM_CASED.search(name):
    return COMM
  if _GEMM_ANY_CASE.search(name):
    return GEMM
  return OTHER


def _union_us(spans: Sequence[tuple[float, float]]) -> float:
  total, end = 0.0, float("-inf")
  for s, e in sorted(spans):
    if e <= end:
      continue
    total += e - max(s, end)
    end = e
  return total


def overlap_summary(intervals: Iterable[tuple[Any, str, float, float]]) -> dict[str, float]:
  """GEMM, communication and overlapped time of a set of events.

  Args:
    intervals: ``(row, category, start_us, end_us)`` per event; ``row`` is any
      hashable (a stream); category ``"gemm"``, ``"comm"`` or ``"other"``.

  Returns:
    dict with ``gemm_us`` and ``comm_us`` (time with at least one event of the
    category active, any row), ``gemm_sum_us`` and ``comm_sum_us`` (sums of
    durations), ``overlap_us`` (time with a GEMM and a communication event
    active on two different rows), ``overlap_fraction`` (overlap_us / comm_us,
    0 without communication) and ``same_row_us`` (GEMM and communication both
    active, but only ever on one and the same row: nested events).
  """
  spans = {GEMM: [], COMM: []}
  points: list[tuple[float, int, Any, str]] = []
  for row, cat, start, end in intervals:
    if cat not in spans or not end > start:
      continue
    spans[cat].append((start, end))
    points.append((start, 1, row, cat))
    points.append((end, -1, row, cat))
  points.sort(key=lambda p: p[0])
  active = {GEMM: {}, COMM: {}}  # row -> open events
  overlap = same_row = 0.0
  i = 0
  while i < len(points):
    t = points[i][0]
    while i < len(points) and points[i][0] == t:  # all changes at t before measuring
      _, delta, row, cat = points[i]
      n = active[cat].get(row, 0) + delta
      if n:
        active[cat][row] = n
      else:
        active[cat].pop(row, None)
      i += 1
    if i == len(points):
      break
    dt = points[i][0] - t
    g, c = active[GEMM], active[COMM]
    if g and c:
      if len(g) > 1 or any(r not in g for r in c):
        overlap += dt
      else:
        same_row += dt
  gemm_us, comm_us = _union_us(spans[GEMM]), _union_us(spans[COMM])
  return {"gemm_us": gemm_us, "comm_us": comm_us,
          "gemm_sum_us": sum(e - s for s, e in spans[GEMM]),
          "comm_sum_us": sum(e - s for s, e in spans[COMM]),
          "overlap_us": overlap, "overlap_fraction": overlap / comm_us if comm_us else 0.0,
          "same_row_us": same_row}


# ------------------------------------------------------------------ trace parsing


@dataclasses.dataclass(frozen=True)
class Row:
  """One thread (stream) of a traced process: ``key`` = (pid, tid)."""
  key: tuple[Any, Any]
  process: str
  thread: str
  sort: tuple = ()

  @property
  def is_device(self) -> bool:
    p = self.process.lower()
    return p.startswith("/device:") or p.startswith(("gpu", "/gpu"))

  @property
  def label(self) -> str:
    proc = self.process.replace("/device:", "").replace("/host:", "host ")
    return f"{proc} {self.thread}"


@dataclasses.dataclass(frozen=True)
class Event:
  """A complete ("X") event: ``start``/``end`` in microseconds; ``args`` as the trace has them
  (e.g. a memcpy's ``memcpy_details``), or None."""
  row: tuple[Any, Any]
  name: str
  start: float
  end: float
  args: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)


def find_trace_file(logdir: str) -> str | None:
  """The newest ``perfetto_trace.json.gz`` under ``logdir`` (else ``*.trace.json.gz``), or None."""
  for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz"):
    found = glob.glob(os.path.join(logdir, "**", pattern), recursive=True)
    if found:
      return max(found, key=os.path.getmtime)
  return None


def load_trace(path: str) -> dict[str, Any]:
  """Reads a Chrome/Perfetto JSON trace (gzip or plain); a bare event list is wrapped."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    trace = json.load(f)
  return {"traceEvents": trace} if isinstance(trace, list) else trace


def parse_trace(trace: Mapping[str, Any], min_dur_us: float = 1e-3
                ) -> tuple[dict[tuple, Row], list[Event], list[tuple[float, float]]]:
  """The rows, the complete events and the step annotations of a trace.

  Args:
    trace: ``{"traceEvents": [...]}`` in the Chrome trace format (``ts`` and
      ``dur`` in microseconds; ``process_name``/``thread_name`` metadata).
    min_dur_us: shorter events (instant markers) are dropped.

  Returns:
    (rows by (pid, tid), events without the step annotations, sorted by start;
    ``(start, end)`` of each ``STEP_NAME`` annotation, sorted).
  """
  procs: dict[Any, str] = {}
  proc_sort: dict[Any, int] = {}
  threads: dict[tuple, str] = {}
  thread_sort: dict[tuple, int] = {}
  events, steps = [], []
  for e in trace.get("traceEvents", []):
    ph = e.get("ph")
    if ph == "M":
      args = e.get("args") or {}
      key = (e.get("pid"), e.get("tid"))
      if e.get("name") == "process_name":
        procs[e.get("pid")] = str(args.get("name", ""))
      elif e.get("name") == "process_sort_index":
        proc_sort[e.get("pid")] = int(args.get("sort_index", 0))
      elif e.get("name") == "thread_name":
        threads[key] = str(args.get("name", ""))
      elif e.get("name") == "thread_sort_index":
        thread_sort[key] = int(args.get("sort_index", 0))
    elif ph == "X" and "ts" in e:
      start, dur = float(e["ts"]), float(e.get("dur", 0.0))
      if e.get("name") == STEP_NAME:
        steps.append((start, start + dur))
      elif dur >= min_dur_us:
        events.append(Event((e.get("pid"), e.get("tid")), str(e.get("name", "")), start,
                            start + dur, e.get("args")))
  rows = {}
  for key in {ev.row for ev in events} | set(threads):
    pid, tid = key
    rows[key] = Row(key, procs.get(pid, str(pid)), threads.get(key, str(tid)),
                    (proc_sort.get(pid, 0), thread_sort.get(key, 0), threads.get(key, str(tid))))
  events.sort(key=lambda ev: ev.start)
  return rows, events, sorted(steps)


def select_rows(rows: Mapping[tuple, Row], events: Sequence[Event]) -> tuple[list[Row], str]:
  """The rows to draw and measure, with a word on where they came from.

  Device streams ("Stream ..." threads of "/device:..." processes) if any have
  events; else the device's other lines but the derived ones (XLA Ops, ...);
  else every host thread with events.

  Returns:
    (rows in trace order, ``"device streams"``, ``"device lines"`` or ``"host threads"``).
  """
  busy = {ev.row for ev in events}
  with_events = [r for r in rows.values() if r.key in busy]
  device = [r for r in with_events if r.is_device]
  streams = [r for r in device if "stream" in r.thread.lower()]
  if streams:
    chosen, source = streams, "device streams"
  elif [r for r in device if not _DERIVED_LINES.match(r.thread)]:
    chosen, source = [r for r in device if not _DERIVED_LINES.match(r.thread)], "device lines"
  else:
    chosen, source = [r for r in with_events if not r.is_device], "host threads"
  return sorted(chosen, key=lambda r: r.sort), source


def step_window(steps: Sequence[tuple[float, float]], events: Sequence[Event],
                rows: Iterable[Row]) -> tuple[float, float]:
  """The last step annotation, shrunk to the events of ``rows`` inside it.

  Without annotations, the span of all events of ``rows``.

  Raises:
    ValueError: no event on ``rows`` (nothing to show).
  """
  keys = {r.key for r in rows}
  mine = [ev for ev in events if ev.row in keys]
  if not mine:
    raise ValueError("the trace holds no event on the selected rows")
  lo, hi = (steps[-1] if steps else (min(e.start for e in mine), max(e.end for e in mine)))
  inside = [ev for ev in mine if ev.end > lo and ev.start < hi]
  if not inside:
    return lo, hi
  return max(lo, min(e.start for e in inside)), min(hi, max(e.end for e in inside))


def clip(events: Iterable[Event], window: tuple[float, float], rows: Iterable[Row]
         ) -> list[Event]:
  """The events of ``rows`` that overlap ``window``, cut to it."""
  lo, hi = window
  keys = {r.key for r in rows}
  return [Event(ev.row, ev.name, max(ev.start, lo), min(ev.end, hi)) for ev in events
          if ev.row in keys and ev.end > lo and ev.start < hi]


def analyze(trace: Mapping[str, Any], max_rows: int = 40) -> dict[str, Any]:
  """Rows, window, clipped events and overlap summary of a trace (rank 0's).

  Args:
    trace: the loaded trace (``load_trace``).
    max_rows: draw and measure at most this many rows (the busiest in the window).

  Returns:
    dict: ``rows`` (``Row`` list), ``source``, ``window`` (start, end us),
    ``events`` (clipped ``Event`` list), ``summary`` (``overlap_summary`` plus
    ``window_us``), ``per_row`` (label, busy us per category, event count),
    ``top`` (the longest kernels/ops per category: name, total us, count),
    ``step_us`` (durations of the step annotations).
  """
  rows_by_key, events, steps = parse_trace(trace)
  rows, source = select_rows(rows_by_key, events)
  window = step_window(steps, events, rows)
  clipped = clip(events, window, rows)
  busy: dict[tuple, float] = {}
  for ev in clipped:
    busy[ev.row] = busy.get(ev.row, 0.0) + ev.end - ev.start
  rows = [r for r in rows if r.key in busy]  # idle during the window: not drawn
  if len(rows) > max_rows:
    keep = set(sorted(busy, key=busy.get, reverse=True)[:max_rows])
    rows = [r for r in rows if r.key in keep]
    clipped = [ev for ev in clipped if ev.row in keep]
  summary = overlap_summary((ev.row, classify(ev.name), ev.start, ev.end) for ev in clipped)
  summary["window_us"] = window[1] - window[0]
  per_row = []
  for r in rows:
    mine = [ev for ev in clipped if ev.row == r.key]
    cats = {c: _union_us([(ev.start, ev.end) for ev in mine if classify(ev.name) == c])
            for c in (GEMM, COMM, OTHER)}
    per_row.append({"row": r.label, **{f"{c}_us": v for c, v in cats.items()},
                    "events": len(mine)})
  totals: dict[tuple[str, str], list[float]] = {}
  for ev in clipped:
    t = totals.setdefault((classify(ev.name), ev.name), [0.0, 0])
    t[0] += ev.end - ev.start
    t[1] += 1
  top = {c: [{"name": n[:160], "us": v[0], "count": v[1]}
             for (cat, n), v in sorted(totals.items(), key=lambda kv: -kv[1][0]) if cat == c][:8]
         for c in (GEMM, COMM, OTHER)}
  return {"rows": rows, "source": source, "window": window, "events": clipped,
          "summary": summary, "per_row": per_row, "top": top,
          "step_us": [e - s for s, e in steps]}


# ------------------------------------------------------------------ picture


def plot_timeline(path: str, rows: Sequence[Row], events: Sequence[Event],
                  window: tuple[float, float], title: str,
                  summary: Mapping[str, float] | None = None) -> None:
  """Draws one row per stream/thread with a box per event, colored by ``classify``.

  Args:
    path: the PNG to write.
    rows: the rows, top to bottom.
    events: the events (already cut to ``window``); those of other rows are ignored.
    window: (start, end) in microseconds; the x axis is ms from its start.
    title: the figure's title.
    summary: ``overlap_summary`` output, shown under the title.
  """
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.patches import Patch

  n = max(1, len(rows))
  fig = Figure(figsize=(14, 1.6 + 0.42 * n))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot()
  lo, hi = window
  index = {r.key: i for i, r in enumerate(rows)}
  boxes: dict[tuple[int, str], list[tuple[float, float]]] = {}
  for ev in events:
    if ev.row in index:
      boxes.setdefault((index[ev.row], classify(ev.name)), []).append(
          ((ev.start - lo) / 1e3, (ev.end - ev.start) / 1e3))
  for (i, cat), spans in boxes.items():
    # Other first (bottom), then GEMM, then communication on top.
    z = {OTHER: 1, GEMM: 2, COMM: 3}[cat]
    ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=COLORS[cat], edgecolors="none", zorder=z)
  ax.set_yticks(range(n))
  ax.set_yticklabels([r.label[:48] for r in rows] or ["(no rows)"], fontsize=7)
  ax.set_ylim(n - 0.5, -0.5)
  ax.set_xlim(0, max((hi - lo) / 1e3, 1e-6))
  ax.set_xlabel("ms from the start of the step window")
  ax.grid(axis="x", alpha=0.3)
  ax.legend(handles=[Patch(color=COLORS[c], label=c) for c in (GEMM, COMM, OTHER)],
            loc="upper right", fontsize=8, ncol=3)
  if summary:
    title += ("\nGEMM {g:.3f} ms, communication {c:.3f} ms, overlapped {o:.3f} ms "
              "({f:.0%} of communication), window {w:.3f} ms").format(
                  g=summary["gemm_us"] / 1e3, c=summary["comm_us"] / 1e3,
                  o=summary["overlap_us"] / 1e3, f=summary["overlap_fraction"],
                  w=summary.get("window_us", hi - lo) / 1e3)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


# ------------------------------------------------------------------ main


def define_flags():
  """Defines the command-line flags (only when run as a script, so importing is free)."""
  from absl import flags

  flags.DEFINE_string("preset", "gpu_small", "preset of examples/train/config.py")
  flags.DEFINE_enum("backend", "cuda", ["auto", "xla", "cuda"], "jaxoverlap backend")
  flags.DEFINE_string("algorithm", None, "jaxoverlap algorithm (default: the preset's)")
  flags.DEFINE_integer("steps_traced", 2, "traced steps; the last one is drawn and measured")
  flags.DEFINE_bool("trace", True, "--notrace: run the same steps (batches made beforehand) "
                    "without jax.profiler and report nothing: tells a failure of the profiler "
                    "apart from one of the steps themselves")
  flags.DEFINE_bool("trace_from_start", False, "start the profiler before the warm-up steps, "
                    "so that XLA records its CUDA graphs under the active session")
  flags.DEFINE_string("logdir", "/tmp/jaxoverlap_profile", "profiler output; rank r traces "
                      "into <logdir>/rank<r> (emptied first)")
  flags.DEFINE_integer("max_rows", 40, "draw at most this many rows (the busiest)")
  harness.define_flags("out", "machine", "mesh", "distributed",
                       warmup=(3, "untraced steps first (compilation, autotuning)"),
                       host_devices=8)


def main(argv):
  del argv
  from absl import app, flags

  fl = flags.FLAGS
  if fl.steps_traced < 1 or fl.warmup < 1:
    raise app.UsageError("--steps_traced and --warmup must be >= 1")
  try:
    mesh = tuple(harness.parse_ints("mesh", fl.mesh)) if fl.mesh else None
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  config_lib, data_lib, train = harness.start_training_example(
      distributed=fl.distributed, cuda=fl.backend == "cuda", host_devices=fl.host_devices)
  import jax
  from jax.experimental import multihost_utils

  import jaxoverlap

  rank = jax.process_index()
  overrides: dict[str, Any] = {"backend": fl.backend}
  if mesh:
    overrides["mesh"] = mesh
  if fl.algorithm:
    overrides["algorithm"] = fl.algorithm
  config = dataclasses.replace(config_lib.get_config(fl.preset), **overrides)
  setup = train.build(config)
  state, setup.state = setup.state, None
  corpus = data_lib.load_corpus(val_percent=config.val_percent)

  logdir = os.path.join(os.path.abspath(fl.logdir), f"rank{rank}")
  if fl.trace and fl.trace_from_start:
    # The profiling session is active when XLA first records its CUDA graphs.
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir, exist_ok=True)
    jax.profiler.start_trace(logdir, create_perfetto_trace=True)
  # The first step compiles: its plans say where each op ran (backend "cuda"
  # raises there, with the reason, where the CUDA kernels cannot run).
  jaxoverlap.clear_decisions()
  for step in range(fl.warmup):
    state, loss = setup.train_step(state, setup.train_batch(corpus, step))
    jax.block_until_ready((state, loss))
  resolved = harness.resolved_backends()
  if rank == 0:
    print(f"profile_step: {fl.preset} ({setup.num_params:,} parameters), backend {fl.backend} "
          f"-> {resolved}, mesh dp={setup.mesh.shape['dp']} x tp={setup.mesh.shape['tp']} on "
          f"{jax.device_count()} {jax.devices()[0].platform} devices", flush=True)
  batches = [setup.train_batch(corpus, fl.warmup + i) for i in range(fl.steps_traced)]
  jax.block_until_ready(batches)
  if not fl.trace:
    for batch in batches:
      state, loss = setup.train_step(state, batch)
      jax.block_until_ready((state, loss))
    multihost_utils.sync_global_devices("profile_step:end")
    if rank == 0:
      print(f"profile_step --notrace: {fl.warmup} + {len(batches)} steps ran", flush=True)
    return 0
  if not fl.trace_from_start:
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir, exist_ok=True)
    jax.profiler.start_trace(logdir, create_perfetto_trace=True)
  losses = []
  try:
    for i, batch in enumerate(batches):
      with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
        state, loss = setup.train_step(state, batch)
        jax.block_until_ready((state, loss))
      losses.append(loss)
  finally:
    jax.profiler.stop_trace()
  losses = [float(x) for x in jax.device_get(losses)]
  code = _report(fl, config, setup, resolved, logdir, losses) if rank == 0 else 0
  # No process leaves (and shuts jax.distributed and NVSHMEM down) before rank 0 is done.
  multihost_utils.sync_global_devices("profile_step:end")
  return code


def _report(fl, config, setup, resolved: Mapping[str, str], logdir: str,
            losses: Sequence[float]) -> int:
  """Rank 0: analyzes its trace, writes the JSON and PNG, prints the summary; the exit code."""
  import jax

  path = find_trace_file(logdir)
  if path is None:
    print(f"NO_PERFETTO_TRACE: jax.profiler.trace wrote no perfetto_trace.json.gz under "
          f"{logdir}", flush=True)
    return NO_TRACE_EXIT
  analysis = analyze(load_trace(path), max_rows=fl.max_rows)
  s = analysis["summary"]
  platform = jax.devices()[0].platform
  if analysis["source"] == "host threads" and platform == "gpu":
    print("warning: the trace has no device rows (is CUPTI available?); drew host threads",
          flush=True)
  impl = harness.run_impl(fl.backend, resolved)
  record = {"op": "train_step", "impl": impl, "dtype": config.dtype,
            "shape": harness.run_shape(fl.preset, dataclasses.asdict(config),
                                       setup.mesh.shape["dp"], setup.mesh.shape["tp"]),
            "world": jax.process_count(), "time_us": round(s["window_us"], 1),
            "gemm_us": round(s["gemm_us"], 1), "comm_us": round(s["comm_us"], 1),
            "overlap_us": round(s["overlap_us"], 1),
            "overlap_fraction": round(s["overlap_fraction"], 4),
            "backend": fl.backend, "algorithm": config.algorithm, "resolved": dict(resolved)}
  machine = harness.machine_name(fl.machine)
  out_json = harness.path(fl.out, f"{BENCHMARK}-{fl.backend}", machine)
  harness.write_result(
      out_json, [record], benchmark=BENCHMARK, machine=machine,
      script="benchmarks/profile_step.py", latency=False,
      method=(f"{fl.warmup} warm-up steps, then {fl.steps_traced} steps under "
              "jax.profiler.trace (each in a StepTraceAnnotation, waited on); rank 0's "
              "perfetto trace; window = the last traced step, shrunk to its events; "
              "time_us = the window; gemm_us/comm_us = union of the category's events on "
              "the rows; overlap_us = time with GEMM and communication active on different "
              "rows; events classified by name (see benchmarks/profile_step.py)"),
      extra={"summary": s, "row_source": analysis["source"], "rows": analysis["per_row"],
             "top_events": analysis["top"], "traced_step_us": analysis["step_us"],
             "median_traced_step_us": (harness.median(analysis["step_us"])
                                       if analysis["step_us"] else None),
             "traced_losses": list(losses), "platform": platform, "trace_file": path})
  out_png = harness.path(fl.out, f"{BENCHMARK}-{fl.backend}", machine, ext="png")
  plot_timeline(out_png, analysis["rows"], analysis["events"], analysis["window"],
                f"{fl.preset}, backend {fl.backend} ({impl}), {machine}, rank 0 of "
                f"{jax.process_count()}: one training step ({analysis['source']})", s)
  print(f"window {s['window_us'] / 1e3:.3f} ms: GEMM {s['gemm_us'] / 1e3:.3f} ms "
        f"(sum {s['gemm_sum_us'] / 1e3:.3f}), communication {s['comm_us'] / 1e3:.3f} ms "
        f"(sum {s['comm_sum_us'] / 1e3:.3f}), overlapped {s['overlap_us'] / 1e3:.3f} ms "
        f"= {s['overlap_fraction']:.0%} of communication; rows: {analysis['source']}")
  print(f"wrote {out_json} and {out_png}; trace {path}", flush=True)
  return 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
