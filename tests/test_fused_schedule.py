"""CPU simulation of the fused ops' schedules (ffi/overlap/overlap.cu) for 2 to 8 ranks.

The GPU runs so far had 2 ranks; groups of more ranks take code paths that
never ran there: GEMM+RS's two staging buffers reused from step 3 on, the add
kernel for the partials of ranks r-2, r-3, ..., and GEMM+AR's all-gather
after it. This test replays, for P = 2..8 ranks of one node, what the host
code of overlap.cu enqueues (mirrored below function by function, same names)
as operations on two streams per rank, and runs them in random interleavings:

* each operation is atomic; the streams of all ranks interleave at random
  (several seeds), so any order the GPUs could take between the operations
  is a possible run, including one rank running a call ahead of the others;
* stream order, event fork/join (cudaEventRecord + cudaStreamWaitEvent, an
  event re-recorded later does not affect earlier waits), the pair epochs,
  the per-chunk data flags and the per-call acks are modelled as the code
  uses them; copies land in the peer's slot, one slot per sender;
* data is symbolic: every row of every buffer says what it holds (which
  call's, which rank's x rows; a partial as the multiset of contributions),
  so a read of a chunk that has not arrived, or of a slot overwritten by the
  next call, gives a wrong row; every output row of every rank of every call
  is checked, and a run where no stream can move is a deadlock;
* several calls of mixed ops in a row share the slots, as in a training step.

Groups of some ranks of a node (local rank != group rank, the spare slot
at index ranks_per_node) are covered too. The last tests break the schedule
on purpose (no ack wait, a chunk read before its flag, a staging buffer
reused without its event, an ack indexed by group rank) and check that the
simulation catches each.

A chunk here is a range of rows; all_gather_matmul's chunks of whole batch
entries (outer > 1) follow the same schedule over other units. The copy
engine's copy then signal kernel is modelled; the 'nvshmem' transport (one
kernel that puts, then raises the flag) orders the same two steps.

It checks the schedule's design, mirrored here in Python, not the CUDA code
itself; tests/gpu (ranks/rank_overlap.py) checks the code on GPUs.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Callable

import pytest

MAIN, ALL_GATHER = 0, 1  # kPhaseMain, kPhaseAllGather


class Deadlock(Exception):
  pass


@dataclasses.dataclass
class Op:
  """One stream operation: runs when ready() holds; run() is atomic."""
  what: str
  ready: Callable[[], bool]
  run: Callable[[], None]


class Rank:
  """One PE: its symmetric memory (slots, flags, acks, epochs) and two streams."""

  def __init__(self, rank: int, size: int, rows: int, rpn: int):
    self.rank, self.size, self.rows = rank, size, rows
    # Slot(index): a sender's slot is indexed by its local rank (0..rpn-1);
    # index rpn (= ranks_per_node) is the spare one. Each slot has a main part
    # and, for GEMM+AR, the all-gather half at offset `half`.
    self.slots = {(i, part): [None] * rows for i in range(rpn + 1) for part in ("main", "half")}
    self.flags = collections.defaultdict(int)  # (sender_local, phase, chunk) -> epoch
    self.acks = collections.defaultdict(int)   # sender_local -> epoch
    self.overlap_epochs = collections.defaultdict(int)  # peer -> pair epoch
    self.call_epochs = {}
    self.streams = {"compute": collections.deque(), "comm": collections.deque()}
    self.events_done = set()
    self.next_event = 0


class Sim:
  """The group of ranks, with a seeded scheduler that interleaves their streams."""

  def __init__(self, size: int, rows: int, seed: int, bugs: frozenset = frozenset(),
               local: list[int] | None = None, rpn: int | None = None):
    self.size, self.rows, self.bugs = size, rows, bugs
    # Group rank -> local rank (PE % ranks_per_node): a TP group of `size`
    # ranks on a node of `rpn` GPUs, e.g. ranks 1 and 3 of 4.
    self.local = list(range(size)) if local is None else list(local)
    self.rpn = size if rpn is None else rpn
    assert len(set(self.local)) == size and all(0 <= l < self.rpn for l in self.local)
    self.ranks = [Rank(r, size, rows, self.rpn) for r in range(size)]
    self.rng = random.Random(seed)

  def run(self, max_ops: int = 10**6) -> None:
    for _ in range(max_ops):
      heads = [(r, name) for r in self.ranks for name, q in r.streams.items() if q]
      if not heads:
        return
      ready = [(r, name) for r, name in heads if r.streams[name][0].ready()]
      if not ready:
        stuck = [f"rank {r.rank} {name}: {r.streams[name][0].what}" for r, name in heads]
        raise Deadlock("no stream can move: " + "; ".join(stuck))
      r, name = self.rng.choice(ready)
      r.streams[name].popleft().run()
    raise AssertionError("did not finish")


# --------------------------------------------------------------- overlap.cu

def chunks_of(rows: int, chunks: int):
  """Chunks() and ChunkStart(): [(q, q0, q1)]."""
  n = max(1, min(chunks, rows))
  return [(q, rows * q // n, rows * (q + 1) // n) for q in range(n)]


class Call:
  """One fused call on one rank: the enqueueing helpers of overlap.cu."""

  def __init__(self, sim: Sim, me: Rank):
    self.sim, self.me, self.size, self.r = sim, me, sim.size, me.rank
    self.my_local = sim.local[me.rank]

  def enqueue(self, stream: str, what: str, run=lambda: None, ready=lambda: True):
    self.me.streams[stream].append(Op(f"{what}", ready, run))

  def record(self, stream: str) -> int:
    """cudaEventRecord: returns the record's id, done when the stream passes it."""
    ev = self.me.next_event
    self.me.next_event += 1
    self.enqueue(stream, f"record {ev}", run=lambda: self.me.events_done.add(ev))
    return ev

  def wait_event(self, stream: str, ev: int) -> None:
    self.enqueue(stream, f"wait event {ev}", ready=lambda: ev in self.me.events_done)

  def handoff(self, src: str, dst: str) -> None:
    self.wait_event(dst, self.record(src))

  def begin(self) -> None:
    def run():
      for j in range(self.size):
        if j != self.r:
          self.me.overlap_epochs[j] += 1
          self.me.call_epochs[j] = self.me.overlap_epochs[j]
    self.enqueue("compute", "BeginKernel", run)
    self.handoff("compute", "comm")

  def end(self) -> None:
    self.handoff("comm", "compute")

    index = self.r if "ack_by_group_rank" in self.sim.bugs else self.my_local

    def run():
      for j in range(self.size):
        if j != self.r:
          self.sim.ranks[j].acks[index] = self.me.call_epochs[j]
    self.enqueue("compute", "AckKernel", run)

  def wait(self, stream: str, key, j: int, lag: int, what: str) -> None:
    """WaitKernel: this rank's flag `key` from rank j >= (epoch with j) - lag."""
    flags = self.me.acks if key == "ack" else self.me.flags
    k = self.sim.local[j] if key == "ack" else key

    def ready():
      return flags[k] >= self.me.call_epochs[j] - lag
    self.enqueue(stream, f"wait {what} from rank {j}", ready=ready)

  def wait_ack(self, j: int) -> None:
    if "no_ack_wait" not in self.sim.bugs:
      self.wait("comm", "ack", j, 1, "ack")

  def send(self, j: int, dst_slot, q0: int, q1: int, read: Callable[[], list], flag) -> None:
    """Send(): copy rows [q0, q1) into rank j's slot, then SignalKernel sets the flag."""
    peer = self.sim.ranks[j]

    def copy():
      peer.slots[dst_slot][q0:q1] = read()
    self.enqueue("comm", f"copy to rank {j} slot {dst_slot} rows {q0}:{q1}", copy)
    self.enqueue("comm", f"signal rank {j} {flag}",
                 lambda: peer.flags.__setitem__(flag, self.me.call_epochs[j]))


def all_gather_matmul(sim, me, call_id, chunks, x, out, gathered=None):
  """AllGatherMatmul(): x = this rank's rows; out/gathered[src] = rows of rank src."""
  c, size, r, rows, local = Call(sim, me), sim.size, me.rank, sim.rows, sim.local
  pieces = chunks_of(rows, chunks)
  c.begin()
  for i in range(1, size):
    dest = (r + i) % size
    c.wait_ack(dest)
    for q, q0, q1 in pieces:
      c.send(dest, (c.my_local, "main"), q0, q1, lambda q0=q0, q1=q1: x[q0:q1],
             (c.my_local, MAIN, q))
  if gathered is not None:
    c.enqueue("comm", "copy x to gathered", lambda: gathered[r].__setitem__(slice(None), x))
  c.enqueue("compute", "GEMM local shard",
            lambda: out[r].__setitem__(slice(None), [("y", v) for v in x]))
  for i in range(1, size):
    src = (r - i) % size
    slot = me.slots[(local[src], "main")]
    for q, q0, q1 in pieces:
      wq = max(q - 1, 0) if "early_read" in sim.bugs else q
      c.wait("compute", (local[src], MAIN, wq), src, 0, f"AG chunk {wq}")
      c.enqueue("compute", f"GEMM chunk {q} of rank {src}",
                lambda src=src, slot=slot, q0=q0, q1=q1:
                out[src].__setitem__(slice(q0, q1), [("y", v) for v in slot[q0:q1]]))
    if gathered is not None:
      c.handoff("compute", "comm")
      c.enqueue("comm", f"copy slot of rank {src} to gathered",
                lambda src=src, slot=slot: gathered[src].__setitem__(slice(None), list(slot)))
  c.end()


def _partial(call_id, r, block, row):
  return collections.Counter({(call_id, r, block, row): 1})


def reduce_scatter_phase(sim, me, c, call_id, chunks, own, all_gather):
  """ReduceScatterPhase(): own = this rank's block; with all_gather, GEMM+AR's sends."""
  size, r, rows, local = sim.size, me.rank, sim.rows, sim.local
  pieces = chunks_of(rows, chunks)
  staging = [(c.my_local, "main"), (sim.rpn, "main")]  # Slot(my_local), Slot(ranks_per_node)
  staging_free = {}
  for i in range(1, size):
    dest = (r + i) % size
    b = (i - 1) % 2
    if i >= 3 and "staging_no_event" not in sim.bugs:
      c.wait_event("compute", staging_free[b])
    c.wait_ack(dest)
    buf = me.slots[staging[b]]
    for q, q0, q1 in pieces:
      c.enqueue("compute", f"GEMM partial for rank {dest} chunk {q}",
                lambda buf=buf, dest=dest, q0=q0, q1=q1: buf.__setitem__(
                    slice(q0, q1), [_partial(call_id, r, dest, row) for row in range(q0, q1)]))
      c.handoff("compute", "comm")
      c.send(dest, (c.my_local, "main"), q0, q1,
             lambda buf=buf, q0=q0, q1=q1: list(buf[q0:q1]), (c.my_local, MAIN, q))
    if i + 2 < size:
      staging_free[b] = c.record("comm")
  first = (r - 1) % size
  first_slot = me.slots[(local[first], "main")]
  for q, q0, q1 in pieces:
    c.wait("compute", (local[first], MAIN, q), first, 0, f"RS chunk {q}")

    def gemm(q0=q0, q1=q1):  # D = A @ B + C: the own partial plus rank r-1's
      own[q0:q1] = [_partial(call_id, r, r, row) + first_slot[row] for row in range(q0, q1)]
    c.enqueue("compute", f"GEMM own chunk {q} + epilogue", gemm)
    if all_gather and size == 2:
      send_reduced_chunk(sim, me, c, own, q, q0, q1)
  if size > 2:
    srcs = [(r - i) % size for i in range(2, size)]
    for src in srcs:
      for q, _, _ in pieces:
        c.wait("compute", (local[src], MAIN, q), src, 0, f"RS chunk {q}")

    def add():
      for row in range(rows):
        own[row] = own[row] + sum((me.slots[(local[s], "main")][row] for s in srcs),
                                  collections.Counter())
    c.enqueue("compute", "AddKernel", add)
    if all_gather:
      for q, q0, q1 in pieces:
        send_reduced_chunk(sim, me, c, own, q, q0, q1)


def send_reduced_chunk(sim, me, c, own, q, q0, q1):
  c.handoff("compute", "comm")
  for i in range(1, sim.size):
    dest = (me.rank + i) % sim.size
    c.send(dest, (c.my_local, "half"), q0, q1, lambda q0=q0, q1=q1: list(own[q0:q1]),
           (c.my_local, ALL_GATHER, q))


def matmul_reduce_scatter(sim, me, call_id, chunks, out):
  c = Call(sim, me)
  c.begin()
  reduce_scatter_phase(sim, me, c, call_id, chunks, out, all_gather=False)
  c.end()


def matmul_all_reduce(sim, me, call_id, chunks, out):
  """MatmulAllReduce(): out[b] = the reduced block b, every b."""
  c, size, r = Call(sim, me), sim.size, me.rank
  c.begin()
  reduce_scatter_phase(sim, me, c, call_id, chunks, out[r], all_gather=True)
  for i in range(1, size):
    src = (r - i) % size
    slot = me.slots[(sim.local[src], "half")]
    for q, q0, q1 in chunks_of(sim.rows, chunks):
      c.wait("compute", (sim.local[src], ALL_GATHER, q), src, 0, f"AR chunk {q}")
      c.enqueue("compute", f"copy reduced chunk {q} of rank {src} into place",
                lambda src=src, slot=slot, q0=q0, q1=q1:
                out[src].__setitem__(slice(q0, q1), list(slot[q0:q1])))
  c.end()


# ----------------------------------------------------------------- driver

OPS = ("ag", "ag_gathered", "rs", "ar")


def run_calls(size, rows, chunks, ops, seed, bugs=frozenset(), local=None, rpn=None):
  """Enqueues the calls `ops` (in order, on every rank), runs them, checks every row.

  Returns the list of wrong rows (empty when all are right).
  """
  sim = Sim(size, rows, seed, bugs, local, rpn)
  checks = []
  for call_id, op in enumerate(ops):
    for me in sim.ranks:
      r = me.rank
      if op.startswith("ag"):
        x = [("x", call_id, r, row) for row in range(rows)]
        out = [[None] * rows for _ in range(size)]
        gathered = [[None] * rows for _ in range(size)] if op == "ag_gathered" else None
        all_gather_matmul(sim, me, call_id, chunks, x, out, gathered)
        want = [[("y", ("x", call_id, s, row)) for row in range(rows)] for s in range(size)]
        checks.append((call_id, op, r, "out", out, want))
        if gathered is not None:
          checks.append((call_id, op, r, "gathered", gathered,
                         [[("x", call_id, s, row) for row in range(rows)] for s in range(size)]))
      elif op == "rs":
        out = [None] * rows
        matmul_reduce_scatter(sim, me, call_id, chunks, out)
        full = [sum((_partial(call_id, s, r, row) for s in range(size)), collections.Counter())
                for row in range(rows)]
        checks.append((call_id, op, r, "out", [out], [full]))
      else:
        out = [[None] * rows for _ in range(size)]
        matmul_all_reduce(sim, me, call_id, chunks, out)
        want = [[sum((_partial(call_id, s, b, row) for s in range(size)), collections.Counter())
                 for row in range(rows)] for b in range(size)]
        checks.append((call_id, op, r, "out", out, want))
  sim.run()
  wrong = []
  for call_id, op, r, name, got, want in checks:
    for b, (g, w) in enumerate(zip(got, want)):
      for row, (gv, wv) in enumerate(zip(g, w)):
        if gv != wv:
          wrong.append(f"call {call_id} ({op}) rank {r} {name} block {b} row {row}: "
                       f"{gv} != {wv}")
  return wrong


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_every_op_every_rank_every_row(size, chunks):
  rng = random.Random(size * 100 + chunks)
  for seed in range(12):
    ops = [rng.choice(OPS) for _ in range(5)]
    wrong = run_calls(size, rows=4, chunks=chunks, ops=ops, seed=seed)
    assert not wrong, (ops, wrong[:5])


@pytest.mark.parametrize("op", OPS)
def test_one_op_many_calls_in_a_row(op):
  # Back-to-back calls of one op: the slots are rewritten every call, so a
  # sender that ran ahead into the next call would overwrite unread rows.
  for size in (2, 4, 8):
    for seed in range(6):
      wrong = run_calls(size, rows=3, chunks=2, ops=[op] * 6, seed=seed)
      assert not wrong, (size, seed, wrong[:5])


@pytest.mark.parametrize("local,rpn", [([3, 1], 4), ([2, 0, 3], 4), ([6, 2, 4, 0], 8),
                                       ([1, 5, 3, 7, 0, 2], 8)])
def test_a_group_of_some_ranks_of_a_node(local, rpn):
  # Several TP groups per node: slots, flags and acks are indexed by the
  # local rank (PE % ranks_per_node), the spare slot is index ranks_per_node.
  rng = random.Random(rpn * 10 + len(local))
  for seed in range(8):
    ops = [rng.choice(OPS) for _ in range(5)]
    wrong = run_calls(len(local), rows=4, chunks=2, ops=ops, seed=seed, local=local, rpn=rpn)
    assert not wrong, (ops, wrong[:5])


def _finds(bug, size, ops, chunks=2, seeds=60, local=None, rpn=None):
  """True when some interleaving shows a wrong row or a deadlock under `bug`."""
  for seed in range(seeds):
    try:
      if run_calls(size, rows=4, chunks=chunks, ops=ops, seed=seed, bugs=frozenset({bug}),
                   local=local, rpn=rpn):
        return True
    except Deadlock:
      return True
  return False


def test_the_simulation_catches_a_missing_ack_wait():
  assert _finds("no_ack_wait", 2, ["ag"] * 4)
  assert _finds("no_ack_wait", 4, ["rs", "ar"] * 2)


def test_the_simulation_catches_a_read_before_its_chunk_arrived():
  # all_gather_matmul waiting for chunk q-1 and multiplying chunk q.
  assert _finds("early_read", 2, ["ag"] * 3)
  assert not _finds("early_read", 2, ["ag"] * 3, chunks=1, seeds=20)


def test_the_simulation_catches_staging_reused_without_its_event():
  # Only groups of 4 or more ranks reuse a staging buffer within a call.
  assert _finds("staging_no_event", 4, ["rs"] * 2)
  assert not _finds("staging_no_event", 3, ["rs"] * 2, seeds=20)


def test_the_simulation_catches_an_ack_indexed_by_group_rank():
  # Harmless while group rank = local rank; a group of ranks 2 and 0 of a node deadlocks.
  assert not _finds("ack_by_group_rank", 2, ["ag"] * 3, seeds=10)
  assert _finds("ack_by_group_rank", 2, ["ag"] * 3, local=[2, 0], rpn=4)
