"""Draws how the algorithms move data: the all-reduce kernels, and the fused ops' schedules.

  python benchmarks/plot_algorithms.py [--all_reduce_png docs/all_reduce_algorithms.png]
                                       [--fused_png docs/fused_schedule.png]

No GPU and no measurement: both figures are drawn from small models of the
algorithms, written here from the kernels' own descriptions, and each model
checks its result before anything is drawn.

* ``--all_reduce_png``: what each GPU holds after each phase of
  ``all_reduce``'s algorithms (``ffi/all_reduce/all_reduce.cu``): one_shot and
  two_shot on the 4 GPUs of one node, and hierarchical (NVRAR, arXiv
  2511.09557, sec. 4) on 4 nodes x 2 GPUs: an intra-node reduce-scatter,
  recursive doubling between the GPUs of the same local rank, an intra-node
  all-gather. Each bar is one GPU's buffer cut into as many shards as the node
  has GPUs; a shard's shade and label say how many of the GPUs' inputs its sum
  holds so far.
* ``--fused_png``: the fused ops' schedule on 4 ranks of a node
  (``ffi/overlap/overlap.cu``; CommFuse, arXiv 2604.24013, sec. 3), each
  rank's compute stream (the shard GEMMs, in the rank-adaptive order) and copy
  stream (the peer-to-peer transfers), against the collective followed by
  one GEMM. The durations are schematic: a shard GEMM takes 1, a shard's
  transfer ``--transfer`` (0.8 by default), the add kernel of GEMM+RS
  ``--add``; transfers do not slow GEMMs. Measured times:
  docs/results.md ("Fused ops").
"""

from __future__ import annotations

import dataclasses
import os

from absl import app, flags

flags.DEFINE_string("all_reduce_png", "docs/all_reduce_algorithms.png",
                    "where the all-reduce figure goes")
flags.DEFINE_string("fused_png", "docs/fused_schedule.png", "where the fused-ops figure goes")
flags.DEFINE_float("transfer", 0.8, "a shard's transfer time, in shard GEMMs")
flags.DEFINE_float("add", 0.3, "GEMM+RS's add kernel (groups of more than 2), in shard GEMMs")
flags.DEFINE_integer("ranks", 4, "ranks of the fused-ops figure")
flags.DEFINE_integer("chunks", 1, "chunks of each shard in the fused-ops figure")
FLAGS = flags.FLAGS

# ---------------------------------------------------------------------------- all-reduce
#
# A state maps each GPU (node, local rank) to its buffer: one entry per shard,
# the set of GPUs whose inputs that shard's sum holds, or None where the
# shard holds nothing the algorithm still needs (it is rewritten later).

Gpu = tuple[int, int]
State = dict[Gpu, list[frozenset | None]]


def initial(nodes: int, per_node: int) -> State:
  """Every GPU holds its own input in every shard."""
  return {(n, l): [frozenset({(n, l)})] * per_node
          for n in range(nodes) for l in range(per_node)}


def _node_gpus(state: State, node: int) -> list[Gpu]:
  return sorted(g for g in state if g[0] == node)


def one_shot(state: State) -> State:
  """Every GPU stores its whole buffer into every node peer's slot; each sums them (one phase)."""
  out = {}
  for (n, l) in state:
    peers = _node_gpus(state, n)
    out[(n, l)] = [frozenset().union(*(state[p][s] for p in peers))
                   for s in range(len(state[(n, l)]))]
  return out


def reduce_scatter(state: State) -> State:
  """Local rank l receives shard l from every node peer and sums it; the other shards are free."""
  out = {}
  for (n, l), buf in state.items():
    peers = _node_gpus(state, n)
    out[(n, l)] = [frozenset().union(*(state[p][s] for p in peers)) if s == l else None
                   for s in range(len(buf))]
  return out


def recursive_doubling_step(state: State, step: int) -> State:
  """Local rank l swaps its shard with local rank l of node ``node ^ 2**step`` and adds it."""
  out = {}
  for (n, l), buf in state.items():
    partner = state[(n ^ (1 << step), l)]
    out[(n, l)] = [mine | partner[s] if s == l else None for s, mine in enumerate(buf)]
  return out


def all_gather(state: State) -> State:
  """Shard s comes from local rank s of the same node (two_shot's second phase)."""
  return {(n, l): [state[(n, s)][s] for s in range(len(buf))] for (n, l), buf in state.items()}


@dataclasses.dataclass
class Algorithm:
  title: str
  nodes: int
  per_node: int
  steps: list[tuple[str, State]]   # (what happened, the state after it), the input first


def run(title: str, nodes: int, per_node: int, phases) -> Algorithm:
  """Applies ``phases`` [(label, fn)] to the inputs; raises unless every GPU ends with the sum."""
  state = initial(nodes, per_node)
  steps = [("input", state)]
  for label, fn in phases:
    state = fn(state)
    steps.append((label, state))
  everyone = frozenset(state)
  for gpu, buf in state.items():
    if any(s != everyone for s in buf):
      raise AssertionError(f"{title}: GPU {gpu} ends with {buf}, not the sum of all {len(state)}")
  return Algorithm(title, nodes, per_node, steps)


def algorithms() -> list[Algorithm]:
  """The three algorithms as drawn: one node of 4 GPUs, and 4 nodes x 2 GPUs."""
  rd = [(f"recursive doubling,\nstep {k + 1}: nodes n, n ^ {1 << k}\n(network, one-sided puts)",
         lambda s, k=k: recursive_doubling_step(s, k)) for k in range(2)]
  return [
      run("one_shot (one phase): every GPU sends its whole buffer to every peer", 1, 4,
          [("each GPU sums the 4 buffers\n(NVLink stores into the peers' slots)", one_shot)]),
      run("two_shot (two phases): reduce-scatter, then all-gather", 1, 4,
          [("reduce-scatter:\nGPU l sums shard l", reduce_scatter),
           ("all-gather:\nshard l from GPU l", all_gather)]),
      run("hierarchical (NVRAR): reduce-scatter in the node, recursive doubling between nodes, "
          "all-gather in the node", 4, 2,
          [("reduce-scatter in the node\n(NVLink)", reduce_scatter), *rd,
           ("all-gather in the node\n(NVLink)", all_gather)]),
  ]


def draw_all_reduce(path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.patches import Rectangle

  algos = algorithms()
  max_cols = max(len(a.steps) for a in algos)
  rows = [a.nodes * a.per_node for a in algos]
  fig, axes = plt.subplots(len(algos), 1, figsize=(2.6 * max_cols + 1.2, 0.55 * sum(rows) + 3.2),
                           gridspec_kw=dict(height_ratios=[r + 2.2 for r in rows]))
  colours = plt.get_cmap("tab10").colors
  for ax, a in zip(axes, algos):
    world = a.nodes * a.per_node
    gpus = sorted(a.steps[0][1])
    for col, (label, state) in enumerate(a.steps):
      x0 = col * 2.6
      ax.text(x0 + 1.0, len(gpus) + 0.25, label, ha="center", va="bottom", fontsize=8.5)
      for row, gpu in enumerate(gpus):
        y = len(gpus) - 1 - row
        width = 2.0 / a.per_node
        for s, held in enumerate(state[gpu]):
          xs = x0 + s * width
          if held is None:
            ax.add_patch(Rectangle((xs, y + 0.12), width, 0.76, facecolor="white",
                                   edgecolor="0.75", hatch="///", lw=0.8))
            continue
          frac = len(held) / world
          ax.add_patch(Rectangle((xs, y + 0.12), width, 0.76, facecolor=colours[s],
                                 alpha=0.15 + 0.85 * frac, edgecolor="black", lw=0.8))
          ax.text(xs + width / 2, y + 0.5, f"{len(held)}/{world}", ha="center", va="center",
                  fontsize=7.5, color="white" if frac > 0.6 else "black")
      if col > 0:
        ax.annotate("", xy=(x0 - 0.05, len(gpus) / 2), xytext=(x0 - 0.55, len(gpus) / 2),
                    arrowprops=dict(arrowstyle="->", lw=1.2, color="0.4"))
    for row, (n, l) in enumerate(gpus):
      y = len(gpus) - 1 - row
      name = f"GPU {l}" if a.nodes == 1 else f"node {n}, GPU {l}"
      ax.text(-0.1, y + 0.5, name, ha="right", va="center", fontsize=8)
      if a.nodes > 1 and l == 0 and n > 0:
        ax.axhline(y + 1, color="0.5", lw=0.8, ls=":")
    ax.set_title(a.title, fontsize=10, loc="left")
    ax.set_xlim(-1.4, max_cols * 2.6 - 0.4)
    ax.set_ylim(-0.1, len(gpus) + 1.9)
    ax.axis("off")
  fig.suptitle("all_reduce: what each GPU holds after each phase (k/N: the shard sums k of the N "
               "GPUs' inputs; hatched: free until rewritten)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------------------- fused ops
#
# Each rank enqueues operations on two streams in order, as overlap.cu's host
# code does; an operation starts when the one before it on its stream has
# ended and every operation it waits for (a flag set by a peer's transfer, an
# event) has ended.


@dataclasses.dataclass
class Op:
  rank: int
  stream: str          # "compute" or "copy"
  label: str
  kind: str            # "gemm", "transfer", "add"
  duration: float
  after: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (rank, key) it waits for
  key: str = ""
  start: float | None = None

  @property
  def end(self) -> float:
    return self.start + self.duration


def schedule(ops: list[Op]) -> list[Op]:
  """Sets every op's start; raises on a deadlock (an op that waits for one that cannot end)."""
  by_key = {(o.rank, o.key): o for o in ops if o.key}
  last: dict[tuple[int, str], float] = {}
  pending = list(ops)
  while pending:
    progressed, waiting = False, []
    done_stream: set[tuple[int, str]] = set()
    for o in pending:
      lane = (o.rank, o.stream)
      deps = [by_key[d] for d in o.after]
      if lane in done_stream or any(d.start is None for d in deps):
        done_stream.add(lane)   # stream order: nothing behind an op that cannot start yet
        waiting.append(o)
        continue
      o.start = max([last.get(lane, 0.0)] + [d.end for d in deps])
      last[lane] = o.end
      progressed = True
    if not progressed:
      raise AssertionError(f"deadlock: {[(o.rank, o.label) for o in waiting]}")
    pending = waiting
  return ops


def all_gather_matmul_ops(p: int, gemm: float, transfer: float, chunks: int = 1) -> list[Op]:
  """AllGather+GEMM: own shard first, then shard r-i chunk by chunk as each lands (ring step i)."""
  ops = []
  c = _chunk_suffix(chunks)
  for r in range(p):
    for i in range(1, p):
      for q in range(chunks):
        ops.append(Op(r, "copy", f"x{r}{c(q)}\u2192{(r + i) % p}", "transfer", transfer / chunks,
                      key=f"send{i}.{q}"))
    ops.append(Op(r, "compute", f"x{r}", "gemm", gemm))
    for i in range(1, p):
      src = (r - i) % p
      for q in range(chunks):
        ops.append(Op(r, "compute", f"x{src}{c(q)}", "gemm", gemm / chunks,
                      after=[(src, f"send{i}.{q}")]))
  return schedule(ops)


def matmul_reduce_scatter_ops(p: int, gemm: float, transfer: float, add: float,
                              chunks: int = 1) -> list[Op]:
  """GEMM+RS: the partials of ranks r+1, r+2, ... first, each chunk sent when done; own block last.

  Chunk q of the own block's GEMM adds chunk q of rank r-1's partial in its
  epilogue; the partials of ranks r-2, r-3, ... are added by one kernel after
  it (groups of more than 2). The partial of step i reuses step i-2's staging
  buffer, so its GEMMs wait for that step's transfers.
  """
  ops = []
  c = _chunk_suffix(chunks)
  for r in range(p):
    for i in range(1, p):
      dest = (r + i) % p
      for q in range(chunks):
        after = [(r, f"send{i - 2}.{chunks - 1}")] if i >= 3 and q == 0 else []
        ops.append(Op(r, "compute", f"\u2192{dest}{c(q)}", "gemm", gemm / chunks, after=after,
                      key=f"gemm{i}.{q}"))
        ops.append(Op(r, "copy", f"\u2192{dest}{c(q)}", "transfer", transfer / chunks,
                      after=[(r, f"gemm{i}.{q}")], key=f"send{i}.{q}"))
    for q in range(chunks):
      ops.append(Op(r, "compute", f"own {r}{c(q)}", "gemm", gemm / chunks,
                    after=[((r - 1) % p, f"send1.{q}")]))
    if p > 2:
      ops.append(Op(r, "compute", "+", "add", add * (p - 2),
                    after=[((r - i) % p, f"send{i}.{chunks - 1}") for i in range(2, p)]))
  return schedule(ops)


def _chunk_suffix(chunks: int):
  """Labels chunk q as ".q" when there is more than one."""
  return (lambda q: f".{q}") if chunks > 1 else (lambda q: "")


def baseline_ops(p: int, gemm: float, transfer: float, collective: str) -> list[Op]:
  """The collective (a ring: p-1 transfers) and one GEMM of p shards, one after the other.

  ``collective`` is "all-gather" (first) or "reduce-scatter" (after the GEMM).
  """
  coll = Op(0, "compute", f"{collective} ({p - 1} ring steps)", "transfer", (p - 1) * transfer)
  mm = Op(0, "compute", "one GEMM", "gemm", p * gemm)
  return schedule([coll, mm] if collective == "all-gather" else [mm, coll])


def draw_fused(path: str, p: int, transfer: float, add: float, chunks: int) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  colour = {"gemm": "tab:blue", "transfer": "tab:orange", "add": "tab:green"}
  panels = [("all_gather_matmul (AllGather+GEMM)", all_gather_matmul_ops(p, 1.0, transfer, chunks),
             baseline_ops(p, 1.0, transfer, "all-gather"), "all-gather, then one GEMM",
             "x_s: the GEMM of rank s's shard (the own shard first, then r-1, r-2, ...)\n"
             "x_s\u2192d: the shard sent to rank d (ring step i: to r+i)"),
            ("matmul_reduce_scatter (GEMM+ReduceScatter)",
             matmul_reduce_scatter_ops(p, 1.0, transfer, add, chunks),
             baseline_ops(p, 1.0, transfer, "reduce-scatter"), "one GEMM, then reduce-scatter",
             "\u2192d: the partial of rank d's block, computed, then sent (r+1 first, the own "
             "block last);\nown r: with r-1's partial added in the GEMM's epilogue; +: the "
             "partials of r-2, r-3")]
  fig, axes = plt.subplots(1, 2, figsize=(15, 1.0 + 0.62 * (2 * p + 2)), sharex=True)
  horizon = max(o.end for _, fused, base, _, _ in panels for o in fused + base)
  for ax, (title, fused, base, base_label, legend) in zip(axes, panels, strict=True):
    lanes = [(-1, "compute")] + [(r, s) for r in range(p) for s in ("compute", "copy")]
    y_of = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    for o in base:
      ax.barh(y_of[(-1, "compute")], o.duration, left=o.start, height=0.7,
              color=colour[o.kind], alpha=0.45, edgecolor="black", lw=0.6)
      ax.text(o.start + o.duration / 2, y_of[(-1, "compute")], o.label, ha="center",
              va="center", fontsize=8)
    for o in fused:
      y = y_of[(o.rank, o.stream)]
      ax.barh(y, o.duration, left=o.start, height=0.7, color=colour[o.kind], edgecolor="black",
              lw=0.6)
      ax.text(o.start + o.duration / 2, y, o.label, ha="center", va="center", fontsize=7.5,
              color="white" if o.kind != "add" else "black")
    end_fused = max(o.end for o in fused)
    end_base = max(o.end for o in base)
    ax.axvline(end_fused, color="tab:red", ls="--", lw=1)
    ax.axvline(end_base, color="0.3", ls=":", lw=1)
    ax.set_yticks([y_of[l] for l in lanes])
    ax.set_yticklabels([f"XLA: {base_label}" if r < 0 else f"rank {r} {s}" for r, s in lanes],
                       fontsize=8)
    ax.set_title(f"{title}\nfused: {end_fused:.1f}, unfused: {end_base:.1f} (shard GEMMs)",
                 fontsize=10)
    ax.set_xlim(0, horizon * 1.02)
    ax.set_xlabel(f"time, in shard GEMMs (schematic)\n{legend}", fontsize=8.5)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colour.values()]
  fig.legend(handles, ["GEMM", "transfer (copy engine, NVLink)", "add kernel"], loc="lower center",
             ncol=3, fontsize=8, frameon=False)
  split = f", {chunks} chunks a shard (.q: chunk q)" if chunks > 1 else ""
  fig.suptitle(f"Fused ops on {p} ranks of a node{split}: each rank's compute stream and copy "
               f"stream (schematic: a shard GEMM takes 1, a shard's transfer {transfer:g}; "
               f"transfers do not slow the GEMMs)", fontsize=9.5)
  fig.tight_layout(rect=(0, 0.04, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  for path in (FLAGS.all_reduce_png, FLAGS.fused_png):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  draw_all_reduce(FLAGS.all_reduce_png)
  draw_fused(FLAGS.fused_png, FLAGS.ranks, FLAGS.transfer, FLAGS.add, FLAGS.chunks)
  print(f"wrote {FLAGS.all_reduce_png} and {FLAGS.fused_png}")


if __name__ == "__main__":
  app.run(main)
