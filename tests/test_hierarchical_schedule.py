"""CPU simulation of the hierarchical all-reduce's inter-node schedule, for any node count.

The GPU runs so far had 1 and 2 nodes; node counts that are not a power of
two (the MPICH fold) need at least 3 PEs. This test replays, for 1..33 nodes,
the schedule that ffi/all_reduce/all_reduce.cu (ReduceScatterAllGatherKernel,
phase 1) executes, and the host's list of peers whose pair epoch a call
advances (AllReduce() in the same file), as a message-passing model:

* every send lands in the receiver's slot for (sender, parity of the pair
  epoch), and a slot must be empty when written and full when read: one
  write per slot per call, every receive matched;
* each node ends with the sum of all nodes' values, bit-identical everywhere
  (fp32 adds in the kernel's order);
* the peers a node exchanges with in a call are exactly its bump list, so
  both sides of every pair advance their epoch once per call;
* several calls in a row keep working while nodes run ahead into their next
  call: a slot is never overwritten before its reader took it (the parity
  argument of all_reduce.cu's header comment).

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
  """The device side of phase 1, as a list of ("send", peer) / ("recv", peer, add)."""
  pow2 = _pow2_below(num_nodes)
  ops = []
  if node >= pow2:
    ops += [("send", node - pow2), ("recv", node - pow2, False)]
    return ops
  has_extra = node + pow2 < num_nodes
  if has_extra:
    ops.append(("recv", node + pow2, True))
  mask = 1
  while mask < pow2:
    ops += [("send", node ^ mask), ("recv", node ^ mask, True)]
    mask <<= 1
  if has_extra:
    ops.append(("send", node + pow2))
  return ops


def _simulate(values, calls, rng):
  """Runs `calls` all-reduces back to back; nodes advance in a random interleaving.

  A node may run ahead into its next call while others are still in the
  previous one, as on the GPUs (nothing synchronises calls but the data).
  """
  n = len(values)
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
    assert runnable, f"deadlock with {n} nodes: pcs {pcs}"
    i = runnable[rng.integers(len(runnable))]
    op = progs[i][pcs[i]]
    pcs[i] += 1
    if op[0] == "end":
      call = op[1]
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
    if op[0] == "send":
      key = (peer, i, parity)
      assert key not in slots, f"slot {key} overwritten before it was read ({n} nodes)"
      slots[key] = acc[i]
    else:
      got = slots.pop((i, peer, parity))
      acc[i] = np.float32(acc[i] + got) if op[2] else got
  assert not slots, f"unread slots {sorted(slots)} ({n} nodes)"
  return results


@pytest.mark.parametrize("num_nodes", list(range(1, 18)) + [31, 32, 33])
def test_every_node_gets_the_same_full_sum(num_nodes):
  rng = np.random.default_rng(num_nodes)
  values = rng.standard_normal(num_nodes).astype(np.float32) * 100
  for call, acc in enumerate(_simulate(values, calls=6, rng=rng)):
    expected = np.sum(values.astype(np.float64) * (call + 1))
    assert len({a.tobytes() for a in acc}) == 1, f"nodes disagree: {acc}"
    assert abs(float(acc[0]) - expected) <= 1e-4 * (abs(expected) + 100)


def test_pair_epochs_stay_in_step():
  # Both sides of every pair advance together, so parities always agree.
  for n in range(1, 34):
    for a, b in itertools.permutations(range(n), 2):
      assert (b in _bump_list(a, n)) == (a in _bump_list(b, n)), (n, a, b)
