"""benchmarks/plot_algorithms.py: the models behind the algorithm pictures, and the pictures."""

import os
import subprocess
import sys

import pytest

_ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
import plot_algorithms as pa  # noqa: E402


# ------------------------------------------------------------------ all-reduce


def test_every_drawn_algorithm_ends_with_the_sum_on_every_gpu():
  for a in pa.algorithms():
    world = a.nodes * a.per_node
    label, last = a.steps[-1]
    assert len(last) == world, a.title
    for gpu, buf in last.items():
      assert buf == [frozenset(last)] * a.per_node, (a.title, label, gpu)


@pytest.mark.parametrize("nodes,per_node", [(2, 4), (8, 2), (4, 8), (1, 8)])
def test_hierarchical_phases_for_other_power_of_two_topologies(nodes, per_node):
  """Reduce-scatter, log2(nodes) doubling steps, all-gather: the sum everywhere."""
  steps = [("rs", pa.reduce_scatter)]
  steps += [(f"rd{k}", lambda s, k=k: pa.recursive_doubling_step(s, k))
            for k in range(nodes.bit_length() - 1)]
  steps += [("ag", pa.all_gather)]
  a = pa.run("hierarchical", nodes, per_node, steps)
  # After the reduce-scatter, local rank l holds shard l summed over its node, and nothing else.
  rs = a.steps[1][1]
  for (n, l), buf in rs.items():
    assert buf[l] == frozenset((n, j) for j in range(per_node))
    assert all(s is None for i, s in enumerate(buf) if i != l)
  # Doubling step k: shard l sums the 2**(k+1) nodes that share n's bits above k.
  for k in range(nodes.bit_length() - 1):
    state = a.steps[2 + k][1]
    for (n, l), buf in state.items():
      group = {m for m in range(nodes) if m >> (k + 1) == n >> (k + 1)}
      assert buf[l] == frozenset((m, j) for m in group for j in range(per_node)), (k, n, l)


def test_a_missing_phase_is_caught_before_drawing():
  """The check in run() fails without the doubling steps or the all-gather."""
  with pytest.raises(AssertionError, match="not the sum"):
    pa.run("no doubling", 4, 2, [("rs", pa.reduce_scatter), ("ag", pa.all_gather)])
  with pytest.raises(AssertionError, match="not the sum"):
    pa.run("no all-gather", 1, 4, [("rs", pa.reduce_scatter)])


# ------------------------------------------------------------------ fused ops


def _compute_order(ops, rank):
  return [o.label for o in sorted(ops, key=lambda o: o.start)
          if o.rank == rank and o.stream == "compute"]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_all_gather_matmul_order_and_length(p):
  ops = pa.all_gather_matmul_ops(p, 1.0, 0.8)
  for r in range(p):
    # The own shard first, then r-1, r-2, ... (overlap.cu: src = r - i at ring step i).
    assert _compute_order(ops, r) == [f"x{(r - i) % p}" for i in range(p)]
  # Transfers shorter than a GEMM: every one hidden, the op takes p shard GEMMs.
  assert max(o.end for o in ops) == pytest.approx(p)
  # Transfers longer than a GEMM: the last GEMM starts when the last shard lands.
  slow = pa.all_gather_matmul_ops(p, 1.0, 1.5)
  assert max(o.end for o in slow) == pytest.approx((p - 1) * 1.5 + 1.0)


@pytest.mark.parametrize("p", [3, 4, 8])
def test_matmul_reduce_scatter_order_and_length(p):
  ops = pa.matmul_reduce_scatter_ops(p, 1.0, 0.8, 0.3)
  for r in range(p):
    want = [f"\u2192{(r + i) % p}" for i in range(1, p)] + [f"own {r}", "+"]
    assert _compute_order(ops, r) == want
  # The last transfer (after GEMM p-1) is hidden under the own block's GEMM; the add follows.
  assert max(o.end for o in ops) == pytest.approx(p + 0.3 * (p - 2))


def test_matmul_reduce_scatter_on_two_ranks_needs_chunks():
  """At 2 ranks the own GEMM waits for the one partial; chunks hide all but its first piece."""
  one = pa.matmul_reduce_scatter_ops(2, 1.0, 0.8, 0.3)
  assert _compute_order(one, 0) == ["\u21921", "own 0"]
  assert max(o.end for o in one) == pytest.approx(1.0 + 0.8 + 1.0)
  two = pa.matmul_reduce_scatter_ops(2, 1.0, 0.8, 0.3, chunks=2)
  assert _compute_order(two, 0) == ["\u21921.0", "\u21921.1", "own 0.0", "own 0.1"]
  assert max(o.end for o in two) == pytest.approx(2.0)


def test_all_gather_matmul_chunks_follow_each_other():
  ops = pa.all_gather_matmul_ops(3, 1.0, 0.8, chunks=2)
  assert _compute_order(ops, 1) == ["x1", "x0.0", "x0.1", "x2.0", "x2.1"]
  assert max(o.end for o in ops) == pytest.approx(3.0)


def test_schedule_reports_a_deadlock():
  a = pa.Op(0, "compute", "a", "gemm", 1.0, after=[(1, "b")], key="a")
  b = pa.Op(1, "compute", "b", "gemm", 1.0, after=[(0, "a")], key="b")
  with pytest.raises(AssertionError, match="deadlock"):
    pa.schedule([a, b])


def test_schedule_keeps_stream_order_behind_a_waiting_op():
  """An op behind one that waits on the same stream starts after it, not before."""
  wait = pa.Op(0, "compute", "waits", "gemm", 1.0, after=[(1, "late")])
  behind = pa.Op(0, "compute", "behind", "gemm", 1.0)
  late = pa.Op(1, "copy", "late", "transfer", 5.0, key="late")
  pa.schedule([wait, behind, late])
  assert (wait.start, behind.start) == (5.0, 6.0)


# ------------------------------------------------------------------ the script


def test_script_writes_both_figures_and_the_docs_show_them(tmp_path):
  ar, fs = tmp_path / "ar.png", tmp_path / "fs.png"
  run = subprocess.run([sys.executable, "benchmarks/plot_algorithms.py", f"--all_reduce_png={ar}",
                        f"--fused_png={fs}"], cwd=_ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=_ROOT))
  assert run.returncode == 0, run.stderr[-2000:]
  for path in (ar, fs):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  readme = open(os.path.join(_ROOT, "README.md")).read()
  for png in ("docs/all_reduce_algorithms.png", "docs/fused_schedule.png"):
    assert os.path.exists(os.path.join(_ROOT, png)), png
    assert f"]({png})" in readme, png
