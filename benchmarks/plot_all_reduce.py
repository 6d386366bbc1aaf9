"""Plots the all-reduce benchmark results and prints the README table.

  python benchmarks/plot_all_reduce.py [--results benchmarks/results] [--machine "2x H200 NV18"]
      [--out_png /tmp/all_reduce.png]

Reads every all_reduce-<machine>-<nodes>x<ranks>.json in the folder (written
by benchmarks/all_reduce.py), draws latency against message size, one panel
per topology, into --out_png (default: all_reduce-<machine>.png in that
folder), and prints a Markdown table of the best jaxoverlap algorithm, auto
and psum per size (a size where no jaxoverlap algorithm was timed reads "-").
The machine is spelled as the benchmarks' --machine ("2x H200 NV18"; spaces
or underscores). A folder without such a file is an error naming it.
"""

from __future__ import annotations

import glob
import os
import re

from absl import app, flags

import harness

flags.DEFINE_string("results", "benchmarks/results", "folder with the JSON files")
flags.DEFINE_string("machine", "2x H200 NV18", "machine name as the benchmarks' --machine "
                    "(spaces become _ in the file names)")
flags.DEFINE_string("out_png", None, "where the picture goes (default: "
                    "<--results>/all_reduce-<machine>.png)")
FLAGS = flags.FLAGS
PSUM, AUTO, FLOOR = harness.PSUM, harness.AUTO, harness.LAUNCH_FLOOR


def _size(b: int) -> str:
  return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def _by_impl(result) -> dict[str, list]:
  by_impl: dict[str, list] = {}
  for r in result["records"]:
    by_impl.setdefault(r["impl"], []).append((r["bytes"], r["time_us"]))
  for pts in by_impl.values():
    pts.sort()
  return by_impl


def main(argv):
  del argv
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tag = FLAGS.machine.replace(" ", "_")
  files = sorted(glob.glob(os.path.join(FLAGS.results, f"all_reduce-{tag}-*.json")))
  files = [f for f in files if re.search(r"-\d+x\d+\.json$", f)]
  if not files:
    raise app.UsageError(f"no all_reduce-{tag}-<nodes>x<ranks>.json in {FLAGS.results} "
                         "(benchmarks/all_reduce.py writes them; --results, --machine)")
  fig, axes = plt.subplots(1, len(files), figsize=(6.5 * len(files), 4.8), squeeze=False)
  for ax, path in zip(axes[0], files):
    result = harness.load_json(path)
    topo = re.search(r"-(\d+)x(\d+)\.json$", path).groups()
    by_impl = _by_impl(result)
    # auto with the shipped tuning table, and psum, from their own later run.
    auto_path = path.replace(".json", "-auto.json")
    auto_run = _by_impl(harness.load_json(auto_path, missing_ok=True) or {"records": []})
    for impl, pts in sorted(by_impl.items()):
      if impl == AUTO:
        continue  # measured with an earlier policy; the -auto run has the shipped one
      style = {PSUM: dict(color="black", lw=2.5), FLOOR: dict(color="gray", ls=":")}.get(impl, {})
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=impl, **style)
    if auto_run:
      pts = auto_run[AUTO]
      ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=2.5, ls="--", color="tab:red",
              label="jaxoverlap:auto (2nd run)")
      pts = auto_run[PSUM]
      ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, ls="--", color="black",
              label="xla:psum (2nd run)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size per rank (bytes, bf16)")
    ax.set_ylabel("latency per all-reduce (us)")
    ax.set_title(f"{result['machine']}: {topo[0]} node(s) x {topo[1]} GPU(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)

    print(f"\n{result['machine']}, {topo[0]} node(s) x {topo[1]} GPU(s), bf16, us per all-reduce\n")
    print("| size | best jaxoverlap (run 1) | psum (run 1) | psum / best | auto (run 2) | "
          "psum (run 2) | psum / auto | launch floor |")
    print("|---|---|---|---|---|---|---|---|")
    sizes = sorted({b for pts in by_impl.values() for b, _ in pts})
    for b in sizes:
      ours = {i: t for i, pts in by_impl.items() for bb, t in pts
              if bb == b and i.startswith("jaxoverlap:") and i != AUTO}
      get = lambda table, i: next((t for bb, t in table.get(i, []) if bb == b), float("nan"))
      if not ours:  # every jaxoverlap algorithm was rejected or not run at this size
        print(f"| {_size(b)} | - | {get(by_impl, PSUM):.1f} | - | - | - | - | - |")
        continue
      best = min(ours, key=ours.get)
      psum1, floor = get(by_impl, PSUM), get(by_impl, FLOOR)
      auto2, psum2 = get(auto_run, AUTO), get(auto_run, PSUM)
      run2 = (f"{auto2:.1f} | {psum2:.1f} | {psum2 / auto2:.2f}x" if auto2 == auto2
              else "- | - | -")  # run 2 did not time this size
      print(f"| {_size(b)} | {ours[best]:.1f} ({harness.short_name(best)}) | {psum1:.1f} | "
            f"{psum1 / ours[best]:.2f}x | {run2} | {floor:.1f} |")
  out = FLAGS.out_png or os.path.join(FLAGS.results, f"all_reduce-{tag}.png")
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  print(f"\nwrote {out}")


if __name__ == "__main__":
  app.run(main)
