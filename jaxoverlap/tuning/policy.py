"""How ``auto`` chooses: the all-reduce policy and the fused ops' rules.

Problem:
  ``all_reduce(..., algorithm="auto")`` must pick, per message size and
  topology, the fastest of the CUDA kernels (one-shot, two-shot, NVRAR's
  hierarchical; protocols LL and simple) and XLA's ``lax.psum`` (NCCL), and it
  must never be slower than psum. The fused GEMM ops must pick how many chunks
  each shard transfer is cut into, and ``matmul_all_reduce`` whether to fuse.
  Which choice wins depends on the machine, so measurements decide where there
  are any, and a model elsewhere.

Algorithm:
  ``Policy.choose`` uses the measured records of a tuning table for the
  topology when it has them, interpolated log-log between measured sizes, and
  the cost model (``jaxoverlap.tuning.cost_model``) otherwise; every
  ``Choice`` says which of the two decided and why. ``protocol_for`` gives the
  wire protocol of a kernel where neither the caller nor the table names one.
  ``fused_chunks`` and ``fuse_all_reduce`` are rules calibrated by chunk sweeps
  on 2x H200 (docs/results.md, "Calibration of the automatic choices").
  ``jaxoverlap.dispatch`` is the only caller inside the package.

Example:
  >>> from jaxoverlap.tuning import policy
  >>> p = policy.Policy.load()   # $JAXOVERLAP_TUNING_FILE or ~/.cache/jaxoverlap/...
  >>> p.choose(1 << 20, 2, ranks_per_node=8, num_nodes=2)   # no file yet
  Choice(algorithm='hierarchical', protocol='simple', source='cost model (no tuning file at
  /root/.cache/jaxoverlap/all_reduce-tuning.json)', time_us=24.28...)
  >>> policy.fused_chunks("all_gather_matmul", 64 << 20, 8192, 2 * 8192 * 4096 * 4096)
  2
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from jaxoverlap import names
from jaxoverlap.tuning import cost_model, results
from jaxoverlap.tuning.cost_model import ALGORITHMS, PROTOCOLS, PSUM, CostParams
from jaxoverlap.tuning.cost_model import whole_numbers as _whole

__all__ = [
    "Choice",
    "Policy",
    "protocol_for",
    "ONE_SHOT_LL_MAX_BYTES",
    "HIERARCHICAL_LL_MAX_SHARD_BYTES",
    "MODEL_EXCLUDED",
    "MODEL_MARGIN",
    "FUSED_ALL_REDUCE_MIN_BYTES",
    "LARGE_BYTES",
    "DEFAULT_FUSED_TRANSPORT",
    "fused_chunks",
    "fuse_all_reduce",
    "NORM_FUSED_MIN_ROWS",
    "NORM_FUSED_MAX_ROW_BYTES",
    "fuse_norm",
    "LINK_BYTES_PER_S",
    "GEMM_FLOPS_PER_S",
]

# --------------------------------------------------------------------------- protocol

# The LL protocol doubles the bytes on the wire (4 B of flag per 4 B of data)
# but needs no separate signal: it wins while the message is small. Measured on
# 2x H200 with the v3 kernels (benchmarks/results/all_reduce-2x_H200_NV18-1x2-v3.json and
# all_reduce-2x_H200_NV18-2x1.json):
# one_shot LL beats simple up to 1 MiB (13.7 vs 17.3 us) and loses from 2 MiB
# (24.4 vs 23.4 us); hierarchical LL beats simple while each rank's shard is up
# to 512 KiB (19.6 vs 28.8 us; 1 MiB: 31.8 vs 28.8 us).
ONE_SHOT_LL_MAX_BYTES = 1 << 20
HIERARCHICAL_LL_MAX_SHARD_BYTES = 512 << 10

# Kernels the cost model does not choose on its own; a table that measures
# them, or a caller who names them, still can. The Lamport kernels: the one
# run that timed one-shot Lamport (benchmarks/results/lamport_grid/) put it
# behind LL up to 256 KiB and ahead of simple at every size, an order no
# constant per-call term reproduces while the model's simple step omits that
# kernel's per-block fence; and two-shot Lamport was checked only with
# processes sharing one GPU, never timed.
MODEL_EXCLUDED = frozenset({(names.ONE_SHOT, names.LAMPORT), (names.TWO_SHOT, names.LAMPORT)})


def protocol_for(algorithm: str, nbytes: int, ranks_per_node: int) -> str:
  """The protocol of a CUDA all-reduce kernel when neither caller nor table names one.

  Args:
    algorithm: "one_shot", "two_shot" or "hierarchical".
    nbytes: message size per rank, bytes.
    ranks_per_node: ranks of the group on one node.

  Returns:
    "ll" or "simple" (two_shot: "simple" until a table measures its "ll").

  Raises:
    ValueError: ``algorithm`` is not a CUDA all-reduce kernel's.
  """
  if algorithm not in ALGORITHMS:
    raise ValueError(f"protocol_for: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
  if algorithm == names.ONE_SHOT:
    return names.LL if nbytes <= ONE_SHOT_LL_MAX_BYTES else names.SIMPLE
  if algorithm == names.HIERARCHICAL:
    shard = nbytes // max(1, ranks_per_node)
    return names.LL if shard <= HIERARCHICAL_LL_MAX_SHARD_BYTES else names.SIMPLE
  return names.SIMPLE


# --------------------------------------------------------------------------- all-reduce policy


def _check_transport(where: str, transport: str | None) -> None:
  if transport is not None and transport not in names.RUNTIME_TRANSPORTS:
    raise ValueError(f"{where}: transport must be None or one of {names.RUNTIME_TRANSPORTS} "
                     f"(the runtime's), got {transport!r}")


class Choice(NamedTuple):
  """What ``Policy.choose`` picked.

  Attributes:
    algorithm: "one_shot", "two_shot", "hierarchical" or "psum".
    protocol: "ll", "simple", "lamport" (from a table that timed it), or None
      (psum, or a record without protocol).
    source: why: "measured (<file>, <size bracket>)", "cost model (<reason>)"
      or "rule: <reason>".
    time_us: the measured (interpolated) or predicted latency, us (None for a
      rule).
    psum_us: psum's time by the same source, us (None for a rule).
  """

  algorithm: str
  protocol: str | None
  source: str
  time_us: float | None = None
  psum_us: float | None = None


def _log_log(nbytes: int, lo: int, hi: int, t_lo: float, t_hi: float) -> float:
  """The time at ``nbytes`` on the straight line through (lo, t_lo), (hi, t_hi) in log-log."""
  return math.exp(math.log(t_lo) + math.log(nbytes / lo) / math.log(hi / lo)
                  * (math.log(t_hi) - math.log(t_lo)))


# Said in a Choice's source when records timed on nodes emulated on one host decided.
_EMULATED_SOURCE = "nodes emulated on one host (NVLink between them), "

# Where the cost model alone decides, a kernel must be predicted this much
# faster than psum (t * (1 + MODEL_MARGIN) < psum's t): the model's errors
# against measurements reach 20-40% (docs/results.md, docs/cluster_model.md),
# and a close call goes to psum, NCCL's tuned and tested path.
MODEL_MARGIN = 0.10


def _itemsize(dtype: str | None) -> int | None:
  import numpy as np

  try:
    return np.dtype(dtype).itemsize if dtype else None
  except TypeError:
    import jax.numpy as jnp  # bfloat16 is registered by ml_dtypes through jax

    return jnp.dtype(dtype).itemsize


class _Measured(NamedTuple):
  """One timing of a tuning table, as the policy keeps it."""

  impl: tuple[str, str | None]
  itemsize: int | None
  nbytes: int
  time_us: float
  transport: str | None
  emulated: bool | None  # nodes emulated on one host (None: one node, or not recorded)


class Policy:
  """Chooses the all-reduce algorithm and protocol per size and topology.

  Measured records of the topology (same ``ranks_per_node`` and ``world``;
  of those, the records of the caller's transport where they cover the size,
  see ``choose``) decide when they include ``xla:psum`` and reach the size:
  each impl's time is interpolated log-log between the two measured sizes of
  psum that bracket the size (taken as flat below the smallest), and the
  fastest wins, psum on ties. An impl not measured at both ends of the
  bracket (e.g. rejected by its correctness check there) does not compete.
  Otherwise the cost model decides among the algorithms valid for the
  topology, less ``MODEL_EXCLUDED``. one_shot/two_shot are never chosen
  across nodes, hierarchical never within one node.

  Args:
    records: records of the results format (``jaxoverlap.tuning.results``), ``op``
      all_reduce.
    params: cost-model parameters (default: ``cost_model.params_from_env()``).
    path: where the records came from, for ``Choice.source``.
    algorithms: the kernels this build has; others are never chosen.
    protocols: the protocols this build has.
    missing: True when ``path`` does not exist (said in ``Choice.source``).
  """

  def __init__(self, records: Iterable[Mapping[str, Any]] = (), params: CostParams | None = None,
               *, path: str | None = None, algorithms: Sequence[str] = ALGORITHMS,
               protocols: Sequence[str] = PROTOCOLS, missing: bool = False):
    self.params = cost_model.params_from_env() if params is None else params
    self.path = path or "<records>"
    self.missing = missing
    self.algorithms = tuple(a for a in algorithms if a in ALGORITHMS)
    self.protocols = tuple(p for p in protocols if p in PROTOCOLS)
    # {(ranks_per_node, world): [_Measured, ...]}; grouped per query by _by_impl.
    self._records: dict[tuple[int, int], list[_Measured]] = {}
    self._grouped: dict = {}
    for rec in records:
      parsed = results.parse_impl(rec.get("impl", ""))
      if rec.get("op") != "all_reduce" or parsed is None:
        continue
      rpn, world = int(rec["ranks_per_node"]), int(rec["world"])
      emulated = rec.get("emulated_nodes") if world > rpn else None
      self._records.setdefault((rpn, world), []).append(_Measured(
          parsed, _itemsize(rec.get("dtype")), int(rec["bytes"]), float(rec["time_us"]),
          rec.get("transport"), emulated))

  def _by_impl(self, topo: tuple[int, int], transport: str | None,
               emulated_nodes: bool | None) -> tuple[dict, bool]:
    """The records of ``topo`` as {(alg, proto): {itemsize: {bytes: [us, ...]}}}.

    ``transport`` None: whatever the transport. ``emulated_nodes`` True/False:
    without the records known to be of the other kind (a record without
    ``emulated_nodes`` stays). Also returns whether any record kept was timed
    on emulated nodes.
    """
    key = (topo, transport, emulated_nodes)
    if key not in self._grouped:
      by_impl: dict = {}
      any_emulated = False
      for m in self._records.get(topo, ()):
        if transport is not None and m.transport != transport:
          continue
        if emulated_nodes is not None and m.emulated is not None and m.emulated != emulated_nodes:
          continue
        any_emulated |= bool(m.emulated)
        (by_impl.setdefault(m.impl, {}).setdefault(m.itemsize, {})
         .setdefault(m.nbytes, []).append(m.time_us))
      self._grouped[key] = (by_impl, any_emulated)
    return self._grouped[key]

  @classmethod
  def from_result(cls, result: Mapping[str, Any] | None, path: str | None = None,
                  **kwargs) -> Policy:
    """The policy of a tuning table already read (None: no table, cost model only).

    Cost-model parameters: the defaults, then the table's ``"params"``, then
    ``JAXOVERLAP_*`` variables.

    Args:
      result: a tuning table (``load_result``), or None.
      path: where it came from, for ``Choice.source``.
      **kwargs: ``algorithms``, ``protocols`` as in ``Policy``.

    Raises:
      ValueError: ``result`` is not a valid all-reduce table
        (``results.validate_tuning_table``: e.g. records of another op, or no
        kernel timed).
    """
    if result is None:
      return cls((), cost_model.params_from_env(), path=path or results.default_tuning_path(),
                 missing=True, **kwargs)
    results.validate_tuning_table(result, path or "the table given to Policy.from_result")
    path = path or "a table given to Policy.from_result"
    params = cost_model.params_from_env(cost_model.DEFAULT_PARAMS.replace(**result.get("params", {})))
    return cls(result["records"], params, path=path, **kwargs)

  @classmethod
  def load(cls, path: str | None = None, **kwargs) -> Policy:
    """The policy of a tuning file (default ``results.default_tuning_path()``); see ``from_result``.

    A missing file gives a cost-model-only policy.

    Raises:
      ValueError: the file exists but is not a valid tuning table.
    """
    path = path or results.default_tuning_path()
    return cls.from_result(results.load_result(path), path, **kwargs)

  def _allowed(self, algorithm: str, protocol: str | None, num_nodes: int) -> bool:
    if algorithm == PSUM:
      return True
    if algorithm not in self.algorithms or (protocol is not None and
                                            protocol not in self.protocols):
      return False
    if protocol is not None and protocol not in names.protocols(algorithm):
      return False  # a protocol the algorithm's kernels do not have
    return (num_nodes > 1) == (algorithm == names.HIERARCHICAL)

  def _from_measurements(self, nbytes, itemsize, ranks_per_node, num_nodes, transport,
                         emulated_nodes, only=None):
    """A Choice from the table, or the reason there is none (str).

    The records of ``transport`` (the process model: "peer" within one
    process, "nvshmem" across processes) decide where they cover the size:
    psum and at least one kernel measured at both ends of the size's bracket.
    Otherwise every record of the topology decides. Across nodes, records of
    the other kind of node than ``emulated_nodes`` are left out.
    ``only``: an algorithm; only its kernels compete (psum gives the sizes).
    """
    topo = (ranks_per_node, ranks_per_node * num_nodes)
    emulated = emulated_nodes if num_nodes > 1 else None
    nodes = (f"{ranks_per_node} ranks/node x {num_nodes} "
             f"{'emulated ' if emulated else 'real ' if emulated is False else ''}nodes")
    if transport is not None:
      by_impl, on_one_host = self._by_impl(topo, transport, emulated)
      if by_impl:
        got = self._pick(by_impl, nbytes, itemsize, num_nodes,
                         f"the records of transport {transport!r}, "
                         + _EMULATED_SOURCE * on_one_host, only=only)
        if isinstance(got, Choice):
          return got
    by_impl, on_one_host = self._by_impl(topo, None, emulated)
    if not by_impl:
      return f"no measurements for {nodes}"
    if (PSUM, None) not in by_impl:
      return f"no xla:psum measurement for {nodes}"
    return self._pick(by_impl, nbytes, itemsize, num_nodes, _EMULATED_SOURCE * on_one_host,
                      kernels_needed=only is not None, only=only)

  def _pick(self, by_impl, nbytes, itemsize, num_nodes, which: str, kernels_needed: bool = True,
            only: str | None = None):
    """The fastest of ``by_impl`` at ``nbytes`` (a Choice), or why it cannot say (str).

    ``kernels_needed``: also a str where no kernel but psum competes at the
    size. ``only``: an algorithm; no other (psum neither) competes.
    """
    if (PSUM, None) not in by_impl:
      return "no xla:psum measurement"
    # Records of this itemsize when psum has some, else all dtypes compared by bytes.
    same = itemsize in by_impl[(PSUM, None)]
    times = {}
    for impl, by_itemsize in by_impl.items():
      sizes: dict[int, list[float]] = {}
      for size, d in by_itemsize.items():
        if not same or size == itemsize:
          for b, ts in d.items():
            sizes.setdefault(b, []).extend(ts)
      times[impl] = {b: statistics.median(ts) for b, ts in sizes.items()}
    grid = sorted(times[(PSUM, None)])
    above = nbytes > grid[-1]
    if above and grid[-1] < LARGE_BYTES:
      return f"{nbytes} bytes is above the largest size measured ({grid[-1]} bytes)"
    lo = max([b for b in grid if b <= nbytes], default=grid[0])
    hi = grid[-1] if above else min(b for b in grid if b >= nbytes)
    best, kernels = None, 0
    for (alg, proto), t in times.items():
      # An impl competes only if measured at both ends of psum's bracket: one
      # rejected (or not run) at a size never wins next to it.
      if (not self._allowed(alg, proto, num_nodes) or lo not in t or hi not in t
          or only not in (None, alg)):
        continue
      kernels += alg != PSUM
      if above:  # bandwidth-bound there: every impl's time grows with the bytes
        us = t[hi] * nbytes / hi
      elif lo == hi or nbytes <= lo:
        us = t[lo]
      else:
        us = _log_log(nbytes, lo, hi, t[lo], t[hi])
      key = (us, alg != PSUM)  # psum wins ties
      if best is None or key < best[0]:
        best = (key, alg, proto)
    if kernels_needed and not kernels:
      return f"no kernel measured at both {lo} and {hi} bytes"
    (us, _), alg, proto = best
    psum_us = times[(PSUM, None)]
    psum_us = (psum_us[hi] * nbytes / hi if above else psum_us[lo] if lo == hi or nbytes <= lo
               else _log_log(nbytes, lo, hi, psum_us[lo], psum_us[hi]))
    if above:
      bracket = f"above {hi} bytes, the largest measured: its times scaled by the bytes"
    elif nbytes == lo == hi:
      bracket = f"at {nbytes} bytes"
    elif nbytes < lo:
      bracket = f"below {lo} bytes, the smallest measured"
    else:
      bracket = f"between {lo} and {hi} bytes"
    return Choice(alg, proto, f"measured ({self.path}, {which}{bracket})", us, psum_us)

  def choose(self, nbytes: int, itemsize: int, ranks_per_node: int, num_nodes: int,
             transport: str | None = None, emulated_nodes: bool | None = None) -> Choice:
    """The algorithm and protocol for one all-reduce.

    Args:
      nbytes: message size per rank, bytes.
      itemsize: bytes per element (2 or 4).
      ranks_per_node: GPUs per node in the reduction group.
      num_nodes: nodes in the reduction group.
      transport: the runtime's transport ("peer": one process drives the
        GPUs; "nvshmem": a process per GPU). Where the table's records of it
        cover the size (psum and a kernel measured at both ends of the size's
        bracket), only those decide: the kernels are the same, but how the
        processes launch them is not (docs/results.md, "Process models").
        None, or no such records: every record of the topology.
      emulated_nodes: across nodes, whether the caller's nodes share a host
        (``runtime.nodes_are_emulated``). Records marked ``emulated_nodes``
        (timed with ``JAXOVERLAP_RANKS_PER_NODE`` on one host: NVLink between
        the "nodes") never decide for real nodes, nor real nodes' records for
        emulated ones; records without the mark serve both. None: any record.

    Returns:
      A ``Choice``; ``algorithm == "psum"`` is the explicit handover to XLA.
      Where the cost model decides, a kernel wins only when predicted
      ``MODEL_MARGIN`` faster than psum. The policy does not know the
      build's limits (``ext.limits()``: 8 ranks per node, 64 nodes);
      ``jaxoverlap.dispatch`` checks them before it asks, and a planner
      calling ``choose`` for larger topologies gets the model's answer for
      kernels that would refuse them.

    Raises:
      ValueError: a size, item size or topology that is not a whole number
        (a negative size, fewer than one rank or node); an unknown transport.
    """
    nbytes, itemsize, ranks_per_node, num_nodes = _whole("Policy.choose", nbytes=nbytes,
                                                         itemsize=itemsize,
                                                         ranks_per_node=ranks_per_node,
                                                         num_nodes=num_nodes)
    _check_transport("Policy.choose", transport)
    got = self._from_measurements(nbytes, itemsize, ranks_per_node, num_nodes, transport,
                                  emulated_nodes)
    if isinstance(got, Choice):
      return got
    why = f"no tuning file at {self.path}" if self.missing else f"{got} in {self.path}"
    psum = cost_model.predict_us(PSUM, None, nbytes, itemsize, ranks_per_node, num_nodes,
                                 self.params)
    kernels = [(cost_model.predict_us(a, p, nbytes, itemsize, ranks_per_node, num_nodes,
                                      self.params), a, p)
               for a in self.algorithms for p in self.protocols
               if self._allowed(a, p, num_nodes) and (a, p) not in MODEL_EXCLUDED]
    if kernels:
      t, alg, proto = min(kernels)
      if t * (1 + MODEL_MARGIN) < psum:
        return Choice(alg, proto, f"cost model ({why})", t, psum)
      kernel = f"the fastest kernel, {results.impl_name(alg, proto)}, {t:.1f} us"
      why += (f"; {kernel}, is not {MODEL_MARGIN:.0%} faster than psum's {psum:.1f} us"
              if t < psum else f"; psum's {psum:.1f} us beats {kernel}")
    return Choice(PSUM, None, f"cost model ({why})", psum, psum)

  def choose_protocol(self, algorithm: str, nbytes: int, itemsize: int, ranks_per_node: int,
                      num_nodes: int, transport: str | None = None,
                      emulated_nodes: bool | None = None) -> Choice:
    """The protocol of a named algorithm when the caller names none.

    Across real nodes (``num_nodes > 1``, ``emulated_nodes`` not True) the
    table's records of the topology that are not marked emulated decide among
    the algorithm's protocols where they cover the size, else the cost model;
    the network is not NVLink, so the size rule measured on one host does not
    apply there. Otherwise ``protocol_for``'s size rule (measured on 2x H200)
    decides.

    Args:
      algorithm: "one_shot", "two_shot" or "hierarchical".
      nbytes, itemsize, ranks_per_node, num_nodes, transport: as in ``choose``.
      emulated_nodes: True: the nodes share a host (the size rule). False or
        None: real nodes (unlike ``choose``, None does not admit emulated
        records: a protocol measured over NVLink says nothing of a network).

    Returns:
      A ``Choice`` of ``algorithm``.

    Raises:
      ValueError: as ``choose``; an algorithm that is not a CUDA kernel's.
    """
    if algorithm not in ALGORITHMS:
      raise ValueError(f"Policy.choose_protocol: algorithm must be one of {ALGORITHMS}, "
                       f"got {algorithm!r}")
    nbytes, itemsize, ranks_per_node, num_nodes = _whole(
        "Policy.choose_protocol", nbytes=nbytes, itemsize=itemsize,
        ranks_per_node=ranks_per_node, num_nodes=num_nodes)
    _check_transport("Policy.choose_protocol", transport)
    if num_nodes > 1 and emulated_nodes is not True:
      got = self._from_measurements(nbytes, itemsize, ranks_per_node, num_nodes, transport,
                                    False, only=algorithm)
      if isinstance(got, Choice):
        return got
      why = f"no tuning file at {self.path}" if self.missing else f"{got} in {self.path}"
      options = [(cost_model.predict_us(algorithm, p, nbytes, itemsize, ranks_per_node,
                                        num_nodes, self.params), p)
                 for p in names.protocols(algorithm) if p in self.protocols
                 and (algorithm, p) not in MODEL_EXCLUDED]
      if options:
        t, proto = min(options)
        return Choice(algorithm, proto, f"cost model across nodes ({why})", t)
    return Choice(algorithm, protocol_for(algorithm, nbytes, ranks_per_node),
                  "rule: LL for small messages (jaxoverlap.tuning.policy.protocol_for, "
                  "measured on 2x H200 over NVLink)")

  def choose_over_xla(self, nbytes: int, itemsize: int, ranks_per_node: int,
                      num_nodes: int) -> Choice:
    """The hierarchical all-reduce with XLA's psum between nodes, or psum alone.

    Where the group spans processes of the in-process runtime (each driving
    several GPUs), only XLA's collective joins the processes: the choice is
    between the intra-node reduce-scatter, a psum of the fp32 shard over the
    same-local-rank GPUs and the intra-node all-gather (NVRAR's structure,
    arXiv 2511.09557 sec. 4, with NCCL between the nodes), and one psum over
    the whole group. No table measures this; the cost model decides, and the
    hierarchical path must be predicted ``MODEL_MARGIN`` faster than psum.

    Args:
      nbytes: message size per rank, bytes.
      itemsize: bytes per element (2 or 4).
      ranks_per_node: GPUs of the group per process (node).
      num_nodes: processes (nodes) of the group, more than one.

    Returns:
      A ``Choice``: ``("hierarchical", "simple", ...)`` or ``("psum", None, ...)``.

    Raises:
      ValueError: fewer than two nodes, or a size or topology out of range.
    """
    if num_nodes < 2 or ranks_per_node < 1 or nbytes < 0 or itemsize < 1:
      raise ValueError(f"Policy.choose_over_xla: need num_nodes >= 2, ranks_per_node >= 1, "
                       f"nbytes >= 0, itemsize >= 1; got {num_nodes}, {ranks_per_node}, "
                       f"{nbytes}, {itemsize}")
    g, prm = ranks_per_node, self.params
    shard_bytes = 4 * math.ceil(nbytes / itemsize / g)  # partial sums cross nodes as fp32
    hierarchical = (cost_model.predict_us(names.TWO_SHOT, names.SIMPLE, nbytes, itemsize, g, 1,
                                          prm)
                    + prm.launch_us  # two calls of our kernels, not one
                    + cost_model.predict_us(PSUM, None, shard_bytes, 4, 1, num_nodes, prm))
    psum = cost_model.predict_us(PSUM, None, nbytes, itemsize, g, num_nodes, prm)
    why = (f"cost model: intra-node steps + psum of the fp32 shard over {num_nodes} "
           f"processes {hierarchical:.1f} us, one psum {psum:.1f} us")
    if hierarchical * (1 + MODEL_MARGIN) < psum:  # the model alone decides: as in choose
      return Choice(names.HIERARCHICAL, names.SIMPLE, why, hierarchical, psum)
    if hierarchical < psum:
      why += f" (not {MODEL_MARGIN:.0%} faster)"
    return Choice(PSUM, None, why, psum, psum)

  def table(self, ranks_per_node: int, num_nodes: int,
            sizes: Sequence[int] = tuple(4096 << (2 * i) for i in range(9)),
            itemsize: int = 2, transport: str | None = None,
            emulated_nodes: bool | None = None) -> list[dict[str, Any]]:
    """What ``choose`` picks for each size (for ``runtime_info()`` and the README).

    Args:
      ranks_per_node, num_nodes: the topology.
      sizes: message sizes per rank, bytes (default 4 KB, 16 KB, ..., 256 MB).
      itemsize: bytes per element.
      transport, emulated_nodes: as in ``choose``.

    Returns:
      One dict per size: ``bytes``, ``impl``, ``algorithm``, ``protocol``,
      ``time_us`` and ``psum_us`` (measured where the table decided, else
      predicted) and ``source``.
    """
    rows = []
    for nbytes in sizes:
      c = self.choose(nbytes, itemsize, ranks_per_node, num_nodes, transport, emulated_nodes)
      rows.append({
          "bytes": nbytes, "impl": results.impl_name(c.algorithm, c.protocol),
          "algorithm": c.algorithm, "protocol": c.protocol,
          "time_us": None if c.time_us is None else round(c.time_us, 2),
          "psum_us": None if c.psum_us is None else round(c.psum_us, 2), "source": c.source})
    return rows


# --------------------------------------------------------------------------- fused ops

# matmul_all_reduce(algorithm="auto") takes the fused kernel from this output
# size per rank (bytes) on; below it the GEMM then the CUDA all_reduce.
# Calibrated on 2x H200 (three chunk sweeps): the fused kernel lost by 37-78 us
# at 1-8 MiB (its two dependent transfers and their flag waits), tied at 16 MiB
# (medians 1% apart; single runs from 10% faster to 15% slower), and won by
# 10-29% at every measured size from 32 MiB.
FUSED_ALL_REDUCE_MIN_BYTES = 32 << 20

# Above the largest size of a table, the table's largest size still decides (each time scaled
# by the bytes) when that size is at least this large: there every algorithm is bandwidth-bound,
# so their order holds (2x H200: psum won at 64 and 256 MiB and would lose to the cost model's
# two-shot pick above). Smaller tables leave larger messages to the cost model.
LARGE_BYTES = 64 << 20

# The fused ops' transport where the caller names none: the copy engines take
# no SMs from the concurrent GEMM; NVSHMEM block puts from a kernel were slower
# wherever the GEMM was long (AG 0.58 vs 0.39 ms, RS 0.60 vs 0.46 ms at
# (16384, 4096, 4096), docs/kernels.md "fused v1").
DEFAULT_FUSED_TRANSPORT = names.COPY_ENGINE

# Auto chunking, calibrated on 2x H200 by three chunk sweeps (1, 2, 3, 4, 8
# chunks over 27 shapes; every configuration's median over its measurements;
# benchmarks/calibrate_fused.py, docs/kernels.md "fused calibration"). No shape
# ran more than 2.7% faster with more than two chunks, so auto uses one or two:
# * all_gather_matmul: ratio = the shard's transfer time over the local
#   shard's GEMM time (estimated with the rates below). Up to
#   _AG_ONE_CHUNK_RATIO that GEMM hides the transfer whole and cutting the
#   GEMM only costs: one chunk (ratios 0.14 and 0.27: two chunks 1-5% slower
#   on four shapes, 1.5% faster on one). From 0.47 on the transfer, slowed by
#   the GEMM beside it, is exposed and two chunks win: 6% at 0.47, 3.5% at
#   0.63, 9-15% at 0.95, 10% at 1.90 (larger ratios were not measured).
# * matmul_reduce_scatter / matmul_all_reduce: this rank's block GEMM adds the
#   partial of rank r-1 chunk by chunk, so that partial must arrive in chunks
#   ahead of it, but each chunk adds a dependent transfer: one chunk for blocks
#   under _RS_TWO_CHUNK_BYTES (two cost 9-63% at 0.5-4 MiB), two from there
#   (8-224 MiB: the best count or within 1.1% of it).
LINK_BYTES_PER_S = 350e9    # one copy-engine stream over NV18 (a 64 MiB shard hid in 185 us)
GEMM_FLOPS_PER_S = 680e12   # bf16 GEMM on one H200 (the sweeps' local GEMMs: median 692 TF/s)
_AG_ONE_CHUNK_RATIO = 0.4    # t_comm / t_gemm up to which AG sends its shard whole
_RS_TWO_CHUNK_BYTES = 8 << 20


def fused_chunks(op: str, payload_bytes: int, pieces: int, gemm_flops: float) -> int:
  """Chunks per shard transfer for a fused op, from its shapes (the rules above).

  Args:
    op: "all_gather_matmul", "matmul_reduce_scatter" or "matmul_all_reduce".
    payload_bytes: bytes of one shard (AG) or one partial block (RS, AR).
    pieces: pieces the shard or block can be cut into (its rows; all_gather_matmul
      with batch dims: the batch entries); chunks never exceed them.
    gemm_flops: flops of the GEMM that the first transfer overlaps (AG: the
      local shard's).

  Returns:
    1 or 2 (at most ``pieces``, at least 1).
  """
  if op == names.ALL_GATHER_MATMUL:
    ratio = (payload_bytes / LINK_BYTES_PER_S) / max(gemm_flops / GEMM_FLOPS_PER_S, 1e-12)
    chunks = 1 if ratio <= _AG_ONE_CHUNK_RATIO else 2
  else:
    chunks = 1 if payload_bytes < _RS_TWO_CHUNK_BYTES else 2
  return int(max(1, min(pieces, chunks)))


def fuse_all_reduce(out_bytes: int) -> bool:
  """True when ``matmul_all_reduce``'s fused kernel beats the GEMM then the all-reduce.

  Args:
    out_bytes: bytes of the output per rank.
  """
  return out_bytes >= FUSED_ALL_REDUCE_MIN_BYTES


# all_reduce_rms_norm, kernel v2 (a row over a cluster of 1-8 blocks): against
# the CUDA all_reduce then the norm in XLA, on 2x H200, bf16, rows of 4096
# (8 KiB): alone (benchmarks/results/all_reduce_rms_norm-2x_H200_NV18-v2.json,
# one run) 8.3 against 9.2 us at 1 row and 8.1 against 9.7 at 2; 8.5 against 7.9
# at 4 and 10.5 against 10.3 at 16, within that run's spread. Inside a 32-layer
# decode step (decode_chain_cudnn_32layers-2x_H200_NV18.json), 64 fused calls a
# token took 15, 73 and 52 us a token less than the unfused chain at batch 1, 4
# and 16. So the fused kernel runs from one row. Rows of 8192 (16 KiB) were
# slower with kernel v1 (one block a row: 14.6 against 13.0 us) and are not yet
# measured with v2; they stay unfused (docs/kernels.md).
NORM_FUSED_MIN_ROWS = 1
NORM_FUSED_MAX_ROW_BYTES = 8 << 10


def fuse_norm(rows: int, row_bytes: int) -> bool:
  """True when ``all_reduce_rms_norm``'s fused kernel beats the all-reduce then the norm.

  Args:
    rows: rows of the message (all dimensions but the last).
    row_bytes: bytes of one row.
  """
  return rows >= NORM_FUSED_MIN_ROWS and row_bytes <= NORM_FUSED_MAX_ROW_BYTES
