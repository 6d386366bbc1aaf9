"""Plots the cost model on 1-64 nodes: all-reduce latency, NVRAR's speed-up, auto's choices.

  python benchmarks/plot_cluster_model.py [--out benchmarks/results] [--png docs/cluster_model.png]

No GPU and no measurement: every number is a prediction of
``jaxoverlap.tuning.cluster`` (the alpha-beta model of
``jaxoverlap.tuning.cost_model`` with the machine presets there). Draws
``--png``:

* rows 1-2: latency against message size on the ``h200_ndr`` preset, 8 and 4
  GPUs per node, at 1, 2, 8 and 64 nodes: psum (NCCL's best, as XLA calls
  it), NCCL's ring and tree, NVRAR (our hierarchical kernel); in one node our
  one-shot and two-shot kernels instead of NVRAR;
* row 3: NVRAR's speed-up over NCCL on each preset for 2-64 nodes, with the
  paper's "up to 1.9x-3.6x at 128 KB-2 MB" (arXiv 2511.09557), and what
  ``Policy.choose`` picks at 8 nodes x 8 GPUs with no measured table.

Writes ``<out>/cluster_model.json`` in the results format of
``jaxoverlap.tuning.results`` (machine "model (no GPU)", the command, the
versions) with the predictions under ``"predictions"``, not ``"records"``:
they are not measurements, and no tuning policy may read them as such. It
also holds the presets with their sources, the paper comparison and the
policy's choices at 4x4, 8x8 and 64x8. Prints the Markdown tables of
docs/cluster_model.md.
"""

from __future__ import annotations

import io
import os

from absl import app, flags

import harness
from jaxoverlap.tuning import cluster, cost_model, policy

harness.define_flags("out", "dtype")
flags.DEFINE_string("png", "docs/cluster_model.png", "where the figure goes")
FLAGS = flags.FLAGS

POLICY_SIZES = tuple(8192 << i for i in range(16))    # 8 KiB ... 256 MiB
POLICY_TOPOLOGIES = ((4, 4), (8, 8), (8, 64))          # (GPUs per node, nodes)
LATENCY_NODES = (1, 2, 8, 64)
STYLE = {
    cost_model.PSUM: dict(color="black", lw=2.4, label="psum (NCCL's best)"),
    cluster.NCCL_RING: dict(color="tab:blue", ls="--", label="NCCL ring"),
    cluster.NCCL_TREE: dict(color="tab:green", ls="--", label="NCCL tree"),
    cluster.NVRAR: dict(color="tab:red", lw=2.0, label="NVRAR (hierarchical)"),
    "one_shot": dict(color="tab:orange", label="one_shot"),
    "two_shot": dict(color="tab:purple", label="two_shot"),
}


def _size(b: int) -> str:
  return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def topologies() -> list[tuple[str, int, int]]:
  """(preset, GPUs per node, nodes) of the predictions: h200_ndr at 8 and 4 GPUs, the others."""
  out = []
  for name, gpus in (("h200_ndr", 8), ("h200_ndr", 4), ("perlmutter", 4), ("vista", 1)):
    out += [(name, gpus, n) for n in cluster.NODES if gpus * n > 1]
  return out


def predictions(itemsize: int) -> list[dict]:
  """Every algorithm's time at every size of ``cluster.SIZES``, per topology."""
  rows = []
  for name, gpus, nodes in topologies():
    params = cluster.PRESETS[name].params
    per_size = [cluster.predict(b, itemsize, gpus, nodes, params) for b in cluster.SIZES]
    for alg in per_size[0]:
      rows.append({"preset": name, "gpus_per_node": gpus, "num_nodes": nodes, "algorithm": alg,
                   "time_us": [round(p[alg].time_us, 2) for p in per_size],
                   "detail": [p[alg].detail for p in per_size]})
  return rows


def policy_choices(itemsize: int) -> dict[str, list[dict]]:
  """What ``Policy.choose`` picks with no table on the h200_ndr preset, per topology."""
  chooser = policy.Policy((), cluster.PRESETS["h200_ndr"].params, path="(no table)",
                          missing=True)
  out = {}
  for gpus, nodes in POLICY_TOPOLOGIES:
    out[f"{nodes}x{gpus}"] = [
        {k: r[k] for k in ("bytes", "algorithm", "protocol", "time_us", "psum_us")}
        for r in chooser.table(gpus, nodes, sizes=POLICY_SIZES, itemsize=itemsize)]
  return out


def print_tables(paper: list[dict], choices: dict[str, list[dict]]) -> None:
  """The Markdown tables of docs/cluster_model.md."""
  print("\nPresets (values; sources in the JSON and docs/cluster_model.md)\n")
  keys = cost_model.PARAM_KEYS
  print("| preset | GPUs/node | " + " | ".join(keys) + " |")
  print("|---|---|" + "---|" * len(keys))
  for p in cluster.PRESETS.values():
    flat = p.params.as_flat()
    print(f"| {p.name} | {p.gpus_per_node} | " + " | ".join(f"{flat[k]:g}" for k in keys) + " |")
  print("\nNVRAR's speed-up over NCCL, model (bf16 messages; fp32 partials as our kernel, "
        "bf16 partials in brackets) beside the paper's 'up to 1.9x-3.6x at 128 KB-2 MB'\n")
  sizes = cluster.PAPER_SIZES
  print("| system | nodes x GPUs | " + " | ".join(_size(b) for b in sizes)
        + " | model's best | NVRAR faster up to | published |")
  print("|---|---|" + "---|" * len(sizes) + "---|---|---|")
  for r in paper:
    cells = " | ".join(f"{r['speedup'][b]:.2f} ({r['speedup_bf16_partials'][b]:.2f})"
                       for b in sizes)
    wins = _size(r["wins_up_to"]) if r["wins_up_to"] else "never"
    print(f"| {r['preset']} | {r['num_nodes']} x {r['gpus_per_node']} | {cells} | "
          f"{r['best']:.2f} ({r['best_bf16_partials']:.2f}) | {wins} | up to "
          f"{r['published'][0]}-{r['published'][1]}x |")
  for topo, rows in choices.items():
    print(f"\nPolicy.choose at {topo} (nodes x GPUs), h200_ndr preset, no measured table\n")
    print("| size | choice | predicted us | psum us |")
    print("|---|---|---|---|")
    for r in rows:
      pick = r["algorithm"] + (f" ({r['protocol']})" if r["protocol"] else "")
      print(f"| {_size(r['bytes'])} | {pick} | {r['time_us']:.1f} | {r['psum_us']:.1f} |")


def plot(rows: list[dict], choices: dict[str, list[dict]], itemsize: int, png: str) -> None:
  """Draws the figure described in the module docstring into ``png``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sizes = cluster.SIZES
  fig, axes = plt.subplots(3, 4, figsize=(22, 14))
  for row, gpus in enumerate((8, 4)):
    for ax, nodes in zip(axes[row], LATENCY_NODES):
      for r in rows:
        if (r["preset"], r["gpus_per_node"], r["num_nodes"]) == ("h200_ndr", gpus, nodes):
          ax.plot(sizes, r["time_us"], marker="o", ms=2.5, **STYLE[r["algorithm"]])
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_title(f"h200_ndr: {nodes} node(s) x {gpus} GPUs (model)")
      ax.set_xlabel("message size per rank (bytes)")
      ax.set_ylabel("predicted latency (us)")
      ax.grid(True, which="both", alpha=0.3)
      ax.legend(fontsize=7)
  colors = matplotlib.colormaps["viridis"]
  for ax, (name, gpus) in zip(axes[2], (("h200_ndr", 8), ("perlmutter", 4), ("vista", 1))):
    params = cluster.PRESETS[name].params
    node_counts = [n for n in cluster.NODES if n > 1]
    for i, nodes in enumerate(node_counts):
      x = [cluster.speedup(b, itemsize, gpus, nodes, params) for b in sizes]
      ax.plot(sizes, x, color=colors(i / (len(node_counts) - 1)), label=f"{nodes} nodes")
    ax.fill_between([128 << 10, 2 << 20], 1.9, 3.6, color="tab:red", alpha=0.12,
                    label="paper: up to 1.9-3.6x")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_title(f"{name} ({gpus} GPU(s)/node): NVRAR speed-up over NCCL")
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel("psum time / NVRAR time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  ax = axes[2][3]
  picks = choices["8x8"]
  ax.plot([r["bytes"] for r in picks], [r["psum_us"] for r in picks], color="black", lw=2.4,
          label="psum")
  for alg, color in ((cost_model.PSUM, "black"), ("hierarchical", "tab:red")):
    pts = [r for r in picks if r["algorithm"] == alg]
    ax.scatter([r["bytes"] for r in pts], [r["time_us"] for r in pts], color=color, zorder=3,
               label=f"auto picks {alg}")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_title("Policy.choose at 8 nodes x 8 GPUs (h200_ndr, no table)")
  ax.set_xlabel("message size per rank (bytes)")
  ax.set_ylabel("predicted latency (us)")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=7)
  fig.suptitle(f"jaxoverlap cost model, {FLAGS.dtype} all-reduce: predictions, not measurements")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=80)
  # A palette of 128 colours: a third of the bytes, the same figure (it is kept in git).
  from PIL import Image

  Image.open(buf).convert("RGB").quantize(colors=128).save(png, optimize=True)


def main(argv):
  del argv
  import jax.numpy as jnp

  itemsize = jnp.dtype(FLAGS.dtype).itemsize
  print(f"[1/4] predictions: {len(topologies())} topologies x {len(cluster.SIZES)} sizes",
        flush=True)
  rows = predictions(itemsize)
  print("[2/4] the paper's figures beside the model; the policy's choices", flush=True)
  paper = cluster.paper_comparison(itemsize=itemsize)
  choices = policy_choices(itemsize)
  print(f"[3/4] drawing {FLAGS.png}", flush=True)
  plot(rows, choices, itemsize, FLAGS.png)
  out = os.path.join(FLAGS.out, "cluster_model.json")
  print(f"[4/4] writing {out}", flush=True)
  harness.write_result(
      out, None, benchmark="cluster_model", machine="model (no GPU)",
      method="alpha-beta cost model (jaxoverlap.tuning.cost_model, .cluster): predictions for "
             "presets of machines, not measurements",
      script="benchmarks/plot_cluster_model.py", latency=False,
      extra={
          "dtype": FLAGS.dtype, "sizes": list(cluster.SIZES),
          "presets": {p.name: {"label": p.label, "gpus_per_node": p.gpus_per_node,
                               "params": p.params.as_flat(), "sources": dict(p.sources)}
                      for p in cluster.PRESETS.values()},
          "nccl_protocols": {k: vars(v) for k, v in cost_model.NCCL_PROTOCOL_COSTS.items()},
          "nccl_tree_bw_factor": cost_model.NCCL_TREE_BW_FACTOR,
          "predictions": rows,
          "paper_figures": list(cluster.PAPER_FIGURES),
          "paper_not_found": list(cluster.PAPER_NOT_FOUND),
          "paper_comparison": [dict(r, speedup={str(b): x for b, x in r["speedup"].items()},
                                    speedup_bf16_partials={
                                        str(b): x for b, x in r["speedup_bf16_partials"].items()})
                               for r in paper],
          "policy": choices,
      })
  print_tables(paper, choices)
  print(f"\nwrote {FLAGS.png} and {out}")


if __name__ == "__main__":
  app.run(main)
