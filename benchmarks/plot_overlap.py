"""Plots the fused GEMM + collective benchmark and prints its tables.

  python benchmarks/plot_overlap.py [--results_dir benchmarks/results] [--machine "2x H200 NV18"]
                                    [--out_png PATH]

Reads overlap-<machine>.json and, when present, overlap_windowed_einsum-<machine>.json
(both written by benchmarks/overlap.py; <machine> with spaces as "_"). Draws
one panel per op with a group of bars per shape; a bar is an implementation's
time divided by the local GEMM's time of the same shape and run (1.0 is the
floor, no communication at all; the dashed line is 15% above it; the red
line over each group is GEMM + collective in series; the y axis starts at
0.8). xla:windowed_einsum comes from its own
run and is divided by that run's local GEMM. Writes
<results_dir>/overlap-<machine>.png (or --out_png) and prints one Markdown
table per op:

  shape | local GEMM ms | collective ms | naive ms | ppermute ms | windowed einsum ms |
  ours ms (the fastest jaxoverlap impl) | exposed ms | hidden % | speed-up vs best XLA

exposed = ours - local GEMM; hidden = 1 - exposed / collective; speed-up vs
best XLA = min over naive, ppermute and windowed einsum of (time / local GEMM
of its run), divided by ours / local GEMM. Missing entries are "-".
"""

from __future__ import annotations

import os

import harness
from harness import LOCAL_GEMM as FLOOR, COLLECTIVE as COMM, NAIVE, PPERMUTE, WINDOWED
from harness import GEMM_ALL_REDUCE as GEMM_AR

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
TITLES = {"all_gather_matmul": "AllGather + GEMM (column-parallel)",
          "matmul_reduce_scatter": "GEMM + ReduceScatter (row-parallel)",
          "matmul_all_reduce": "GEMM + AllReduce (row-parallel)"}
XLA_VARIANTS = (NAIVE, PPERMUTE, WINDOWED)
YMIN = 0.8  # bars are time / floor; the interesting range is 1.0 to about 2
# Bar order and colours; chunked variants (".../c<k>") follow their transport in shades of it.
IMPL_ORDER = (NAIVE, PPERMUTE, WINDOWED, "jaxoverlap:copy_engine", "jaxoverlap:nvshmem", GEMM_AR)
COLORS = {NAIVE: "#7f7f7f", PPERMUTE: "#bcbd22", WINDOWED: "#9467bd",
          "jaxoverlap:copy_engine": "#1f77b4", "jaxoverlap:nvshmem": "#2ca02c",
          GEMM_AR: "#ff7f0e"}
_SHADES = {"jaxoverlap:copy_engine": ("#6baed6", "#9ecae1", "#08519c", "#4292c6", "#c6dbef"),
           "jaxoverlap:nvshmem": ("#74c476", "#a1d99b", "#006d2c", "#41ab5d", "#c7e9c0")}


def load(results_dir: str, machine: str) -> tuple[dict, dict | None]:
  """(overlap result, windowed-einsum result or None) for ``machine``.

  Raises:
    FileNotFoundError: no overlap-<tag>.json in ``results_dir``.
  """
  return (harness.load_json(harness.path(results_dir, "overlap", machine)),
          harness.load_json(harness.path(results_dir, "overlap_windowed_einsum", machine),
                            missing_ok=True))


def _sort_key(impl: str):
  base, _, chunks = impl.partition("/")
  rank = IMPL_ORDER.index(base) if base in IMPL_ORDER else len(IMPL_ORDER)
  return rank, int(chunks[1:]) if chunks[1:].isdigit() else 0, impl


def _times(result: dict | None) -> dict:
  """{(op, (M, K, N)): {impl: time_us}}."""
  out: dict = {}
  for r in (result or {}).get("records", []):
    out.setdefault((r["op"], tuple(r["shape"])), {})[r["impl"]] = r["time_us"]
  return out


def rows(main: dict, windowed: dict | None = None) -> dict[str, list[dict]]:
  """Per op, one dict per shape (sorted by K, N, M), times in us; missing values None.

  Keys: shape, floor, comm, naive, ppermute, windowed, windowed_floor, ours,
  ours_impl, exposed, hidden, speedup, ratios ({impl: time / floor of its run}),
  serial ((floor + comm) / floor).
  """
  t_main, t_win = _times(main), _times(windowed)
  out: dict[str, list[dict]] = {}
  for (op, shape), t in sorted(t_main.items(), key=lambda kv: (kv[0][0], kv[0][1][1],
                                                                kv[0][1][2], kv[0][1][0])):
    w = t_win.get((op, shape), {})
    floor, comm = t.get(FLOOR), t.get(COMM)
    ours = {i: v for i, v in t.items() if i.startswith("jaxoverlap:")}
    best = min(ours, key=ours.get) if ours else None
    row = {"shape": shape, "floor": floor, "comm": comm, "naive": t.get(NAIVE),
           "ppermute": t.get(PPERMUTE), "windowed": w.get(WINDOWED),
           "windowed_floor": w.get(FLOOR), "ours_impl": best,
           "ours": ours.get(best), "exposed": None, "hidden": None, "speedup": None,
           "ratios": {}, "serial": None}
    if floor:
      row["ratios"] = {i: v / floor for i, v in t.items() if i not in (FLOOR, COMM)}
      if comm:
        row["serial"] = (floor + comm) / floor
    if row["windowed"] is not None and row["windowed_floor"]:
      row["ratios"][WINDOWED] = row["windowed"] / row["windowed_floor"]
    if best is not None and floor is not None:
      row["exposed"] = row["ours"] - floor
      if comm:
        row["hidden"] = 1.0 - row["exposed"] / comm
    if best is not None:
      if floor:
        xla = [row["ratios"][i] for i in XLA_VARIANTS if i in row["ratios"]]
        if xla:
          row["speedup"] = min(xla) / row["ratios"][best]
      else:  # no floor: raw times of this run only
        xla = [v for v in (row["naive"], row["ppermute"]) if v is not None]
        if xla:
          row["speedup"] = min(xla) / row["ours"]
    out.setdefault(op, []).append(row)
  return out


def _ms(us) -> str:
  return "-" if us is None else f"{us / 1e3:.3f}"


def markdown_tables(main: dict, windowed: dict | None = None) -> str:
  """One Markdown table per op (the columns of the module docstring)."""
  by_op = rows(main, windowed)
  world = next((r.get("world") for r in main.get("records", [])), "?")
  dtype = next((r.get("dtype") for r in main.get("records", [])), "?")
  parts = []
  for op in [o for o in OPS if o in by_op] + [o for o in by_op if o not in OPS]:
    parts.append(f"\n{op}, {main.get('machine', '?')}, world {world}, {dtype}, ms per op\n")
    parts.append("| shape (M,K,N) | local GEMM ms | collective ms | naive ms | ppermute ms | "
                 "windowed einsum ms | ours ms | exposed ms | hidden % | "
                 "speed-up vs best XLA |")
    parts.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in by_op[op]:
      ours = "-" if r["ours"] is None else (
          f"{r['ours'] / 1e3:.3f} ({harness.short_name(r['ours_impl'])})")
      hidden = "-" if r["hidden"] is None else f"{100 * r['hidden']:.0f}%"
      speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
      parts.append(f"| {','.join(map(str, r['shape']))} | {_ms(r['floor'])} | {_ms(r['comm'])} | "
                   f"{_ms(r['naive'])} | {_ms(r['ppermute'])} | {_ms(r['windowed'])} | {ours} | "
                   f"{_ms(r['exposed'])} | {hidden} | {speed} |")
  return "\n".join(parts)


def _color(impl: str, shade_index: dict) -> str:
  base, slash, _ = impl.partition("/")
  if not slash:
    return COLORS.get(base, "#d62728")
  shades = _SHADES.get(base, ("#e377c2", "#f7b6d2", "#8c564b", "#c49c94"))
  i = shade_index.setdefault(impl, len([k for k in shade_index if k.startswith(base)]))
  return shades[i % len(shades)]


def plot(main: dict, windowed: dict | None, path: str) -> str:
  """Draws the bar chart into ``path`` (PNG); returns ``path``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  by_op = rows(main, windowed)
  ops = [o for o in OPS if o in by_op] + [o for o in by_op if o not in OPS]
  if not ops:
    raise ValueError("no records to plot")
  impls = sorted({i for rs in by_op.values() for r in rs for i in r["ratios"]}, key=_sort_key)
  widest = max(len(by_op[o]) for o in ops)
  fig, axes = plt.subplots(len(ops), 1, figsize=(max(8.0, 1.6 * widest + 3), 3.8 * len(ops)),
                           squeeze=False)
  shade_index: dict = {}
  world = next((r.get("world") for r in main.get("records", [])), "?")
  for ax, op in zip(axes[:, 0], ops):
    shapes = by_op[op]
    present = [i for i in impls if any(i in r["ratios"] for r in shapes)]
    width = 0.8 / max(1, len(present))
    for j, impl in enumerate(present):
      xs = [g + (j - (len(present) - 1) / 2) * width for g, r in enumerate(shapes)
            if impl in r["ratios"]]
      ys = [r["ratios"][impl] for r in shapes if impl in r["ratios"]]
      ax.bar(xs, ys, width=width * 0.95, color=_color(impl, shade_index), label=impl)
    serial = [(g, r["serial"]) for g, r in enumerate(shapes) if r["serial"] is not None]
    if serial:
      ax.hlines([s for _, s in serial], [g - 0.42 for g, _ in serial],
                [g + 0.42 for g, _ in serial], colors="#d62728", lw=1.5,
                label="local GEMM + collective (in series)")
    ax.axhline(1.0, color="black", lw=1, label="local GEMM (floor)")
    ax.axhline(1.15, color="black", lw=1, ls="--", label="floor + 15%")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"{m}\n{k},{n}" for m, k, n in (r["shape"] for r in shapes)],
                       fontsize=8)
    ax.set_xlim(-0.6, len(shapes) - 0.4)
    top = max([1.3] + [v for r in shapes for v in r["ratios"].values()] +
              [r["serial"] or 0 for r in shapes])
    ax.set_ylim(YMIN, min(top * 1.05, 4.0))
    ax.set_ylabel(f"time / local GEMM (axis from {YMIN})", fontsize=8)
    ax.set_xlabel("M (rows), K,N", fontsize=8)
    ax.set_title(f"{TITLES.get(op, op)}: {main.get('machine', '?')}, TP={world}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
  handles = {}
  for ax in axes[:, 0]:
    for h, label in zip(*ax.get_legend_handles_labels()):
      handles.setdefault(label, h)
  ncol = min(len(handles), 5)
  fig.legend(list(handles.values()), list(handles), loc="upper center", ncol=ncol, fontsize=8,
             frameon=False)
  rows_of_legend = -(-len(handles) // ncol)
  fig.tight_layout(rect=(0, 0, 1, 1 - (0.2 + 0.17 * rows_of_legend) / fig.get_figheight()))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def define_flags():
  """Defines the command-line flags (only when run as a script, so importing is free)."""
  from absl import flags

  flags.DEFINE_string("results_dir", "benchmarks/results", "folder with the JSON files")
  flags.DEFINE_string("machine", "2x H200 NV18", "machine name (spaces or _) in the file names")
  flags.DEFINE_string("out_png", "", "PNG path (default: <results_dir>/overlap-<machine>.png)")


def main(argv):
  del argv
  from absl import flags

  FLAGS = flags.FLAGS
  main_result, windowed = load(FLAGS.results_dir, FLAGS.machine)
  print(markdown_tables(main_result, windowed))
  out = FLAGS.out_png or harness.path(FLAGS.results_dir, "overlap", FLAGS.machine, ext="png")
  print(f"\nwrote {plot(main_result, windowed, out)}")


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
