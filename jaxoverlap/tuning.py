"""All-reduce algorithm choice: an alpha-beta cost model and a table of measurements.

Problem:
  ``all_reduce(..., algorithm="auto")`` must pick, per message size and
  topology, the fastest of the CUDA kernels (one-shot, two-shot, NVRAR's
  hierarchical; protocols LL and simple) and XLA's ``lax.psum`` (NCCL), and it
  must never be slower than psum. Which one wins depends on the machine, so
  measurements decide where there are any, and a cost model elsewhere.

Algorithm:
  ``predict_us`` prices each algorithm with one (alpha, beta) pair per link
  kind (NVLink inside a node, the network between nodes), a fixed per-call
  overhead and the local reduction's HBM traffic; psum is priced as NCCL's
  ring. ``Policy.choose`` uses the measured records of the tuning file
  (written by ``python -m jaxoverlap.tune``) for the topology when it has
  them, interpolated log-log between measured sizes, and the cost model
  otherwise; every ``Choice`` says which of the two decided and why.
  ``time_chain_us`` is the timing method of the tuner and of
  ``benchmarks/all_reduce.py`` (BRIEF section 5).

Example:
  >>> from jaxoverlap import tuning
  >>> round(tuning.predict_us("one_shot", "ll", 8192, 2, ranks_per_node=8, num_nodes=1), 1)
  5.6
  >>> policy = tuning.Policy.load()   # $JAXOVERLAP_TUNING_FILE or ~/.cache/jaxoverlap/...
  >>> policy.choose(1 << 20, 2, ranks_per_node=8, num_nodes=2)   # no file yet
  Choice(algorithm='hierarchical', protocol='simple', source='cost model (no tuning file at
  /root/.cache/jaxoverlap/all_reduce-tuning.json)', time_us=24.28...)

Environment:
  ``JAXOVERLAP_TUNING_FILE``: path of the tuning table (default
  ``~/.cache/jaxoverlap/all_reduce-tuning.json``). ``JAXOVERLAP_<KEY>`` for
  every key of ``PARAM_KEYS`` (e.g. ``JAXOVERLAP_NET_ALPHA_US``,
  ``JAXOVERLAP_NET_BETA_GBPS``) overrides one cost-model parameter; it beats
  the tuning file's ``"params"``, which beat the defaults.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

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
    "impl_name",
    "parse_impl",
    "default_tuning_path",
    "package_versions",
    "make_result",
    "validate_result",
    "load_result",
    "save_result",
    "Choice",
    "Policy",
    "run_tuning",
    "chain_time_s",
    "time_chain_us",
]

ALGORITHMS = ("one_shot", "two_shot", "hierarchical")
PROTOCOLS = ("ll", "simple")
PSUM = "psum"  # lax.psum, i.e. NCCL: the handover that auto must never lose to
_SINGLE_NODE = ("one_shot", "two_shot")  # their kernels reach peers over NVLink only


# --------------------------------------------------------------------------- cost model


@dataclasses.dataclass(frozen=True)
class LinkParams:
  """One link kind in the alpha-beta model: a step costs ``alpha_us + bytes / beta``.

  Attributes:
    alpha_us: latency of one message (put, or signal), us.
    beta_gbps: bandwidth one GPU gets for its sends, GB/s (1e9 bytes/s).
  """

  alpha_us: float
  beta_gbps: float

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
      value = float(value)
      if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"cost-model parameter {key} must be a positive number, got {value}")
      values[key] = value
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

# Defaults. NVLink and NCCL numbers are BRIEF section 5's measurements on 2x H200
# (NV18, 478 GB/s per direction), jax 0.11.2, NVSHMEM 3.4.5, NCCL 2.28.9. The
# network numbers are NOT measured: no multi-node machine is lent to us.
DEFAULT_PARAMS = CostParams(
    # alpha: NVSHMEM signal ping-pong, 0.71 us one way (BRIEF s5).
    # beta: nvshmem putmem_block, both directions at once, 32 blocks: 355 GB/s
    # per direction (BRIEF s5), 74% of NVLink's 478 GB/s. Check at 2 GPUs
    # (model vs PyTorch symm-mem, BRIEF s5): two_shot 1 MB 10.9 vs 10.1 us,
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
    # (13.7-21.2 us, BRIEF s5). beta: fit to 64 MB: (301 - 13.7) us for
    # 2(P-1)/P * 64 MiB = 64 MiB -> 234 GB/s. The single alpha-beta line
    # underestimates psum between 256 KB and 4 MB (NCCL's LL->Simple switch:
    # measured 18.5/23.8/44.1 us, model 14.8/18.2/31.6 us), i.e. the model
    # leans towards psum where it is unsure, as auto must.
    nccl=LinkParams(alpha_us=13.7, beta_gbps=234.0),
    # Fixed cost per call, fit to PyTorch symmetric-memory one-shot/two-shot
    # (CUDA graphs, 2x H200, BRIEF s5) at 8 KB - 1 MB: their small-message
    # floor is 6.5-6.7 us, of which the model's steps explain 0.7-1.5 us.
    launch_us=4.5,
    # H200 HBM3e: 4.8 TB/s peak (NVIDIA H200 datasheet); ~85% reached by
    # streaming kernels -> 4000 GB/s. ASSUMPTION: not measured by us.
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
  try:
    return base.replace(**flat)
  except ValueError as e:
    raise ValueError(f"{e} (from the JAXOVERLAP_* environment)") from None


def _step_us(link: LinkParams, nbytes: float, protocol: str) -> float:
  """One step in which every rank sends ``nbytes`` payload bytes and waits for its peers'.

  LL8 sends 4 B of flag with every 4 B of data (2x the wire bytes) and needs
  no signal; simple sends the data once, then a signal that costs one more
  latency.
  """
  if protocol == "ll":
    return link.alpha_us + link.transfer_us(2 * nbytes)
  return 2 * link.alpha_us + link.transfer_us(nbytes)


def predict_us(
    algorithm: str,
    protocol: str | None,
    nbytes: int,
    itemsize: int,
    ranks_per_node: int,
    num_nodes: int,
    params: CostParams | None = None,
) -> float:
  """Predicted latency of one all-reduce, us.

  With G = ranks_per_node, N = num_nodes, P = G N and M = nbytes:

  * one_shot (N = 1): launch + one step of (G-1) M bytes (every rank pushes M
    to each peer) + reading G inputs from HBM.
  * two_shot (N = 1): launch + reduce-scatter step of (G-1)/G M + all-gather
    step of (G-1)/G M, + HBM traffic.
  * hierarchical (N > 1; NVRAR, arXiv 2511.09557): intra-node reduce-scatter
    and all-gather as two_shot, between them floor(log2 N) network steps of
    the whole shard as fp32 partial sums (M/G * 4/itemsize bytes), plus a
    pre-step and a post-step when N is not a power of two.
  * psum: NCCL ring, nccl.alpha + 2(P-1)/P M / beta; across nodes beta is
    min(nccl.beta, G * network.beta) (rail-aligned rings share the node's
    NICs) and 2 ceil(log2 N) network latencies are added (NCCL's tree for
    small messages).

  A step (``_step_us``) costs alpha + 2 bytes/beta with protocol "ll" and
  2 alpha + bytes/beta with "simple".

  Args:
    algorithm: "one_shot", "two_shot", "hierarchical" or "psum".
    protocol: "ll" or "simple"; None for psum.
    nbytes: message size per rank, bytes.
    itemsize: bytes per element (2 for bf16/f16, 4 for f32).
    ranks_per_node: G, GPUs per node in the group.
    num_nodes: N, nodes in the group.
    params: model parameters (default: ``params_from_env()``).

  Returns:
    Latency, us.

  Raises:
    ValueError: unknown algorithm or protocol, one_shot/two_shot across
      nodes, hierarchical within one node, or a non-positive size.
  """
  p = params_from_env() if params is None else params
  g, n, m = int(ranks_per_node), int(num_nodes), float(nbytes)
  if g < 1 or n < 1 or m < 0 or itemsize < 1:
    raise ValueError(f"predict_us: need ranks_per_node >= 1, num_nodes >= 1, nbytes >= 0 and "
                     f"itemsize >= 1; got {ranks_per_node}, {num_nodes}, {nbytes}, {itemsize}")
  if algorithm == PSUM:
    if protocol is not None:
      raise ValueError(f"predict_us: psum takes protocol=None, got {protocol!r}")
    num_ranks = g * n
    if num_ranks == 1:
      return 0.0  # XLA drops a psum over one rank
    ring_bytes = 2 * (num_ranks - 1) / num_ranks * m
    if n == 1:
      return p.nccl.alpha_us + p.nccl.transfer_us(ring_bytes)
    beta = min(p.nccl.beta_gbps, g * p.network.beta_gbps)
    return (p.nccl.alpha_us + 2 * math.ceil(math.log2(n)) * p.network.alpha_us
            + ring_bytes / (beta * 1e3))
  if algorithm not in ALGORITHMS:
    raise ValueError(f"predict_us: algorithm must be one of {ALGORITHMS + (PSUM,)}, "
                     f"got {algorithm!r}")
  if protocol not in PROTOCOLS:
    raise ValueError(f"predict_us: protocol must be one of {PROTOCOLS}, got {protocol!r}")
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
    return (p.launch_us + (_step_us(p.nvlink, peers * m, protocol) if peers else 0.0)
            + hbm((peers * wire + 1) * m + m))

  # two_shot and hierarchical share the intra-node reduce-scatter and all-gather.
  shard = m / g
  t = p.launch_us
  if peers:
    t += 2 * _step_us(p.nvlink, peers * shard, protocol)
    t += hbm((peers * wire + 1) * shard + shard)   # reduce G shards into one
    t += hbm((wire + 1) * peers * shard)           # unpack the gathered shards
  if algorithm == "hierarchical":
    wire_shard = shard * 4 / itemsize  # partial sums travel as fp32
    steps = int(math.log2(n)) + (0 if n & (n - 1) == 0 else 2)  # fold in / out
    t += steps * (_step_us(p.network, wire_shard, protocol)
                  + hbm((wire + 2) * wire_shard))
  return t


# --------------------------------------------------------------------------- table file


def impl_name(algorithm: str, protocol: str | None) -> str:
  """The ``impl`` of a record: ``"xla:psum"`` or ``"jaxoverlap:<algorithm>[_<protocol>]"``."""
  if algorithm == PSUM:
    return "xla:psum"
  return f"jaxoverlap:{algorithm}" + (f"_{protocol}" if protocol else "")


def parse_impl(impl: str) -> tuple[str, str | None] | None:
  """Inverse of ``impl_name``; None for impls that are not a choice (auto, ppermute, ...)."""
  if impl == "xla:psum":
    return PSUM, None
  if not impl.startswith("jaxoverlap:"):
    return None
  name = impl.split(":", 1)[1]
  if name in ALGORITHMS:
    return name, None
  for protocol in PROTOCOLS:
    alg = name[: -len(protocol) - 1]
    if name.endswith("_" + protocol) and alg in ALGORITHMS:
      return alg, protocol
  return None


def default_tuning_path() -> str:
  """``$JAXOVERLAP_TUNING_FILE``, else ``~/.cache/jaxoverlap/all_reduce-tuning.json``."""
  return os.environ.get("JAXOVERLAP_TUNING_FILE") or os.path.join(
      os.path.expanduser("~"), ".cache", "jaxoverlap", "all_reduce-tuning.json")


_RECORD_KEYS = {"op": str, "impl": str, "bytes": int, "ranks_per_node": int, "world": int,
                "time_us": (int, float)}


_VERSIONED = (("jax", "jax"), ("jaxlib", "jaxlib"), ("nvshmem", "nvidia-nvshmem-cu13"),
              ("nccl", "nvidia-nccl-cu13"))


def package_versions() -> dict[str, str | None]:
  """The installed versions of jax, jaxlib, nvidia-nvshmem-cu13 and nvidia-nccl-cu13.

  Returns:
    ``{"jax", "jaxlib", "nvshmem", "nccl"}`` -> version string, None where the
    distribution is not installed; the ``versions`` of ``make_result``.
  """
  out = {}
  for name, dist in _VERSIONED:
    try:
      out[name] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def make_result(records: Sequence[Mapping[str, Any]], *, machine: str, command: str,
                method: str, versions: Mapping[str, Any] | None = None,
                params: Mapping[str, float] | None = None,
                rejected: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
  """A tuning table in the BRIEF section 7 format (benchmark ``all_reduce_tuning``).

  Args:
    records: ``{"op": "all_reduce", "impl", "dtype", "bytes", "shape", "world",
      "ranks_per_node", "time_us"}`` each.
    machine, command, method: free text, as in the benchmark files.
    versions: package versions.
    params: cost-model overrides under ``PARAM_KEYS`` (e.g. the network's).
    rejected: ``{"impl", "bytes", "reason"}`` of configurations that failed
      their correctness check and were not timed.
  """
  return {
      "benchmark": "all_reduce_tuning",
      "machine": machine,
      "command": command,
      "method": method,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "versions": dict(versions or {}),
      "params": dict(params or {}),
      "records": [dict(r) for r in records],
      "rejected": [dict(r) for r in rejected],
  }


def validate_result(result: Any, where: str = "tuning table") -> None:
  """Checks the BRIEF section 7 layout and the cost-model ``params``.

  Raises:
    ValueError: a missing or mistyped field; the message names it.
  """
  if not isinstance(result, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(result).__name__}")
  for key in ("benchmark", "machine", "command", "date", "versions", "records"):
    if key not in result:
      raise ValueError(f"{where}: missing field {key!r}")
  if not isinstance(result["records"], list):
    raise ValueError(f"{where}: 'records' must be a list")
  for i, rec in enumerate(result["records"]):
    for key, typ in _RECORD_KEYS.items():
      if not isinstance(rec, dict) or not isinstance(rec.get(key), typ) or isinstance(
          rec.get(key), bool):
        raise ValueError(f"{where}: records[{i}] lacks {key!r} of type "
                         f"{getattr(typ, '__name__', 'number')}: {rec!r}")
    if rec["time_us"] <= 0 or rec["bytes"] < 0 or rec["ranks_per_node"] < 1 or (
        rec["world"] % rec["ranks_per_node"]):
      raise ValueError(f"{where}: records[{i}] has impossible values: {rec!r}")
  DEFAULT_PARAMS.replace(**result.get("params", {}))  # raises on a bad key or value


def load_result(path: str | None = None) -> dict[str, Any] | None:
  """Reads and validates a tuning table; None when the file does not exist.

  Raises:
    ValueError: the file is not valid JSON or not a valid table.
  """
  path = path or default_tuning_path()
  try:
    with open(path) as f:
      result = json.load(f)
  except FileNotFoundError:
    return None
  except json.JSONDecodeError as e:
    raise ValueError(f"tuning table {path} is not valid JSON: {e}") from None
  validate_result(result, path)
  return result


def save_result(result: Mapping[str, Any], path: str | None = None) -> str:
  """Writes a tuning table atomically, creating folders; returns the path.

  Raises:
    ValueError: ``result`` is not a valid table.
  """
  path = path or default_tuning_path()
  validate_result(result, path)
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tuning-", suffix=".json")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(result, f, indent=1)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; the table is shared, not secret
    os.replace(tmp, path)  # readers on other ranks never see half a file
  except BaseException:
    os.unlink(tmp)
    raise
  return path


# --------------------------------------------------------------------------- policy


class Choice(NamedTuple):
  """What ``Policy.choose`` picked.

  Attributes:
    algorithm: "one_shot", "two_shot", "hierarchical" or "psum".
    protocol: "ll", "simple", or None (psum, or a record without protocol).
    source: why: "measured (<file>, <size bracket>)" or "cost model (<reason>)".
    time_us: the measured (interpolated) or predicted latency, us.
  """

  algorithm: str
  protocol: str | None
  source: str
  time_us: float | None = None


def _itemsize(dtype: str | None) -> int | None:
  import numpy as np

  try:
    return np.dtype(dtype).itemsize if dtype else None
  except TypeError:
    import jax.numpy as jnp  # bfloat16 is registered by ml_dtypes through jax

    return jnp.dtype(dtype).itemsize


class Policy:
  """Chooses the all-reduce algorithm and protocol per size and topology.

  Measured records of the topology (same ``ranks_per_node`` and ``world``)
  decide when they include ``xla:psum`` and reach the size: each impl's time
  is interpolated log-log between the two measured sizes of psum that bracket
  the size (taken as flat below the smallest), and the fastest wins, psum on
  ties. An impl not measured at both ends of the bracket (e.g. rejected by its
  correctness check there) does not compete.
  Otherwise the cost model decides among the algorithms valid for the
  topology. one_shot/two_shot are never chosen across nodes, hierarchical
  never within one node.

  Args:
    records: BRIEF section 7 records (``op`` all_reduce).
    params: cost-model parameters (default: ``params_from_env()``).
    path: where the records came from, for ``Choice.source``.
    algorithms: the kernels this build has; others are never chosen.
    protocols: the protocols this build has.
    missing: True when ``path`` does not exist (said in ``Choice.source``).
  """

  def __init__(self, records: Iterable[Mapping[str, Any]] = (), params: CostParams | None = None,
               *, path: str | None = None, algorithms: Sequence[str] = ALGORITHMS,
               protocols: Sequence[str] = PROTOCOLS, missing: bool = False):
    self.params = params_from_env() if params is None else params
    self.path = path or "<records>"
    self.missing = missing
    self.algorithms = tuple(a for a in algorithms if a in ALGORITHMS)
    self.protocols = tuple(p for p in protocols if p in PROTOCOLS)
    # {(ranks_per_node, world): {(alg, proto): {itemsize: {bytes: [us, ...]}}}}
    self._measured: dict = {}
    for rec in records:
      parsed = parse_impl(rec.get("impl", ""))
      if rec.get("op") != "all_reduce" or parsed is None:
        continue
      topo = (int(rec["ranks_per_node"]), int(rec["world"]))
      sizes = (self._measured.setdefault(topo, {}).setdefault(parsed, {})
               .setdefault(_itemsize(rec.get("dtype")), {}))
      sizes.setdefault(int(rec["bytes"]), []).append(float(rec["time_us"]))

  @classmethod
  def from_result(cls, result: Mapping[str, Any] | None, path: str | None = None,
                  **kwargs) -> Policy:
    """The policy of a tuning table already read (None: no table, cost model only).

    Cost-model parameters: the defaults, then the table's ``"params"``, then
    ``JAXOVERLAP_*`` variables.

    Args:
      result: a BRIEF section 7 table (``load_result``), or None.
      path: where it came from, for ``Choice.source``.
      **kwargs: ``algorithms``, ``protocols`` as in ``Policy``.

    Raises:
      ValueError: ``result`` is not a valid table.
    """
    path = path or default_tuning_path()
    if result is None:
      return cls((), params_from_env(), path=path, missing=True, **kwargs)
    validate_result(result, path)
    params = params_from_env(DEFAULT_PARAMS.replace(**result.get("params", {})))
    return cls(result["records"], params, path=path, **kwargs)

  @classmethod
  def load(cls, path: str | None = None, **kwargs) -> Policy:
    """The policy of a tuning file (default ``default_tuning_path()``); see ``from_result``.

    A missing file gives a cost-model-only policy.

    Raises:
      ValueError: the file exists but is not a valid tuning table.
    """
    path = path or default_tuning_path()
    return cls.from_result(load_result(path), path, **kwargs)

  def _allowed(self, algorithm: str, protocol: str | None, num_nodes: int) -> bool:
    if algorithm == PSUM:
      return True
    if algorithm not in self.algorithms or (protocol is not None and
                                            protocol not in self.protocols):
      return False
    if algorithm == "two_shot" and protocol == "ll":
      return False  # the two-shot kernel has only the simple protocol
    return (num_nodes > 1) == (algorithm == "hierarchical")

  def _from_measurements(self, nbytes, itemsize, ranks_per_node, num_nodes):
    """A Choice from the table, or the reason there is none (str)."""
    topo = (ranks_per_node, ranks_per_node * num_nodes)
    by_impl = self._measured.get(topo)
    if not by_impl:
      return f"no measurements for {ranks_per_node} ranks/node x {num_nodes} nodes"
    if (PSUM, None) not in by_impl:
      return f"no xla:psum measurement for {ranks_per_node} ranks/node x {num_nodes} nodes"
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
    if nbytes > grid[-1]:
      return f"{nbytes} bytes is above the largest size measured ({grid[-1]} bytes)"
    lo = max([b for b in grid if b <= nbytes], default=grid[0])
    hi = min(b for b in grid if b >= nbytes)
    best = None
    for (alg, proto), t in times.items():
      # An impl competes only if measured at both ends of psum's bracket: one
      # rejected (or not run) at a size never wins next to it.
      if not self._allowed(alg, proto, num_nodes) or lo not in t or hi not in t:
        continue
      us = t[lo] if lo == hi or nbytes <= lo else math.exp(
          math.log(t[lo]) + math.log(nbytes / lo) / math.log(hi / lo)
          * (math.log(t[hi]) - math.log(t[lo])))
      key = (us, alg != PSUM)  # psum wins ties
      if best is None or key < best[0]:
        best = (key, alg, proto)
    (us, _), alg, proto = best
    if nbytes == lo == hi:
      bracket = f"at {nbytes} bytes"
    elif nbytes < lo:
      bracket = f"below {lo} bytes, the smallest measured"
    else:
      bracket = f"between {lo} and {hi} bytes"
    return Choice(alg, proto, f"measured ({self.path}, {bracket})", us)

  def choose(self, nbytes: int, itemsize: int, ranks_per_node: int, num_nodes: int) -> Choice:
    """The algorithm and protocol for one all-reduce.

    Args:
      nbytes: message size per rank, bytes.
      itemsize: bytes per element (2 or 4).
      ranks_per_node: GPUs per node in the reduction group.
      num_nodes: nodes in the reduction group.

    Returns:
      A ``Choice``; ``algorithm == "psum"`` is the explicit handover to XLA.

    Raises:
      ValueError: negative size, or a topology with fewer than one rank.
    """
    if nbytes < 0 or itemsize < 1 or ranks_per_node < 1 or num_nodes < 1:
      raise ValueError(f"Policy.choose: need nbytes >= 0, itemsize >= 1, ranks_per_node >= 1 "
                       f"and num_nodes >= 1; got {nbytes}, {itemsize}, {ranks_per_node}, "
                       f"{num_nodes}")
    got = self._from_measurements(nbytes, itemsize, ranks_per_node, num_nodes)
    if isinstance(got, Choice):
      return got
    why = f"no tuning file at {self.path}" if self.missing else f"{got} in {self.path}"
    candidates = [(PSUM, None)] + [(a, p) for a in self.algorithms for p in self.protocols
                                   if self._allowed(a, p, num_nodes)]
    t, _, alg, proto = min(
        (predict_us(a, p, nbytes, itemsize, ranks_per_node, num_nodes, self.params), a != PSUM,
         a, p) for a, p in candidates)
    return Choice(alg, proto, f"cost model ({why})", t)

  def table(self, ranks_per_node: int, num_nodes: int,
            sizes: Sequence[int] = tuple(4096 << (2 * i) for i in range(9)),
            itemsize: int = 2) -> list[dict[str, Any]]:
    """What ``choose`` picks for each size (for ``runtime_info()`` and the README).

    Args:
      ranks_per_node, num_nodes: the topology.
      sizes: message sizes per rank, bytes (default 4 KB, 16 KB, ..., 256 MB).
      itemsize: bytes per element.

    Returns:
      One dict per size: ``bytes``, ``impl``, ``algorithm``, ``protocol``,
      ``time_us`` (measured or predicted), ``psum_us`` (psum's predicted time)
      and ``source``.
    """
    rows = []
    for nbytes in sizes:
      c = self.choose(nbytes, itemsize, ranks_per_node, num_nodes)
      rows.append({
          "bytes": nbytes, "impl": impl_name(c.algorithm, c.protocol), "algorithm": c.algorithm,
          "protocol": c.protocol, "time_us": None if c.time_us is None else round(c.time_us, 2),
          "psum_us": round(predict_us(PSUM, None, nbytes, itemsize, ranks_per_node, num_nodes,
                                      self.params), 2),
          "source": c.source})
    return rows


# --------------------------------------------------------------------------- tuning loop


def run_tuning(
    measure: Callable[[str, int], float],
    check: Callable[[str, int], str | None],
    impls: Sequence[str],
    sizes: Sequence[int],
    *,
    dtype: str,
    ranks_per_node: int,
    world: int,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """Checks, then times, every impl at every size.

  Args:
    measure: ``measure(impl, nbytes) -> us``, median latency of one op.
    check: ``check(impl, nbytes) -> None`` when the impl's result equals
      psum's, else the reason it does not (or why it cannot run). An impl that
      fails is not timed at that size, so a wrong but fast one never wins.
    impls: ``impl_name`` strings, ``"xla:psum"`` among them.
    sizes: message sizes per rank, bytes.
    dtype: element type name (e.g. ``"bfloat16"``).
    ranks_per_node, world: the topology measured.
    log: receives one line per size.

  Returns:
    ``(records, rejected)``: BRIEF section 7 records, and ``{"impl", "bytes",
    "reason"}`` for each configuration that failed its check.
  """
  itemsize = _itemsize(dtype)
  records, rejected = [], []
  for nbytes in sizes:
    row = []
    for impl in impls:
      reason = check(impl, nbytes)
      if reason is not None:
        rejected.append({"impl": impl, "bytes": nbytes, "reason": reason})
        row.append(f"{impl}=rejected")
        continue
      us = float(measure(impl, nbytes))
      records.append({"op": "all_reduce", "impl": impl, "dtype": dtype, "bytes": nbytes,
                      "shape": [nbytes // itemsize], "world": world,
                      "ranks_per_node": ranks_per_node, "time_us": round(max(us, 0.01), 2)})
      row.append(f"{impl}={us:.1f}us")
    log(f"{nbytes:>10} B  " + "  ".join(row))
  return records, rejected


def chain_time_s(op: Callable | None, x, *, mesh, axis_name: str, length: int = 50,
                 reps: int = 30, warmup: int = 3) -> float:
  """Median wall time of one run of a chain of ``length`` ops in one jit, seconds.

  Each link applies ``op`` to the previous result and casts it back to varying
  over ``axis_name``; ``op=None`` gives the same chain without the ops.

  Args:
    op: per-shard function (inside ``shard_map``), e.g. ``lambda y:
      lax.psum(y, "x")``; None for the empty chain.
    x: global array sharded over ``axis_name`` along dimension 0.
    mesh: the mesh; axis_name: its axis.
    length: ops per chain. reps: timed runs (median). warmup: untimed runs.
  """
  import jax
  from jax.sharding import PartitionSpec as P

  from jaxoverlap import _xla

  def f(y):
    for _ in range(length):
      if op is not None:
        y = _xla.to_varying(op(y), axis_name)
    return y

  fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name)))
  for _ in range(warmup):
    fn(x).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn(x).block_until_ready()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def time_chain_us(op: Callable, x, *, mesh, axis_name: str, length: int = 50, reps: int = 30,
                  warmup: int = 3, empty_s: float | None = None) -> float:
  """Latency of one ``op``, us: (chain of ops - empty chain) / length (BRIEF s5 method).

  Args:
    op, x, mesh, axis_name, length, reps, warmup: as ``chain_time_s``.
    empty_s: the empty chain's time if already measured, seconds (saves a
      compile per impl when several are timed at one size).
  """
  kw = dict(mesh=mesh, axis_name=axis_name, length=length, reps=reps, warmup=warmup)
  if empty_s is None:
    empty_s = chain_time_s(None, x, **kw)
  return (chain_time_s(op, x, **kw) - empty_s) / length * 1e6
