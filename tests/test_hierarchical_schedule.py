"""CPU simulation of the hierarchical all-reduce's inter-node schedule, for any node count.

The GPU runs so far had 1 and 2 nodes; node counts that are not a power of
two (the MPICH fold) need at least 3 PEs. This test replays, for 1..33 nodes,
the schedule that ffi/all_reduce/all_reduce.cu executes (the inter-node steps
of HierarchicalLLKernel and of ReduceScatterAllGatherKernel, the same order of
sends and receives), and the host's list of peers whose pair epoch a call
advances (MakeParams in the same file), as a message-passing model:

* every send lands in the receiver's slot for (sender, parity of the pair
  epoch), and a slot must be empty when written and full when read: one
  write per slot per call, every receive matched;
* each node ends with the sum of all nodes' values, bit-identical everywhere
  (fp32 adds in the kernel's order);
* the peers a node exchanges with in a call are exactly its bump list, so
  both sides of every pair advance their epoch once per call;
* several calls in a row keep working while nodes run ahead into their next
  call: a slot is never overwritten before its reader took it (the parity
  argument of all_reduce.cu's header comment);
* with NVSHMEM puts (HierarchicalLLKernel's SendPartialLL): a put reads its
  staging buffer at any time until a quiet completes it, so the model delivers
  each put at a random later moment with the buffer's content of that moment.
  The kernel's two buffers in turn, quieted before reuse, give every receiver
  the value sent; without that quiet some sums come out wrong (checked, so
  the test can fail). On one GPU the puts complete at once, so only this
  model exercises the quiet.

It checks the schedule's design, mirrored here in Python, not the CUDA code
itself; the GPU suite (tests/gpu/ranks/rank_all_reduce.py) checks the code for 1 to 8
nodes.
"""

import itertools

import numpy as np
import pytest


def _pow2_below(n):
  p = 1
  while p * 2 <= n:
    p *= 2
  return p


def _bump_list(node, num_nodes):
  """The host side: peers (node indices) whose pair epoch this call advances."""
  pow2 = _pow2_below(num_nodes)
  if node >= pow2:
    return [node - pow2]
  out = [node + pow2] if node + pow2 < num_nodes else []
  mask = 1
  while mask < pow2:
    out.append(node ^ mask)
    mask <<= 1
  return out


def _node_program(node, num_nodes):
  """The device side of the steps: ("send", peer, staging buffer) / ("recv", peer, add)."""
  pow2 = _pow2_below(num_nodes)
  ops = []
  if node >= pow2:
    ops += [("send", node - pow2, 0), ("recv", node - pow2, False)]
    return ops
  has_extra = node + pow2 < num_nodes
  if has_extra:
    ops.append(("recv", node + pow2, True))
  mask, stage = 1, 0
  while mask < pow2:
    ops += [("send", node ^ mask, stage), ("recv", node ^ mask, True)]
    stage ^= 1
    mask <<= 1
  if has_extra:
    ops.append(("send", node + pow2, stage))
  return ops


def _simulate(values, calls, rng, puts=False, quiet_before_reuse=True):
  """Runs `calls` all-reduces back to back; nodes advance in a random interleaving.

  A node may run ahead into its next call while others are still in the
  previous one, as on the GPUs (nothing synchronises calls but the data).
  With ``puts``, a send writes the node's staging buffer and leaves a put in
  flight, delivered at a random later moment from the buffer as it is then; a
  send quiets (delivers all of the node's puts) before it rewrites a buffer
  that a put in flight reads (``quiet_before_reuse``), and the end of a call
  quiets (Finish).
  """
  n = len(values)
  stage = [[None, None] for _ in range(n)]
  in_flight = [[] for _ in range(n)]  # per node: (staging buffer, destination slot)

  def deliver(i, k):
    buf, key = in_flight[i].pop(k)
    assert key not in slots, f"slot {key} overwritten before it was read ({n} nodes)"
    slots[key] = stage[i][buf]

  def quiet(i):
    while in_flight[i]:
      deliver(i, 0)

  epochs = [{b: 0 for b in range(n) if b != a} for a in range(n)]  # a's count with b
  slots = {}  # (receiver, sender, parity) -> value
  progs = [[op + (c,) for c in range(calls) for op in _node_program(i, n) + [("end",)]]
           for i in range(n)]
  acc = [np.float32(v) for v in values]
  touched = [set() for _ in range(n)]
  results = [[None] * n for _ in range(calls)]
  pcs = [0] * n
  while any(pcs[i] < len(progs[i]) for i in range(n)):
    runnable = []
    for i in range(n):
      if pcs[i] == len(progs[i]):
        continue
      op = progs[i][pcs[i]]
      if op[0] == "recv" and (i, op[1], (epochs[i][op[1]] + 1) & 1) not in slots:
        continue
      runnable.append(i)
    puts_in_flight = [(i, k) for i in range(n) for k in range(len(in_flight[i]))]
    assert runnable or puts_in_flight, f"deadlock with {n} nodes: pcs {pcs}"
    pick = rng.integers(len(runnable) + len(puts_in_flight))
    if pick >= len(runnable):
      deliver(*puts_in_flight[pick - len(runnable)])
      continue
    i = runnable[pick]
    op = progs[i][pcs[i]]
    pcs[i] += 1
    if op[0] == "end":
      call = op[1]
      quiet(i)  # Finish(p, quiet=used_put)
      assert touched[i] == set(_bump_list(i, n)), (n, i, touched[i], _bump_list(i, n))
      for peer in touched[i]:
        epochs[i][peer] += 1
      touched[i] = set()
      results[call][i] = acc[i]
      acc[i] = np.float32(values[i] * (call + 2))  # the next call's input
      continue
    peer = op[1]
    parity = (epochs[i][peer] + 1) & 1
    touched[i].add(peer)
    if op[0] == "send" and puts:
      buf = op[2]
      if quiet_before_reuse and any(b == buf for b, _ in in_flight[i]):
        quiet(i)
      stage[i][buf] = acc[i]
      in_flight[i].append((buf, (peer, i, parity)))
    elif op[0] == "send":
      key = (peer, i, parity)
      assert key not in slots, f"slot {key} overwritten before it was read ({n} nodes)"
      slots[key] = acc[i]
    else:
      got = slots.pop((i, peer, parity))
      acc[i] = np.float32(acc[i] + got) if op[2] else got
  assert not slots, f"unread slots {sorted(slots)} ({n} nodes)"
  return results


def _wrong_sums(values, results) -> list[str]:
  wrong = []
  for call, acc in enumerate(results):
    expected = np.sum(values.astype(np.float64) * (call + 1))
    if len({a.tobytes() for a in acc}) != 1:
      wrong.append(f"call {call}: nodes disagree: {acc}")
    elif not abs(float(acc[0]) - expected) <= 1e-4 * (abs(expected) + 100):
      wrong.append(f"call {call}: {acc[0]}, want {expected}")
  return wrong


@pytest.mark.parametrize("puts", [False, True], ids=["direct", "puts"])
@pytest.mark.parametrize("num_nodes", list(range(1, 18)) + [31, 32, 33])
def test_every_node_gets_the_same_full_sum(num_nodes, puts):
  rng = np.random.default_rng(num_nodes)
  values = rng.standard_normal(num_nodes).astype(np.float32) * 100
  wrong = _wrong_sums(values, _simulate(values, calls=6, rng=rng, puts=puts))
  assert not wrong, wrong


def test_puts_without_the_quiet_before_reuse_go_wrong():
  # The third put of a node rewrites the first one's staging buffer: from 8 nodes (three
  # steps), or 5-7 nodes with the fold. Without the quiet, a put still in flight then
  # delivers the newer partial, and some interleavings give wrong sums.
  wrong = []
  for num_nodes in (5, 8, 16):
    for seed in range(20):
      rng = np.random.default_rng([num_nodes, seed])
      values = rng.standard_normal(num_nodes).astype(np.float32) * 100
      try:
        results = _simulate(values, calls=3, rng=rng, puts=True, quiet_before_reuse=False)
      except AssertionError as e:  # a slot written twice also shows the fault
        wrong.append(str(e))
        continue
      wrong += _wrong_sums(values, results)
  assert wrong, "no interleaving exposed the missing quiet: the model cannot fail"


def test_pair_epochs_stay_in_step():
  # Both sides of every pair advance together, so parities always agree.
  for n in range(1, 34):
    for a, b in itertools.permutations(range(n), 2):
      assert (b in _bump_list(a, n)) == (a in _bump_list(b, n)), (n, a, b)
