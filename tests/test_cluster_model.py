"""The cost model across nodes: NCCL's ring and tree, NVRAR, the presets, the policy at scale.

No GPU and no timing: the predictions of ``jaxoverlap.tuning.cost_model`` and
``jaxoverlap.tuning.cluster`` are checked against their documented formulas
(computed here by hand), against the shape the physics demands (monotone in
size and nodes, ring against tree), against the statements of
docs/cluster_model.md about NVRAR's paper (arXiv 2511.09557), and the choices
of ``Policy.choose`` with no measured table at 4x4, 8x8 and 64x8.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from jaxoverlap import tuning
from jaxoverlap.tuning import cluster, cost_model
from jaxoverlap.tuning import policy as policy_mod

P = tuning.DEFAULT_PARAMS
PM = cluster.PRESETS["perlmutter"]
VISTA = cluster.PRESETS["vista"]
KIB, MIB = 1 << 10, 1 << 20
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
  for key in tuning.PARAM_KEYS:
    monkeypatch.delenv("JAXOVERLAP_" + key.upper(), raising=False)
  monkeypatch.setenv("JAXOVERLAP_TUNING_FILE", str(tmp_path / "none.json"))


# ------------------------------------------------------------------ presets


def test_presets_values_and_sources():
  assert set(cluster.PRESETS) == {"h200_ndr", "perlmutter", "vista"}
  assert cluster.PRESETS["h200_ndr"].params is P  # the defaults are the H200 preset
  assert cluster.PRESETS["h200_ndr"].gpus_per_node == 8
  assert PM.gpus_per_node == 4 and VISTA.gpus_per_node == 1
  # Perlmutter: Slingshot 11 at 200 Gb/s = 25 GB/s, 90% reached; A100 NVLink 3 at
  # 300 GB/s per direction, 74% reached (the H200 measurement's share, 355/478).
  assert PM.params.network == tuning.LinkParams(4.0, 22.5)
  assert PM.params.network.beta_gbps == pytest.approx(0.9 * 200 / 8)
  assert PM.params.nvlink.beta_gbps == pytest.approx(300 * 355 / 478, abs=1)
  assert PM.params.nccl.beta_gbps == pytest.approx(234 * 300 / 478, abs=1)
  assert PM.params.hbm_gbps == pytest.approx(0.85 * 1555, abs=5)
  # Vista: one NDR port at 400 Gb/s = 50 GB/s, 90% reached; GH200 HBM3 4 TB/s at 85%.
  assert VISTA.params.network == tuning.LinkParams(2.5, 45.0)
  assert VISTA.params.hbm_gbps == pytest.approx(0.85 * 4000)
  for preset in cluster.PRESETS.values():
    assert set(preset.sources) == set(tuning.PARAM_KEYS), preset.name
    for key, text in preset.sources.items():
      # Every value is measured, fit, cited, unused, or an ASSUMPTION with its reasoning.
      assert len(text) > 30, (preset.name, key, text)
      assert any(w in text for w in ("measured", "fit", "datasheet", ".gov", ".com", ".edu",
                                     "ASSUMPTION", "unused", "no effect")), (preset.name, key)
    assert preset.params.replace(**preset.params.as_flat()) == preset.params


# ------------------------------------------------------------------ NCCL's formulas


def test_nccl_ring_and_tree_match_their_formulas():
  """The documented formulas, computed here step by step."""
  ll, l128 = cost_model.NCCL_PROTOCOL_COSTS["ll"], cost_model.NCCL_PROTOCOL_COSTS["ll128"]
  base = P.nccl.alpha_us - 2 * ll.nvlink_hop_us
  assert cost_model.nccl_base_us(P) == pytest.approx(base)
  # Ring, 2 GPUs of one node, LL: the measured floor plus the bytes at half the bus bandwidth.
  m = 8 * KIB
  want = base + 2 * ll.nvlink_hop_us + 2 * 1 / 2 * m / (P.nccl.beta_gbps * 0.5 * 1e3)
  assert cost_model.nccl_us("ring", "ll", m, 2, 1, P) == pytest.approx(want)
  assert want == pytest.approx(P.nccl.alpha_us + m / (P.nccl.beta_gbps * 1e3 * 0.5))
  # Ring, 8 nodes x 8 GPUs, LL128: 126 hops, 14 of them across nodes; the bus is the
  # 8 NICs of a node (8 x 45 = 360 GB/s) or NCCL's NVLink bandwidth, whichever is less.
  m = 4 * MIB
  bus = min(P.nccl.beta_gbps, 8 * P.network.beta_gbps) * (120 / 128) * 1e3
  want = (base + (126 - 14) * l128.nvlink_hop_us + 14 * (P.network.alpha_us + l128.net_hop_us)
          + 2 * 63 / 64 * m / bus)
  assert cost_model.nccl_us("ring", "ll128", m, 8, 8, P) == pytest.approx(want)
  # Tree, 8 nodes x 8 GPUs: a chain of 8 in each node (7 hops up, 7 down) and
  # 2 log2(8) = 6 hops across nodes, 2M at the tree's share of the bus.
  want = (base + 14 * l128.nvlink_hop_us + 6 * (P.network.alpha_us + l128.net_hop_us)
          + 2 * m / (cost_model.NCCL_TREE_BW_FACTOR * bus))
  assert cost_model.nccl_us("tree", "ll128", m, 8, 8, P) == pytest.approx(want)
  # A node count that is not a power of two: the tree's depth rounds up.
  t5, t8 = (cost_model.nccl_us("tree", "ll", 8 * KIB, 8, n, P) for n in (5, 8))
  assert t5 == pytest.approx(t8)


def test_protocols_shares_follow_line_formats():
  costs = cost_model.NCCL_PROTOCOL_COSTS
  assert set(costs) == set(cost_model.NCCL_PROTOCOLS)
  assert costs["ll"].bw_factor == 0.5 and costs["ll128"].bw_factor == 120 / 128
  assert costs["simple"].bw_factor == 1.0
  for field in ("nvlink_hop_us", "net_hop_us"):  # more bandwidth costs more latency
    assert getattr(costs["ll"], field) < getattr(costs["ll128"], field) < getattr(
        costs["simple"], field)


def test_nccl_best_picks_ll_small_and_simple_or_ll128_large():
  us, alg, proto = cost_model.nccl_best(8 * KIB, 8, 8, P)
  assert (alg, proto) == ("tree", "ll")
  assert us == min(cost_model.nccl_us(a, p, 8 * KIB, 8, 8, P)
                   for a in cost_model.NCCL_ALGORITHMS for p in cost_model.NCCL_PROTOCOLS)
  assert cost_model.nccl_best(256 * MIB, 8, 2, P)[1:] == ("ring", "simple")
  assert cost_model.nccl_best(64 * MIB, 8, 1, P)[1] == "ring"  # no tree inside one node


@pytest.mark.parametrize("call,match", [
    (("tree", "ll", 4096, 8, 1), "within one node it runs a ring"),
    (("butterfly", "ll", 4096, 8, 2), "algorithm must be one of"),
    (("ring", "ll64", 4096, 8, 2), "protocol must be one of"),
    (("ring", "ll", 4096, 0, 2), "ranks_per_node must be an integer >= 1, got 0"),
    (("ring", "ll", 4096, 8, 2.5), "num_nodes must be an integer >= 1, got 2.5"),
])
def test_nccl_us_rejects_invalid(call, match):
  with pytest.raises(ValueError, match=match):
    cost_model.nccl_us(*call, params=P)


def test_single_rank_and_psum_within_one_node_unchanged():
  assert cost_model.nccl_us("ring", "ll", 1 * MIB, 1, 1, P) == 0.0
  assert tuning.predict_us("psum", None, 1 * MIB, 2, 1, 1, P) == 0.0
  # Within one node psum stays the line fit to the measurements (docs/results.md).
  for g in (2, 4, 8):
    want = P.nccl.alpha_us + 2 * (g - 1) / g * 4 * MIB / (P.nccl.beta_gbps * 1e3)
    assert tuning.predict_us("psum", None, 4 * MIB, 2, g, 1, P) == pytest.approx(want)
  # Across nodes psum is NCCL's best configuration.
  for g, n in ((8, 2), (4, 8), (1, 16)):
    assert tuning.predict_us("psum", None, 1 * MIB, 2, g, n, P) == pytest.approx(
        cost_model.nccl_best(1 * MIB, g, n, P)[0])


# ------------------------------------------------------------------ shape of the predictions


@pytest.mark.parametrize("preset,gpus", [("h200_ndr", 8), ("h200_ndr", 4), ("perlmutter", 4),
                                         ("vista", 1)])
def test_every_algorithm_monotone_in_size(preset, gpus):
  params = cluster.PRESETS[preset].params
  sizes = [0] + [1 << i for i in range(10, 29)]
  for n in cluster.NODES:
    if gpus * n < 2:
      continue
    table = [cluster.predict(s, 2, gpus, n, params) for s in sizes]
    for alg in table[0]:
      t = [row[alg].time_us for row in table]
      assert all(a < b for a, b in zip(t, t[1:])), (preset, gpus, n, alg, t)
      assert all(math.isfinite(x) and x > 0 for x in t)


@pytest.mark.parametrize("preset", ["h200_ndr", "perlmutter", "vista"])
def test_more_nodes_never_faster(preset):
  params = cluster.PRESETS[preset].params
  g = cluster.PRESETS[preset].gpus_per_node
  nodes = [n for n in cluster.NODES if n > 1]
  for size in (8 * KIB, 1 * MIB, 64 * MIB):
    rows = [cluster.predict(size, 2, g, n, params) for n in nodes]
    for alg in rows[0]:
      t = [r[alg].time_us for r in rows]
      assert all(a <= b + 1e-9 for a, b in zip(t, t[1:])), (preset, size, alg, t)


def test_ring_beats_tree_large_and_tree_beats_ring_small_at_many_nodes():
  for params, g in ((P, 8), (PM.params, 4), (VISTA.params, 1)):
    for n in (2, 4, 8):
      ring, tree = (min(cost_model.nccl_us(a, p, 256 * MIB, g, n, params)
                        for p in cost_model.NCCL_PROTOCOLS) for a in ("ring", "tree"))
      assert ring < tree, (g, n, ring, tree)
    gaps = []
    for n in (8, 16, 32, 64):
      ring, tree = (min(cost_model.nccl_us(a, p, 8 * KIB, g, n, params)
                        for p in cost_model.NCCL_PROTOCOLS) for a in ("ring", "tree"))
      assert tree < ring, (g, n)
      gaps.append(ring / tree)
    assert gaps == sorted(gaps) and gaps[-1] > 4  # ring's latency is linear in nodes
  # The crossover: at 8 x 8 the tree wins below some size and the ring above it.
  winners = [min(("ring", "tree"), key=lambda a: min(
      cost_model.nccl_us(a, p, s, 8, 8, P) for p in cost_model.NCCL_PROTOCOLS))
             for s in (8 * KIB << i for i in range(16))]
  assert winners[0] == "tree" and winners[-1] == "ring"
  assert winners == sorted(winners, key=["tree", "ring"].index)  # one switch


# ------------------------------------------------------------------ NVRAR against NCCL


def test_nvrar_wins_small_messages_on_slingshot_at_8_or_more_nodes():
  for n in (8, 16, 32, 64):
    x = [cluster.speedup(b, 2, 4, n, PM.params) for b in cluster.PAPER_SIZES]
    assert x[0] > 1.4 and x[1] > 1.05, (n, x)   # 128 KiB, 256 KiB
    assert x == sorted(x, reverse=True), (n, x)  # the lead shrinks with the size
    assert x[-1] < 1, (n, x)                     # 2 MiB: the model gives it to NCCL
  # Our kernel sends fp32 partials across nodes; bf16 partials halve those bytes.
  for n in (8, 32):
    for b in cluster.PAPER_SIZES:
      assert cluster.speedup(b, 2, 4, n, PM.params, partial_itemsize=2) > cluster.speedup(
          b, 2, 4, n, PM.params)


def test_nvrar_wins_128k_to_2m_on_ndr_with_8_gpus_per_node():
  for n in (2, 4, 8, 16, 32):
    for b in cluster.PAPER_SIZES:
      assert cluster.speedup(b, 2, 8, n, P) > 1.0, (n, b)


def test_paper_comparison_matches_the_documented_statements():
  """docs/cluster_model.md: where the model meets the paper's 1.9x-3.6x and where not."""
  assert cluster.PAPER_FIGURES[0]["low"] == 1.9 and cluster.PAPER_FIGURES[0]["high"] == 3.6
  assert cluster.PAPER_FIGURES[1]["high"] == 1.72
  rows = cluster.paper_comparison()
  assert {(r["preset"], r["num_nodes"]) for r in rows} == {
      (p, n) for p in ("perlmutter", "vista") for n in (2, 4, 8, 16, 32, 64)}
  by = {(r["preset"], r["num_nodes"]): r for r in rows}
  # The model reaches the paper's lower figure (Perlmutter, 2 nodes, 128 KiB) ...
  assert by[("perlmutter", 2)]["best"] >= 1.9
  # ... never its upper one, on either system, even with bf16 partials.
  assert max(max(r["best"], r["best_bf16_partials"]) for r in rows) < 3.6
  # At 2 MiB and 4 or more nodes the model has NCCL faster on both systems.
  for (preset, n), r in by.items():
    if n >= 4:
      assert r["speedup"][2 * MIB] < 1, (preset, n)
    assert r["best"] == max(r["speedup"].values()) == r["speedup"][128 * KIB]
  assert by[("vista", 16)]["wins_up_to"] == 128 * KIB
  assert by[("perlmutter", 2)]["wins_up_to"] == 2 * MIB


# ------------------------------------------------------------------ the policy at scale

POLICY_SIZES = [8 * KIB << i for i in range(16)]  # 8 KiB ... 256 MiB


@pytest.mark.parametrize("gpus,nodes,last_nvrar", [(4, 4, 1 * MIB), (8, 8, 2 * MIB),
                                                    (8, 64, 1 * MIB)])
def test_policy_choices_at_scale_are_sane(gpus, nodes, last_nvrar):
  policy = tuning.Policy((), P, path="none", missing=True)
  picks = [policy.choose(s, 2, gpus, nodes) for s in POLICY_SIZES]
  algs = [c.algorithm for c in picks]
  assert set(algs) == {"hierarchical", "psum"}  # never one_shot or two_shot across nodes
  assert algs == sorted(algs, key=["hierarchical", "psum"].index)  # NVRAR, then psum
  assert max(s for s, a in zip(POLICY_SIZES, algs) if a == "hierarchical") == last_nvrar
  for s, c in zip(POLICY_SIZES, picks):
    psum = tuning.predict_us("psum", None, s, 2, gpus, nodes, P)
    best = min(tuning.predict_us("hierarchical", p, s, 2, gpus, nodes, P) for p in ("ll", "simple"))
    assert c.psum_us == psum
    if c.algorithm == "hierarchical":
      assert c.source == "cost model (no tuning file at none)"
      assert c.time_us == pytest.approx(best)
      assert c.time_us * (1 + policy_mod.MODEL_MARGIN) < psum  # clearly faster than psum
    else:  # psum: faster, or a kernel within the margin of it, said so
      assert c.time_us == psum
      assert c.source.startswith("cost model (no tuning file at none; ")
      assert ("is not 10% faster than psum's" if best < psum else "beats the fastest kernel") \
          in c.source
  assert [c.protocol for c in picks[:5]] == ["ll"] * 5  # 8-128 KiB: LL
  assert picks[algs.index("psum") - 1].protocol == "simple"  # the largest NVRAR sizes: simple


def test_policy_at_8x8_table():
  """The table docs/cluster_model.md prints (sizes 8 KiB - 256 MiB, bf16)."""
  rows = tuning.Policy((), P, path="none", missing=True).table(8, 8, sizes=POLICY_SIZES)
  impls = [r["impl"] for r in rows]
  assert impls == (["jaxoverlap:hierarchical_ll"] * 6 + ["jaxoverlap:hierarchical_simple"] * 3
                   + ["xla:psum"] * 7)
  # 4 MiB: NVRAR predicted 1.8% faster than psum, inside the margin: psum.
  assert "118.3 us, is not 10% faster than psum's 120.5 us" in rows[9]["source"]


# ------------------------------------------------------------------ the script's output


def test_results_file_and_doc_agree_with_the_model():
  path = os.path.join(_ROOT, "benchmarks", "results", "cluster_model.json")
  with open(path) as f:
    result = json.load(f)
  assert result["machine"] == "model (no GPU)"
  assert result["command"].startswith("python benchmarks/plot_cluster_model.py")
  assert "records" not in result  # predictions are not measurements
  assert result["sizes"] == list(cluster.SIZES)
  for name, preset in cluster.PRESETS.items():
    assert result["presets"][name]["params"] == preset.params.as_flat()
  for row in result["predictions"]:
    params = cluster.PRESETS[row["preset"]].params
    for b, us in zip(result["sizes"], row["time_us"]):
      got = cluster.predict(b, 2, row["gpus_per_node"], row["num_nodes"], params)
      assert got[row["algorithm"]].time_us == pytest.approx(us, abs=0.01), row["algorithm"]
  doc = open(os.path.join(_ROOT, "docs", "cluster_model.md")).read()
  assert "cluster_model.png" in doc and "arXiv 2511.09557" in doc
  for r in cluster.paper_comparison():
    cells = " | ".join(f"{r['speedup'][b]:.2f} ({r['speedup_bf16_partials'][b]:.2f})"
                       for b in cluster.PAPER_SIZES)
    assert f"| {r['num_nodes']} x {r['gpus_per_node']} | {cells} |" in doc, r


# ------------------------------------------------------------------ the planner's command line


def test_planner_command_prints_the_models_table():
  """`python -m jaxoverlap.tuning.cluster`: a planner's table for their own cluster."""
  env = dict(os.environ, PYTHONPATH=_ROOT)
  cmd = [sys.executable, "-m", "jaxoverlap.tuning.cluster", "--preset", "perlmutter",
         "--nodes", "4", "--set", "net_beta_gbps=20", "--sizes", "128K,4M"]
  done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=True)
  params, rows = cluster.planner_rows("perlmutter", 4, None, {"net_beta_gbps": 20.0},
                                      2, [128 * KIB, 4 * MIB])
  assert params.network.beta_gbps == 20.0 and "net_beta_gbps" in done.stdout
  assert "--set" in [line.split()[2] for line in done.stdout.splitlines()
                     if line.strip().startswith("net_beta_gbps")]
  for r, size in zip(rows, ("128 KiB", "4 MiB")):
    got = cluster.predict(r["bytes"], 2, 4, 4, params)
    assert r[cluster.NVRAR] == got[cluster.NVRAR] and r["psum"] == got["psum"]
    auto = r["auto"]
    assert auto == tuning.Policy((), params, path="no table: the model").choose(r["bytes"], 2, 4, 4)
    line = next(x for x in done.stdout.splitlines() if x.startswith(f"| {size} |"))
    assert f"| {got['psum'].time_us:.1f} ({got['psum'].detail}) |" in line
    assert f"| {got[cluster.NVRAR].time_us:.1f} ({got[cluster.NVRAR].detail}) |" in line
    per_node = r["auto_per_node"]  # trial 31: the process-per-node choice, with the margin
    assert per_node == tuning.Policy((), params, path="no table: the model").choose_over_xla(
        r["bytes"], 2, 4, 4)
    assert line.endswith(f"| {auto.algorithm}{f' ({auto.protocol})' if auto.protocol else ''} | "
                         f"{per_node.algorithm}"
                         f"{f' ({per_node.protocol})' if per_node.protocol else ''} |")
  bad = subprocess.run(cmd[:5] + ["--set", "net_beta_gbps=0"], capture_output=True, text=True,
                       env=env, timeout=120)
  assert bad.returncode == 2 and bad.stdout == ""
  assert bad.stderr.strip() == ("jaxoverlap.tuning.cluster: error: cost-model parameter "
                                "net_beta_gbps must be a positive number, got 0.0")
  for flag, says in ((["--set", "net_beta_gbps=fast"], "--set 'net_beta_gbps=fast': expected "
                      "key=number"), (["--sizes", "1.5M"], "--sizes='1.5M' is not a byte count")):
    bad = subprocess.run(cmd[:5] + flag, capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and says in bad.stderr, bad.stderr
