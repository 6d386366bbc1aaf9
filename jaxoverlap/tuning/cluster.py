"""The cost model on machines we could not measure: presets, N-node predictions, NVRAR's paper.

Problem:
  The kernels were timed on one node of 2x H200 only, yet ``all_reduce``'s
  ``auto`` must choose for 1-64 nodes of 4 or 8 GPUs, and the claim that
  NVRAR's hierarchical all-reduce beats NCCL across nodes (arXiv 2511.09557:
  "up to 1.9x-3.6x lower latency than NCCL for message sizes between 128 KB and
  2 MB on HPE Slingshot and InfiniBand") should be checked against the model
  before anyone trusts the model's choices there.

Algorithm:
  ``PRESETS`` are named ``CostParams`` of three machines, every value with its
  source or marked ASSUMPTION with the reasoning (``Preset.sources``):
  ``h200_ndr`` (the defaults: 8x H200 NVLink 4 per node, one 400 Gb/s
  InfiniBand NDR NIC per GPU), ``perlmutter`` (4x A100 NVLink 3 per node, one
  200 Gb/s Slingshot 11 NIC per GPU) and ``vista`` (one GH200 per node,
  InfiniBand NDR). ``predict`` prices, for one topology and size, NVRAR
  (``cost_model.predict_us("hierarchical")``, best protocol), NCCL's ring and
  tree (``cost_model.nccl_us``, best protocol each) and psum (NCCL's best, as
  XLA calls it); within one node our one-shot and two-shot kernels instead of
  NVRAR. ``paper_comparison`` sets the model's NVRAR speed-up over NCCL beside
  the paper's published figures (``PAPER_FIGURES``: only what was found).

Command line (a planner's table for one cluster; no GPU, no measurement):
  python -m jaxoverlap.tuning.cluster --preset perlmutter --nodes 4
  python -m jaxoverlap.tuning.cluster --nodes 16 --set net_alpha_us=3 --sizes 64K,1M
  prints the parameters and where each comes from, then per size psum (NCCL's
  best), NCCL's ring and tree, NVRAR (or one-shot/two-shot in one node), its
  speed-up, and what ``Policy.choose`` picks without a measured table.
  ``net_beta_gbps`` is the network bandwidth one GPU gets: with a NIC per GPU
  its achieved rate; where k GPUs share a NIC, that rate / k.

Example:
  >>> from jaxoverlap.tuning import cluster
  >>> p = cluster.PRESETS["perlmutter"]
  >>> round(cluster.speedup(128 << 10, 2, p.gpus_per_node, 8, p.params), 2)
  1.6
  >>> cluster.predict(128 << 10, 2, 4, 8, p.params)["psum"]
  Prediction(time_us=60.98..., detail='tree/ll')
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from jaxoverlap import names
from jaxoverlap.tuning import cost_model
from jaxoverlap.tuning.cost_model import PSUM, CostParams, LinkParams

__all__ = [
    "Preset",
    "PRESETS",
    "SIZES",
    "NODES",
    "Prediction",
    "predict",
    "speedup",
    "PAPER_FIGURES",
    "PAPER_SIZES",
    "PAPER_NOT_FOUND",
    "paper_comparison",
    "NVRAR",
    "NCCL_RING",
    "NCCL_TREE",
]

SIZES = tuple(8192 << i for i in range(12))   # 8 KiB ... 16 MiB per rank
NODES = (1, 2, 4, 8, 16, 32, 64)              # the kernels take up to 64 nodes
NVRAR = "nvrar"
NCCL_RING, NCCL_TREE = "nccl_ring", "nccl_tree"


@dataclasses.dataclass(frozen=True)
class Preset:
  """One machine for the cost model.

  Attributes:
    name: the key in ``PRESETS``.
    label: the machine in words.
    gpus_per_node: GPUs per node (G).
    params: the model's parameters.
    sources: flat parameter key (``cost_model.PARAM_KEYS``) -> where its value
      comes from, or "ASSUMPTION: <reasoning>".
  """

  name: str
  label: str
  gpus_per_node: int
  params: CostParams
  sources: Mapping[str, str]


_H200 = "docs/results.md, 'Baselines measured at the start' (2x H200 NV18)"

PRESETS: dict[str, Preset] = {
    "h200_ndr": Preset(
        name="h200_ndr",
        label="8x H200 (NVLink 4) per node, one InfiniBand NDR 400 Gb/s NIC per GPU",
        gpus_per_node=8,
        params=cost_model.DEFAULT_PARAMS,
        sources={
            "nvlink_alpha_us": f"measured: NVSHMEM signal ping-pong, 0.71 us one way ({_H200})",
            "nvlink_beta_gbps": f"measured: nvshmem putmem_block both ways, 355 GB/s per "
                                f"direction, 74% of NV18's 478 GB/s ({_H200})",
            "net_alpha_us": "ASSUMPTION: InfiniBand write ~1.5-2 us plus NVSHMEM's proxy or "
                            "IBGDA overhead",
            "net_beta_gbps": "ASSUMPTION: one NDR NIC per GPU, 400 Gb/s = 50 GB/s line rate, "
                             "90% reached by large RDMA writes",
            "nccl_alpha_us": f"measured: JAX psum, bf16, 2 GPUs, 8 KB, 13.7 us ({_H200})",
            "nccl_beta_gbps": f"measured: JAX psum 64 MB on 2 GPUs, 234 GB/s bus bandwidth "
                              f"({_H200})",
            "launch_us": f"fit: PyTorch symmetric-memory kernels' 6.5-6.7 us floor ({_H200})",
            "hbm_gbps": "ASSUMPTION: H200 HBM3e 4.8 TB/s (NVIDIA H200 datasheet), 85% reached",
        }),
    "perlmutter": Preset(
        name="perlmutter",
        label="Perlmutter: 4x A100 (NVLink 3) per node, one Slingshot 11 200 Gb/s NIC per GPU",
        gpus_per_node=4,
        params=CostParams(
            nvlink=LinkParams(alpha_us=0.71, beta_gbps=222.0),
            network=LinkParams(alpha_us=4.0, beta_gbps=22.5),
            nccl=LinkParams(alpha_us=13.7, beta_gbps=147.0),
            launch_us=4.5,
            hbm_gbps=1320.0,
        ),
        sources={
            "nvlink_alpha_us": "ASSUMPTION: as measured on H200 (one NVLink hop; NVLink 3 and 4 "
                               "differ in bandwidth, not in this latency's order)",
            "nvlink_beta_gbps": "A100 NVLink 3: 600 GB/s both ways = 300 GB/s per direction "
                                "(NVIDIA A100 datasheet), all 12 links to the 3 peers of a "
                                "4-GPU node; ASSUMPTION: 74% reached, as on H200 -> 222",
            "net_alpha_us": "ASSUMPTION: Slingshot 11 is driven through libfabric (CXI "
                            "provider; glennklockwood.com/garden/slingshot), with no "
                            "GPU-initiated path, so NVSHMEM's puts go through a CPU proxy: "
                            "~2 us wire + ~2 us proxy",
            "net_beta_gbps": "4 Slingshot 11 NICs per node, one per GPU "
                             "(docs.nersc.gov/systems/perlmutter/architecture); Cassini NIC "
                             "200 Gb/s = 25 GB/s (glennklockwood.com/garden/slingshot); "
                             "ASSUMPTION: 90% reached",
            "nccl_alpha_us": "ASSUMPTION: the per-call overhead measured on H200 (host side: "
                             "XLA's and NCCL's launch)",
            "nccl_beta_gbps": "ASSUMPTION: H200's measured 234 GB/s scaled by NVLink bandwidth, "
                              "300/478",
            "launch_us": "ASSUMPTION: as fit on H200 (launch and entry synchronisation)",
            "hbm_gbps": "A100 40 GB HBM2 1555 GB/s (NVIDIA A100 datasheet); ASSUMPTION: 85% "
                        "reached",
        }),
    "vista": Preset(
        name="vista",
        label="Vista (TACC): one GH200 per node, InfiniBand NDR",
        gpus_per_node=1,
        params=CostParams(
            nvlink=cost_model.DEFAULT_PARAMS.nvlink,
            network=LinkParams(alpha_us=2.5, beta_gbps=45.0),
            nccl=cost_model.DEFAULT_PARAMS.nccl,
            launch_us=4.5,
            hbm_gbps=3400.0,
        ),
        sources={
            "nvlink_alpha_us": "unused: one GPU per node (Vista's GH nodes pair one Grace CPU "
                               "with one Hopper GPU, cvw.cac.cornell.edu/vista/intro/"
                               "system-components); the H200 value is kept",
            "nvlink_beta_gbps": "unused: one GPU per node; the H200 value is kept",
            "net_alpha_us": "ASSUMPTION: as the h200_ndr preset (InfiniBand NDR: two tiers of "
                            "NDR switches, cvw.cac.cornell.edu/vista/intro/system-components)",
            "net_beta_gbps": "ASSUMPTION: one NDR port per node at NDR's 400 Gb/s = 50 GB/s "
                             "(the port speed of the GH nodes is not in the sources found), "
                             "90% reached",
            "nccl_alpha_us": "ASSUMPTION: the per-call overhead measured on H200 (host side: "
                             "XLA's and NCCL's launch)",
            "nccl_beta_gbps": "no effect: with one GPU per node the NIC (45 GB/s) bounds NCCL; "
                              "the H200 value is kept",
            "launch_us": "ASSUMPTION: as fit on H200 (our kernel's launch and entry "
                         "synchronisation)",
            "hbm_gbps": "GH200's Hopper GPU, 96 GB HBM3 up to 4 TB/s "
                        "(cvw.cac.cornell.edu/vista/intro/system-components); ASSUMPTION: 85% "
                        "reached",
        }),
}


class Prediction(NamedTuple):
  """One algorithm's predicted latency.

  Attributes:
    time_us: latency, us.
    detail: how: the protocol ("ll", "simple"), NCCL's "<algorithm>/<protocol>",
      or "measured fit" (psum within one node).
  """

  time_us: float
  detail: str


def _best_kernel(algorithm: str, nbytes: int, itemsize: int, ranks_per_node: int,
                 num_nodes: int, params: CostParams, partial_itemsize: int) -> Prediction:
  """Our kernel's latency with its faster protocol."""
  return Prediction(*min(
      (cost_model.predict_us(algorithm, proto, nbytes, itemsize, ranks_per_node, num_nodes,
                             params, partial_itemsize=partial_itemsize), proto)
      for proto in names.protocols(algorithm)))


def predict(nbytes: int, itemsize: int, ranks_per_node: int, num_nodes: int,
            params: CostParams | None = None, *,
            partial_itemsize: int = 4) -> dict[str, Prediction]:
  """Every algorithm's predicted latency for one all-reduce.

  Args:
    nbytes: message size per rank, bytes.
    itemsize: bytes per element of the message.
    ranks_per_node: GPUs per node (G).
    num_nodes: nodes (N).
    params: model parameters (default: ``cost_model.params_from_env()``).
    partial_itemsize: bytes per element of NVRAR's partial sums between nodes
      (4: fp32, as our kernel sends them).

  Returns:
    ``{"psum", "nccl_ring", "nccl_tree", "nvrar"}`` -> ``Prediction`` across
    nodes; ``{"psum", "nccl_ring", "one_shot", "two_shot"}`` within one node.
    psum across nodes is the fastest NCCL configuration; within one node the
    line fit to our measurements.

  Raises:
    ValueError: a topology of one rank (nothing to reduce), or as
      ``cost_model.predict_us``.
  """
  p = cost_model.params_from_env() if params is None else params
  g, n = cost_model.whole_numbers("predict", ranks_per_node=ranks_per_node,
                                  num_nodes=num_nodes)
  if g * n < 2:
    raise ValueError(f"predict: an all-reduce needs 2 or more ranks, got {g} x {n}")
  out = {}
  if n == 1:
    out[PSUM] = Prediction(cost_model.predict_us(PSUM, None, nbytes, itemsize, g, n, p),
                           "measured fit")
  else:
    us, alg, proto = cost_model.nccl_best(nbytes, g, n, p)
    out[PSUM] = Prediction(us, f"{alg}/{proto}")
  ring = min((cost_model.nccl_us("ring", proto, nbytes, g, n, p), proto)
             for proto in cost_model.NCCL_PROTOCOLS)
  out[NCCL_RING] = Prediction(*ring)
  if n == 1:
    for alg in (names.ONE_SHOT, names.TWO_SHOT):
      out[alg] = _best_kernel(alg, nbytes, itemsize, g, n, p, partial_itemsize)
    return out
  tree = min((cost_model.nccl_us("tree", proto, nbytes, g, n, p), proto)
             for proto in cost_model.NCCL_PROTOCOLS)
  out[NCCL_TREE] = Prediction(*tree)
  out[NVRAR] = _best_kernel(names.HIERARCHICAL, nbytes, itemsize, g, n, p, partial_itemsize)
  return out


def speedup(nbytes: int, itemsize: int, ranks_per_node: int, num_nodes: int,
            params: CostParams | None = None, *, partial_itemsize: int = 4) -> float:
  """NVRAR's predicted speed-up over NCCL (psum's time over NVRAR's), across nodes.

  Args:
    nbytes, itemsize, ranks_per_node, num_nodes, params, partial_itemsize: as
      in ``predict``.

  Returns:
    psum_us / nvrar_us; above 1 where NVRAR is faster.

  Raises:
    ValueError: num_nodes < 2 (NVRAR spans nodes), or as ``predict``.
  """
  if num_nodes < 2:
    raise ValueError(f"speedup: NVRAR spans nodes; got num_nodes={num_nodes}")
  got = predict(nbytes, itemsize, ranks_per_node, num_nodes, params,
                partial_itemsize=partial_itemsize)
  return got[PSUM].time_us / got[NVRAR].time_us


# --------------------------------------------------------------------------- the paper

# The published figures of NVRAR's paper that could be found (its abstract; the
# figures with per-size latencies and node counts were not in the sources at hand).
PAPER_FIGURES = (
    {"figure": "NVRAR's latency: up to 1.9x-3.6x lower than NCCL's",
     "setup": "message sizes 128 KB - 2 MB; HPE Slingshot (Perlmutter) and InfiniBand (Vista)",
     "low": 1.9, "high": 3.6,
     "source": "arXiv 2511.09557, abstract"},
    {"figure": "end-to-end batch latency up to 1.72x lower with NVRAR in YALIS",
     "setup": "Llama 3.1 405B, multi-node, decode-heavy, tensor parallelism",
     "low": None, "high": 1.72,
     "source": "arXiv 2511.09557, abstract; not modelled here (needs the model's step time)"},
)
PAPER_SIZES = tuple(128 << 10 << i for i in range(5))  # 128 KiB ... 2 MiB
PAPER_NOT_FOUND = ("per-size latencies of NVRAR and NCCL", "the node counts of each figure",
                   "which system gives 1.9x and which 3.6x", "the data type")


def paper_comparison(presets: Iterable[str] = ("perlmutter", "vista"),
                     nodes: Sequence[int] = (2, 4, 8, 16, 32, 64), itemsize: int = 2,
                     sizes: Sequence[int] = PAPER_SIZES) -> list[dict[str, Any]]:
  """The model's NVRAR speed-up over NCCL beside the paper's "up to 1.9x-3.6x".

  Args:
    presets: names in ``PRESETS``.
    nodes: node counts (the paper's are not known: see ``PAPER_NOT_FOUND``).
    itemsize: bytes per element (2: bf16, as LLM inference runs).
    sizes: message sizes per rank (default 128 KiB - 2 MiB, the paper's range).

  Returns:
    One dict per preset and node count: ``preset``, ``gpus_per_node``,
    ``num_nodes``, ``speedup`` ({bytes: x} with fp32 partials, as our kernel),
    ``speedup_bf16_partials`` (the same with bf16 partials), ``best`` and
    ``best_bf16_partials`` (the largest over ``sizes``), ``wins_up_to`` (the
    largest size at which NVRAR is faster, fp32 partials, or None), and
    ``published`` (the paper's range, ``PAPER_FIGURES[0]``).
  """
  rows = []
  for name in presets:
    preset = PRESETS[name]
    g = preset.gpus_per_node
    for n in nodes:
      fp32 = {b: speedup(b, itemsize, g, n, preset.params) for b in sizes}
      bf16 = {b: speedup(b, itemsize, g, n, preset.params, partial_itemsize=2) for b in sizes}
      wins = [b for b, x in fp32.items() if x > 1]
      rows.append({
          "preset": name, "gpus_per_node": g, "num_nodes": n,
          "speedup": {b: round(x, 2) for b, x in fp32.items()},
          "speedup_bf16_partials": {b: round(x, 2) for b, x in bf16.items()},
          "best": round(max(fp32.values()), 2), "best_bf16_partials": round(max(bf16.values()), 2),
          "wins_up_to": max(wins) if wins else None,
          "published": (PAPER_FIGURES[0]["low"], PAPER_FIGURES[0]["high"]),
      })
  return rows


# --------------------------------------------------------------------------- command line


def planner_rows(preset: str, num_nodes: int, gpus_per_node: int | None = None,
                 overrides: Mapping[str, float] | None = None, itemsize: int = 2,
                 sizes: Sequence[int] = SIZES) -> tuple[CostParams, list[dict[str, Any]]]:
  """What ``python -m jaxoverlap.tuning.cluster`` prints, as data.

  Args:
    preset: a name in ``PRESETS``.
    num_nodes: nodes (N).
    gpus_per_node: GPUs per node (G; default the preset's).
    overrides: flat parameter keys (``cost_model.PARAM_KEYS``) -> values.
    itemsize: bytes per element of the message.
    sizes: message sizes per rank, bytes.

  Returns:
    ``(params, rows)``: the parameters used, and per size a dict of
    ``bytes``, every ``predict`` entry (``Prediction``), ``speedup`` (psum over
    our best kernel), ``auto`` (``Policy.choose`` without a table: one process
    per GPU, the NVSHMEM runtime) and ``auto_per_node`` (across nodes,
    ``Policy.choose_over_xla``: one process per node driving its GPUs, which
    joins the nodes through XLA's collective; None on one node).

  Raises:
    ValueError: an unknown preset or parameter, a bad value, or a topology
      of fewer than 2 ranks.
  """
  from jaxoverlap.tuning import policy as _policy

  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; one of {sorted(PRESETS)}")
  p = PRESETS[preset].params.replace(**dict(overrides or {}))
  g = PRESETS[preset].gpus_per_node if gpus_per_node is None else gpus_per_node
  chooser = _policy.Policy((), p, path="no table: the model")
  rows = []
  for b in sizes:
    got = predict(b, itemsize, g, num_nodes, p)
    ours = got[NVRAR] if NVRAR in got else min(got[names.ONE_SHOT], got[names.TWO_SHOT])
    rows.append({"bytes": b, **got, "speedup": got[PSUM].time_us / ours.time_us,
                 "auto": chooser.choose(b, itemsize, g, num_nodes),
                 "auto_per_node": (chooser.choose_over_xla(b, itemsize, g, num_nodes)
                                   if num_nodes > 1 else None)})
  return p, rows


def _size(b: int) -> str:
  for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
    if b >= 1 << shift and b % (1 << shift) == 0:
      return f"{b >> shift} {unit}"
  return f"{b} B"


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _main(argv) -> int:
  from absl import flags

  from jaxoverlap.tuning import policy as _policy
  from jaxoverlap.tuning.results import parse_bytes

  del argv
  f = flags.FLAGS
  try:
    overrides = {}
    for item in f.set:
      key, sep, value = item.partition("=")
      try:
        if not sep:
          raise ValueError
        overrides[key.strip()] = float(value)
      except ValueError:
        raise ValueError(f"--set {item!r}: expected key=number, e.g. net_beta_gbps=22.5") from None
    sizes = [parse_bytes(x, "--sizes") for x in f.sizes] if f.sizes else SIZES
    params, rows = planner_rows(f.preset, f.nodes, f.gpus_per_node or None, overrides,
                                _ITEMSIZE[f.dtype], sizes)
  except (TypeError, ValueError) as e:
    print(f"jaxoverlap.tuning.cluster: error: {e}", file=sys.stderr, flush=True)
    return 2
  preset = PRESETS[f.preset]
  g = f.gpus_per_node or preset.gpus_per_node
  print(f"{preset.label}\n{f.nodes} node{'s' * (f.nodes != 1)} x {g} GPUs, {f.dtype}; "
        "cost-model predictions, us (no measurement)\n")
  for key, value in params.as_flat().items():
    source = "--set" if key in overrides else preset.sources.get(key, "")
    print(f"  {key:<17} {value:>9g}  {textwrap.shorten(source, 100)}")
  ours = "NVRAR" if f.nodes > 1 else "ours (best of one/two-shot)"
  per_node = " auto, a process per node |" if f.nodes > 1 else ""
  print(f"\n| size | psum (NCCL's best) | NCCL ring | NCCL tree | {ours} | speed-up | auto |"
        + per_node)
  print("|---|---|---|---|---|---|---|" + "---|" * bool(per_node))
  for r in rows:
    mine = r.get(NVRAR) or min(r[names.ONE_SHOT], r[names.TWO_SHOT])
    tree = f"{r[NCCL_TREE].time_us:.1f}" if NCCL_TREE in r else "-"
    pick = [c.algorithm if c.protocol is None else f"{c.algorithm} ({c.protocol})"
            for c in (r["auto"], r["auto_per_node"]) if c is not None]
    print(f"| {_size(r['bytes'])} | {r[PSUM].time_us:.1f} ({r[PSUM].detail}) | "
          f"{r[NCCL_RING].time_us:.1f} | {tree} | {mine.time_us:.1f} ({mine.detail}) | "
          f"{r['speedup']:.2f}x | {' | '.join(pick)} |")
  print("\nauto: what Policy.choose picks with no measured table, for one process per GPU (a "
        f"kernel must be predicted {_policy.MODEL_MARGIN:.0%} faster than psum)."
        + (" auto, a process per node: one process driving each node's GPUs (SLURM one task "
           "per node), where XLA's collective joins the nodes (Policy.choose_over_xla: "
           "hierarchical is the kernels' intra-node steps around a psum of the fp32 shard; "
           "same margin)." if per_node else "")
        + " Every network value of the presets is an assumption; docs/cluster_model.md says "
        "which and why.")
  return 0


if __name__ == "__main__":
  from absl import flags

  from jaxoverlap import _cli

  flags.DEFINE_enum("preset", "h200_ndr", sorted(PRESETS), "the machine's parameters")
  flags.DEFINE_integer("nodes", 2, "nodes (N)", lower_bound=1)
  flags.DEFINE_integer("gpus_per_node", 0, "GPUs per node (G; 0: the preset's)", lower_bound=0)
  flags.DEFINE_list("set", [], "parameter overrides, key=value (keys: "
                    + ", ".join(cost_model.PARAM_KEYS) + ")")
  flags.DEFINE_enum("dtype", "bfloat16", sorted(_ITEMSIZE), "element type")
  flags.DEFINE_list("sizes", [], "message sizes per rank (K/M/G suffixes; default 8K..16M)")
  _cli.run(_main)
