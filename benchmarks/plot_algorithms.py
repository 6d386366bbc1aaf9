"""Draws how the algorithms move data: the all-reduce kernels, and the fused ops' schedules.

  python benchmarks/plot_algorithms.py [--all_reduce_png docs/all_reduce_algorithms.png]
                                       [--fused_png docs/fused_schedule.png]

No GPU and no measurement: both figures are drawn from small models of the
algorithms, written here from the kernels, and each model checks its result
before anything is drawn (an ``AssertionError`` says what is wrong).

* ``--all_reduce_png``: what each GPU holds after each phase of
  ``all_reduce``'s algorithms (``ffi/all_reduce/all_reduce.cu``): one_shot and
  two_shot on the 4 GPUs of one node, and hierarchical (NVRAR, arXiv
  2511.09557, sec. 4) on 4 nodes x 2 GPUs: an intra-node reduce-scatter,
  recursive doubling between the GPUs of the same local rank (node counts
  that are not a power of two fold the extra nodes in first and out last, as
  MPICH does), an intra-node all-gather. Each bar is one GPU's buffer, cut
  into as many shards as the node has GPUs; "Σk" in a shard: its sum holds k
  GPUs' inputs. The model checks that every GPU ends with every input, once.
* ``--fused_png``: the fused ops' schedules (``ffi/overlap/overlap.cu``;
  CommFuse, arXiv 2604.24013, sec. 3) at 2 ranks with 2 chunks a shard (the
  measured configuration) and at 4 ranks with 1: each rank's compute stream
  (the shard GEMMs, in the rank-adaptive order) and copy stream (the
  peer-to-peer transfers), against the collective followed by one GEMM. The
  model checks that every GEMM waits for the shard or partial it reads, through
  its waits and stream order, whatever the timing, that no staging buffer is
  rewritten before the transfer that reads it ends, and that every output
  block sums every rank's partial once. The durations are a model: a shard
  GEMM takes 1, a shard's transfer ``--transfer``, the add kernel ``--add``
  per partial it adds, and transfers do not slow the GEMMs. Measured times:
  docs/results.md ("Fused ops").

The figures' PNG metadata ("Description") holds the drawn model as JSON and
this script's hash, so a test can tell a figure drawn by another version of the
model or of the drawing code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

from absl import app, flags

flags.DEFINE_string("all_reduce_png", "docs/all_reduce_algorithms.png",
                    "where the all-reduce figure goes")
flags.DEFINE_string("fused_png", "docs/fused_schedule.png", "where the fused-ops figure goes")
flags.DEFINE_float("transfer", 0.8, "a shard's transfer time, in shard GEMMs (> 0)")
flags.DEFINE_float("add", 0.15, "GEMM+RS's add kernel, per partial it adds, in shard GEMMs (>= 0)")
flags.register_validator("transfer", lambda v: math.isfinite(v) and v > 0,
                         "--transfer must be a finite number above 0")
flags.register_validator("add", lambda v: math.isfinite(v) and v >= 0,
                         "--add must be a finite number of at least 0")
FLAGS = flags.FLAGS

# The fused-ops figure: (ranks, chunks a shard) of its two rows.
FUSED_ROWS = ((2, 2), (4, 1))
FONT = 11

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


def _sum(sets) -> frozenset:
  """The union of contributions; two that overlap would count an input twice."""
  out: frozenset = frozenset()
  for s in sets:
    if out & s:
      raise AssertionError(f"inputs {sorted(out & s)} added twice")
    out |= s
  return out


def _node_gpus(state: State, node: int) -> list[Gpu]:
  return sorted(g for g in state if g[0] == node)


def one_shot(state: State) -> State:
  """Every GPU stores its whole buffer into every node peer's slot; each sums them (one phase)."""
  return {(n, l): [_sum(state[p][s] for p in _node_gpus(state, n)) for s in range(len(buf))]
          for (n, l), buf in state.items()}


def reduce_scatter(state: State) -> State:
  """Local rank l sums shard l over its node; its other shards are no longer needed."""
  return {(n, l): [_sum(state[p][l] for p in _node_gpus(state, n)) if s == l else None
                   for s in range(len(buf))]
          for (n, l), buf in state.items()}


def _pow2(nodes: int) -> int:
  p = 1
  while p * 2 <= nodes:
    p *= 2
  return p


def fold_in(state: State) -> State:
  """Node pow2 + i hands its shard to node i, which adds it (node counts not a power of two)."""
  nodes = 1 + max(n for n, _ in state)
  pow2 = _pow2(nodes)
  out = {}
  for (n, l), buf in state.items():
    if n >= pow2:
      out[(n, l)] = [None] * len(buf)
    elif n + pow2 < nodes:
      out[(n, l)] = [_sum([mine, state[(n + pow2, l)][l]]) if s == l else None
                     for s, mine in enumerate(buf)]
    else:
      out[(n, l)] = list(buf)
  return out


def recursive_doubling_step(state: State, step: int) -> State:
  """Among the first pow2 nodes, local rank l adds the shard of node ``n ^ 2**step``."""
  pow2 = _pow2(1 + max(n for n, _ in state))
  out = {}
  for (n, l), buf in state.items():
    if n >= pow2:
      out[(n, l)] = list(buf)
      continue
    partner = state[(n ^ (1 << step), l)][l]
    out[(n, l)] = [_sum([mine, partner]) if s == l else None for s, mine in enumerate(buf)]
  return out


def fold_out(state: State) -> State:
  """Node i hands the sum back to node pow2 + i."""
  pow2 = _pow2(1 + max(n for n, _ in state))
  return {(n, l): ([state[(n - pow2, l)][l] if s == l else None for s in range(len(buf))]
                   if n >= pow2 else list(buf))
          for (n, l), buf in state.items()}


def all_gather(state: State) -> State:
  """Shard s comes from local rank s of the same node."""
  return {(n, l): [state[(n, s)][s] for s in range(len(buf))] for (n, l), buf in state.items()}


def _pairs(nodes: int, step: int) -> str:
  pow2 = _pow2(nodes)
  return ", ".join(f"{n}\u2194{n ^ (1 << step)}" for n in range(pow2) if n < n ^ (1 << step))


def hierarchical_phases(nodes: int) -> list[tuple[str, object]]:
  """NVRAR's phases for ``nodes`` nodes (all_reduce.cu, HierarchicalLLKernel)."""
  pow2 = _pow2(nodes)
  phases: list[tuple[str, object]] = [("reduce-scatter\nin each node (NVLink)", reduce_scatter)]
  if pow2 < nodes:
    phases.append(("fold in: nodes past\nthe power of two", fold_in))
  for k in range(pow2.bit_length() - 1):
    phases.append((f"doubling step {k + 1}:\nnodes {_pairs(nodes, k)}",
                   lambda s, k=k: recursive_doubling_step(s, k)))
  if pow2 < nodes:
    phases.append(("fold out", fold_out))
  phases.append(("all-gather\nin each node (NVLink)", all_gather))
  return phases


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
  return [
      run("one_shot: one phase", 1, 4,
          [("every GPU stores its buffer\ninto each peer's slot and\nsums what it got", one_shot)]),
      run("two_shot: two phases", 1, 4,
          [("reduce-scatter:\nGPU l sums shard l", reduce_scatter),
           ("all-gather:\nshard l from GPU l", all_gather)]),
      run("hierarchical (NVRAR): 4 nodes x 2 GPUs; between nodes, one-sided puts (or direct "
          "stores) completed by sequence numbers", 4, 2, hierarchical_phases(4)),
  ]


def all_reduce_summary(algos: list[Algorithm]) -> list:
  """What the figure shows, as plain data: per algorithm and phase, each GPU's shard counts."""
  return [[a.title, [[label, [[len(s) if s is not None else None for s in state[g]]
                              for g in sorted(state)]] for label, state in a.steps]]
          for a in algos]


def _draw_algorithm(ax, a: Algorithm, colours) -> None:
  from matplotlib.patches import Rectangle

  world = a.nodes * a.per_node
  gpus = sorted(a.steps[0][1])
  col_w, bar_w = 2.7, 2.0
  for col, (label, state) in enumerate(a.steps):
    x0 = col * col_w
    ax.text(x0 + bar_w / 2, len(gpus) + 0.2, label, ha="center", va="bottom", fontsize=FONT - 1)
    for row, gpu in enumerate(gpus):
      y = len(gpus) - 1 - row
      width = bar_w / a.per_node
      for s, held in enumerate(state[gpu]):
        xs = x0 + s * width
        if held is None:
          ax.add_patch(Rectangle((xs, y + 0.1), width, 0.8, facecolor="white", edgecolor="0.7",
                                 hatch="///", lw=0.8))
          continue
        frac = len(held) / world
        ax.add_patch(Rectangle((xs, y + 0.1), width, 0.8, facecolor=colours[s],
                               alpha=0.2 + 0.8 * frac, edgecolor="black", lw=0.8))
        ax.text(xs + width / 2, y + 0.5, f"\u03a3{len(held)}", ha="center", va="center",
                fontsize=FONT - 1, color="white" if frac > 0.6 else "black")
    if col > 0:
      ax.annotate("", xy=(x0 - 0.08, len(gpus) / 2), xytext=(x0 - 0.6, len(gpus) / 2),
                  arrowprops=dict(arrowstyle="->", lw=1.4, color="0.35"))
  for row, (n, l) in enumerate(gpus):
    y = len(gpus) - 1 - row
    ax.text(-0.12, y + 0.5, f"GPU {l}" if a.nodes == 1 else f"node {n}, GPU {l}", ha="right",
            va="center", fontsize=FONT - 1)
    if a.nodes > 1 and l == 0 and n > 0:
      ax.plot([-1.6, len(a.steps) * col_w - 0.6], [y + 1, y + 1], color="0.5", lw=0.8, ls=":")
  ax.set_title(a.title, fontsize=FONT, loc="left")
  ax.set_xlim(-1.7 if a.nodes > 1 else -1.0, len(a.steps) * col_w - 0.5)
  ax.set_ylim(-0.1, len(gpus) + 1.5)
  ax.axis("off")


def draw_all_reduce(path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  algos = algorithms()
  colours = plt.get_cmap("tab10").colors
  fig = plt.figure(figsize=(13, 10.5))
  grid = fig.add_gridspec(2, 2, height_ratios=[4 + 1.6, 8 + 1.6], width_ratios=[2, 3])
  axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])]
  for ax, a in zip(axes, algos, strict=True):
    _draw_algorithm(ax, a, colours)
  fig.suptitle("all_reduce: what each GPU holds after each phase (\u03a3k: the shard sums k "
               "GPUs' inputs; hatched: not needed until rewritten)", fontsize=FONT + 1)
  fig.tight_layout()
  fig.savefig(path, dpi=100, metadata=_metadata(all_reduce_summary(algos)))
  plt.close(fig)


# ---------------------------------------------------------------------------- fused ops
#
# Each rank enqueues operations on two streams in order, as overlap.cu's host
# code does; an operation starts when the one before it on its stream has
# ended and every operation it waits for (a flag set by a peer's transfer, an
# event) has ended. The data fields say what each operation reads and
# writes, and the checks ask of every reader whether a chain of stream order
# and waits leads to it from the writer: a wait missing from the model shows
# up even where this model's timing happens to hide it.


@dataclasses.dataclass
class Op:
  rank: int
  stream: str          # "compute" or "copy"
  label: str
  kind: str            # "gemm", "transfer", "add"
  duration: float
  after: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (rank, key) it waits for
  key: str = ""
  data: dict = dataclasses.field(default_factory=dict)  # what it reads and writes (the checks)
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
    blocked: set[tuple[int, str]] = set()
    for o in pending:
      lane = (o.rank, o.stream)
      deps = [by_key[d] for d in o.after]
      if lane in blocked or any(d.start is None for d in deps):
        blocked.add(lane)   # stream order: nothing behind an op that cannot start yet
        waiting.append(o)
        continue
      o.start = max([last.get(lane, 0.0)] + [d.end for d in deps])
      last[lane] = o.end
      progressed = True
    if not progressed:
      raise AssertionError(f"deadlock: {[(o.rank, o.label) for o in waiting]}")
    pending = waiting
  return ops


_EPS = 1e-9


def _find(ops, **match) -> list[Op]:
  return [o for o in ops if all(o.data.get(k) == v for k, v in match.items())]


def _orders(ops: list[Op]):
  """``before(a, b)``: whether ``a`` ends before ``b`` starts on any GPU's timing: a chain of
  stream order and waits leads from ``a`` to ``b``, and the model's times agree."""
  by_key = {(o.rank, o.key): o for o in ops if o.key}
  preds: dict[int, list[Op]] = {}
  last: dict[tuple[int, str], Op] = {}
  for o in ops:   # ops are listed in each stream's enqueue order
    lane = (o.rank, o.stream)
    preds[id(o)] = ([last[lane]] if lane in last else []) + [by_key[d] for d in o.after]
    last[lane] = o
  memo: dict[int, set[int]] = {}

  def ancestors(o: Op) -> set[int]:
    if id(o) not in memo:
      out: set[int] = set()
      for q in preds[id(o)]:
        out |= {id(q)} | ancestors(q)
      memo[id(o)] = out
    return memo[id(o)]

  return lambda a, b: id(a) in ancestors(b) and a.end <= b.start + _EPS


def check_all_gather_matmul(ops: list[Op], p: int, chunks: int) -> list[str]:
  """What is wrong with a scheduled AllGather+GEMM: shards multiplied before they land, or an
  output row block computed twice or never."""
  problems, before = [], _orders(ops)
  for r in range(p):
    done = []
    for g in _find(ops, op="gemm", rank=r):
      done += [(g.data["shard"], q) for q in (g.data["chunks"])]
      s = g.data["shard"]
      if s == r:
        continue
      for q in g.data["chunks"]:
        sent = _find(ops, op="transfer", rank=s, shard=s, dst=r, chunk=q)
        if len(sent) != 1:
          problems.append(f"rank {r}: chunk {q} of shard {s} is sent {len(sent)} times")
        elif not before(sent[0], g):
          problems.append(f"rank {r} multiplies chunk {q} of shard {s} without waiting for it "
                          f"to land (at {g.start:.2f}; it lands at {sent[0].end:.2f})")
    want = [(s, q) for s in range(p) for q in range(chunks)]
    if sorted(done) != want:
      problems.append(f"rank {r} multiplies {sorted(done)}, not every chunk of every shard once")
  return problems


def check_matmul_reduce_scatter(ops: list[Op], p: int, chunks: int) -> list[str]:
  """What is wrong with a scheduled GEMM+ReduceScatter: a partial sent before its GEMM ends, a
  staging buffer rewritten while a transfer reads it, a partial added before it lands, or an
  output block that does not sum every rank's partial once."""
  problems, before = [], _orders(ops)
  for r in range(p):
    for g in _find(ops, op="partial", rank=r):
      d, q = g.data["block"], g.data["chunk"]
      sent = _find(ops, op="transfer", rank=r, block=d, chunk=q)
      if len(sent) != 1 or not before(g, sent[0]):
        problems.append(f"rank {r}: chunk {q} of the partial for rank {d} is sent before its "
                        "GEMM ends, or not once")
      for t in _find(ops, op="transfer", rank=r, buffer=g.data["buffer"]):
        if t.data["step"] < g.data["step"] and not before(t, g):
          problems.append(f"rank {r}: step {g.data['step']}'s GEMM rewrites staging buffer "
                          f"{g.data['buffer']} at {g.start:.2f} while step {t.data['step']}'s "
                          f"transfer reads it until {t.end:.2f}")
  for d in range(p):
    prev = (d - 1) % p
    owns = _find(ops, op="own", rank=d)
    if sorted(o.data["chunk"] for o in owns) != list(range(chunks)):
      problems.append(f"rank {d} computes its own block's chunks "
                      f"{sorted(o.data['chunk'] for o in owns)}, not each once")
    for own in owns:
      sent = _find(ops, op="transfer", rank=prev, block=d, chunk=own.data["chunk"])
      if len(sent) != 1 or not before(sent[0], own):
        problems.append(f"rank {d}: the epilogue of own chunk {own.data['chunk']} adds rank "
                        f"{prev}'s partial before it lands")
    got = {d, prev} if owns else set()   # the own GEMMs, with r-1's partial in their epilogue
    for a in _find(ops, op="add", rank=d):
      for src in a.data["sources"]:
        for t in _find(ops, op="transfer", rank=src, block=d):
          if not before(t, a):
            problems.append(f"rank {d}: the add reads rank {src}'s partial (chunk "
                            f"{t.data['chunk']}) without waiting for it to land")
        if src in got:
          problems.append(f"rank {d}: rank {src}'s partial is added twice")
        got.add(src)
    if got != set(range(p)):
      problems.append(f"rank {d}'s block sums the partials of ranks {sorted(got)}, not all {p}")
  return problems


def _checked(ops: list[Op], problems: list[str], what: str) -> list[Op]:
  if problems:
    raise AssertionError(f"{what}: " + "; ".join(problems))
  return ops


def _chunk(q: int, chunks: int) -> str:
  return f".{q}" if chunks > 1 else ""


def all_gather_matmul_ops(p: int, gemm: float, transfer: float, chunks: int = 1) -> list[Op]:
  """AllGather+GEMM: own shard first, then shard r-i chunk by chunk as each lands (ring step i).

  Mirrors ``AllGatherMatmul``: the copy stream sends this rank's shard to
  ranks r+1, r+2, ... chunk by chunk; the compute stream multiplies the own
  shard, then, for i = 1, 2, ..., each chunk of rank r-i's shard after its
  flag. Raises ``AssertionError`` where the checks find a problem.
  """
  ops = []
  for r in range(p):
    for i in range(1, p):
      d = (r + i) % p
      for q in range(chunks):
        ops.append(Op(r, "copy", f"\u2192{d}{_chunk(q, chunks)}", "transfer",
                      transfer / chunks, key=f"send{i}.{q}",
                      data=dict(op="transfer", rank=r, shard=r, dst=d, chunk=q)))
    ops.append(Op(r, "compute", f"x{r}", "gemm", gemm,
                  data=dict(op="gemm", rank=r, shard=r, chunks=list(range(chunks)))))
    for i in range(1, p):
      src = (r - i) % p
      for q in range(chunks):
        ops.append(Op(r, "compute", f"x{src}{_chunk(q, chunks)}", "gemm", gemm / chunks,
                      after=[(src, f"send{i}.{q}")],
                      data=dict(op="gemm", rank=r, shard=src, chunks=[q])))
  return _checked(schedule(ops), check_all_gather_matmul(ops, p, chunks), "all_gather_matmul")


def matmul_reduce_scatter_ops(p: int, gemm: float, transfer: float, add: float,
                              chunks: int = 1) -> list[Op]:
  """GEMM+RS: the partials of ranks r+1, r+2, ... first, each chunk sent when done; own block last.

  Mirrors ``ReduceScatterPhase``: at step i the partial for rank r+i goes into
  staging buffer i % 2, so its GEMMs wait for step i-2's transfers, which read
  that buffer. Chunk q of the own block's GEMM adds chunk q of rank r-1's
  partial in its epilogue; the partials of ranks r-2, ..., r-p+1 are added by
  one kernel after it (groups of more than 2), taking ``add`` per partial.
  Raises ``AssertionError`` where the checks find a problem.
  """
  ops = []
  for r in range(p):
    for i in range(1, p):
      d = (r + i) % p
      for q in range(chunks):
        after = [(r, f"send{i - 2}.{chunks - 1}")] if i >= 3 and q == 0 else []
        where = dict(rank=r, block=d, chunk=q, buffer=i % 2, step=i)
        ops.append(Op(r, "compute", f"\u2192{d}{_chunk(q, chunks)}", "gemm", gemm / chunks,
                      after=after, key=f"gemm{i}.{q}", data=dict(op="partial", **where)))
        ops.append(Op(r, "copy", f"\u2192{d}{_chunk(q, chunks)}", "transfer", transfer / chunks,
                      after=[(r, f"gemm{i}.{q}")], key=f"send{i}.{q}",
                      data=dict(op="transfer", dst=d, **where)))
    for q in range(chunks):
      ops.append(Op(r, "compute", f"own{_chunk(q, chunks)}", "gemm", gemm / chunks,
                    after=[((r - 1) % p, f"send1.{q}")],
                    data=dict(op="own", rank=r, block=r, chunk=q)))
    if p > 2:
      sources = [(r - i) % p for i in range(2, p)]
      ops.append(Op(r, "compute", "+", "add", add * (p - 2),
                    after=[(s, f"send{(r - s) % p}.{chunks - 1}") for s in sources],
                    data=dict(op="add", rank=r, block=r, sources=sources)))
  return _checked(schedule(ops), check_matmul_reduce_scatter(ops, p, chunks),
                  "matmul_reduce_scatter")


def baseline_ops(p: int, gemm: float, transfer: float, collective: str) -> list[Op]:
  """The collective (a ring: p-1 transfers) and one GEMM of p shards, one after the other.

  ``collective`` is "all-gather" (first) or "reduce-scatter" (after the GEMM).
  """
  coll = Op(0, "compute", f"{collective}", "transfer", (p - 1) * transfer)
  mm = Op(0, "compute", "one GEMM", "gemm", p * gemm)
  return schedule([coll, mm] if collective == "all-gather" else [mm, coll])


def fused_panels(transfer: float, add: float) -> list[dict]:
  """The panels of the fused-ops figure: per row of ``FUSED_ROWS``, AG+GEMM and GEMM+RS."""
  panels = []
  for p, chunks in FUSED_ROWS:
    panels.append(dict(op="all_gather_matmul", p=p, chunks=chunks,
                       fused=all_gather_matmul_ops(p, 1.0, transfer, chunks),
                       unfused=baseline_ops(p, 1.0, transfer, "all-gather")))
    panels.append(dict(op="matmul_reduce_scatter", p=p, chunks=chunks,
                       fused=matmul_reduce_scatter_ops(p, 1.0, transfer, add, chunks),
                       unfused=baseline_ops(p, 1.0, transfer, "reduce-scatter")))
  return panels


def fused_summary(panels: list[dict]) -> list:
  """What the figure shows, as plain data: every op's lane, label and times."""
  return [[pn["op"], pn["p"], pn["chunks"],
           [[o.rank, o.stream, o.label, round(o.start, 6), round(o.end, 6)]
            for o in pn["fused"] + pn["unfused"]]] for pn in panels]


def draw_fused(path: str, transfer: float, add: float) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = fused_panels(transfer, add)
  colour = {"gemm": "tab:blue", "transfer": "tab:orange", "add": "tab:green"}
  fig, axes = plt.subplots(len(FUSED_ROWS), 2, figsize=(14, 9.5))
  # One time axis per row (its two panels alike), so the short 2-rank row is not half empty.
  horizon = {pn["p"]: max(o.end for q in panels if q["p"] == pn["p"]
                          for o in q["fused"] + q["unfused"]) for pn in panels}
  for ax, pn in zip(axes.flat, panels, strict=True):
    p = pn["p"]
    shown = range(min(p, 2))   # the other ranks run the same schedule, rotated
    lanes = [(-1, "compute")] + [(r, s) for r in shown for s in ("compute", "copy")]
    y_of = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    for o in pn["unfused"]:
      ax.barh(y_of[(-1, "compute")], o.duration, left=o.start, height=0.7,
              color=colour[o.kind], alpha=0.45, edgecolor="black", lw=0.6)
      ax.text(o.start + o.duration / 2, y_of[(-1, "compute")], o.label, ha="center",
              va="center", fontsize=FONT - 1)
    for o in pn["fused"]:
      if o.rank not in shown:
        continue
      y = y_of[(o.rank, o.stream)]
      ax.barh(y, o.duration, left=o.start, height=0.7, color=colour[o.kind], edgecolor="black",
              lw=0.6)
      ax.text(o.start + o.duration / 2, y, o.label, ha="center", va="center",
              fontsize=FONT - 2 if pn["chunks"] > 1 else FONT - 1,
              color="black" if o.kind == "add" else "white")
    end_fused = max(o.end for o in pn["fused"])
    end_base = max(o.end for o in pn["unfused"])
    ax.axvline(end_fused, color="tab:red", ls="--", lw=1.2)
    ax.axvline(end_base, color="0.3", ls=":", lw=1.2)
    ax.set_yticks([y_of[l] for l in lanes])
    ax.set_yticklabels(["unfused" if r < 0 else f"rank {r} {s}" for r, s in lanes],
                       fontsize=FONT - 1)
    rest = f" (ranks 2-{p - 1} alike, rotated)" if p > 2 else ""
    ax.set_title(f"{pn['op']}, {p} ranks, {pn['chunks']} chunk{'s' if pn['chunks'] > 1 else ''} "
                 f"a shard{rest}\nmodel: fused {end_fused:.2f}, unfused {end_base:.2f}",
                 fontsize=FONT)
    ax.set_xlim(0, horizon[p] * 1.02)
    ax.tick_params(axis="x", labelsize=FONT - 1)
  for ax in axes[-1]:
    ax.set_xlabel("time, in shard GEMMs (model)", fontsize=FONT)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colour.values()]
  fig.legend(handles, ["GEMM", "transfer (copy engine, NVLink)", "add kernel"],
             loc="upper center", bbox_to_anchor=(0.5, 0.96), ncol=3, fontsize=FONT - 1,
             frameon=False)
  fig.text(0.01, 0.01,
           "all_gather_matmul: x1 = the GEMM of rank 1's shard (.q: its chunk q); \u21921 = "
           "this rank's shard sent to rank 1.  matmul_reduce_scatter: \u21921 = the partial "
           "product of rank 1's output block,\ncomputed, then sent; own = the rank's own "
           "block, with rank r-1's partial added in its epilogue; + = one kernel adding the "
           "other partials. A gap on a compute stream: a GEMM waiting\nfor its data (or for a "
           f"staging buffer a transfer still reads). Model: a shard's transfer takes {transfer:g} "
           "shard GEMMs, and transfers do not slow the GEMMs (on GPUs they do: that is why\n"
           "all_gather_matmul's chunks pay at 2 ranks); measured: docs/results.md.",
           fontsize=FONT - 1, va="bottom")
  fig.suptitle("Fused ops: each rank's compute stream (shard GEMMs) and copy stream "
               "(transfers), against the collective and one GEMM unfused", fontsize=FONT + 1)
  fig.tight_layout(rect=(0, 0.1, 1, 0.94))
  fig.savefig(path, dpi=100, metadata=_metadata(fused_summary(panels)))
  plt.close(fig)


def script_hash() -> str:
  """SHA-256 of this script: the figures record which drawing code made them."""
  with open(__file__, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def _metadata(summary) -> dict[str, str]:
  return {"Description": json.dumps({"model": summary, "script_sha256": script_hash()})}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Both models first: a failed check leaves both figures as they were.
  algorithms()
  fused_panels(FLAGS.transfer, FLAGS.add)
  for path in (FLAGS.all_reduce_png, FLAGS.fused_png):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  draw_all_reduce(FLAGS.all_reduce_png)
  draw_fused(FLAGS.fused_png, FLAGS.transfer, FLAGS.add)
  print(f"wrote {FLAGS.all_reduce_png} and {FLAGS.fused_png}")


if __name__ == "__main__":
  app.run(main)
