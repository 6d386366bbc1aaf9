"""Draws where a decode token's time goes: one GPU's step against its roofline, and TP=2 steps.

  python benchmarks/plot_decode_floor.py [--png docs/decode_floor.png]

No GPU: reads committed results of benchmarks/decode_floor.py (``--floor``)
and benchmarks/decode.py (``--decode``, each ``label=path``). Left panel,
per batch size, microseconds per token of one TP=2 rank's 32-layer step
without communication: the weights-read roofline, the weight matmuls alone
and the whole step, under XLA's defaults and with the layers' GEMMs padded
to 4 rows (``ParallelConfig(min_matmul_rows=4)``). Right panel, the TP=2
step on two GPUs at batch 1: psum, jaxoverlap's all-reduce and the floor
(no all-reduce), for each ``--decode`` file.
"""

from __future__ import annotations

from absl import app, flags

import harness

R = "benchmarks/results/"
flags.DEFINE_list("floor", [R + "decode_floor/decode_floor-1x_H200-variants.json",
                            R + "decode_floor/decode_floor-1x_H200-rows4.json"],
                  "decode_floor.py results (later files win for the same impl and batch)")
flags.DEFINE_list("decode", [
    "no padding=" + R + "decode_fuse_norm_32layers-2x_H200_NV18.json",
    "min_matmul_rows=4=" + R + "decode_32layers_rows4-2x_H200_NV18.json",
    "rows=4, psum in graphs=" + R + "decode_32layers_rows4_collectives_cmdbuf-2x_H200_NV18.json"],
    "label=decode.py results, drawn at batch --decode_batch")
flags.DEFINE_integer("decode_batch", 1, "the batch of the right panel")
flags.DEFINE_string("png", "docs/decode_floor.png", "where the figure goes")
FLAGS = flags.FLAGS

FLOOR_BARS = (  # impl, label, colour
    ("roofline", "weights-read roofline", "0.75"),
    ("matmuls/xla_default", "weight matmuls alone", "tab:blue"),
    ("matmuls/rows4", "weight matmuls, 4 rows", "tab:cyan"),
    ("step/xla_default", "step (XLA defaults)", "tab:red"),
    ("step/rows4", "step, min_matmul_rows=4", "tab:orange"),
)
DECODE_BARS = (("xla:psum", "psum", "black"), ("jaxoverlap:cuda:auto", "jaxoverlap", "tab:red"),
               ("floor:no_all_reduce", "no all-reduce", "0.75"))


def floor_table(paths: list[str]) -> dict[tuple[str, int], float]:
  """(impl, batch) -> us per token from decode_floor results; later files win."""
  out = {}
  for p in paths:
    for r in harness.load_results(p, "decode_floor")["records"]:
      out[(r["impl"], r["shape"]["batch"])] = r["time_us"]
  return out


def decode_table(path: str, batch: int) -> dict[str, float]:
  """impl -> us per token of a decode.py result at ``batch``."""
  return {r["impl"]: r["time_us"] for r in harness.load_results(path, "decode")["records"]
          if r["shape"]["batch"] == batch}


def main(argv):
  del argv
  bad = [item for item in FLAGS.decode if len(item.rsplit("=", 1)) != 2
         or not all(item.rsplit("=", 1))]
  if bad:
    raise app.UsageError(f"--decode: {bad} are not label=path")
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  floor = floor_table(FLAGS.floor)
  batches = sorted({b for _, b in floor})
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [3, 2]})
  width = 0.8 / len(FLOOR_BARS)
  for i, (impl, label, color) in enumerate(FLOOR_BARS):
    xs = [j + (i - len(FLOOR_BARS) / 2 + 0.5) * width for j, b in enumerate(batches)
          if (impl, b) in floor]
    ys = [floor[(impl, b)] for b in batches if (impl, b) in floor]
    ax.bar(xs, ys, width, label=label, color=color)
  ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
  ax.set_ylabel("us per token")
  ax.set_title("one TP=2 rank's 32-layer decode step, no communication (1x H200)", fontsize=9)
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
  ax.grid(True, axis="y", alpha=0.3)

  runs = [item.rsplit("=", 1) for item in FLAGS.decode]
  width = 0.8 / len(DECODE_BARS)
  for i, (impl, label, color) in enumerate(DECODE_BARS):
    ys = [decode_table(path, FLAGS.decode_batch).get(impl, 0.0) for _, path in runs]
    xs = [j + (i - len(DECODE_BARS) / 2 + 0.5) * width for j in range(len(runs))]
    bars = bx.bar(xs, ys, width, label=label, color=color)
    if impl != "floor:no_all_reduce":
      bx.bar_label(bars, fmt="%.0f", fontsize=7)
  bx.set_xticks(range(len(runs)), [label for label, _ in runs], fontsize=8)
  bx.set_ylabel("us per token")
  bx.set_title(f"TP=2 decode step, 32 layers, batch {FLAGS.decode_batch} (2x H200 NV18)",
               fontsize=9)
  bx.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
  bx.grid(True, axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(FLAGS.png, dpi=120)
  print(f"wrote {FLAGS.png}")


if __name__ == "__main__":
  app.run(main)
