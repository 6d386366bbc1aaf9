"""The CUDA kernels' runtime: bootstrap, symmetric heap, topology, rank <-> PE mapping.

Problem:
  The CUDA kernels write into peers' memory, so every GPU of a job needs a
  symmetric heap (the same layout on every GPU), allocated once, in the same
  order everywhere, before the first kernel runs; and every GPU needs a PE
  number that the mesh's devices map to.

Algorithm:
  ``initialize()`` picks the runtime from the process model:

  * One GPU per process (the launcher, SLURM one task per GPU): NVSHMEM, after
    ``jax.distributed.initialize``. Process 0 makes an NVSHMEM unique id; it
    travels through the jax.distributed key-value store under a
    ``jaxoverlap/`` key; every process then initialises NVSHMEM on its GPU and
    allocates the heap once. PE = ``jax.process_index()``.
  * One process driving several GPUs (JAX's default on a host; a notebook; one
    task per node): the in-process runtime ("peer" transport). Each GPU gets a
    heap of the same layout (cudaMalloc) and peer access to the others; no
    NVSHMEM and no jax.distributed is needed for one process. PE =
    process index x GPUs per process + the GPU's position among the
    process's devices; each process is one node.

  The hosts of all processes go through the key-value store to find the ranks
  per node, and rank 0's all-reduce tuning table goes to every process, so that
  all choose alike. This module is the one place that maps devices to PEs
  (``pe_of_device``, ``groups_along_axis``).

  ``facts()`` is what the dispatcher (``jaxoverlap.dispatch``) reads at every
  lowering: a small frozen snapshot, made once per initialisation. At module
  level it imports ``names`` and ``_checks.as_int`` (``_checks`` imports only
  ``names``), nothing of the layers that use it (docs/design.md).

Example:
  >>> jax.distributed.initialize(coordinator, num_processes, process_id,
  ...                            local_device_ids=[local_rank])
  >>> jaxoverlap.initialize()            # or: python -m jaxoverlap.launch
  >>> jaxoverlap.runtime_info()["num_pes"]
  2
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import json
import logging
import math
import numbers
import os
import re
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from jaxoverlap import names
from jaxoverlap._checks import as_int as _as_int

logger = logging.getLogger("jaxoverlap")

__all__ = [
    "initialize",
    "finalize",
    "is_initialized",
    "runtime_info",
    "unavailable_reason",
    "Facts",
    "facts",
    "nodes_are_emulated",
    "tuning_table",
    "pe_of_device",
    "groups_along_axis",
    "DEFAULT_HEAP_BYTES",
    "DEFAULT_OVERLAP_HEAP_BYTES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_INIT_TIMEOUT_S",
]

DEFAULT_HEAP_BYTES = 1 << 30  # 1 GiB per GPU
# The fused ops' slots: (ranks per node + 1) slots of this / (ranks + 1) bytes,
# e.g. 682 MiB per sender with 2 GPUs per node (a bf16 shard of 16384 x 16384).
DEFAULT_OVERLAP_HEAP_BYTES = 2 << 30
# A device wait that times out traps its kernel, which loses the GPU context: a rank late by
# more than this ends the job. So it bounds hangs, not lateness: longer than the skew between
# processes (a slower compilation, host work on one rank), as long as jax.distributed's own
# heartbeat timeout (100 s), after which JAX declares a silent process dead anyway.
DEFAULT_TIMEOUT_S = 100.0
DEFAULT_INIT_TIMEOUT_S = 120.0  # every wait of initialize(): peers, rank 0's table and id, NVSHMEM
HEAP_ALIGNMENT = 256  # heap_bytes and overlap_heap_bytes are multiples of this (bytes)
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1e-3, 1e9  # the range of timeout_s (seconds); init_timeout_s <= max
# NVSHMEM's own heap must hold ours plus its internal allocations.
_NVSHMEM_HEAP_SLACK_BYTES = 256 << 20

_lock = threading.Lock()
_initialized = False
_generation = 0
_info: dict[str, Any] = {}
_facts: Facts | None = None
# The in-process runtime: the PE of every device of the job, by device id.
_pe_by_device_id: dict[int, int] = {}
# Rank 0's all-reduce tuning table (its path, and the parsed JSON or None),
# shared at initialize() so that every rank's "auto" makes the same choice.
_tuning: tuple[str, dict | None] = ("", None)
# The ranks per node the hosts gave at initialize() (None: they gave none),
# which a second initialize() without ranks_per_node asks for.
_ranks_per_node_from_hosts: int | None = None


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the dispatcher needs to know of this process's CUDA runtime.

  Attributes:
    unavailable: why the CUDA kernels cannot run in this process, or None when
      they can.
    transport: the runtime's transport: "nvshmem" (one GPU per process) or
      "peer" (one process driving several GPUs), or None.
    pe, num_pes: this process's (first) PE and the number of PEs.
    ranks_per_node: PEs per node (node = pe // ranks_per_node).
    slot_bytes, ll_slot_bytes, lamport_slot_bytes: the all-reduce's capacity
      per sender and launch (lamport_slot_bytes 0: no Lamport slots).
    overlap_slot_bytes: the fused ops' capacity per sender, bytes.
    limits: the kernels' compile-time limits (``max_group_size``,
      ``max_nodes``, ``max_chunks``, ...), exported by the extension.
    fused_command_buffer: ``JAXOVERLAP_FUSED_CMD_BUFFER=1``: the fused ops
      lower to their command-buffer handlers.
    emulated_nodes: the runtime's nodes share hosts (``nodes_are_emulated``).
    unreachable_pairs: every ``(pe, peer)`` of one node where ``pe`` cannot
      load/store ``peer``'s memory (no NVLink or PCIe peer access), gathered
      from every process at start-up; empty under the in-process runtime, whose
      start-up requires peer access.
  """

  unavailable: str | None
  transport: str | None = None
  pe: int = -1
  num_pes: int = 0
  ranks_per_node: int = 1
  slot_bytes: int = 0
  ll_slot_bytes: int = 0
  lamport_slot_bytes: int = 0
  overlap_slot_bytes: int = 0
  limits: Mapping[str, int] = dataclasses.field(default_factory=dict)
  fused_command_buffer: bool = False
  emulated_nodes: bool = False
  unreachable_pairs: tuple[tuple[int, int], ...] = ()


def nodes_are_emulated(hosts: Sequence[str], num_nodes: int) -> bool:
  """True when ``num_nodes`` nodes are not each on hosts of their own.

  Nodes emulated on one host (``JAXOVERLAP_RANKS_PER_NODE`` below the GPUs of
  a host) run the hierarchical all-reduce's inter-node steps over NVLink, so
  their timings say nothing of a network; the tuning policy keeps such
  records apart (``tuning.Policy.choose``).

  Args:
    hosts: the host of every process, by process rank (the processes of one
      node consecutive).
    num_nodes: nodes of the runtime.
  """
  if num_nodes < 2:
    return False
  if len(set(hosts)) < num_nodes:
    return True
  per_node = len(hosts) // num_nodes
  return len({hosts[n * per_node] for n in range(num_nodes)}) < num_nodes


def is_initialized() -> bool:
  """True once ``initialize()`` has brought the CUDA kernels' runtime up in this process.

  The runtime is NVSHMEM (one GPU per process), or CUDA peer access in one
  process (a process driving several GPUs).
  """
  return _initialized


# The kernels' integer measurement knobs (ffi/all_reduce/all_reduce.cu, LamportKnobs and
# NormKnob): the values they accept, checked at initialize().
_INTEGER_KNOBS = {
    "JAXOVERLAP_LAMPORT_BLOCKS_PER_SM": (lambda v: v in (1, 2, 4), "1, 2 or 4"),
    "JAXOVERLAP_LAMPORT_BLOCK_BYTES": (lambda v: v >= 16, "an integer of at least 16 (bytes)"),
    "JAXOVERLAP_LAMPORT_MAX_BLOCKS": (lambda v: True, "a non-negative integer (0: what fits)"),
    "JAXOVERLAP_LAMPORT_POLL_NS": (lambda v: v < 2**32, "an integer from 0 to 2**32 - 1 (ns)"),
    "JAXOVERLAP_NORM_CLUSTER": (lambda v: v <= 8, "an integer from 0 to 8 (0: by the row's "
                                                  "size)"),
}


def _valid_alignment_cap(text: str) -> bool:
  """JAXOVERLAP_GEMM_ALIGNMENT_CAP's rule (ffi/overlap/gemm.cc): a power of two in 1..256."""
  return text.isdigit() and 1 <= int(text) <= 256 and int(text) & (int(text) - 1) == 0


def _parse_bytes(text: str, what: str) -> int:
  from jaxoverlap.tuning.results import parse_bytes

  return parse_bytes(text, what)


def _kv_client():
  # The jax.distributed key-value store has no public accessor in jax 0.11;
  # this is the one private JAX attribute the package touches.
  from jax._src import distributed

  return distributed.global_state.client


def _client_or_raise():
  client = _kv_client()
  if client is None:
    raise RuntimeError(
        "jaxoverlap.initialize: jax.distributed is not initialised but there are several "
        "processes; call jax.distributed.initialize(...) first (python -m jaxoverlap.launch does)")
  return client


def _missing(client, keys: dict[int, str]) -> list[int]:
  """The ranks whose key is not (yet) in the store."""
  out = []
  for r, key in keys.items():
    try:
      client.blocking_key_value_get(key, 1)
    except Exception:  # noqa: BLE001 - jax raises its own error types for a timeout
      out.append(r)
  return out


def _gather(what: str, value: str, rank: int, num_ranks: int, timeout_s: float) -> list[str]:
  """Every rank publishes ``value``; returns all ranks' values, in rank order.

  Raises:
    RuntimeError: some rank's value did not arrive within ``timeout_s``; the
      message names those ranks.
  """
  client = _client_or_raise()
  keys = {r: f"jaxoverlap/{_generation}/{what}/{r}" for r in range(num_ranks)}
  client.key_value_set(keys[rank], value)
  values = []
  for r in range(num_ranks):
    try:
      values.append(client.blocking_key_value_get(keys[r], int(timeout_s * 1000)))
    except Exception:  # noqa: BLE001
      missing = _missing(client, keys)
      raise RuntimeError(
          f"jaxoverlap.initialize (rank {rank} of {num_ranks}): ranks {missing} did not reach "
          f"the start-up step '{what}' within {timeout_s:g} s; each process must call "
          "jaxoverlap.initialize() (a collective). Check that those processes are alive (their "
          "output), or raise init_timeout_s (JAXOVERLAP_INIT_TIMEOUT_S)") from None
  return values


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


def _barrier_or_raise(what: str, rank: int, num_ranks: int, timeout_s: float) -> None:
  """Waits until every rank reaches the start-up step ``what`` (bounded by ``timeout_s``).

  Raises:
    RuntimeError: the barrier failed (some rank did not reach it in time); it
      fails on every rank alike.
  """
  try:
    _client_or_raise().wait_at_barrier(f"jaxoverlap/{_generation}/{what}/done",
                                       int(timeout_s * 1000))
  except Exception as e:  # noqa: BLE001 - jax raises its own error types for a timeout
    raise RuntimeError(
        f"jaxoverlap.initialize (rank {rank} of {num_ranks}): not every process finished the "
        f"start-up step '{what}' within {timeout_s:g} s ({_first_line(e)}); "
        "every process fails at this step alike. Check the other processes' output, or raise "
        "init_timeout_s (JAXOVERLAP_INIT_TIMEOUT_S)") from None


def _exchange(key: str, value: bytes | None, rank: int, timeout_s: float) -> bytes:
  """Rank 0 (value given) publishes ``value`` under ``key``; others read it (bounded).

  Raises:
    RuntimeError: rank 0's value did not arrive within ``timeout_s``
      (``init_timeout_s``); the message names the key and the bound.
  """
  client = _client_or_raise()
  if value is not None:
    client.key_value_set(key, base64.b64encode(value).decode())
    return value
  try:
    return base64.b64decode(client.blocking_key_value_get(key, int(timeout_s * 1000)))
  except Exception:  # noqa: BLE001
    raise RuntimeError(
        f"jaxoverlap.initialize (rank {rank}): rank 0's '{key}' did not arrive within "
        f"{timeout_s:g} s (init_timeout_s, JAXOVERLAP_INIT_TIMEOUT_S); is rank 0 alive and "
        "calling jaxoverlap.initialize()? Its output says why it stopped") from None


def _check_same_on_every_process(settings: dict[str, Any], rank: int, num_ranks: int,
                                 timeout_s: float) -> None:
  """Every process resolved the same ``settings`` (heap sizes, ranks per node, knobs).

  They lay out the symmetric heap and pick the kernels on both ends of a
  transfer: a process with another heap size puts its payloads where a peer
  keeps its accumulator (wrong sums, no error), one with another kernel waits
  for slots its peer never writes. Every process sees every value, so all
  raise alike, before the native start-up.

  Raises:
    RuntimeError: a setting differs; the message names it with each value and its ranks.
    RuntimeError: a process did not arrive within ``timeout_s`` (``_gather``).
  """
  if num_ranks == 1:
    return
  mine = json.dumps(settings, sort_keys=True)
  values = [json.loads(v) for v in _gather("settings", mine, rank, num_ranks, timeout_s)]
  differ = []
  for key in sorted(settings):
    ranks_by_value: dict[str, list[int]] = {}
    for r, theirs in enumerate(values):
      ranks_by_value.setdefault(repr(theirs.get(key)), []).append(r)
    if len(ranks_by_value) > 1:
      differ.append(f"{key}: " + "; ".join(f"{v} on ranks {rs}"
                                           for v, rs in ranks_by_value.items()))
  if differ:
    raise RuntimeError(
        f"jaxoverlap.initialize (rank {rank} of {num_ranks}): the processes resolved different "
        f"settings, which must be equal on every process (the symmetric heap's layout and the "
        f"kernels on both ends of a transfer depend on them): {' | '.join(differ)}. Pass the "
        "same arguments to initialize() and export the same JAXOVERLAP_* variables everywhere "
        "(None: unset)")


def _shared_settings(params: dict[str, Any], ranks_per_node: int) -> dict[str, Any]:
  """The settings ``_check_same_on_every_process`` compares."""
  from jaxoverlap import _settings  # its table of which settings are compared, and how

  # The resolved values, then the variables as set: the measurement knobs that pick the
  # kernel, protocol or grid on both ends of a transfer, and the cost model's overrides,
  # which steer algorithm="auto" (two ranks of a group that chose differently would run
  # different collectives).
  resolved = {"heap_bytes": params["heap_bytes"],
              "overlap_heap_bytes": params["overlap_heap_bytes"],
              "ranks_per_node": ranks_per_node}
  return {**resolved, **{k: os.environ.get(k) or None
                         for k in _settings.names(compared=_settings.VARIABLE)}}


def _ranks_per_node_of_hosts(hosts: list[str], rank: int) -> tuple[int | None, str | None]:
  """The ranks per node the hosts give: ``(per_node, None)``, or ``(None, why not)``.

  Every node must hold as many processes, and the ranks of one node must be
  consecutive (node = rank // ranks_per_node).
  """
  counts = {h: hosts.count(h) for h in hosts}
  if len(set(counts.values())) != 1:
    return None, (f"jaxoverlap.initialize: nodes hold different numbers of processes {counts}; "
                  "set JAXOVERLAP_RANKS_PER_NODE (or ranks_per_node=) if that is intended")
  per_node = counts[hosts[rank]]
  for r, h in enumerate(hosts):
    if hosts[(r // per_node) * per_node] != h:
      return None, (f"jaxoverlap.initialize: process ranks are not grouped by node (hosts by "
                    f"rank: {hosts}); launch ranks node by node (srun's default block "
                    "distribution), or set JAXOVERLAP_RANKS_PER_NODE=1 for ranks placed round "
                    "robin (each GPU its own node: correct, without the intra-node steps); a "
                    "larger value asserts that each block of that many consecutive ranks is one "
                    "node")
  return per_node, None


def _ranks_per_node(rank: int, num_ranks: int, override: int | None,
                    timeout_s: float) -> tuple[int, int | None, list[str]]:
  """The ranks per node of the NVSHMEM runtime, from ``override`` or the hosts.

  Args:
    rank, num_ranks: this process's rank and the number of processes.
    override: ``ranks_per_node`` as the user set it, or None to detect it.
    timeout_s: bound on the wait for the other processes' hosts.

  Returns:
    ``(ranks_per_node, from_hosts, hosts)``: the value in effect, the one the
    hosts give (None where they give none), and every rank's host.

  Raises:
    RuntimeError: no override, and the hosts hold different numbers of
      processes or their ranks are not consecutive; or a host did not arrive.
  """
  host = socket.gethostname()
  hosts = [host] if num_ranks == 1 else _gather("host", host, rank, num_ranks, timeout_s)
  from_hosts, why_not = _ranks_per_node_of_hosts(hosts, rank)
  if override is not None:
    # The user's assertion replaces the check (e.g. srun --distribution=cyclic, uneven
    # nodes, or several hosts of one NVLink domain); initialize() documents what it asserts.
    if override != from_hosts:
      logger.info("jaxoverlap: ranks_per_node=%d as set, not from the hosts (%s); hosts by rank: "
                  "%s", override, from_hosts or "none", hosts)
    return override, from_hosts, hosts
  if from_hosts is None:
    raise RuntimeError(why_not)
  return from_hosts, from_hosts, hosts


def _resolve(heap_bytes, overlap_heap_bytes, timeout_s, ranks_per_node,
             init_timeout_s) -> dict[str, Any]:
  """The parameters of ``initialize``: arguments, else environment, else defaults; checked.

  A value refused names the environment variable it came from, where it did.
  """
  env = os.environ
  passed = {"heap_bytes": heap_bytes, "overlap_heap_bytes": overlap_heap_bytes,
            "timeout_s": timeout_s, "init_timeout_s": init_timeout_s,
            "ranks_per_node": ranks_per_node}
  # "name" in messages, or "name (JAXOVERLAP_NAME)" for a value read from the environment.
  said = {k: k + (f" ({_PARAMETER_ENV[k]})" if v is None and env.get(_PARAMETER_ENV[k]) else "")
          for k, v in passed.items()}
  if heap_bytes is None:
    heap_bytes = (_parse_bytes(env["JAXOVERLAP_HEAP_BYTES"], "JAXOVERLAP_HEAP_BYTES")
                  if env.get("JAXOVERLAP_HEAP_BYTES") else DEFAULT_HEAP_BYTES)
  if overlap_heap_bytes is None:
    overlap_heap_bytes = (_parse_bytes(env["JAXOVERLAP_OVERLAP_HEAP_BYTES"],
                                       "JAXOVERLAP_OVERLAP_HEAP_BYTES")
                          if env.get("JAXOVERLAP_OVERLAP_HEAP_BYTES")
                          else DEFAULT_OVERLAP_HEAP_BYTES)
  if timeout_s is None:
    timeout_s = _parse_seconds(env.get("JAXOVERLAP_TIMEOUT_S"), "JAXOVERLAP_TIMEOUT_S",
                               DEFAULT_TIMEOUT_S)
  if init_timeout_s is None:
    init_timeout_s = _parse_seconds(env.get("JAXOVERLAP_INIT_TIMEOUT_S"),
                                    "JAXOVERLAP_INIT_TIMEOUT_S", DEFAULT_INIT_TIMEOUT_S)
  if ranks_per_node is None and env.get("JAXOVERLAP_RANKS_PER_NODE"):
    text = env["JAXOVERLAP_RANKS_PER_NODE"]
    if not text.strip().isdigit():
      raise ValueError(f"JAXOVERLAP_RANKS_PER_NODE={text!r} is not a positive integer")
    ranks_per_node = int(text)
  sizes = {}
  for name, value in (("heap_bytes", heap_bytes), ("overlap_heap_bytes", overlap_heap_bytes)):
    sizes[name] = _as_int(value)
    if sizes[name] is None or sizes[name] <= 0:
      raise ValueError(f"{said[name]} must be a positive int (bytes), got {value!r}")
    if sizes[name] % HEAP_ALIGNMENT:
      # The fused ops' region starts at heap_bytes: its 64-bit flags and 16-byte vectors need
      # the alignment (ffi/runtime.cu, MakeLayout checks it too).
      raise ValueError(f"{said[name]} must be a multiple of {HEAP_ALIGNMENT} bytes, got {value!r} "
                       f"(e.g. {sizes[name] // HEAP_ALIGNMENT * HEAP_ALIGNMENT + HEAP_ALIGNMENT})")
  heap_bytes, overlap_heap_bytes = sizes["heap_bytes"], sizes["overlap_heap_bytes"]
  for name, value in (("timeout_s", timeout_s), ("init_timeout_s", init_timeout_s)):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
      raise ValueError(f"{said[name]} must be a positive number of seconds, got {value!r}")
    if not math.isfinite(value):  # a wait cannot be unbounded (nan fails the test above)
      raise ValueError(f"{said[name]} must be a finite number of seconds, got {value!r}")
  if not MIN_TIMEOUT_S <= timeout_s <= MAX_TIMEOUT_S:
    # The device waits count nanoseconds in 64 bits; below a millisecond every wait that is not
    # met at its first look would trap the kernel (and lose the GPU context).
    raise ValueError(f"{said['timeout_s']} must be from {MIN_TIMEOUT_S:g} to "
                     f"{MAX_TIMEOUT_S:g} seconds, got {timeout_s!r}")
  if init_timeout_s > MAX_TIMEOUT_S:  # the host's waits: past threading's limit they overflow
    raise ValueError(f"{said['init_timeout_s']} must be at most {MAX_TIMEOUT_S:g} seconds, got "
                     f"{init_timeout_s!r}")
  if ranks_per_node is not None:
    rpn = _as_int(ranks_per_node)
    if rpn is None or rpn < 1:
      raise ValueError(f"{said['ranks_per_node']} must be a positive int, got "
                       f"{ranks_per_node!r}")
    ranks_per_node = rpn
  cap = env.get("JAXOVERLAP_GEMM_ALIGNMENT_CAP")
  if cap is not None and not _valid_alignment_cap(cap):
    raise ValueError(f"JAXOVERLAP_GEMM_ALIGNMENT_CAP={cap!r}: expected a power of two "
                     "from 1 to 256 (bytes)")
  for name, (valid, expected) in _INTEGER_KNOBS.items():
    text = (env.get(name) or "").strip()
    if text and not (text.isdigit() and valid(int(text))):
      # ffi/ reads these once, at the first kernel, and could only say so on stderr.
      raise ValueError(f"{name}={env[name]!r}: expected {expected} (a measurement knob, "
                       "docs/design.md 'Settings for testing the kernels'); unset it for the "
                       "default")
  if env.get("JAXOVERLAP_TEST_LL_STALE") == "1":
    # The stale cells carry flags 0 (even slots) and 1 (odd): the flags of the calls just after
    # the 32-bit wrap. A count that reaches such a call before both period-end calls have
    # re-stamped the cells (starting at 2**32 - 2, 2**32 - 1 or 0 modulo 2**32, or unset: 0)
    # takes them as its data and returns NaN with no error.
    start = env.get("JAXOVERLAP_TEST_PAIR_EPOCH", "").strip()
    if not start.isdigit() or int(start) % 2**32 in (0, 2**32 - 2, 2**32 - 1):
      raise ValueError(
          "JAXOVERLAP_TEST_LL_STALE=1 needs JAXOVERLAP_TEST_PAIR_EPOCH, a count from which both "
          "period-end calls come before the wrap (e.g. 2**32 - 3, as "
          f"tests/gpu/test_gpu_flag_wrap.py sets), got {start or None!r}: otherwise the first "
          "calls read the stale cells as data")
  return {"heap_bytes": heap_bytes, "overlap_heap_bytes": overlap_heap_bytes,
          "timeout_s": float(timeout_s), "ranks_per_node": ranks_per_node,
          "init_timeout_s": float(init_timeout_s)}


def _parse_seconds(text: str | None, what: str, default: float) -> float:
  if not text:
    return default
  try:
    return float(text)
  except ValueError:
    raise ValueError(f"{what}={text!r} is not a number of seconds") from None


# The environment variable behind each parameter of initialize().
_PARAMETER_ENV = {"heap_bytes": "JAXOVERLAP_HEAP_BYTES",
                  "overlap_heap_bytes": "JAXOVERLAP_OVERLAP_HEAP_BYTES",
                  "timeout_s": "JAXOVERLAP_TIMEOUT_S",
                  "ranks_per_node": "JAXOVERLAP_RANKS_PER_NODE",
                  "init_timeout_s": "JAXOVERLAP_INIT_TIMEOUT_S"}


def _source(key: str, passed: Mapping[str, Any]) -> str:
  """Where a parameter of this call came from: "" (the argument), its variable, or a default."""
  if passed.get(key) is not None:
    return ""
  var = _PARAMETER_ENV[key]
  if os.environ.get(var):
    return f" (from {var}={os.environ[var]!r})"
  return " (from the hosts)" if key == "ranks_per_node" else " (the default)"


def _check_same_parameters(params: dict[str, Any], passed: Mapping[str, Any]) -> None:
  """A second ``initialize()`` must resolve to the parameters of the first.

  Both calls' parameters are compared as resolved (the argument, else the
  ``JAXOVERLAP_*`` variable, else the default), so a changed variable counts
  like a changed argument. ``ranks_per_node`` is compared as it takes effect:
  an unset one is the value the hosts gave at the first call. ``init_timeout_s``
  bounds the waits of one call and is not compared.

  Args:
    params: this call's parameters (``_resolve``).
    passed: this call's arguments (None where not passed), to name the source.

  Raises:
    RuntimeError: a parameter differs; the message names each with both values.
  """
  first = _info["parameters"]
  differ = [f"{k}={params[k]!r}{_source(k, passed)} (active: {first[k]!r})"
            for k in ("heap_bytes", "overlap_heap_bytes", "timeout_s") if params[k] != first[k]]
  active_rpn = _info["ranks_per_node"]
  rpn = params["ranks_per_node"]
  if rpn is None:  # unset: what the hosts give (None: nothing), as the first call saw them
    rpn = active_rpn if first["ranks_per_node"] is None else _ranks_per_node_from_hosts
  if rpn != active_rpn:
    differ.append(f"ranks_per_node={rpn!r}{_source('ranks_per_node', passed)} "
                  f"(active: {active_rpn!r})")
  if differ:
    raise RuntimeError(
        f"jaxoverlap.initialize: already initialised with other parameters: "
        f"{', '.join(differ)}. Call jaxoverlap.finalize() first (on every process) to start "
        "again with these")


def _run_bounded(fn, timeout_s: float, what: str, stage) -> None:
  """Runs ``fn`` in a thread and waits at most ``timeout_s``; re-raises its error.

  A call that does not return in time (NVSHMEM's start-up cannot be
  cancelled) leaves its thread behind and raises a RuntimeError that names
  the step ``stage()`` reports; the process should then exit.
  """
  box: dict[str, BaseException] = {}

  def target():
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      box["error"] = e

  thread = threading.Thread(target=target, name="jaxoverlap-init", daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise RuntimeError(
        f"{what} did not finish within {timeout_s:g} s (stuck at: {stage()}). Likely causes: "
        "a process that never reached jaxoverlap.initialize(), several processes placed "
        "unevenly on the GPUs, or a bootstrap network NVSHMEM cannot use "
        "(NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME). JAXOVERLAP_DEBUG=1 prints each step; "
        "NVSHMEM_DEBUG=INFO shows NVSHMEM's own; JAXOVERLAP_INIT_TIMEOUT_S sets the bound. "
        "Exit this process: NVSHMEM cannot be restarted in it")
  if "error" in box:
    raise box["error"]


def _start_up(fn, wait_s: float, who: str, step: str, stage) -> None:
  """Runs the extension's start-up ``fn`` bounded by ``wait_s``; every error names ``who``."""
  try:
    _run_bounded(fn, wait_s, f"jaxoverlap.initialize ({who}): {step}", stage)
  except RuntimeError as e:
    msg = str(e)
    if not msg.startswith("jaxoverlap.initialize"):
      msg = f"jaxoverlap.initialize ({who}): {msg}"
    raise RuntimeError(msg) from None


def initialize(
    heap_bytes: int | None = None,
    *,
    overlap_heap_bytes: int | None = None,
    timeout_s: float | None = None,
    ranks_per_node: int | None = None,
    init_timeout_s: float | None = None,
) -> dict[str, Any]:
  """Brings up the CUDA kernels' runtime in this process and allocates the heaps.

  A process that drives one GPU joins an NVSHMEM job (one PE per process); a
  process that drives several GPUs (JAX's default on one host) brings up the
  in-process runtime on them ("peer" transport; no NVSHMEM, and no
  jax.distributed for a single process). Call once per process, after
  ``jax.distributed.initialize`` when there are several processes, and before
  the first op with ``backend="cuda"``. Every process must call it: it is a
  collective. Rank 0's all-reduce tuning table is read and checked, and
  shared, before NVSHMEM or the heaps start, so a bad table leaves nothing
  started. A second call returns ``runtime_info()`` when its parameters,
  resolved as the first call's were (the argument, else the environment
  variable, else the default), equal the first call's; otherwise it raises,
  naming each parameter that differs with both values. ``init_timeout_s`` is
  not compared: it bounds the waits of one call.

  Args:
    heap_bytes: size of the symmetric heap of each GPU in bytes, a multiple of
      256 (default: environment variable ``JAXOVERLAP_HEAP_BYTES``, e.g.
      ``512M``, else 1 GiB). It must fit beside XLA's preallocation
      (``XLA_PYTHON_CLIENT_MEM_FRACTION``), and be the same on every process.
    overlap_heap_bytes: symmetric memory for the fused ops, bytes, a multiple of
      256 and the same on every process (default:
      ``JAXOVERLAP_OVERLAP_HEAP_BYTES``, else 2 GiB), allocated with the heap.
      It holds ranks_per_node + 1 equal slots; one slot must hold the largest
      shard of x (all_gather_matmul), partial output block
      (matmul_reduce_scatter) or twice the reduced block (matmul_all_reduce);
      ``runtime_info()["overlap_slot_bytes"]`` gives its size.
    timeout_s: bound on every device wait, in seconds, from 0.001 to 1e9
      (default ``JAXOVERLAP_TIMEOUT_S`` or 100 s). A wait that times out records the
      op, rank, peer and step, prints them to stderr and traps the kernel, which
      loses the GPU context: keep it above the skew between processes (a rank
      that arrives later than this ends the job, where NCCL would wait).
    ranks_per_node: GPUs per node (default ``JAXOVERLAP_RANKS_PER_NODE``, else
      detected from the hosts of the processes, which must then hold as many
      processes each, with consecutive ranks). The kernels take node = rank //
      ranks_per_node, so setting it asserts that the ranks k * ranks_per_node
      to (k + 1) * ranks_per_node - 1 form one node for every k: GPUs that
      reach each other by load/store (NVLink or PCIe peer access). It must
      divide the number of processes; the hosts are not checked then (ranks
      placed round-robin, nodes of different sizes, hosts of one NVLink
      domain), and where two GPUs of one such node cannot reach each other,
      the calls whose groups hold the pair run on XLA under backend="auto"
      and raise under "cuda", naming it (``runtime_info()["unreachable_pairs"]``). Setting 1 makes
      each GPU its own "node" (on one host: the inter-node path; ranks placed
      round-robin across hosts: correct, without the intra-node steps). With
      the in-process runtime a process is a node of its GPUs, and only that
      value is accepted.
    init_timeout_s: bound on every wait of this call, in seconds (default
      ``JAXOVERLAP_INIT_TIMEOUT_S`` or 120 s): for the other processes, for
      rank 0's tuning table and NVSHMEM id, and for NVSHMEM's own start-up.

  Returns:
    ``runtime_info()``.

  Raises:
    RuntimeError: the process sees no GPU (said before anything about the
      extension), the CUDA extension is missing, XLA's own NVSHMEM is switched
      on, two of its GPUs cannot reach each other (in-process runtime: the
      pair is named), the hosts give no ranks per node and none is set, a
      process did not arrive within ``init_timeout_s`` (the message names the
      ranks or the step), the processes resolved different heap sizes, ranks
      per node or measurement knobs (``JAXOVERLAP_HIERARCHICAL_LL``,
      ``JAXOVERLAP_EPOCH_AT_START``, ``JAXOVERLAP_NORM_CLUSTER``,
      ``JAXOVERLAP_TEST_PAIR_EPOCH``; the message names each with its ranks),
      NVSHMEM fails to start or the heap does not fit, or
      the runtime is already up with other parameters. Messages say which.
    ValueError: a size or timeout is not positive, a heap size not a multiple
      of 256, a timeout not finite, ``timeout_s`` outside 0.001-1e9 s, a
      value malformed, JAXOVERLAP_GEMM_ALIGNMENT_CAP is not a power of two
      from 1 to 256, ranks_per_node does not divide the processes, or rank 0's
      tuning table is not valid JSON or not a usable all-reduce table
      (``tuning.validate_tuning_table``; every process raises it).
  """
  global _generation
  with _lock:
    params = _resolve(heap_bytes, overlap_heap_bytes, timeout_s, ranks_per_node, init_timeout_s)
    if _initialized:
      _check_same_parameters(params, {"heap_bytes": heap_bytes,
                                      "overlap_heap_bytes": overlap_heap_bytes,
                                      "timeout_s": timeout_s, "ranks_per_node": ranks_per_node})
      return runtime_info()
    try:
      _start(params)
    except BaseException:
      # The key-value store keeps this attempt's keys and refuses to set one again: a retry
      # (after every process failed alike, e.g. on a bad tuning table) takes new ones.
      _generation += 1
      raise
  return runtime_info()


def _start(params: dict[str, Any]) -> None:
  """``initialize``'s start-up, under the lock: checks, the table, then the native runtime.

  Everything that can fail for a reason of this package (platform, hosts,
  ranks per node, tuning table) is checked before the native start-up; once
  that returns, ``_commit`` marks the runtime up at once, so ``finalize()``
  frees what was started.
  """
  import jax

  from jaxoverlap import _ffi

  if re.search(r"xla_gpu_experimental_enable_nvshmem(=true|=1)?(\s|$)",
               os.environ.get("XLA_FLAGS", "")):
    raise RuntimeError(
        "jaxoverlap.initialize: XLA's own NVSHMEM is switched on "
        "(--xla_gpu_experimental_enable_nvshmem in XLA_FLAGS); two NVSHMEM runtimes cannot "
        "share a process. Remove the flag.")
  # XLA's GPU client must exist before the extension (and NVSHMEM's host
  # library) is loaded: loaded the other way round, NVSHMEM's start-up
  # crashed (seen on 2x H200, jax 0.11.2, NVSHMEM 3.4.5).
  devices = jax.local_devices()
  if not devices or any(d.platform != "gpu" for d in devices):
    # Before the extension: without a GPU, rebuilding it would not help.
    raise RuntimeError(
        "jaxoverlap.initialize: the CUDA backend needs NVIDIA GPUs; this process sees "
        f"{[str(d) for d in devices]}")
  ext = _ffi.load()
  if len(devices) > 1:
    _initialize_peer(ext, devices, params)
    return
  device = devices[0]
  ordinal = int(getattr(device, "local_hardware_id", None) or 0)
  rank, num_ranks = jax.process_index(), jax.process_count()
  wait_s = params["init_timeout_s"]

  rpn, from_hosts, hosts = _ranks_per_node(rank, num_ranks, params["ranks_per_node"], wait_s)
  if num_ranks % rpn:
    raise ValueError(
        f"ranks_per_node={rpn} must divide the number of processes {num_ranks}")
  _check_same_on_every_process(_shared_settings(params, rpn), rank, num_ranks, wait_s)
  tuning = _shared_tuning_table(rank, num_ranks, wait_s)

  # NVLink multicast stays off (it can take a host's GPUs down; our kernels
  # do not use it), and NVSHMEM's heap must hold ours.
  os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
  os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE",
                        str(params["heap_bytes"] + params["overlap_heap_bytes"]
                            + _NVSHMEM_HEAP_SLACK_BYTES))
  if len(set(hosts)) == 1:
    # One host: NVSHMEM's unique-id bootstrap talks over loopback.
    os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")

  key = f"jaxoverlap/{_generation}/nvshmem_uid"
  uid = ext.get_unique_id() if rank == 0 else None
  if num_ranks > 1:
    uid = _exchange(key, uid, rank, timeout_s=wait_s)
  info = {
      "transport": names.NVSHMEM,
      "pe": rank,
      "num_pes": num_ranks,
      "device": str(device),
      "cuda_ordinal": ordinal,
      "ranks_per_node": rpn,
      "num_nodes": num_ranks // rpn,
      "hosts": hosts,
      "emulated_nodes": nodes_are_emulated(hosts, num_ranks // rpn),
      "heap_bytes": params["heap_bytes"],
      "overlap_heap_bytes": params["overlap_heap_bytes"],
      "timeout_s": params["timeout_s"],
      "parameters": params,
  }
  logger.info("jaxoverlap: NVSHMEM PE %d of %d on GPU %d, heap %d bytes", rank, num_ranks,
              ordinal, params["heap_bytes"])
  _start_up(lambda: ext.initialize(uid, rank, num_ranks, ordinal, params["heap_bytes"],
                                   params["overlap_heap_bytes"],
                                   int(params["timeout_s"] * 1e9), rpn),
            wait_s, f"PE {rank} of {num_ranks}", "NVSHMEM's start-up", ext.init_stage)
  info["unreachable_pairs"] = _unreachable_pairs(ext, rank, num_ranks, wait_s)
  _commit(info, tuning, {}, from_hosts)


def _unreachable_pairs(ext, rank: int, num_ranks: int,
                       wait_s: float) -> tuple[tuple[int, int], ...]:
  """Every ``(pe, peer)`` of one node where ``pe`` cannot load/store ``peer``'s heap.

  Each process knows only its own pairs (the extension asks NVSHMEM for each
  peer's address once the heap is up); every process gets them all, so that
  every rank of a group plans alike (``dispatch``: such groups run on XLA).

  A barrier ends the step, so the processes come up together or fail together
  (without it, a rank whose gather timed out as the last value arrived would
  fail while the others came up).

  Raises:
    RuntimeError: a process did not arrive within ``wait_s`` (at the gather or
      at the barrier after it). NVSHMEM, up on this process, is then left to
      its exit, as ``finalize()`` leaves it when a peer is gone: its shutdown
      is a barrier the missing ranks would never join.
  """
  try:
    mine = [int(pe) for pe in ext.info().get("unreachable_local_pes", ())]
    if num_ranks == 1:
      return tuple((0, peer) for peer in mine)
    every = [json.loads(v) for v in _gather("unreachable", json.dumps(mine), rank, num_ranks,
                                            wait_s)]
    # The coordination service's barrier passes or fails for every rank alike.
    _barrier_or_raise("unreachable", rank, num_ranks, wait_s)
  except Exception as e:  # noqa: BLE001  # said, with what it leaves behind
    raise RuntimeError(f"{e}. NVSHMEM started on this process and is left to its exit (its "
                       "shutdown is a barrier that the missing ranks would never join)") from None
  return tuple(sorted((pe, int(peer)) for pe, peers in enumerate(every) for peer in peers))


def _commit(info: dict[str, Any], tuning: tuple[str, dict | None], pes: dict[int, int],
            from_hosts: int | None) -> None:
  """Marks the runtime up, right after the native start-up returned: nothing here can fail.

  From here ``is_initialized()`` is True and ``finalize()`` (also at exit)
  shuts the native runtime down.
  """
  global _initialized, _generation, _info, _pe_by_device_id, _tuning, _ranks_per_node_from_hosts
  _generation += 1
  _initialized = True
  _info = info
  _tuning = tuning
  _pe_by_device_id = pes
  _ranks_per_node_from_hosts = from_hosts
  atexit.register(_finalize_at_exit)


def _initialize_peer(ext, devices, params: dict[str, Any]) -> None:
  """The in-process runtime on this process's GPUs (``initialize`` holds the lock)."""
  import jax

  local = sorted(devices, key=lambda d: d.id)
  num_local = len(local)
  rank, num_processes = jax.process_index(), jax.process_count()
  wait_s = params["init_timeout_s"]
  if num_processes > 1:
    counts = _gather("local_devices", str(num_local), rank, num_processes, wait_s)
    if len(set(counts)) != 1:
      raise RuntimeError(
          "jaxoverlap.initialize: the processes drive different numbers of GPUs "
          f"{[int(c) for c in counts]}; the in-process runtime needs the same number on each")
  if params["ranks_per_node"] not in (None, num_local):
    raise ValueError(
        f"ranks_per_node={params['ranks_per_node']}: one process driving {num_local} GPUs is one "
        f"node of {num_local} ranks for the in-process runtime")
  pes = {}
  for process in range(num_processes):
    ids = sorted(d.id for d in jax.devices() if d.process_index == process)
    pes.update({i: process * num_local + k for k, i in enumerate(ids)})
  ordinals = [int(getattr(d, "local_hardware_id", i)) for i, d in enumerate(local)]
  first_pe = rank * num_local
  hosts = ([socket.gethostname()] if num_processes == 1 else
           _gather("host", socket.gethostname(), rank, num_processes, wait_s))
  _check_same_on_every_process(_shared_settings(params, num_local), rank, num_processes, wait_s)
  tuning = _shared_tuning_table(rank, num_processes, wait_s)
  info = {
      "transport": names.PEER,
      "pe": first_pe,
      "pes": [pes[d.id] for d in local],
      "num_pes": num_local * num_processes,
      "device": [str(d) for d in local],
      "cuda_ordinal": ordinals,
      "ranks_per_node": num_local,
      "num_nodes": num_processes,
      "hosts": hosts,
      "emulated_nodes": nodes_are_emulated(hosts, num_processes),
      "unreachable_pairs": (),  # initialize_peer requires peer access between every pair
      "heap_bytes": params["heap_bytes"],
      "overlap_heap_bytes": params["overlap_heap_bytes"],
      "timeout_s": params["timeout_s"],
      "parameters": params,
  }
  logger.info("jaxoverlap: in-process runtime on GPUs %s (PEs %d..%d of %d), heap %d bytes each",
              ordinals, first_pe, first_pe + num_local - 1, num_local * num_processes,
              params["heap_bytes"])
  _start_up(lambda: ext.initialize_peer(ordinals, first_pe, num_local * num_processes,
                                       params["heap_bytes"], params["overlap_heap_bytes"],
                                       int(params["timeout_s"] * 1e9)),
            wait_s, f"process {rank}, GPUs {ordinals}", "the in-process runtime's start-up",
            ext.init_stage)
  _commit(info, tuning, pes, num_local)


def _rank_0_table() -> tuple[str, bytes]:
  """Rank 0's tuning table file, unparsed: ``(path, its bytes)``, b"" where there is none.

  Raises:
    OSError: the file exists but cannot be read.
  """
  from jaxoverlap.tuning import results

  path = results.default_tuning_path()
  if not os.path.exists(path):
    # No table of the user's own: the one measured on this GPU model, if
    # the package ships one (python -m jaxoverlap.tune makes one's own).
    import jax

    kind = jax.local_devices()[0].device_kind.replace(" ", "_")
    path = os.path.join(os.path.dirname(__file__), "tuning_tables", f"all_reduce-{kind}.json")
  if not os.path.exists(path):
    return path, b""
  with open(path, "rb") as f:
    return path, f.read()


def _parse_tuning_table(path: str, data: bytes) -> dict | None:
  """The table in ``data`` (None when empty), checked as the policy needs it.

  Raises:
    ValueError: not JSON, or not a usable all-reduce table
      (``tuning.validate_tuning_table``); the message names ``path``.
  """
  from jaxoverlap.tuning import results

  if not data:
    return None
  try:
    table = json.loads(data)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"tuning table {path} is not valid JSON: {e}") from None
  results.validate_tuning_table(table, f"tuning table {path}")
  return table


def _shared_tuning_table(rank: int, num_ranks: int, wait_s: float) -> tuple[str, dict | None]:
  """Rank 0's all-reduce tuning table on every process, checked before the native start-up.

  Rank 0 reads and checks its table first, then shares it (path and bytes)
  under a ``jaxoverlap/`` key of the key-value store, a bad one too, so that
  every process checks the same bytes and raises the same error instead of
  waiting for rank 0.

  Returns:
    ``(path, table)``: the file rank 0 read (or would have read), and the
    table, or None when there is none (the cost model decides).

  Raises:
    ValueError: rank 0's table is not valid JSON or not a usable all-reduce
      table.
    OSError: (rank 0) the file cannot be read.
    RuntimeError: (other ranks) rank 0's table did not arrive within
      ``wait_s`` (``init_timeout_s``).
  """
  path, data, error = "", b"", None
  if rank == 0:
    path, data = _rank_0_table()
    try:
      table = _parse_tuning_table(path, data)
    except ValueError as e:
      error = e
  if num_ranks > 1:
    got = _exchange(f"jaxoverlap/{_generation}/tuning",
                    path.encode() + b"\n" + data if rank == 0 else None, rank, timeout_s=wait_s)
    if rank != 0:
      raw_path, _, data = got.partition(b"\n")
      path = raw_path.decode()
      table = _parse_tuning_table(path, data)
  if error is not None:
    raise error
  return path, table


def tuning_table() -> tuple[str, dict | None]:
  """Rank 0's all-reduce tuning table as shared at ``initialize()``.

  Returns:
    ``(path, table)``: the file rank 0 read (or would have read), and the
    validated table, or None when there is none (the cost model decides).
  """
  from jaxoverlap.tuning import results

  path, table = _tuning
  return path or results.default_tuning_path(), table


# The longest finalize() waits for the other processes before NVSHMEM's own barrier.
FINALIZE_WAIT_S = 30.0


def _synchronize(ext) -> str | None:
  """Waits for every GPU this process drives; why one failed (a lost context), or None."""
  try:
    ext.synchronize()
  except RuntimeError as e:
    return _first_line(e)
  return None


def _peers_gone_at_finalize() -> str | None:
  """Why NVSHMEM's finalising barrier would not return, or None when every process is there.

  With NVSHMEM across processes, the processes first meet at a barrier of
  jax.distributed's coordination service, bounded by ``FINALIZE_WAIT_S``. That
  barrier's outcome is the same for every process: if one process does not
  arrive in time (it died, was killed, or is still busy), the barrier fails for
  all of them, late arrivals included, so every process skips NVSHMEM's own
  barrier alike and none is left waiting in it. Without jax.distributed (shut
  down already) nothing can be checked: None.
  """
  if _info.get("transport") != names.NVSHMEM or _info.get("num_pes", 1) < 2:
    return None
  client = _kv_client()
  if client is None:
    return None
  wait_s = FINALIZE_WAIT_S
  try:
    client.wait_at_barrier(f"jaxoverlap/{_generation}/finalize", int(wait_s * 1000))
  except Exception as e:  # noqa: BLE001 - jax raises its own error types for a failed barrier
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"not every process reached it within {wait_s:g} s (one died, was killed, or is "
            f"still busy): {first[:300]}")
  return None


def finalize() -> None:
  """Frees the heaps and shuts the CUDA kernels' runtime down (a collective; runs at exit).

  The runtime is NVSHMEM, or CUDA peer access in one process, whichever
  ``initialize()`` brought up. Every GPU the process drives finishes its work
  before anything is freed. NVSHMEM's shutdown is a barrier of all
  processes: first they meet at a barrier of jax.distributed, at most
  ``FINALIZE_WAIT_S`` seconds, whose outcome every process sees alike; where
  not every process arrived (one died, was killed, or is still busy), or a
  device wait failed, NVSHMEM is left to the processes' exit, with a warning,
  instead of a barrier that would never return. A process whose GPU cannot
  finish its work (its context lost, say by a fault in another kernel) stays
  away from that barrier, so the others skip NVSHMEM's shutdown too.

  XLA records the ops' kernels into CUDA graphs with the runtime's device
  addresses, and replays a graph without asking the op again. So
  ``finalize()`` also clears JAX's compilation caches (``jax.clear_caches()``):
  a jitted function compiles anew on its next call, and after a new
  ``initialize()`` runs with the new runtime (before one, it raises that the
  runtime is not up). An executable the caller keeps
  (``jax.jit(f).lower(...).compile()``) is not recompiled: do not call one
  compiled before ``finalize()`` after it.

  Raises:
    RuntimeError: the native shutdown failed, or a GPU of this process could
      not finish its work (the message names the GPU and the CUDA call); the
      runtime is marked down all the same.
  """
  _finalize(clear_caches=True)


def _finalize_at_exit() -> None:
  """``finalize()`` at the interpreter's exit: nothing will run again, the caches stay."""
  _finalize(clear_caches=False)


def _finalize(clear_caches: bool) -> None:
  with _lock:
    if not _initialized:
      return
    from jaxoverlap import _ffi

    ext = _ffi.load()
    if ext.device_error() is not None:
      # A peer may be gone; the finalising barrier would never return.
      logger.warning("jaxoverlap: skipping the runtime's finalize after a device error")
    elif (failed := _synchronize(ext)) is not None:
      # This process stays away from the barrier below, so every other
      # process skips NVSHMEM's collective shutdown too; the native finalize
      # then frees what is this process's alone and raises the failure.
      logger.warning("jaxoverlap: a GPU of this process did not finish its work, so no "
                     "process runs NVSHMEM's collective shutdown: %s", failed)
      try:
        ext.finalize()
      finally:
        _mark_down(clear_caches)
      return
    elif (gone := _peers_gone_at_finalize()) is not None:
      logger.warning("jaxoverlap: skipping the runtime's finalize, whose barrier would never "
                     "return: %s", gone)
    else:
      try:
        ext.finalize()
      finally:
        _mark_down(clear_caches)
      return
    _mark_down(clear_caches)


def _mark_down(clear_caches: bool) -> None:
  """After the native shutdown (or its skipping): the runtime is down, no executable kept."""
  global _initialized, _facts
  _initialized = False
  _facts = None
  _pe_by_device_id.clear()
  if clear_caches:
    import jax

    jax.clear_caches()


def _platform() -> str:
  import jax

  try:
    return jax.default_backend()
  except RuntimeError as e:  # no backend could be initialised
    return f"no platform ({e})"


def unavailable_reason() -> str | None:
  """Why the CUDA kernels cannot run in this process, or None when they can.

  Returns:
    A sentence naming the missing piece (no GPU, the extension not built or
    not loadable, ``initialize()`` not called), or None.
  """
  platform = _platform()
  if platform != "gpu":
    return (f"JAX runs on {platform!r} here, with no GPU: the CUDA backend needs NVIDIA GPUs "
            "(backend 'xla' runs everywhere)")
  from jaxoverlap import _ffi  # local import: importing jaxoverlap never loads the extension

  reason = _ffi.unavailable_reason()
  if reason is not None:
    return reason
  if not _initialized:
    return ("jaxoverlap.initialize() has not been called in this process (the CUDA kernels' "
            "runtime, NVSHMEM or CUDA peer access in one process, is not up)")
  return None


def facts() -> Facts:
  """The runtime as the dispatcher sees it (cheap: a snapshot made once per start-up).

  ``fused_command_buffer`` is read from the environment at every call, so it
  applies to the ops lowered after it is set.
  """
  global _facts
  cmd_buffer = os.environ.get("JAXOVERLAP_FUSED_CMD_BUFFER") == "1"
  base = _facts
  if base is None:
    reason = unavailable_reason()
    if reason is not None:
      return Facts(unavailable=reason, fused_command_buffer=cmd_buffer)
    from jaxoverlap import _ffi

    ext = _ffi.load()
    native = ext.info()
    base = Facts(
        unavailable=None, transport=_info["transport"], pe=_info["pe"], num_pes=_info["num_pes"],
        ranks_per_node=_info["ranks_per_node"], slot_bytes=native["slot_bytes"],
        ll_slot_bytes=native["ll_slot_bytes"], lamport_slot_bytes=native["lamport_slot_bytes"],
        overlap_slot_bytes=native["overlap_slot_bytes"],
        limits=dict(ext.limits()), emulated_nodes=_info["emulated_nodes"],
        unreachable_pairs=tuple(_info.get("unreachable_pairs", ())))
    with _lock:
      if _initialized:
        _facts = base
  return dataclasses.replace(base, fused_command_buffer=cmd_buffer)


def runtime_info() -> dict[str, Any]:
  """What the CUDA backend uses in this process, so that no fallback is silent.

  Returns:
    A dict with ``initialized``, ``extension`` ("loaded" or why not), and once
    initialised: ``transport``, ``pe``, ``num_pes``, ``ranks_per_node``,
    ``num_nodes``, ``hosts``, ``emulated_nodes`` (True when nodes share a
    host: ``nodes_are_emulated``), ``unreachable_pairs`` (one process per
    GPU: the ``(pe, peer)`` pairs of one node without load/store access, whose
    groups run on XLA under ``backend="auto"``), ``heap_bytes``, ``slot_bytes`` (simple-protocol
    capacity per sender, bytes), ``overlap_slot_bytes`` (the fused ops'
    capacity per sender, bytes), ``ll_slot_bytes`` (LL8 cells per sender,
    bytes), ``lamport_slot_bytes`` (Lamport payload per sender, bytes; 0
    when the heap leaves no room for it), ``lamport_blocks_per_sm`` (blocks
    of the Lamport kernels an SM holds at once: their grid is at most that
    many per SM, one wave), ``max_group_size``,
    ``inter_node_transport``, and the measurement knobs in effect
    (docs/design.md): ``hierarchical_ll_kernel`` ("v4", or "v3" under
    ``JAXOVERLAP_HIERARCHICAL_LL=v3``), ``epochs_at_start`` (True under
    ``JAXOVERLAP_EPOCH_AT_START=1``), ``norm_blocks_per_row``
    (``JAXOVERLAP_NORM_CLUSTER``, 0 when unset); ``timeout_s``,
    ``device_error`` (None, or what a timed-out wait recorded, or a call
    that failed on the host half-way: either refuses every later call); always
    ``backends``: for each op, ``"cuda"`` or the reason it runs on ``"xla"``.
    What each lowered call chose is in ``jaxoverlap.decisions()``.
  """
  from jaxoverlap import _ffi

  info: dict[str, Any] = {"initialized": _initialized}
  reason = _ffi.unavailable_reason()
  info["extension"] = "loaded" if reason is None else reason
  if _initialized:
    info.update(_info)
    ext = _ffi.load()
    native = ext.info()
    info["slot_bytes"] = native["slot_bytes"]
    info["max_group_size"] = ext.limits()["max_group_size"]
    info["ll_slot_bytes"] = native["ll_slot_bytes"]
    info["lamport_slot_bytes"] = native["lamport_slot_bytes"]
    info["lamport_blocks_per_sm"] = native["lamport_blocks_per_sm"]
    info["overlap_slot_bytes"] = native["overlap_slot_bytes"]
    # Across nodes: direct NVLink stores where a peer is load/store-reachable,
    # NVSHMEM puts otherwise (always, with JAXOVERLAP_FORCE_NVSHMEM_PUT=1).
    info["inter_node_transport"] = ("nvshmem put" if native["force_nvshmem_put"]
                                    else "direct store if reachable, else nvshmem put")
    info["hierarchical_ll_kernel"] = native["hierarchical_ll_kernel"]
    info["epochs_at_start"] = native["epochs_at_start"]
    info["norm_blocks_per_row"] = native["norm_blocks_per_row"]
    info["device_error"] = ext.device_error()
  unavailable = unavailable_reason()
  info["backends"] = {op: unavailable or names.CUDA for op in names.OPS}
  return info


def pe_of_device(device) -> int:
  """The PE of a JAX device.

  NVSHMEM runtime (one GPU per process): the device's process index. The
  in-process runtime: process index x GPUs per process + the device's position
  among its process's devices (by id). Before ``initialize()``, the process
  index.
  """
  if _pe_by_device_id:
    return _pe_by_device_id[device.id]
  return int(device.process_index)


def _rows_along_axis(mesh, axis_name):
  """The mesh's devices and their flat positions, one row per group along ``axis_name``.

  Rows are ordered by position along the axes (the last axis fastest, as
  ``lax.axis_index``); positions index ``mesh.devices`` flattened.

  Raises:
    ValueError: an axis is not in the mesh.
  """
  import numpy as np

  mesh_axes = list(mesh.axis_names)
  axes = names.axis_names(axis_name)
  for a in axes:
    if a not in mesh_axes:
      raise ValueError(f"axis {a!r} is not in the mesh axes {tuple(mesh_axes)}")
  src, dst = [mesh_axes.index(a) for a in axes], list(range(-len(axes), 0))
  size = int(np.prod([mesh.shape[a] for a in axes]))
  devices = np.asarray(mesh.devices)
  positions = np.arange(devices.size).reshape(devices.shape)
  return (np.moveaxis(devices, src, dst).reshape(-1, size),
          np.moveaxis(positions, src, dst).reshape(-1, size))


def groups_along_axis(mesh, axis_name) -> list[list[int]]:
  """PE groups of a collective over ``axis_name`` of ``mesh``, each in rank order.

  Args:
    mesh: a concrete ``jax.sharding.Mesh``.
    axis_name: one of ``mesh.axis_names``, or a tuple of them (ranks ordered
      with the last axis fastest, as ``lax.axis_index`` does).

  Returns:
    One list per group, each as long as the product of the axes' sizes,
    ordered by position along the axes.

  Raises:
    ValueError: an axis is not in the mesh, or two devices of one group have
      the same PE (two devices of one process under the NVSHMEM runtime,
      which takes one GPU per process).
  """
  devices, _ = _rows_along_axis(mesh, axis_name)
  groups = []
  for row in devices:
    pes = [pe_of_device(d) for d in row]
    if len(set(pes)) != len(pes):
      raise ValueError(
          f"the NVSHMEM runtime takes one GPU per process, but devices "
          f"{[str(d) for d in row]} along axis {axis_name!r} share processes {pes}; "
          "jaxoverlap.initialize() in a process that drives several GPUs brings up the "
          "in-process runtime instead")
    groups.append(pes)
  return groups


def node_groups_along_axis(mesh, axis_name, ranks_per_node: int) -> list[list[int]]:
  """Groups of the inter-node step of a hierarchical all-reduce over ``axis_name``.

  Each group of ``groups_along_axis`` is split by node (node = PE //
  ranks_per_node, a process of the in-process runtime); the GPUs with the
  same local rank on each node form one inter-node group. Groups are given as
  positions in ``mesh.devices`` (flattened), the logical device ids of XLA's
  collectives in a ``shard_map``.

  Args:
    mesh: a concrete ``jax.sharding.Mesh``.
    axis_name: one of ``mesh.axis_names``, or a tuple of them.
    ranks_per_node: PEs per node (GPUs per process of the in-process runtime).

  Returns:
    For every group and local rank, the mesh positions of that local rank's
    GPU on each node of the group, nodes in ascending order.

  Raises:
    ValueError: an axis is not in the mesh, or a group holds different numbers
      of GPUs on different nodes.
  """
  devices, positions = _rows_along_axis(mesh, axis_name)
  rpn = int(ranks_per_node)
  out = []
  for row, pos in zip(devices, positions):
    by_node: dict[int, list[int]] = {}
    for d, i in zip(row, pos):
      by_node.setdefault(pe_of_device(d) // rpn, []).append(int(i))
    counts = {n: len(v) for n, v in sorted(by_node.items())}
    if len(set(counts.values())) != 1:
      raise ValueError(f"the group along axis {axis_name!r} holds different numbers of GPUs on "
                       f"its nodes {counts}; the hierarchical all-reduce needs the same number "
                       "on every node")
    nodes = [by_node[n] for n in sorted(by_node)]
    out.extend([members[l] for members in nodes] for l in range(len(nodes[0])))
  return out
