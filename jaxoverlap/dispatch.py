"""The dispatcher: one function turns an op call into a frozen plan of how it runs.

Problem:
  Whether a call runs on XLA's collectives or on this package's kernels, with
  which algorithm, protocol, transport and chunking, depends on the request,
  the shapes, the mesh's devices (which processes and nodes a group spans) and
  the runtime (extension loaded, NVSHMEM up, slot sizes, the measured table).
  The mesh's devices are known only when JAX lowers the program, so that is
  where every choice is made, once, in one place.

Algorithm:
  Each public op binds one primitive whose parameters are a ``Request`` (what
  the caller asked for). Its lowering rule (``jaxoverlap._primitives``) calls
  ``plan_lowering``, which calls ``make_plan(request, avals, mesh, facts)``:

  1. Hard checks: the request against the runtime and the devices. A CUDA
     requirement that fails sends ``backend="auto"`` to XLA (logged once per
     reason, and said in the plan) and makes ``backend="cuda"`` raise.
     Workspace that is too small always raises. A call with nothing to
     communicate (empty operands, or a group of one rank) runs the xla
     expression with either backend, and its plan says why.
  2. Heuristics: for the all-reduce, the tuning policy (the measured table,
     then the cost model; it may hand the call to ``lax.psum``); the protocol
     rule; for the fused ops, the chunk rule, the fused-or-unfused rule of
     ``matmul_all_reduce`` and the default transport
     (``jaxoverlap.tuning.policy``).

  The ``Plan`` names every choice and the reason for it. Lowerings only read
  it. Every plan goes into one bounded log, read with ``decisions()``.

Example (8 devices, as in ``jaxoverlap.reference``):
  >>> import jax, jax.numpy as jnp, jaxoverlap
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.make_mesh((8,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> f = jax.jit(jax.shard_map(lambda x: jaxoverlap.all_reduce(x, "tp"), mesh=mesh,
  ...                           in_specs=P("tp"), out_specs=P()))
  >>> _ = f.lower(jnp.ones(8 * 4096, jnp.bfloat16))   # planning happens here
  >>> print(jaxoverlap.decisions()[-1].summary())      # doctest: +ELLIPSIS
  all_reduce [4096] bfloat16 over 'tp' (8 ranks): xla collective [backend: auto: ...]
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxoverlap import _xla, names, runtime
from jaxoverlap.tuning import policy as _policy

__all__ = ["Request", "Plan", "Geometry", "make_plan", "plan_lowering", "decisions",
           "clear_decisions", "geometry", "stage_pieces", "norm_capacity"]

logger = logging.getLogger("jaxoverlap")

_MAX_DECISIONS = 1000
_log: collections.deque = collections.deque(maxlen=_MAX_DECISIONS)
_logged = 0  # plans ever appended to _log (a mark for _plans_since; clear_decisions keeps it)
_warned: set[str] = set()
_lock = threading.Lock()
# (path, table, policy) of the last table seen; the table itself is kept, so that a
# new table (a new initialize()) never passes for it by a reused id().
_policy_cache: list[tuple[str, Any, _policy.Policy]] = []


@dataclasses.dataclass(frozen=True)
class Request:
  """What the caller of an op asked for (the primitive's only parameter).

  Attributes:
    op: one of ``names.OPS``.
    axis_name: the mesh axis (str) or tuple of axes of the collective.
    backend, algorithm, protocol, transport: as passed, or "auto".
    chunks: the fused ops' chunks per shard transfer, or None (auto).
    dim: all_gather_matmul's gather or matmul_reduce_scatter's scatter
      dimension, non-negative; None for the other ops.
    gathered: all_gather_matmul only: also return the gathered x.
  """

  op: str
  axis_name: str | tuple[str, ...]
  backend: str = names.AUTO
  algorithm: str = names.AUTO
  protocol: str = names.AUTO
  transport: str = names.AUTO
  chunks: int | None = None
  dim: int | None = None
  gathered: bool = False


@dataclasses.dataclass(frozen=True)
class Geometry:
  """The fused ops' problem as the kernels see it (``ffi/include/jaxoverlap/overlap.h``).

  Attributes:
    outer, rows, k, n: the kernels' shape attributes (for all_gather_matmul x
      is [outer, rows, k] per rank, for matmul_reduce_scatter the output block
      is [outer, rows, n], for matmul_all_reduce outer is 1 and the block
      [rows, n]).
    payload_bytes: fused-op slot bytes one sender needs.
    pieces: how many pieces a transfer can be cut into (the chunk limit).
    chunk_bytes: the bytes the chunk rule weighs (a shard or a block).
    gemm_flops: flops of the GEMM that the first transfer overlaps.
  """

  outer: int
  rows: int
  k: int
  n: int
  payload_bytes: int
  pieces: int
  chunk_bytes: int
  gemm_flops: float


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one op call runs, and why.

  Attributes:
    op: the op's name.
    axis_name: the mesh axis (or axes) of the collective.
    shapes: the per-rank shapes of the operands (x, and w for the GEMM ops).
    dtype: the operands' dtype name.
    nbytes: the bytes of the operand x per rank (all_reduce: the message
      size; the fused ops' slot need per sender is ``geometry.payload_bytes``).
    num_ranks: ranks in the group.
    ranks_per_node, num_nodes: the group's topology (backend "cuda").
    groups: the PE groups of the collective, each in rank order (backend "cuda").
    backend: "xla" or "cuda".
    algorithm: the algorithm (``jaxoverlap.names``).
    protocol: the CUDA all-reduce's protocol, else None.
    transport: the CUDA kernels' transport, else None.
    chunks: the fused kernels' chunks per shard transfer, else None.
    precision: the fused kernels' float32 GEMM precision ("default" or
      "highest"), else None.
    command_buffer: the fused kernels lower to their command-buffer handlers.
    geometry: the fused kernels' shape attributes, else None.
    all_reduce: for the "unfused" algorithm of matmul_all_reduce and
      all_reduce_rms_norm, the plan of its all-reduce.
    inter_node: all_reduce "hierarchical" across processes of the in-process
      runtime: "xla", XLA's all-reduce joins the nodes between the kernels'
      intra-node reduce-scatter and all-gather; else None.
    node_groups: with ``inter_node="xla"``, the groups of that all-reduce:
      for every group and local rank, the mesh positions (XLA's logical
      device ids) of the GPUs with that local rank on each node.
    pieces: with ``inter_node="xla"``, how the intra-node steps cut the
      message: ``(start, length, shard)`` in elements per launch of the
      reduce-scatter and the all-gather (``stage_pieces``: each shard fits
      one slot of the heap); else None.
    why: (choice, reason) pairs: why each choice was made ("requested", a
      fallback's cause, "measured (...)", "cost model (...)", a rule).
  """

  op: str
  axis_name: str | tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtype: str
  nbytes: int
  num_ranks: int
  backend: str
  algorithm: str
  why: tuple[tuple[str, str], ...]
  ranks_per_node: int | None = None
  num_nodes: int | None = None
  groups: tuple[tuple[int, ...], ...] | None = None
  protocol: str | None = None
  transport: str | None = None
  chunks: int | None = None
  precision: str | None = None
  command_buffer: bool = False
  geometry: Geometry | None = None
  all_reduce: Plan | None = None
  inter_node: str | None = None
  node_groups: tuple[tuple[int, ...], ...] | None = None
  pieces: tuple[tuple[int, int, int], ...] | None = None

  # The choices a plan can give a reason for (the first items of ``why``).
  CHOICES = ("backend", "algorithm", "protocol", "transport", "chunks", "inter_node")

  def __post_init__(self):
    unknown = [k for k, _ in self.why if k not in self.CHOICES]
    if unknown:  # a planner's bug: reason() could not return these
      raise ValueError(f"Plan: reasons for unknown choices {unknown}; one of {self.CHOICES}")
    if self.backend == names.XLA:  # an algorithm _xla has no branch for: raises, unlogged
      _xla.check_algorithm(self.op, self.algorithm)

  def reason(self, choice: str) -> str | None:
    """Why ``choice`` (one of ``Plan.CHOICES``) was made; None where this plan made no such
    choice (e.g. "protocol" on the XLA backend).

    Raises:
      ValueError: ``choice`` is not one of ``Plan.CHOICES``.
    """
    if choice not in self.CHOICES:
      raise ValueError(f"Plan.reason: {choice!r} is not a choice; one of {self.CHOICES}")
    return dict(self.why).get(choice)

  def summary(self) -> str:
    """One line: the call, what runs, and why."""
    what = f"{self.backend} {self.algorithm}"
    extra = [f"{k}={v}" for k, v in (("protocol", self.protocol), ("transport", self.transport),
                                     ("inter_node", self.inter_node), ("chunks", self.chunks))
             if v is not None]
    if extra:
      what += " (" + ", ".join(extra) + ")"
    topo = f"{self.num_ranks} ranks"
    if self.num_nodes is not None:
      topo += f" = {self.num_nodes} node{'s' * (self.num_nodes != 1)} x {self.ranks_per_node}"
    shapes = " x ".join(str(list(s)) for s in self.shapes)
    reasons = "; ".join(f"{k}: {v}" for k, v in self.why)
    line = f"{self.op} {shapes} {self.dtype} over {self.axis_name!r} ({topo}): {what} [{reasons}]"
    if self.all_reduce is not None:
      line += f"; then {self.all_reduce.summary()}"
    return line

  def as_dict(self) -> dict[str, Any]:
    """The plan as plain data (JSON-able), e.g. for a benchmark's records."""
    out = dataclasses.asdict(self)
    out["why"] = dict(self.why)
    out["axis_name"] = list(self.axis_name) if isinstance(self.axis_name, tuple) else self.axis_name
    if self.all_reduce is not None:  # the unfused ops' all-reduce: a plan of its own
      out["all_reduce"] = self.all_reduce.as_dict()
    return out


class _Fallback(Exception):
  """A CUDA requirement that failed: backend "auto" runs XLA, "cuda" raises."""


def decisions(op: str | None = None) -> list[Plan]:
  """The plans of the calls lowered in this process, oldest first (the last 1000).

  Args:
    op: only the plans of this op (None: all); one of ``jaxoverlap.names.OPS``.

  Returns:
    A list of ``Plan``; each says what ran (backend, algorithm, protocol,
    transport, chunks) and why. A plan is made when a call is lowered (once per
    compilation), not at every execution; identical calls in one program (the
    same op, shapes and options, e.g. in every layer) may be lowered once and
    leave one plan. A program JAX takes from its caches (a jitted function
    called again, or a new ``jax.jit`` of the same function and arguments) is
    not lowered again and adds no plan: after ``clear_decisions()`` only new
    compilations appear. To see a compiled function's plans again, call
    ``jax.clear_caches()``, then lower or call it again (which recompiles it).

  Raises:
    ValueError: ``op`` is not None and not an op's name.
  """
  if op is not None and op not in names.OPS:
    raise ValueError(f"decisions: op={op!r} is not an op; expected None or one of {names.OPS}")
  with _lock:
    return [p for p in _log if op is None or p.op == op]


def _decision_mark() -> int:
  """How many plans were ever logged; ``_plans_since`` takes it."""
  with _lock:
    return _logged


def _plans_since(mark: int) -> list[Plan]:
  """The plans logged since ``_decision_mark()`` returned ``mark`` that are still in the log."""
  with _lock:
    new = min(_logged - mark, len(_log))
    return list(_log)[len(_log) - new:] if new > 0 else []


def clear_decisions() -> None:
  """Empties the log of ``decisions()``."""
  with _lock:
    _log.clear()


# ---------------------------------------------------------------------------- helpers


def _nbytes(shape, itemsize) -> int:
  return int(np.prod(shape, dtype=np.int64)) * int(itemsize)


def _topology(groups: Sequence[Sequence[int]], pe: int, ranks_per_node: int,
              axis_name) -> tuple[Sequence[int], int, int]:
  """This PE's group, and (ranks of a group per node, nodes of a group).

  Every group must hold as many ranks on each of its nodes (the kernels
  refuse others when they run), and every group must have the same shape:
  one plan serves every group of the call, and under the in-process runtime
  one process plans for all of its GPUs' groups.

  Raises:
    _Fallback: a group with different numbers of ranks on its nodes, or
      groups of different shapes.
  """
  shapes: dict[tuple[int, int], tuple[int, ...]] = {}
  for g in groups:
    counts = collections.Counter(p // ranks_per_node for p in g)
    if len(set(counts.values())) != 1:
      per_node = ", ".join(f"{n} on node {node}" for node, n in sorted(counts.items()))
      raise _Fallback(f"the group {tuple(g)} over {axis_name!r} has {per_node} (PEs of node k: "
                      f"k * {ranks_per_node} on); the kernels need as many ranks on each node "
                      "of a group")
    shapes.setdefault((len(g) // len(counts), len(counts)), tuple(g))
  if len(shapes) > 1:
    kinds = "; ".join(f"{g}: {rpn} on each of {n} node{'s' * (n > 1)}"
                      for (rpn, n), g in shapes.items())
    raise _Fallback(f"the groups over {axis_name!r} differ in shape ({kinds}); one plan serves "
                    "every group of the call, so the kernels need every group to have as many "
                    "ranks on as many nodes")
  group = next((g for g in groups if pe in g), groups[0])
  (local_size, num_nodes), = shapes
  return group, local_size, num_nodes


def geometry(op: str, x_shape, w_shape, dim: int | None, num_ranks: int,
             itemsize: int) -> Geometry:
  """The fused kernels' view of an op's shapes (see ``Geometry``)."""
  k, n = int(w_shape[0]), int(w_shape[1])
  if op == names.ALL_GATHER_MATMUL:
    outer = math.prod(x_shape[:dim])
    rows = math.prod(x_shape[dim:-1])
    shard = outer * rows * k * itemsize
    # Chunks cut the shard's rows, or whole batch entries where it has batch
    # dims (each chunk one contiguous, graph-updatable copy).
    return Geometry(outer, rows, k, n, shard, outer if outer > 1 else rows, shard,
                    2.0 * outer * rows * k * n)
  if op == names.MATMUL_REDUCE_SCATTER:
    outer = math.prod(x_shape[:dim])
    rows = math.prod(x_shape[dim:-1]) // num_ranks
    block = outer * rows * n * itemsize
    return Geometry(outer, rows, k, n, block, rows, block, 2.0 * outer * rows * k * n)
  rows = math.prod(x_shape[:-1]) // num_ranks
  block = rows * n * itemsize
  # The slot holds the reduce-scatter's partial and, after it, the all-gather's block.
  return Geometry(1, rows, k, n, 2 * (-(-block // 256) * 256), rows, block,
                  2.0 * rows * k * n)


def stage_pieces(num_elements: int, local_size: int, itemsize: int,
                 slot_bytes: int) -> list[tuple[int, int, int]]:
  """How the intra-node steps between processes cut a message (``AllReduceStage``).

  Each piece is one launch of the reduce-scatter and one of the all-gather;
  its shard (the two-shot shard: ceil(length / local_size) rounded up to 16
  bytes of the dtype) must fit one slot of the heap.

  Args:
    num_elements: the message's elements.
    local_size: ranks of the group in this process.
    itemsize: bytes per element.
    slot_bytes: the heap's slot per sender (``runtime_info()["slot_bytes"]``).

  Returns:
    ``(start, length, shard)`` per piece, in elements.

  Raises:
    ValueError: a slot too small for one 16-byte vector.
  """
  vec = 16 // itemsize
  capacity = (slot_bytes // itemsize // vec) * vec * local_size
  if capacity == 0:
    raise ValueError(f"all_reduce: the heap's slots ({slot_bytes} bytes) are too small for one "
                     "vector per rank; raise heap_bytes in jaxoverlap.initialize()")
  pieces = []
  for start in range(0, num_elements, capacity):
    length = min(capacity, num_elements - start)
    pieces.append((start, length, -(-(-(-length // local_size)) // vec) * vec))
  return pieces


def _warn_fallback(request: Request, reason: str) -> None:
  key = f"{request.op}: {reason}"
  with _lock:
    if key in _warned:
      return
    _warned.add(key)
  logger.warning("jaxoverlap: %s with backend 'auto' runs on backend 'xla': %s", request.op,
                 reason)


def _tuning_policy() -> _policy.Policy:
  path, table = runtime.tuning_table()
  with _lock:
    if _policy_cache and _policy_cache[0][0] == path and _policy_cache[0][1] is table:
      return _policy_cache[0][2]
    p = _policy.Policy.from_result(table, path=path)
    _policy_cache[:] = [(path, table, p)]
  return p


def _precision() -> str:
  p = str(jax.config.jax_default_matmul_precision).lower()
  return "highest" if p in ("highest", "float32", "precision.highest") else "default"


# ---------------------------------------------------------------------------- the plan


def make_plan(request: Request, avals: Sequence[Any], mesh, facts: runtime.Facts,
              *, num_ranks: int | None = None) -> Plan:
  """The plan of one op call (a pure function of its arguments).

  Args:
    request: what the caller asked for.
    avals: the operands' per-rank abstract values (``.shape``, ``.dtype``): x,
      and w for the GEMM ops.
    mesh: the concrete ``jax.sharding.Mesh`` of the enclosing ``shard_map``, or
      None where none is known.
    facts: the runtime (``jaxoverlap.runtime.facts()``).
    num_ranks: the size of the axis; taken from ``mesh`` when None.

  Returns:
    The ``Plan``.

  Raises:
    ValueError: the request cannot run as asked (a CUDA-only choice on a group
      or shape the kernels do not take, chunks with backend "xla", a fused-op
      slot too small for the call).
    RuntimeError: ``backend="cuda"`` (or a CUDA-only choice) while the CUDA
      kernels cannot run in this process; the message says why.
  """
  r = request
  dtype = np.dtype(avals[0].dtype)
  shapes = tuple(tuple(int(d) for d in a.shape) for a in avals)
  if num_ranks is None:
    num_ranks = math.prod(int(mesh.shape[a]) for a in names.axis_names(r.axis_name))
  base = dict(op=r.op, axis_name=r.axis_name, shapes=shapes, dtype=dtype.name,
              nbytes=_nbytes(shapes[0], dtype.itemsize), num_ranks=num_ranks)

  # 1. The backend: requested, implied by an algorithm of one backend, or auto.
  if r.backend == names.XLA:
    return _xla_plan(r, base, "requested")
  if names.backend_of_algorithm(r.op, r.algorithm) == names.XLA:
    return _xla_plan(r, base, f"algorithm {r.algorithm!r} belongs to backend 'xla'")
  if any(math.prod(s) == 0 for s in shapes):
    # Nothing moves; the xla expression gives the (empty or zero) result.
    return _xla_plan(r, base, "empty operands: nothing to communicate (the xla expression, "
                     "no kernel)", chunks_ok=True)
  if num_ranks == 1:
    # Nothing moves either: the xla expression is the local GEMM (or x itself, or the norm).
    # The CUDA kernels assume peers: the fused ones would wait on a slot nobody writes.
    return _xla_plan(r, base, "a group of one rank: nothing to communicate (the xla "
                     "expression, no kernel)", chunks_ok=True)
  try:
    return _cuda_plan(r, shapes, dtype, mesh, facts, num_ranks, base)
  except _Fallback as f:
    wants_cuda = _cuda_only_choice(r)
    if r.backend == names.CUDA or wants_cuda:
      asked = "backend='cuda'" if r.backend == names.CUDA else f"{wants_cuda} (backend 'cuda')"
      kind = RuntimeError if facts.unavailable is not None else ValueError
      raise kind(f"{r.op}: {asked} was requested, but {f}") from None
    return _xla_plan(r, base, f"auto: {f}")


def _xla_plan(r: Request, base: dict, why_backend: str, chunks_ok: bool = False) -> Plan:
  if r.chunks is not None and not chunks_ok:
    raise ValueError(f"{r.op}: chunks={r.chunks} applies to backend 'cuda' only, and this call "
                     f"runs on backend 'xla' ({why_backend})")
  if r.algorithm in (names.AUTO,) or names.backend_of_algorithm(r.op, r.algorithm) != names.XLA:
    algorithm, why_algorithm = names.COLLECTIVE, "default of backend 'xla'"
  else:
    algorithm, why_algorithm = r.algorithm, "requested"
  # CUDA choices that a call with nothing to communicate leaves unused: said, not dropped
  # silently (the other ways to backend 'xla' refuse them, or the caller asked for 'xla').
  unused = [(key, f"{spelled} requested, not used: the call runs on backend 'xla' "
                  f"({why_backend})") for key, spelled in _cuda_only_choices(r)]
  if unused and unused[0][0] == "algorithm":
    why_algorithm = f"{unused.pop(0)[1]}; {why_algorithm}"
  return Plan(backend=names.XLA, algorithm=algorithm,
              why=(("backend", why_backend), ("algorithm", why_algorithm), *unused), **base)


def _cuda_only_choices(r: Request) -> list[tuple[str, str]]:
  """The request's choices that only backend "cuda" has: ``(key, "key=value")``, in order."""
  out = []
  if names.backend_of_algorithm(r.op, r.algorithm) == names.CUDA:
    out.append(("algorithm", f"algorithm={r.algorithm!r}"))
  for key in ("protocol", "transport"):
    if getattr(r, key) != names.AUTO:
      out.append((key, f"{key}={getattr(r, key)!r}"))
  if r.chunks is not None:
    out.append(("chunks", f"chunks={r.chunks}"))
  return out


def _cuda_only_choice(r: Request) -> str | None:
  """The first choice of the request that only backend "cuda" has, as spelled, or None."""
  choices = _cuda_only_choices(r)
  return choices[0][1] if choices else None


def _check_reachable(groups, facts: runtime.Facts, axis_name) -> None:
  """Raises _Fallback where two PEs of one node of a group cannot load/store each other.

  Every kernel's intra-node steps store into the peers' heaps. Every group is
  checked, not only this PE's, so that every process makes the same plan.
  """
  if not facts.unreachable_pairs:
    return
  node = lambda pe: pe // facts.ranks_per_node  # noqa: E731
  for g in groups:
    members = set(g)
    for pe, peer in facts.unreachable_pairs:
      if pe in members and peer in members and node(pe) == node(peer):
        raise _Fallback(
            f"PE {pe} cannot load/store PE {peer}'s memory (no NVLink or PCIe peer access "
            f"between their GPUs), and both are on node {node(pe)} of the group {tuple(g)} over "
            f"{axis_name!r} (ranks_per_node={facts.ranks_per_node}), whose intra-node steps "
            "need it; set JAXOVERLAP_RANKS_PER_NODE to a size whose blocks of consecutive ranks "
            "reach each other (1 on any machine)")


def _cuda_plan(r, shapes, dtype, mesh, facts, num_ranks, base) -> Plan:
  """The plan on backend "cuda"; raises _Fallback where a requirement fails."""
  if facts.unavailable is not None:
    raise _Fallback(facts.unavailable)
  if mesh is None:
    raise _Fallback("the enclosing shard_map has no concrete jax.sharding.Mesh (the PE groups "
                    "come from the mesh's devices; a shard_map nested in another without "
                    "mesh= has an AbstractMesh)")
  try:
    groups = runtime.groups_along_axis(mesh, r.axis_name)
  except ValueError as e:
    raise _Fallback(str(e)) from None
  group, local_size, num_nodes = _topology(groups, facts.pe, facts.ranks_per_node, r.axis_name)
  _check_reachable(groups, facts, r.axis_name)
  if r.op == names.ALL_REDUCE_RMS_NORM:
    return _norm_plan(r, shapes, dtype, group, local_size, num_nodes, facts,
                      dict(base, backend=names.CUDA, ranks_per_node=local_size,
                           num_nodes=num_nodes, groups=tuple(tuple(g) for g in groups)))
  if facts.transport == names.PEER and num_nodes > 1 and r.op != names.ALL_REDUCE:
    raise _Fallback(
        f"the group over {r.axis_name!r} spans {num_nodes} processes, and the fused kernels of "
        "the in-process runtime reach only the GPUs of this process (put the tensor-parallel "
        "axis within a process)")
  cuda = dict(base, backend=names.CUDA, ranks_per_node=local_size, num_nodes=num_nodes,
              groups=tuple(tuple(g) for g in groups))
  if r.op == names.ALL_REDUCE:
    if facts.transport == names.PEER and num_nodes > 1:
      return _all_reduce_over_xla_plan(r, dtype, mesh, local_size, num_nodes, facts, cuda)
    return _all_reduce_plan(r, dtype, local_size, num_nodes, facts, cuda)
  return _fused_plan(r, shapes, dtype, group, num_nodes, facts, num_ranks, cuda)


def _all_reduce_plan(r, dtype, local_size, num_nodes, facts, cuda) -> Plan:
  limits = facts.limits
  if local_size > limits["max_group_size"]:
    raise _Fallback(f"the group has {local_size} ranks on one node; the kernels take at most "
                    f"{limits['max_group_size']}")
  if num_nodes > limits["max_nodes"]:
    raise _Fallback(f"the group spans {num_nodes} nodes; the kernels take at most "
                    f"{limits['max_nodes']}")
  nbytes = cuda["nbytes"]
  if r.algorithm in (names.ONE_SHOT, names.TWO_SHOT) and num_nodes > 1:
    raise ValueError(
        f"all_reduce: algorithm {r.algorithm!r} needs the whole group on one node, but the group "
        f"over {r.axis_name!r} spans {num_nodes} nodes (ranks_per_node={facts.ranks_per_node}); "
        "use 'hierarchical' or 'auto'")
  why = [("backend", "requested" if r.backend == names.CUDA else "auto: the CUDA kernels run here")]
  if r.algorithm != names.AUTO:
    algorithm, protocol = r.algorithm, None
    why.append(("algorithm", "requested"))
  else:
    choice = _tuning_policy().choose(nbytes, dtype.itemsize, local_size, num_nodes,
                                     facts.transport, facts.emulated_nodes)
    if choice.algorithm == _policy.PSUM:
      if r.protocol != names.AUTO:
        raise ValueError(f"all_reduce: protocol={r.protocol!r} was requested, but the policy "
                         f"hands this call to lax.psum ({choice.source}); name an algorithm too")
      return Plan(**dict(cuda, backend=names.XLA, groups=None),
                  algorithm=names.COLLECTIVE,
                  why=(("backend",
                        f"auto policy hands the call to lax.psum (NCCL): {choice.source}"),
                       ("algorithm", "lax.psum")))
    algorithm, protocol = choice.algorithm, choice.protocol
    why.append(("algorithm", choice.source))
  if r.protocol != names.AUTO:
    if r.protocol not in names.protocols(algorithm):
      raise ValueError(f"all_reduce: protocol={r.protocol!r} was requested, but the policy chose "
                       f"algorithm {algorithm!r}, which has only {names.protocols(algorithm)} "
                       f"({why[-1][1]}); name an algorithm too")
    protocol = r.protocol
    why.append(("protocol", "requested"))
  elif protocol is not None:
    why.append(("protocol", f"with the algorithm: {choice.source}"))
  else:
    choice = _tuning_policy().choose_protocol(algorithm, nbytes, dtype.itemsize, local_size,
                                              num_nodes, facts.transport, facts.emulated_nodes)
    protocol = choice.protocol
    why.append(("protocol", choice.source))
  if protocol == names.LAMPORT and facts.lamport_slot_bytes == 0:
    raise ValueError(
        f"all_reduce: protocol 'lamport' ({why[-1][1]}) has no slots in this runtime: its heap "
        "leaves no room beside the other slots of its PEs; raise heap_bytes in "
        "jaxoverlap.initialize() (or JAXOVERLAP_HEAP_BYTES), or use protocol 'll' or 'simple'")
  transport = facts.transport
  why.append(("transport", "the runtime's transport" if r.transport == names.AUTO else "requested"))
  if r.transport not in (names.AUTO, transport):
    raise ValueError(f"all_reduce: transport={r.transport!r} was requested, but this runtime's "
                     f"transport is {transport!r}")
  return Plan(**cuda, algorithm=algorithm, protocol=protocol, transport=transport,
              why=tuple(why))


def norm_capacity(itemsize: int, ll_slot_bytes: int) -> int:
  """Elements one launch of the fused all-reduce + RMSNorm carries per rank.

  The kernel is the one-shot LL all-reduce in one launch: every 8 bytes of the
  message travel as one 16-byte LL8 line, two 8-byte LL cells (4 bytes of data
  + a 4-byte flag each), in the receiver's slot per sender.
  """
  return (ll_slot_bytes // 16) * (8 // itemsize)


def _norm_plan(r, shapes, dtype, group, local_size, num_nodes, facts, cuda) -> Plan:
  """all_reduce_rms_norm on backend "cuda": the fused kernel, or the CUDA all_reduce then the norm.

  "auto" runs the fused kernel where it takes the call and the rule of
  ``jaxoverlap.tuning.policy.fuse_norm`` says it is faster; else "unfused".
  """
  op, limits = r.op, facts.limits
  if num_nodes > 1:
    raise _Fallback(f"the group over {r.axis_name!r} (PEs {list(group)}) spans {num_nodes} "
                    "nodes (or processes of the in-process runtime) and the fused all-reduce + "
                    "RMSNorm is a one-shot all-reduce within one node")
  if local_size > limits["max_group_size"]:
    raise _Fallback(f"the group has {local_size} ranks; the kernels take at most "
                    f"{limits['max_group_size']}")
  if r.transport not in (names.AUTO, facts.transport):
    raise ValueError(f"{op}: transport={r.transport!r} was requested, but this runtime's "
                     f"transport is {facts.transport!r}")
  hidden = shapes[0][-1]
  rows = math.prod(shapes[0][:-1])
  n = rows * hidden
  capacity = norm_capacity(dtype.itemsize, facts.ll_slot_bytes)
  cannot = None  # why the fused kernel cannot take this call
  if (hidden * dtype.itemsize) % 8:
    cannot = (f"a row of hidden={hidden} {dtype.name} elements is not a whole number of "
              "LL8 lines (8 bytes of data each, as two 8-byte LL cells of 4 bytes of data + "
              "a 4-byte flag; the kernel's blocks own whole rows)")
  elif n > capacity:
    cannot = (f"the message ({cuda['nbytes']} bytes per rank) exceeds one launch of the "
              f"one-shot LL all-reduce ({capacity * dtype.itemsize} bytes: the LL slot of "
              f"{facts.ll_slot_bytes} bytes per sender)")
  backend_why = ("backend", "requested" if r.backend == names.CUDA
                 else "auto: the CUDA kernels run here")
  if r.algorithm == names.ONE_SHOT:
    if cannot:
      raise _Fallback(cannot)
    unfused = None
  elif r.algorithm == names.UNFUSED:
    unfused = "requested"
  elif cannot:
    unfused = f"the fused kernel cannot take this call: {cannot}"
  elif not _policy.fuse_norm(rows, hidden * dtype.itemsize):
    unfused = (f"rule: {rows} rows of {hidden * dtype.itemsize} bytes; the fused kernel is "
               f"faster for rows of at most {_policy.NORM_FUSED_MAX_ROW_BYTES} bytes "
               "(jaxoverlap.tuning.policy.fuse_norm, measured on 2x H200)")
  else:
    unfused = None
  if unfused is not None:
    sub = _unfused_all_reduce(r, _Aval(tuple(shapes[0]), dtype), cuda, facts, cuda["num_ranks"])
    return Plan(**dict(cuda, groups=sub.groups), algorithm=names.UNFUSED,
                why=(backend_why, ("algorithm", unfused)), all_reduce=sub)
  why = (backend_why,
         ("algorithm", "requested" if r.algorithm == names.ONE_SHOT
          else "rule: the fused kernel is faster here (jaxoverlap.tuning.policy.fuse_norm)"),
         ("protocol", "the fused kernel's protocol (LL: no flag round trip for small messages)"),
         ("transport", "the runtime's transport"))
  return Plan(**cuda, algorithm=names.ONE_SHOT, protocol=names.LL, transport=facts.transport,
              why=why)


def _all_reduce_over_xla_plan(r, dtype, mesh, local_size, num_nodes, facts, cuda) -> Plan:
  """all_reduce over processes of the in-process runtime: XLA's psum joins the nodes.

  The in-process runtime reaches only its own process's GPUs, so between
  processes (nodes) the hierarchical algorithm's middle step is XLA's
  all-reduce of the fp32 shard over the same-local-rank GPUs.
  """
  if local_size > facts.limits["max_group_size"]:
    raise _Fallback(f"the group has {local_size} ranks in one process; the kernels take at most "
                    f"{facts.limits['max_group_size']}")
  if r.algorithm in (names.ONE_SHOT, names.TWO_SHOT):
    raise ValueError(
        f"all_reduce: algorithm {r.algorithm!r} needs the whole group in one process with the "
        f"in-process runtime, but the group over {r.axis_name!r} spans {num_nodes} processes; "
        "use 'hierarchical' or 'auto'")
  if r.protocol not in (names.AUTO, names.SIMPLE):
    raise ValueError(
        f"all_reduce: protocol={r.protocol!r}: across processes of the in-process runtime the "
        "intra-node steps run the simple protocol only (XLA's all-reduce joins the processes)")
  if r.transport not in (names.AUTO, names.PEER):
    raise ValueError(f"all_reduce: transport={r.transport!r} was requested, but this runtime's "
                     f"transport is {names.PEER!r}")
  why = [("backend", "requested" if r.backend == names.CUDA else "auto: the CUDA kernels run here")]
  if r.algorithm == names.HIERARCHICAL:
    why.append(("algorithm", "requested"))
  else:
    choice = _tuning_policy().choose_over_xla(cuda["nbytes"], dtype.itemsize, local_size,
                                              num_nodes)
    if choice.algorithm == _policy.PSUM:
      return Plan(**dict(cuda, backend=names.XLA, groups=None), algorithm=names.COLLECTIVE,
                  why=(("backend", f"auto policy hands the call to lax.psum (NCCL): "
                                   f"{choice.source}"), ("algorithm", "lax.psum")))
    why.append(("algorithm", choice.source))
  why.append(("protocol", "the only protocol of the intra-node steps between processes"))
  why.append(("transport", "the runtime's transport within a process"))
  why.append(("inter_node", f"the in-process runtime reaches only its own GPUs: XLA's "
                            f"all-reduce (NCCL) of the fp32 shard over the {num_nodes} "
                            "same-local-rank GPUs joins the processes"))
  try:
    node_groups = runtime.node_groups_along_axis(mesh, r.axis_name, facts.ranks_per_node)
  except ValueError as e:
    raise _Fallback(str(e)) from None
  pieces = stage_pieces(cuda["nbytes"] // dtype.itemsize, local_size, dtype.itemsize,
                        facts.slot_bytes)
  return Plan(**cuda, algorithm=names.HIERARCHICAL, protocol=names.SIMPLE,
              transport=names.PEER, inter_node=names.XLA,
              node_groups=tuple(tuple(g) for g in node_groups), pieces=tuple(pieces),
              why=tuple(why))


def _fused_plan(r, shapes, dtype, group, num_nodes, facts, num_ranks, cuda) -> Plan:
  op, limits = r.op, facts.limits
  if num_nodes > 1:
    raise _Fallback(f"the group over {r.axis_name!r} (PEs {list(group)}) spans {num_nodes} "
                    "nodes and the fused kernels run within one node "
                    f"(ranks_per_node={facts.ranks_per_node}); put the tensor-parallel axis "
                    "within a node")
  if len(group) > limits["max_group_size"]:
    raise _Fallback(f"the group over {r.axis_name!r} has {len(group)} ranks; the fused kernels "
                    f"take at most {limits['max_group_size']}")
  x_shape, w_shape = shapes
  if op == names.MATMUL_REDUCE_SCATTER and r.dim == len(x_shape) - 1:
    raise _Fallback(f"the kernel scatters any output dimension but the last "
                    f"(scatter_dimension={r.dim} is the last)")
  if op == names.ALL_GATHER_MATMUL and r.dim == len(x_shape) - 1:
    raise _Fallback(f"the kernel gathers any dimension of x but the contracted last one "
                    f"(gather_dimension={r.dim})")
  why = [("backend", "requested" if r.backend == names.CUDA else "auto: the CUDA kernels run here")]

  if op == names.MATMUL_ALL_REDUCE:
    rows = math.prod(x_shape[:-1])
    out_bytes = rows * w_shape[1] * dtype.itemsize
    if r.algorithm == names.FUSED and rows % num_ranks:
      raise ValueError(
          f"{op}: algorithm='fused' needs the rows of x (all leading dimensions, {rows}) to "
          f"divide by the size {num_ranks} of axis {r.axis_name!r}; use 'unfused' or 'auto'")
    if r.algorithm == names.UNFUSED:
      unfused = "requested"
    elif r.algorithm == names.FUSED:
      unfused = None
    elif rows % num_ranks:
      unfused = f"rule: {rows} rows do not divide by {num_ranks} ranks"
    elif not _policy.fuse_all_reduce(out_bytes):
      unfused = (f"rule: the output has {out_bytes} bytes per rank, under "
                 f"{_policy.FUSED_ALL_REDUCE_MIN_BYTES} (FUSED_ALL_REDUCE_MIN_BYTES)")
    else:
      unfused = None
    if unfused is not None:
      if r.transport != names.AUTO:
        raise ValueError(f"{op}: transport={r.transport!r} applies to the fused algorithm, and "
                         f"this call runs 'unfused' ({unfused})")
      if r.chunks is not None and r.algorithm == names.UNFUSED:
        raise ValueError(f"{op}: chunks={r.chunks} applies to the fused algorithm, not to "
                         "'unfused'")
      if r.chunks is not None:
        why.append(("chunks", f"chunks={r.chunks} is unused: the call runs unfused"))
      out_aval = _Aval(tuple(x_shape[:-1]) + (w_shape[1],), dtype)
      sub = _unfused_all_reduce(r, out_aval, cuda, facts, num_ranks)
      why.append(("algorithm", unfused))
      return Plan(**dict(cuda, groups=sub.groups), algorithm=names.UNFUSED, why=tuple(why),
                  all_reduce=sub)
    why.append(("algorithm", "requested" if r.algorithm == names.FUSED
                else f"rule: the output has {out_bytes} bytes per rank, at least "
                     f"{_policy.FUSED_ALL_REDUCE_MIN_BYTES}"))
  else:
    why.append(("algorithm", "requested" if r.algorithm == names.FUSED
                else "the only algorithm of the CUDA kernels"))

  geo = geometry(op, x_shape, w_shape, r.dim, num_ranks, dtype.itemsize)
  if geo.payload_bytes > facts.overlap_slot_bytes:
    raise ValueError(
        f"{op}: this call needs {geo.payload_bytes} bytes of fused-op slot per sender, but the "
        f"slot has {facts.overlap_slot_bytes} bytes; raise overlap_heap_bytes in "
        "jaxoverlap.initialize() (or JAXOVERLAP_OVERLAP_HEAP_BYTES), or run with more ranks")
  if r.chunks is not None and r.chunks > limits["max_chunks"]:
    raise ValueError(f"{op}: chunks={r.chunks} exceeds the kernels' limit of "
                     f"{limits['max_chunks']}")
  if r.chunks is None:
    chunks = _policy.fused_chunks(op, geo.chunk_bytes, geo.pieces, geo.gemm_flops)
    why.append(("chunks", "rule: from the shapes (jaxoverlap.tuning.policy.fused_chunks)"))
  elif r.chunks > geo.pieces:
    chunks = geo.pieces
    why.append(("chunks", f"requested {r.chunks}, at most {geo.pieces} pieces"))
  else:
    chunks = r.chunks
    why.append(("chunks", "requested"))
  if r.transport == names.AUTO:
    transport = _policy.DEFAULT_FUSED_TRANSPORT
    why.append(("transport", "default: the copy engines take no SMs from the GEMM"))
  elif r.transport == names.NVSHMEM and facts.transport != names.NVSHMEM:
    raise ValueError(f"{op}: transport='nvshmem' needs the NVSHMEM runtime (one GPU per "
                     f"process); this runtime's transport is {facts.transport!r}: use "
                     "'copy_engine' or 'auto'")
  else:
    transport = r.transport
    why.append(("transport", "requested"))
  precision = _precision() if dtype == np.float32 else "default"
  return Plan(**cuda, algorithm=names.FUSED, transport=transport, chunks=chunks,
              precision=precision, command_buffer=facts.fused_command_buffer, geometry=geo,
              why=tuple(why))


@dataclasses.dataclass(frozen=True)
class _Aval:
  shape: tuple[int, ...]
  dtype: Any


def _unfused_all_reduce(r, out_aval, cuda, facts, num_ranks) -> Plan:
  """The all-reduce plan of an "unfused" algorithm (of the GEMM's output, or of p)."""
  sub = Request(names.ALL_REDUCE, r.axis_name, backend=names.CUDA)
  nbytes = _nbytes(out_aval.shape, out_aval.dtype.itemsize)
  base = dict(op=names.ALL_REDUCE, axis_name=r.axis_name, shapes=(out_aval.shape,),
              dtype=out_aval.dtype.name, nbytes=nbytes, num_ranks=num_ranks)
  sub_cuda = dict(base, backend=names.CUDA, ranks_per_node=cuda["ranks_per_node"],
                  num_nodes=cuda["num_nodes"], groups=cuda["groups"])
  if nbytes == 0:
    return Plan(**dict(sub_cuda, backend=names.XLA, groups=None), algorithm=names.COLLECTIVE,
                why=(("backend", "empty output: nothing to communicate"),))
  return _all_reduce_plan(sub, out_aval.dtype, cuda["ranks_per_node"], cuda["num_nodes"], facts,
                          sub_cuda)


# ---------------------------------------------------------------------------- lowering


def _concrete_mesh(ctx):
  """The enclosing shard_map's ``jax.sharding.Mesh``; None for an ``AbstractMesh``.

  (A nested shard_map without ``mesh=`` lowers under an AbstractMesh, whose
  ``devices`` raises ValueError rather than AttributeError.)
  """
  mesh = getattr(ctx.module_context.axis_context, "mesh", None)
  return mesh if isinstance(mesh, jax.sharding.Mesh) else None


def plan_lowering(ctx, request: Request, num_ranks: int) -> Plan:
  """The plan of a call being lowered (``ctx``: JAX's lowering context); logged.

  Every plan is kept for ``decisions()`` and logged at INFO (logger
  ``jaxoverlap``); a fallback of backend "auto" to XLA is logged once per
  reason as a WARNING.
  """
  plan = make_plan(request, ctx.avals_in, _concrete_mesh(ctx), runtime.facts(),
                   num_ranks=num_ranks)
  global _logged
  with _lock:
    _log.append(plan)
    _logged += 1
  why_backend = plan.reason("backend") or ""
  if request.backend == names.AUTO and why_backend.startswith("auto: ") and \
      plan.backend == names.XLA:
    _warn_fallback(request, why_backend[len("auto: "):])
  logger.info("jaxoverlap: %s", plan.summary())
  return plan
