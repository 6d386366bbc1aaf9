"""The vocabulary of jaxoverlap: ops, backends, algorithms, protocols and transports.

Problem:
  Every public op takes ``backend=``, ``algorithm=`` and, on the CUDA kernels,
  ``protocol=``, ``transport=`` and ``chunks=``. The dispatcher
  (``jaxoverlap.dispatch``), the lowerings (``jaxoverlap._cuda``), the tuner and
  the benchmarks must all spell these values alike, and the C++ handlers must
  agree on their enum values.

Algorithm:
  This module is the one place that names them. ``algorithm=`` names an
  algorithm and nothing else; how data moves is ``transport=``, and the CUDA
  all-reduce's wire format is ``protocol=``. The C++ enum values are not kept
  here: the extension exports its enums under these same names
  (``_jaxoverlap_cuda.AllReduceAlgorithm`` etc.) and the FFI decodes them as enum
  attributes; ``tests/test_extension.py`` checks that both sides list the same
  names.

  ===================== ======================== ==================================
  op                    backend "xla"            backend "cuda"
  ===================== ======================== ==================================
  all_reduce            collective, ppermute     one_shot, two_shot, hierarchical
                                                 (protocol ll, simple or lamport;
                                                 lamport: one_shot and two_shot)
  all_gather_matmul     collective, ppermute     fused (transport copy_engine or
  matmul_reduce_scatter                          nvshmem)
  matmul_all_reduce     collective, ppermute     fused, unfused (the GEMM, then
                                                 the CUDA all_reduce)
  all_reduce_rms_norm   collective, ppermute     one_shot (LL, the norm in the
                                                 all-reduce's epilogue), unfused
                                                 (the CUDA all_reduce, then the
                                                 norm in XLA)
  ===================== ======================== ==================================

Example:
  >>> from jaxoverlap import names
  >>> names.algorithms("all_reduce", names.CUDA)
  ('one_shot', 'two_shot', 'hierarchical')
  >>> names.backend_of_algorithm("matmul_all_reduce", "unfused")
  'cuda'
"""

from __future__ import annotations

__all__ = [
    "AUTO",
    "ALL_REDUCE", "ALL_GATHER_MATMUL", "MATMUL_REDUCE_SCATTER", "MATMUL_ALL_REDUCE",
    "ALL_REDUCE_RMS_NORM",
    "OPS", "FUSED_OPS",
    "XLA", "CUDA", "BACKENDS",
    "COLLECTIVE", "PPERMUTE", "ONE_SHOT", "TWO_SHOT", "HIERARCHICAL", "FUSED", "UNFUSED",
    "LL", "SIMPLE", "LAMPORT", "PROTOCOLS",
    "NVSHMEM", "PEER", "COPY_ENGINE", "RUNTIME_TRANSPORTS",
    "algorithms", "protocols", "transports", "backend_of_algorithm", "renamed_value",
    "axis_names",
]

AUTO = "auto"

# Ops, as the public functions are named.
ALL_REDUCE = "all_reduce"
ALL_GATHER_MATMUL = "all_gather_matmul"
MATMUL_REDUCE_SCATTER = "matmul_reduce_scatter"
MATMUL_ALL_REDUCE = "matmul_all_reduce"
# residual + all_reduce(p), then RMSNorm of the sum (one kernel on backend "cuda").
ALL_REDUCE_RMS_NORM = "all_reduce_rms_norm"
OPS = (ALL_REDUCE, ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE,
       ALL_REDUCE_RMS_NORM)
FUSED_OPS = (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE)

# Backends. "xla": pure JAX (lax collectives); "cuda": this package's kernels.
XLA = "xla"
CUDA = "cuda"
BACKENDS = (AUTO, XLA, CUDA)

# Algorithms of backend "xla" (every op).
COLLECTIVE = "collective"  # the lax collective next to one GEMM (psum, all_gather, psum_scatter)
PPERMUTE = "ppermute"      # a ring of lax.ppermute steps in CommFuse's rank-adaptive order
# Algorithms of backend "cuda".
ONE_SHOT = "one_shot"          # all_reduce: every rank reads every peer's buffer, sums locally
TWO_SHOT = "two_shot"          # all_reduce: reduce-scatter, then all-gather, within a node
HIERARCHICAL = "hierarchical"  # all_reduce: NVRAR (intra-node RS, recursive doubling, AG)
FUSED = "fused"                # GEMM ops: CommFuse's peer-to-peer decomposition, one custom call
UNFUSED = "unfused"            # matmul_all_reduce: the GEMM, then the CUDA all_reduce;
                               # all_reduce_rms_norm: the CUDA all_reduce, then the norm

_ALGORITHMS = {
    XLA: {op: (COLLECTIVE, PPERMUTE) for op in OPS},
    CUDA: {
        ALL_REDUCE: (ONE_SHOT, TWO_SHOT, HIERARCHICAL),
        ALL_GATHER_MATMUL: (FUSED,),
        MATMUL_REDUCE_SCATTER: (FUSED,),
        MATMUL_ALL_REDUCE: (FUSED, UNFUSED),
        ALL_REDUCE_RMS_NORM: (ONE_SHOT, UNFUSED),
    },
}

# Protocols of the CUDA all-reduce: "ll" sends 8-byte cells of 4 B data and a
# 4 B epoch flag (no separate signal); "simple" sends the data, then a flag;
# "lamport" (one_shot and two_shot) sends the data alone into slots that read
# as an empty pattern until it arrives, and the receiver empties them again.
LL = "ll"
SIMPLE = "simple"
LAMPORT = "lamport"
PROTOCOLS = (LL, SIMPLE, LAMPORT)
_PROTOCOLS = {ONE_SHOT: (LL, SIMPLE, LAMPORT), TWO_SHOT: (LL, SIMPLE, LAMPORT),
              HIERARCHICAL: (LL, SIMPLE)}

# Transports of the CUDA kernels. "nvshmem": the NVSHMEM runtime, one PE per
# process (all_reduce: direct NVLink stores to load/store-reachable peers and
# NVSHMEM puts to the others; fused ops: NVSHMEM block puts from a kernel).
# "peer": the in-process runtime, one process driving several GPUs of a node
# with CUDA peer access (all_reduce: direct NVLink stores). "copy_engine": the
# fused ops' shards moved by cudaMemcpyAsync into the peer's slot (no SM taken
# from the GEMM), under either runtime.
NVSHMEM = "nvshmem"
PEER = "peer"
COPY_ENGINE = "copy_engine"
RUNTIME_TRANSPORTS = (NVSHMEM, PEER)
_TRANSPORTS = {
    ALL_REDUCE: (NVSHMEM, PEER),
    ALL_GATHER_MATMUL: (COPY_ENGINE, NVSHMEM),
    MATMUL_REDUCE_SCATTER: (COPY_ENGINE, NVSHMEM),
    MATMUL_ALL_REDUCE: (COPY_ENGINE, NVSHMEM),
    ALL_REDUCE_RMS_NORM: (),  # no transport keyword: its kernel runs over the runtime's
}

# Values of version 0.1 that now have another name or keyword.
_RENAMED = {
    ALL_REDUCE: {
        "one_shot_ll": "algorithm='one_shot', protocol='ll'",
        "one_shot_simple": "algorithm='one_shot', protocol='simple'",
        "hierarchical_ll": "algorithm='hierarchical', protocol='ll'",
        "hierarchical_simple": "algorithm='hierarchical', protocol='simple'",
    },
    **{op: {COPY_ENGINE: "algorithm='fused', transport='copy_engine'",
            NVSHMEM: "algorithm='fused', transport='nvshmem'"} for op in FUSED_OPS},
}
_RENAMED[MATMUL_ALL_REDUCE]["gemm_all_reduce"] = "algorithm='unfused'"


def _check_op(op: str) -> None:
  if op not in OPS:
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


def algorithms(op: str, backend: str | None = None) -> tuple[str, ...]:
  """The algorithms of ``op`` on ``backend`` ("xla" or "cuda"), or on both (None).

  Raises:
    ValueError: unknown op or backend.
  """
  _check_op(op)
  if backend is None:
    return _ALGORITHMS[XLA][op] + _ALGORITHMS[CUDA][op]
  if backend not in (XLA, CUDA):
    raise ValueError(f"backend must be {XLA!r} or {CUDA!r}, got {backend!r}")
  return _ALGORITHMS[backend][op]


def backend_of_algorithm(op: str, algorithm: str) -> str | None:
  """The backend that has ``algorithm`` for ``op``; None for "auto" or an unknown name."""
  for backend in (XLA, CUDA):
    if algorithm in _ALGORITHMS[backend][op]:
      return backend
  return None


def protocols(algorithm: str | None = None) -> tuple[str, ...]:
  """The protocols of a CUDA all-reduce algorithm (all of them for None); () for others."""
  if algorithm is None:
    return PROTOCOLS
  return _PROTOCOLS.get(algorithm, ())


def transports(op: str) -> tuple[str, ...]:
  """The values of ``op``'s ``transport`` keyword besides "auto" (backend "cuda").

  Empty for ``all_reduce_rms_norm``, which takes no ``transport``: its kernel
  runs over the runtime's transport, as ``all_reduce``'s "auto" does.

  Raises:
    ValueError: an unknown ``op``.
  """
  _check_op(op)
  return _TRANSPORTS[op]


def renamed_value(op: str, value: str) -> str | None:
  """How to spell a value of version 0.1 now (e.g. ``"one_shot_ll"``), or None."""
  return _RENAMED.get(op, {}).get(value)


def axis_names(axis_name) -> tuple[str, ...]:
  """A mesh axis name, or a tuple of them, as a tuple (checked by ``_checks`` at trace time)."""
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)
