"""How far each all-reduce kernel is from its floor, size by size (no GPU: reads a results file).

  python benchmarks/all_reduce_floors.py \\
      --results benchmarks/results/all_reduce-2x_H200_NV18-1x2.json [--out benchmarks/results]

The floor of a kernel is what its launch, its dependent signals and its data movement cost at
the hardware's speeds, with nothing else. For a message of M bytes per rank over P GPUs of one
node:

  launch   the fixed cost of one custom call inside XLA: the run's ``floor:launch`` record at
           its smallest size (a one-kernel copy of a few KiB: thunk or graph node, launch);
  signal   ALPHA_US (one NVLink one-way latency: the NVSHMEM signal ping-pong,
           docs/results.md "Baselines measured at the start") per dependent phase: one for
           one-shot, two for two-shot (reduce-scatter, then all-gather);
  wire     the bytes each GPU sends, at BETA_GBPS per direction (H200 NVLink: 900 GB/s
           both directions together; a link carries both directions at once): one-shot
           (P-1) M, two-shot 2 (P-1) M / P; the LL protocol sends 8-byte cells that carry
           4 bytes of data each, so twice that;
  hbm      the bytes through this GPU's HBM at HBM_GBPS (docs/decode.md's probe): the input
           read and the output written (2 M), and every received byte written by the peer
           and read back (one-shot 2 (P-1) M, two-shot 4 (P-1) M / P; twice for LL), and for
           the Lamport protocol the received bytes written back as the empty pattern (one-shot
           (P-1) M, two-shot 2 (P-1) M / P).

floor = launch + signal + max(wire, hbm): a kernel that streams can overlap its HBM traffic
with the transfers, not its launch or its dependent signals. The script prints, per size,
every kernel's measured time, its floor and the distance, and names the best kernel; it writes
``<out>/all_reduce_floors-<machine><--suffix>.json`` (the results format's header, the link
parameters and the rows; an analysis, so no ``records``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import harness

ALPHA_US = 0.71     # one-way NVLink signal, us
BETA_GBPS = 450.0   # H200 NVLink per direction, GB/s (900 GB/s both directions)
HBM_GBPS = 3700.0   # HBM, GB/s (docs/decode.md's read probe: 3.68-3.76 TB/s)
LL_FACTOR = 2       # LL8 cells: 4 bytes of data per 8 bytes sent


@dataclasses.dataclass(frozen=True)
class Links:
  alpha_us: float = ALPHA_US
  beta_gbps: float = BETA_GBPS
  hbm_gbps: float = HBM_GBPS


def kernel_floor_us(impl: str, nbytes: int, ranks: int, launch_us: float,
                    links: Links = Links()) -> dict[str, float] | None:
  """The floor of one kernel and its parts, us; None for an impl that is no kernel of ours.

  Args:
    impl: ``"jaxoverlap:<algorithm>_<protocol>"`` (one_shot or two_shot; ``two_shot``
      alone is the simple protocol, as in the results files).
    nbytes: message bytes per rank. ranks: GPUs of the node.
    launch_us: the fixed cost of one custom call.

  Returns:
    ``{"launch", "signal", "wire", "hbm", "floor"}``, us.
  """
  name = impl.removeprefix("jaxoverlap:")
  algorithm, _, protocol = name.partition("_shot")
  protocol = protocol.lstrip("_") or "simple"
  if algorithm not in ("one", "two") or protocol not in ("ll", "simple", "lamport"):
    return None
  factor = LL_FACTOR if protocol == "ll" else 1
  peers = ranks - 1
  if algorithm == "one":
    phases, sent, received_passes = 1, peers * nbytes, 2 * peers * nbytes
    if protocol == "lamport":
      received_passes += peers * nbytes  # the slots written back empty
  else:
    phases, sent, received_passes = 2, 2 * peers * nbytes / ranks, 4 * peers * nbytes / ranks
    if protocol == "lamport":
      received_passes += 2 * peers * nbytes / ranks
  parts = {"launch": launch_us, "signal": phases * links.alpha_us,
           "wire": factor * sent / (links.beta_gbps * 1e3),
           "hbm": (2 * nbytes + factor * received_passes) / (links.hbm_gbps * 1e3)}
  parts["floor"] = parts["launch"] + parts["signal"] + max(parts["wire"], parts["hbm"])
  return parts


def floors_table(result: dict[str, Any], links: Links = Links()) -> list[dict[str, Any]]:
  """One row per (size, kernel) of a results file's all-reduce records, with its floor.

  Raises:
    ValueError: the file holds no ``floor:launch`` record.
  """
  by_size: dict[int, dict[str, dict]] = {}
  for r in result["records"]:
    by_size.setdefault(r["bytes"], {})[r["impl"]] = r
  launches = [(b, recs["floor:launch"]["time_us"]) for b, recs in sorted(by_size.items())
              if "floor:launch" in recs]
  if not launches:
    raise ValueError("the results file holds no floor:launch record")
  launch_us = launches[0][1]  # the smallest size: the fixed cost, without a long copy
  rows = []
  for nbytes in sorted(by_size):
    recs = by_size[nbytes]
    kernels = {i: r for i, r in recs.items() if kernel_floor_us(i, nbytes, 2, 0.0) is not None}
    if not kernels:
      continue
    launch = launch_us
    best = min(kernels, key=lambda i: kernels[i]["time_us"])
    for impl, r in sorted(kernels.items()):
      f = kernel_floor_us(impl, nbytes, r["ranks_per_node"], launch, links)
      rows.append({"bytes": nbytes, "impl": impl, "time_us": r["time_us"],
                   **{k: round(v, 2) for k, v in f.items()},
                   "above_floor_us": round(r["time_us"] - f["floor"], 2),
                   "x_floor": round(r["time_us"] / f["floor"], 2), "best": impl == best,
                   "psum_us": recs.get("xla:psum", {}).get("time_us")})
  return rows


def _size(b: int) -> str:
  return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def markdown(rows: list[dict[str, Any]], best_only: bool = True) -> str:
  """size | kernel | measured | floor (launch + signal + max(wire, hbm)) | above | x | psum."""
  out = ["| size | kernel | measured us | floor us = launch + signal + max(wire, hbm) "
         "| above floor us | x floor | psum us |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    if best_only and not r["best"]:
      continue
    parts = (f"{r['launch']:.1f} + {r['signal']:.1f} + max({r['wire']:.1f}, "
             f"{r['hbm']:.1f})")
    psum = "-" if r["psum_us"] is None else f"{r['psum_us']:.1f}"
    out.append(f"| {_size(r['bytes'])} | {r['impl'].removeprefix('jaxoverlap:')} | "
               f"{r['time_us']:.1f} | {r['floor']:.1f} = {parts} | {r['above_floor_us']:.1f} | "
               f"{r['x_floor']:.2f} | {psum} |")
  return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
  """Measured (solid) against floor (dashed) per kernel, and psum, over the message sizes (PNG)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7.5, 4.8))
  colors = {}
  for impl in sorted({r["impl"] for r in rows}):
    pts = sorted((r["bytes"], r["time_us"], r["floor"]) for r in rows if r["impl"] == impl)
    label = impl.removeprefix("jaxoverlap:")
    line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
    colors[impl] = line.get_color()
    ax.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", lw=1, color=line.get_color(),
            label=f"{label} floor")
  psum = sorted({(r["bytes"], r["psum_us"]) for r in rows if r["psum_us"] is not None})
  ax.plot([p[0] for p in psum], [p[1] for p in psum], color="black", lw=2, label="psum")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  sizes = sorted({r["bytes"] for r in rows})
  ax.set_xticks(sizes, [_size(b) for b in sizes], rotation=45, fontsize=7)
  ax.set_xlabel("message per rank")
  ax.set_ylabel("us per call")
  ax.set_title(title, fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  from absl import flags

  fl = flags.FLAGS
  result = harness.load_results(fl.results, "all_reduce")
  links = Links(fl.alpha_us, fl.beta_gbps, fl.hbm_gbps)
  rows = floors_table(result, links)
  print(markdown(rows, best_only=True))
  print()
  print(markdown(rows, best_only=False))
  path = harness.path(fl.out, "all_reduce_floors", result["machine"], fl.suffix)
  harness.write_result(
      path, None, benchmark="all_reduce_floors", machine=result["machine"],
      script="benchmarks/all_reduce_floors.py", latency=False,
      method="floor = launch (the run's floor:launch at its smallest size) + signal + "
             "max(wire, hbm); see the script's docstring",
      extra={"source": fl.results, "source_command": result.get("command"),
             "links": dataclasses.asdict(links), "rows": rows})
  print(f"wrote {path}")
  if fl.png:
    plot(rows, fl.png, f"all-reduce against its floors, {result['machine']}, 2 GPUs "
         "(floor = launch + signal + max(wire, hbm))")
    print(f"wrote {fl.png}")
  return 0


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_string("results", "benchmarks/results/all_reduce-2x_H200_NV18-1x2.json",
                      "an all_reduce results file with floor:launch records")
  flags.DEFINE_float("alpha_us", ALPHA_US, "one-way NVLink signal latency, us")
  flags.DEFINE_float("beta_gbps", BETA_GBPS, "NVLink bandwidth per direction, GB/s")
  flags.DEFINE_float("hbm_gbps", HBM_GBPS, "HBM bandwidth, GB/s")
  flags.DEFINE_string("out", "benchmarks/results", "where the JSON goes")
  flags.DEFINE_string("suffix", "", "added to the JSON's name (one file per results file)")
  flags.DEFINE_string("png", None, "also draw measured against floor per kernel here")
  app.run(main)
