"""The alpha-beta cost model of the all-reduce algorithms and of ``lax.psum``.

Problem:
  Where no measured table covers a topology (other GPU counts, other nodes,
  networks we could not measure), ``all_reduce``'s automatic choice still has to
  rank one-shot, two-shot, NVRAR's hierarchical algorithm and XLA's psum.

Algorithm:
  ``predict_us`` prices each algorithm with one (alpha, beta) pair per link
  kind (NVLink inside a node, the network between nodes), a fixed per-call
  overhead and the local reduction's HBM traffic. psum is priced as NCCL
  would run it: within one node by a line fit to our measurements of psum;
  across nodes (``nccl_us``) as the fastest of NCCL's ring and tree with its
  LL, LL128 and Simple protocols, each a number of pipeline hops of a
  per-protocol latency plus the bytes at the protocol's share of the
  bandwidth (NCCL's algorithms and protocols: "Demystifying NCCL", arXiv
  2507.04786). The defaults were fit on 2x H200 (docs/results.md); the
  network's are assumed (400 Gb/s NIC per GPU) and can be set by environment
  variables or a tuning table's ``"params"``. Presets of other machines are in
  ``jaxoverlap.tuning.cluster``; docs/cluster_model.md sets the model beside
  NVRAR's published figures.

Example:
  >>> from jaxoverlap.tuning import cost_model
  >>> round(cost_model.predict_us("one_shot", "ll", 8192, 2, ranks_per_node=8, num_nodes=1), 1)
  5.6

Environment:
  ``JAXOVERLAP_<KEY>`` for every key of ``PARAM_KEYS`` (e.g.
  ``JAXOVERLAP_NET_ALPHA_US``, ``JAXOVERLAP_NET_BETA_GBPS``) overrides one
  parameter; it beats a tuning table's ``"params"``, which beat the defaults.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
from collections.abc import Mapping

from jaxoverlap import names

__all__ = [
    "ALGORITHMS",
    "PROTOCOLS",
    "PSUM",
    "PARAM_KEYS",
    "LinkParams",
    "CostParams",
    "DEFAULT_PARAMS",
    "params_from_env",
    "predict_us",
    "NCCL_ALGORITHMS",
    "NCCL_PROTOCOLS",
    "NcclProtocol",
    "NCCL_PROTOCOL_COSTS",
    "NCCL_TREE_BW_FACTOR",
    "nccl_base_us",
    "nccl_us",
    "nccl_best",
    "whole_numbers",
]

ALGORITHMS = names.algorithms(names.ALL_REDUCE, names.CUDA)
PROTOCOLS = names.PROTOCOLS
PSUM = "psum"  # lax.psum, i.e. NCCL: the handover that auto must never lose to
_SINGLE_NODE = (names.ONE_SHOT, names.TWO_SHOT)  # their kernels reach peers over NVLink only



def _check_positive(what: str, value) -> float:
  """``value`` as a float; ValueError naming ``what`` unless a positive finite number."""
  try:
    v = float(value) if not isinstance(value, bool) else math.nan
  except (TypeError, ValueError):
    v = math.nan
  if not (v > 0 and math.isfinite(v)):
    raise ValueError(f"{what} must be a positive number, got {value!r}")
  return v


@dataclasses.dataclass(frozen=True)
class LinkParams:
  """One link kind in the alpha-beta model: a step costs ``alpha_us + bytes / beta``.

  Attributes:
    alpha_us: latency of one message (put, or signal), us.
    beta_gbps: bandwidth one GPU gets for its sends, GB/s (1e9 bytes/s).
  """

  alpha_us: float
  beta_gbps: float

  def __post_init__(self):
    for name in ("alpha_us", "beta_gbps"):  # stored as floats ("2.5" would fail later)
      object.__setattr__(self, name, _check_positive(f"LinkParams.{name}", getattr(self, name)))

  def transfer_us(self, nbytes: float) -> float:
    """Time to stream ``nbytes`` bytes at ``beta_gbps``, us (no latency)."""
    return nbytes / (self.beta_gbps * 1e3)


@dataclasses.dataclass(frozen=True)
class CostParams:
  """Parameters of ``predict_us``.

  Attributes:
    nvlink: GPU-to-GPU inside a node (NVSHMEM puts over NVLink/NVSwitch).
    network: GPU-to-GPU across nodes, per GPU (its own NIC).
    nccl: ``lax.psum``: ``alpha_us`` is NCCL's whole small-message latency as
      seen from JAX, ``beta_gbps`` its ring bus bandwidth inside a node.
    launch_us: fixed cost of one call of our kernel: launch (graph node) and
      entry synchronisation, us.
    hbm_gbps: local memory bandwidth for the reduction's reads and writes, GB/s.
  """

  nvlink: LinkParams
  network: LinkParams
  nccl: LinkParams
  launch_us: float
  hbm_gbps: float

  def __post_init__(self):
    for name in ("nvlink", "network", "nccl"):
      if not isinstance(getattr(self, name), LinkParams):
        raise TypeError(f"CostParams.{name} must be a LinkParams, got "
                        f"{type(getattr(self, name)).__name__}")
    for name in ("launch_us", "hbm_gbps"):
      object.__setattr__(self, name, _check_positive(f"CostParams.{name}", getattr(self, name)))

  def as_flat(self) -> dict[str, float]:
    """The parameters under the flat keys of ``PARAM_KEYS``."""
    return {key: getattr(getattr(self, f[0]), f[1]) if len(f) == 2 else getattr(self, f[0])
            for key, f in _FIELDS.items()}

  def replace(self, **flat: float | None) -> CostParams:
    """A copy with some flat keys (``PARAM_KEYS``) changed; None values are ignored.

    Raises:
      ValueError: unknown key, or a value that is not a positive number.
    """
    values = self.as_flat()
    for key, value in flat.items():
      if value is None:
        continue
      if key not in _FIELDS:
        raise ValueError(f"unknown cost-model parameter {key!r}; expected one of {PARAM_KEYS}")
      values[key] = _check_positive(f"cost-model parameter {key}", value)
    return CostParams(
        nvlink=LinkParams(values["nvlink_alpha_us"], values["nvlink_beta_gbps"]),
        network=LinkParams(values["net_alpha_us"], values["net_beta_gbps"]),
        nccl=LinkParams(values["nccl_alpha_us"], values["nccl_beta_gbps"]),
        launch_us=values["launch_us"],
        hbm_gbps=values["hbm_gbps"],
    )


_FIELDS = {
    "nvlink_alpha_us": ("nvlink", "alpha_us"),
    "nvlink_beta_gbps": ("nvlink", "beta_gbps"),
    "net_alpha_us": ("network", "alpha_us"),
    "net_beta_gbps": ("network", "beta_gbps"),
    "nccl_alpha_us": ("nccl", "alpha_us"),
    "nccl_beta_gbps": ("nccl", "beta_gbps"),
    "launch_us": ("launch_us",),
    "hbm_gbps": ("hbm_gbps",),
}
PARAM_KEYS = tuple(_FIELDS)

# Defaults. NVLink and NCCL numbers are the project's first measurements on 2x H200
# (NV18, 478 GB/s per direction), jax 0.11.2, NVSHMEM 3.4.5, NCCL 2.28.9
# (docs/results.md, "Baselines measured at the start"). The network numbers are
# NOT measured: no multi-node machine was available.
DEFAULT_PARAMS = CostParams(
    # alpha: NVSHMEM signal ping-pong, 0.71 us one way (docs/results.md).
    # beta: nvshmem putmem_block, both directions at once, 32 blocks: 355 GB/s
    # per direction (docs/results.md), 74% of NVLink's 478 GB/s. Check at 2 GPUs
    # (model vs PyTorch symm-mem, docs/results.md): two_shot 1 MB 10.9 vs 10.1 us,
    # 4 MB 21.8 vs 20.1 us, 64 MB 238 vs 212 us; one_shot 1 MB 9.7 vs 13.3 us.
    nvlink=LinkParams(alpha_us=0.71, beta_gbps=355.0),
    # ASSUMPTION (not measured): one 400 Gb/s InfiniBand NDR / RoCE NIC per GPU.
    # beta: 400 Gb/s = 50 GB/s line rate, ~90% of it achieved by large RDMA
    # writes -> 45 GB/s. alpha: ~2.5 us for a GPU-initiated RDMA put plus its
    # completion seen by the peer (IB write latency ~1.5-2 us + NVSHMEM proxy or
    # IBGDA overhead). Set JAXOVERLAP_NET_ALPHA_US / JAXOVERLAP_NET_BETA_GBPS,
    # or `python -m jaxoverlap.tune --net_alpha_us ... --net_beta_gbps ...`.
    network=LinkParams(alpha_us=2.5, beta_gbps=45.0),
    # alpha: JAX psum, bf16, 2 GPUs, 8 KB: 13.7 us, the lowest of our runs
    # (13.7-21.2 us, docs/results.md). beta: fit to 64 MB: (301 - 13.7) us for
    # 2(P-1)/P * 64 MiB = 64 MiB -> 234 GB/s. The single alpha-beta line
    # underestimates psum between 256 KB and 4 MB (NCCL's LL->Simple switch:
    # measured 18.5/23.8/44.1 us, model 14.8/18.2/31.6 us), i.e. the model
    # leans towards psum where it is unsure, as auto must.
    nccl=LinkParams(alpha_us=13.7, beta_gbps=234.0),
    # Fixed cost per call, fit to PyTorch symmetric-memory one-shot/two-shot
    # (CUDA graphs, 2x H200, docs/results.md) at 8 KB - 1 MB: their small-message
    # floor is 6.5-6.7 us, of which the model's steps explain 0.7-1.5 us.
    launch_us=4.5,
    # H200 HBM3e: 4.8 TB/s peak (NVIDIA H200 datasheet); ~85% reached by
    # streaming kernels -> 4000 GB/s. ASSUMPTION: the decode benchmark's read
    # probe later measured 3.23-3.97 TB/s on lent H200s, median 3.72 (docs/design.md,
    # "Machine constants"); the model keeps 4000 (not refitted).
    hbm_gbps=4000.0,
)


def params_from_env(base: CostParams | None = None,
                    environ: Mapping[str, str] | None = None) -> CostParams:
  """``base`` (default ``DEFAULT_PARAMS``) with ``JAXOVERLAP_<KEY>`` overrides applied.

  Args:
    base: parameters to start from.
    environ: the environment (default ``os.environ``).

  Returns:
    The parameters, e.g. with ``net_alpha_us`` from ``JAXOVERLAP_NET_ALPHA_US``.

  Raises:
    ValueError: an override that is not a positive number (names the variable).
  """
  base = DEFAULT_PARAMS if base is None else base
  environ = os.environ if environ is None else environ
  flat = {}
  for key in PARAM_KEYS:
    name = "JAXOVERLAP_" + key.upper()
    if environ.get(name, "").strip():
      try:
        flat[key] = float(environ[name])
      except ValueError:
        raise ValueError(f"{name}={environ[name]!r} is not a number") from None
      if not (flat[key] > 0 and math.isfinite(flat[key])):
        raise ValueError(f"{name}={environ[name]!r}: cost-model parameter {key} must be a "
                         "positive number")
  return base.replace(**flat)


# --------------------------------------------------------------------------- NCCL across nodes

NCCL_ALGORITHMS = ("ring", "tree")
NCCL_PROTOCOLS = ("ll", "ll128", "simple")


@dataclasses.dataclass(frozen=True)
class NcclProtocol:
  """What one NCCL protocol costs per pipeline hop, and what share of a link it gets.

  Attributes:
    bw_factor: share of a link's bandwidth that carries payload.
    nvlink_hop_us: latency of one hop between two GPUs of a node, us.
    net_hop_us: software latency of one hop between nodes, added to the
      network's ``alpha_us`` (NCCL's network transport runs through a CPU proxy
      thread that posts the send and polls for its completion), us.
  """

  bw_factor: float
  nvlink_hop_us: float
  net_hop_us: float


# The protocols of NCCL ("Demystifying NCCL", arXiv 2507.04786): LL stores 8-byte
# lines of 4 B data + 4 B flag (half the bandwidth, no fence, ~1 us per hop); LL128
# stores 128-byte lines with 8 B of flag (120/128 of the bandwidth, ~2 us); Simple
# moves data with a memory fence and a flag per chunk (all the bandwidth, the most
# latency). Bandwidth shares follow from the line formats; the hop latencies are
# ASSUMPTIONS (not measured by us): LL and LL128 on NVLink from the paper's orders
# of magnitude as a third-party summary of it gives them (docs/cluster_model.md),
# Simple twice LL128 (a fence per chunk), and across nodes 2-6 us of
# proxy work on top of the wire (``network.alpha_us``). The same values serve every
# machine: they are NCCL's software, the links are in ``CostParams``.
NCCL_PROTOCOL_COSTS = {
    "ll": NcclProtocol(bw_factor=0.5, nvlink_hop_us=1.0, net_hop_us=2.0),
    "ll128": NcclProtocol(bw_factor=120 / 128, nvlink_hop_us=2.0, net_hop_us=3.0),
    "simple": NcclProtocol(bw_factor=1.0, nvlink_hop_us=4.0, net_hop_us=6.0),
}

# NCCL's tree across nodes reaches less bus bandwidth than its ring: a parent
# receives from two children while it forwards to its own parent. ASSUMPTION:
# 0.8 of the ring's, so that ring wins at large sizes and tree at small sizes and
# many nodes, as arXiv 2507.04786 measures; not measured by us.
NCCL_TREE_BW_FACTOR = 0.8


def nccl_base_us(params: CostParams | None = None) -> float:
  """The fixed cost of one NCCL all-reduce as JAX calls it (``lax.psum``), us.

  The measured psum floor on 2 GPUs (``nccl.alpha_us``) less the two NVLink
  hops of its LL ring: what remains is XLA's and NCCL's launch and set-up.

  Args:
    params: model parameters (default: ``params_from_env()``).
  """
  p = params_from_env() if params is None else params
  return max(0.0, p.nccl.alpha_us - 2 * NCCL_PROTOCOL_COSTS["ll"].nvlink_hop_us)


def nccl_us(algorithm: str, protocol: str, nbytes: int, ranks_per_node: int, num_nodes: int,
            params: CostParams | None = None) -> float:
  """Predicted latency of NCCL's all-reduce with one algorithm and protocol, us.

  With G = ranks_per_node, N = num_nodes, P = G N, M = nbytes and the
  protocol's hop latencies h_nv (NVLink) and h_net = network.alpha + net_hop:

  * ring: one ring through all P ranks (``2 (P-1)`` pipeline hops, of which
    ``2 (N-1)`` cross nodes): base + (2(P-1) - 2(N-1)) h_nv + 2(N-1) h_net +
    2(P-1)/P M / B.
  * tree (N > 1; NCCL's double binary tree across nodes, a chain inside each
    node): base + 2(G-1) h_nv + 2 ceil(log2 N) h_net + 2 M / (tree_factor B).

  B is the bus bandwidth times the protocol's share: within one node
  ``nccl.beta``; across nodes min(nccl.beta, G network.beta), the node's G
  NICs shared by rail-aligned rings or trees.

  Args:
    algorithm: "ring" or "tree".
    protocol: "ll", "ll128" or "simple".
    nbytes: message size per rank, bytes.
    ranks_per_node: G.
    num_nodes: N.
    params: model parameters (default: ``params_from_env()``).

  Returns:
    Latency, us (0 for a single rank).

  Raises:
    ValueError: unknown algorithm or protocol, tree within one node (NCCL
      runs a ring there), or a topology with fewer than one rank.
  """
  p = params_from_env() if params is None else params
  nbytes, g, n = whole_numbers("nccl_us", nbytes=nbytes, ranks_per_node=ranks_per_node,
                               num_nodes=num_nodes)
  m = float(nbytes)
  if algorithm not in NCCL_ALGORITHMS:
    raise ValueError(f"nccl_us: algorithm must be one of {NCCL_ALGORITHMS}, got {algorithm!r}")
  if protocol not in NCCL_PROTOCOL_COSTS:
    raise ValueError(f"nccl_us: protocol must be one of {NCCL_PROTOCOLS}, got {protocol!r}")
  if algorithm == "tree" and n == 1:
    raise ValueError("nccl_us: NCCL's tree spans nodes; within one node it runs a ring")
  ranks = g * n
  if ranks == 1:
    return 0.0
  proto = NCCL_PROTOCOL_COSTS[protocol]
  net_hop = p.network.alpha_us + proto.net_hop_us
  bus = p.nccl.beta_gbps if n == 1 else min(p.nccl.beta_gbps, g * p.network.beta_gbps)
  bus *= proto.bw_factor * 1e3  # bytes per us
  if algorithm == "ring":
    hops, net_hops = 2 * (ranks - 1), 2 * (n - 1)
    return (nccl_base_us(p) + (hops - net_hops) * proto.nvlink_hop_us + net_hops * net_hop
            + 2 * (ranks - 1) / ranks * m / bus)
  depth = math.ceil(math.log2(n))
  return (nccl_base_us(p) + 2 * (g - 1) * proto.nvlink_hop_us + 2 * depth * net_hop
          + 2 * m / (NCCL_TREE_BW_FACTOR * bus))


def nccl_best(nbytes: int, ranks_per_node: int, num_nodes: int,
              params: CostParams | None = None) -> tuple[float, str, str]:
  """NCCL's fastest algorithm and protocol for one all-reduce, as its tuner would pick.

  Args:
    nbytes: message size per rank, bytes.
    ranks_per_node: GPUs per node in the group.
    num_nodes: nodes in the group.
    params: model parameters (default: ``params_from_env()``).

  Returns:
    ``(time_us, algorithm, protocol)``; only the ring within one node.

  Raises:
    ValueError: as ``nccl_us``.
  """
  p = params_from_env() if params is None else params
  algorithms = NCCL_ALGORITHMS if num_nodes > 1 else ("ring",)
  return min((nccl_us(a, proto, nbytes, ranks_per_node, num_nodes, p), a, proto)
             for a in algorithms for proto in NCCL_PROTOCOLS)


# What a Lamport kernel pays per step beyond the alpha-beta terms: its blocks
# carry 4 KiB (half their threads idle) and every vector is polled, then written
# back empty. Fitted to the one run that measured it against LL on 2x H200
# (benchmarks/results/lamport_grid/, 2026-12-01): LL faster up to 256 KiB
# (5.9 / 6.5 / 7.4 against 6.1 / 7.6 / 10.6 us at 8 / 64 / 256 KiB), Lamport
# from 512 KiB (7.7 against 9.4 us). The policy does not let the model alone
# choose Lamport (policy.MODEL_EXCLUDED).
LAMPORT_OVERHEAD_US = 0.7


_MINIMUM = {"nbytes": 0, "partial_itemsize": 1, "itemsize": 1, "ranks_per_node": 1,
            "num_nodes": 1}


def whole_numbers(where: str, **values) -> tuple[int, ...]:
  """``values`` (sizes, item sizes, counts) as ints, in the order given.

  Raises:
    ValueError: a value that is not an integer (a float such as 2.5 too; a
      bool), or below its minimum (``nbytes`` 0, the others 1); the message
      names ``where`` and the argument.
  """
  out = []
  for name, value in values.items():
    try:
      v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
      v = None
    if v is None or v < _MINIMUM[name]:
      raise ValueError(f"{where}: {name} must be an integer >= {_MINIMUM[name]}, "
                       f"got {value!r}")
    out.append(int(v))
  return tuple(out)


def _step_us(link: LinkParams, nbytes: float, protocol: str) -> float:
  """One step in which every rank sends ``nbytes`` payload bytes and waits for its peers'.

  LL8 sends 4 B of flag with every 4 B of data (2x the wire bytes) and needs
  no signal; simple sends the data once, then a signal that costs one more
  latency; lamport sends the data once and needs no signal, but pays
  ``LAMPORT_OVERHEAD_US`` per step.
  """
  if protocol == "ll":
    return link.alpha_us + link.transfer_us(2 * nbytes)
  if protocol == "lamport":
    return link.alpha_us + link.transfer_us(nbytes) + LAMPORT_OVERHEAD_US
  return 2 * link.alpha_us + link.transfer_us(nbytes)


def predict_us(
    algorithm: str,
    protocol: str | None,
    nbytes: int,
    itemsize: int,
    ranks_per_node: int,
    num_nodes: int,
    params: CostParams | None = None,
    *,
    partial_itemsize: int = 4,
) -> float:
  """Predicted latency of one all-reduce, us.

  With G = ranks_per_node, N = num_nodes, P = G N and M = nbytes:

  * one_shot (N = 1): launch + one step of (G-1) M bytes (every rank pushes M
    to each peer) + reading G inputs from HBM.
  * two_shot (N = 1): launch + reduce-scatter step of (G-1)/G M + all-gather
    step of (G-1)/G M, + HBM traffic.
  * hierarchical (N > 1; NVRAR, arXiv 2511.09557): intra-node reduce-scatter
    and all-gather as two_shot, between them floor(log2 N) network steps of
    the whole shard as fp32 partial sums (M/G * 4/itemsize bytes; set
    ``partial_itemsize`` for another width), plus a pre-step and a post-step
    when N is not a power of two.
  * psum: within one node NCCL's ring as measured, nccl.alpha + 2(P-1)/P M /
    nccl.beta; across nodes the fastest of NCCL's ring and tree and of its
    protocols (``nccl_best``).

  A step (``_step_us``) costs alpha + 2 bytes/beta with protocol "ll",
  2 alpha + bytes/beta with "simple" and alpha + bytes/beta +
  ``LAMPORT_OVERHEAD_US`` with "lamport" (which also writes every received
  byte back as the empty pattern).

  Args:
    algorithm: "one_shot", "two_shot", "hierarchical" or "psum".
    protocol: "ll", "simple" or "lamport" (one_shot, two_shot); None for psum.
    nbytes: message size per rank, bytes.
    itemsize: bytes per element (2 for bf16/f16, 4 for f32).
    ranks_per_node: G, GPUs per node in the group.
    num_nodes: N, nodes in the group.
    params: model parameters (default: ``params_from_env()``).
    partial_itemsize: bytes per element of the partial sums that hierarchical
      sends between nodes: 4 (fp32), as the kernel does; 2 prices a kernel that
      sends them in bf16.

  Returns:
    Latency, us.

  Raises:
    ValueError: unknown algorithm or protocol, one_shot/two_shot across
      nodes, hierarchical within one node, or a size, item size or count
      that is not an integer or below its minimum (``whole_numbers``).
  """
  p = params_from_env() if params is None else params
  nbytes, itemsize, g, n, partial_itemsize = whole_numbers(
      "predict_us", nbytes=nbytes, itemsize=itemsize, ranks_per_node=ranks_per_node,
      num_nodes=num_nodes, partial_itemsize=partial_itemsize)
  m = float(nbytes)
  if algorithm == PSUM:
    if protocol is not None:
      raise ValueError(f"predict_us: psum takes protocol=None, got {protocol!r}")
    num_ranks = g * n
    if num_ranks == 1:
      return 0.0  # XLA drops a psum over one rank
    if n == 1:
      return p.nccl.alpha_us + p.nccl.transfer_us(2 * (num_ranks - 1) / num_ranks * m)
    return nccl_best(nbytes, g, n, p)[0]
  if algorithm not in ALGORITHMS:
    raise ValueError(f"predict_us: algorithm must be one of {ALGORITHMS + (PSUM,)}, "
                     f"got {algorithm!r}")
  if protocol not in PROTOCOLS:
    raise ValueError(f"predict_us: protocol must be one of {PROTOCOLS}, got {protocol!r}")
  if protocol not in names.protocols(algorithm):
    raise ValueError(f"predict_us: {algorithm} has no protocol {protocol!r}; valid: "
                     f"{names.protocols(algorithm)}")
  if algorithm in _SINGLE_NODE and n > 1:
    raise ValueError(f"predict_us: {algorithm} runs within one node; got num_nodes={n}")
  if algorithm == "hierarchical" and n == 1:
    raise ValueError("predict_us: hierarchical needs num_nodes > 1 (within one node it is "
                     "two_shot)")

  wire = 2 if protocol == "ll" else 1  # LL8 cells are read back from HBM at 8 B per 4 B too

  def hbm(nbytes):
    return nbytes / (p.hbm_gbps * 1e3)

  peers = g - 1
  if algorithm == "one_shot":
    emptied = peers * m if protocol == names.LAMPORT else 0.0  # the slots written back empty
    return (p.launch_us + (_step_us(p.nvlink, peers * m, protocol) if peers else 0.0)
            + hbm((peers * wire + 1) * m + m + emptied))

  # two_shot and hierarchical share the intra-node reduce-scatter and all-gather.
  shard = m / g
  t = p.launch_us
  if peers:
    t += 2 * _step_us(p.nvlink, peers * shard, protocol)
    t += hbm((peers * wire + 1) * shard + shard)   # reduce G shards into one
    t += hbm((wire + 1) * peers * shard)           # unpack the gathered shards
    if protocol == names.LAMPORT:
      t += hbm(2 * peers * shard)                  # both phases' slots written back empty
  if algorithm == "hierarchical":
    wire_shard = shard * partial_itemsize / itemsize  # partial sums (fp32 by default)
    steps = int(math.log2(n)) + (0 if n & (n - 1) == 0 else 2)  # fold in / out
    t += steps * (_step_us(p.network, wire_shard, protocol)
                  + hbm((wire + 2) * wire_shard))
  return t
