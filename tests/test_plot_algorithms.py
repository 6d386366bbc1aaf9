"""benchmarks/plot_algorithms.py: the models behind the algorithm pictures, and the pictures."""

import dataclasses
import json
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
    label, last = a.steps[-1]
    assert len(last) == a.nodes * a.per_node, a.title
    for gpu, buf in last.items():
      assert buf == [frozenset(last)] * a.per_node, (a.title, label, gpu)


@pytest.mark.parametrize("nodes", range(1, 10))
@pytest.mark.parametrize("per_node", [1, 2, 4])
def test_hierarchical_for_any_node_count(nodes, per_node):
  """Powers of two double; the others fold the extra nodes in and out (all_reduce.cu)."""
  a = pa.run("hierarchical", nodes, per_node, pa.hierarchical_phases(nodes))
  labels = [label for label, _ in a.steps]
  pow2 = 1 << (nodes.bit_length() - 1)
  assert sum(label.startswith("doubling") for label in labels) == pow2.bit_length() - 1
  assert ("fold out" in labels) == (pow2 < nodes)
  # After the reduce-scatter, local rank l holds shard l summed over its node, and nothing else.
  for (n, l), buf in a.steps[1][1].items():
    assert buf[l] == frozenset((n, j) for j in range(per_node))
    assert all(s is None for i, s in enumerate(buf) if i != l)


def test_doubling_steps_sum_the_nodes_that_share_the_high_bits():
  a = pa.run("hierarchical", 8, 2, pa.hierarchical_phases(8))
  for k in range(3):
    for (n, l), buf in a.steps[2 + k][1].items():
      group = {m for m in range(8) if m >> (k + 1) == n >> (k + 1)}
      assert buf[l] == frozenset((m, j) for m in group for j in range(2)), (k, n, l)
  assert "nodes 0\u21942, 1\u21943, 4\u21946, 5\u21947" in a.steps[3][0]


def test_a_wrong_all_reduce_model_is_caught_before_drawing():
  with pytest.raises(AssertionError, match="not the sum"):   # no doubling between the nodes
    pa.run("no doubling", 4, 2, [("rs", pa.reduce_scatter), ("ag", pa.all_gather)])
  with pytest.raises(AssertionError, match="not the sum"):   # no all-gather
    pa.run("no all-gather", 1, 4, [("rs", pa.reduce_scatter)])
  with pytest.raises(AssertionError, match="not the sum"):   # 3 nodes without the fold
    pa.run("no fold", 3, 2, [p for p in pa.hierarchical_phases(3) if "fold" not in p[0]])
  with pytest.raises(AssertionError, match="added twice"):   # a doubling step run twice
    phases = pa.hierarchical_phases(4)
    pa.run("twice", 4, 2, phases[:2] + phases[1:])


# ------------------------------------------------------------------ fused ops


def _compute(ops, rank):
  return [o.label for o in sorted(ops, key=lambda o: o.start)
          if o.rank == rank and o.stream == "compute"]


@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("transfer", [0.25, 0.8, 1.5, 3.0])
def test_fused_models_pass_their_checks_and_keep_the_kernels_order(p, chunks, transfer):
  c = (lambda q: f".{q}") if chunks > 1 else (lambda q: "")
  ag = pa.all_gather_matmul_ops(p, 1.0, transfer, chunks)
  rs = pa.matmul_reduce_scatter_ops(p, 1.0, transfer, 0.15, chunks)
  for r in range(p):
    # overlap.cu: the own shard first, then chunk by chunk the shard of r-i at ring step i.
    assert _compute(ag, r) == [f"x{r}"] + [f"x{(r - i) % p}{c(q)}" for i in range(1, p)
                                           for q in range(chunks)]
    # ReduceScatterPhase: the partials of r+1, r+2, ... chunk by chunk, the own block last.
    assert _compute(rs, r) == ([f"\u2192{(r + i) % p}{c(q)}" for i in range(1, p)
                                for q in range(chunks)]
                               + [f"own{c(q)}" for q in range(chunks)] + (["+"] if p > 2 else []))
  # AG: chunk q of ring step i lands at ((i-1)*chunks + q + 1) * transfer / chunks.
  end = 1.0
  for i in range(1, p):
    for q in range(chunks):
      end = max(end, ((i - 1) * chunks + q + 1) * transfer / chunks) + 1.0 / chunks
  assert max(o.end for o in ag) == pytest.approx(end)


def test_reduce_scatter_times_where_transfers_are_slower_than_gemms():
  """4 ranks, transfers of 1.5 GEMMs: step 3's GEMM waits for step 1's transfer (the staging
  buffer), the own GEMM follows it, and the add waits for step 3's transfer."""
  ops = pa.matmul_reduce_scatter_ops(4, 1.0, 1.5, 0.15)
  at = {o.label: (o.start, o.end) for o in ops if o.rank == 0 and o.stream == "compute"}
  assert at == {"\u21921": (0.0, 1.0), "\u21922": (1.0, 2.0), "\u21923": (2.5, 3.5),
                "own": (3.5, 4.5), "+": (5.5, pytest.approx(5.8))}


def test_two_ranks_need_chunks_to_hide_the_partial():
  """At 2 ranks the own GEMM adds the peer's partial in its epilogue: with one chunk the whole
  transfer shows; with two, chunk 0 of the own GEMM waits for chunk 0 of the partial alone,
  and at these speeds nothing shows."""
  one = pa.matmul_reduce_scatter_ops(2, 1.0, 0.8, 0.15)
  assert max(o.end for o in one) == pytest.approx(1.0 + 0.8 + 1.0)
  two = pa.matmul_reduce_scatter_ops(2, 1.0, 0.8, 0.15, chunks=2)
  assert max(o.end for o in two) == pytest.approx(2.0)


def _rebuilt(ops, change):
  """The ops with ``change(op)`` applied to copies, scheduled again."""
  new = [dataclasses.replace(o, after=list(o.after), data=dict(o.data), start=None) for o in ops]
  for o in new:
    change(o)
  return pa.schedule(new)


def _sender_of(o):
  return int(o.after[0][0]) if o.after else None


@pytest.mark.parametrize("what,op,change,message", [
    ("AG waits for the wrong sender", "ag",
     lambda o: o.data.get("op") == "gemm" and o.after
     and o.after.__setitem__(0, ((2 * o.rank - _sender_of(o)) % 4, o.after[0][1])),
     "without waiting for it"),
    ("AG waits for chunk 0 only", "ag",
     lambda o: o.data.get("op") == "gemm" and o.after
     and o.after.__setitem__(0, (o.after[0][0], o.after[0][1].split(".")[0] + ".0")),
     "without waiting for it"),
    ("AG leaves out a shard", "ag",
     lambda o: o.data.get("op") == "gemm" and o.data["shard"] != o.rank
     and o.data.__setitem__("shard", o.rank), "not every chunk of every shard once"),
    ("RS epilogue waits for r+1", "rs",
     lambda o: o.data.get("op") == "own" and o.after.__setitem__(0, ((o.rank + 1) % 4, "send1.0")),
     "epilogue of own chunk"),
    ("RS staging buffer without its wait", "rs",
     lambda o: o.data.get("op") == "partial" and o.after.clear(), "rewrites staging buffer"),
    ("RS add without its waits", "rs",
     lambda o: o.data.get("op") == "add" and o.after.clear(), "without waiting for it"),
    ("RS add counts r-1 again", "rs",
     lambda o: o.data.get("op") == "add"
     and o.data.__setitem__("sources", o.data["sources"] + [(o.rank - 1) % 4]), "added twice"),
    ("RS sends a partial before its GEMM", "rs",
     lambda o: o.data.get("op") == "transfer" and o.after.clear(), "before its GEMM ends"),
])
def test_the_checks_catch_a_wrong_fused_model(what, op, change, message):
  """Trial 40: five of fifteen wrong models passed. Each is caught now, even where the
  timing of the drawn figures would hide it (transfer 0.8)."""
  for transfer in (0.8, 3.0):
    if op == "ag":
      ops = pa.all_gather_matmul_ops(4, 1.0, transfer, 2)
      problems = pa.check_all_gather_matmul(_rebuilt(ops, change), 4, 2)
    else:
      ops = pa.matmul_reduce_scatter_ops(4, 1.0, transfer, 0.15, 2)
      problems = pa.check_matmul_reduce_scatter(_rebuilt(ops, change), 4, 2)
    assert any(message in p for p in problems), (what, transfer, problems)


def test_schedule_reports_a_deadlock_and_keeps_stream_order():
  a = pa.Op(0, "compute", "a", "gemm", 1.0, after=[(1, "b")], key="a")
  b = pa.Op(1, "compute", "b", "gemm", 1.0, after=[(0, "a")], key="b")
  with pytest.raises(AssertionError, match="deadlock"):
    pa.schedule([a, b])
  wait = pa.Op(0, "compute", "waits", "gemm", 1.0, after=[(1, "late")])
  behind = pa.Op(0, "compute", "behind", "gemm", 1.0)
  late = pa.Op(1, "copy", "late", "transfer", 5.0, key="late")
  pa.schedule([wait, behind, late])
  assert (wait.start, behind.start) == (5.0, 6.0)


# ------------------------------------------------------------------ the script and the figures


def _script(*args):
  return subprocess.run([sys.executable, "benchmarks/plot_algorithms.py", *args], cwd=_ROOT,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=_ROOT))


def test_committed_figures_show_the_models_of_today():
  """The PNGs' metadata holds the model they were drawn from and the script's hash: a figure
  left stale by a change to the model or to the drawing code fails here (run the script)."""
  from PIL import Image

  drawn = {png: json.loads(Image.open(os.path.join(_ROOT, png)).text["Description"])
           for png in ("docs/all_reduce_algorithms.png", "docs/fused_schedule.png")}
  assert drawn["docs/all_reduce_algorithms.png"]["model"] == json.loads(
      json.dumps(pa.all_reduce_summary(pa.algorithms())))
  assert drawn["docs/fused_schedule.png"]["model"] == json.loads(
      json.dumps(pa.fused_summary(pa.fused_panels(0.8, 0.15))))
  for png, meta in drawn.items():
    assert meta["script_sha256"] == pa.script_hash(), (
        f"{png} was drawn by another version of benchmarks/plot_algorithms.py: run it")
  readme = open(os.path.join(_ROOT, "README.md")).read()
  for png in drawn:
    assert f"]({png})" in readme, png


def test_script_writes_both_figures_and_refuses_bad_flags(tmp_path):
  ar, fs = tmp_path / "ar.png", tmp_path / "fs.png"
  run = _script(f"--all_reduce_png={ar}", f"--fused_png={fs}", "--transfer=1.5")
  assert run.returncode == 0, run.stderr[-2000:]
  for path in (ar, fs):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for bad, says in (("--transfer=0", "--transfer must be a finite number above 0"),
                    ("--transfer=inf", "--transfer must be a finite number above 0"),
                    ("--add=-1", "--add must be a finite number of at least 0")):
    ar.unlink(missing_ok=True)
    run = _script(f"--all_reduce_png={ar}", f"--fused_png={fs}", bad)
    assert run.returncode != 0 and says in run.stderr, run.stderr[-2000:]
    assert not ar.exists()
