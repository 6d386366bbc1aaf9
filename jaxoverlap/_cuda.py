"""The CUDA backend's custom calls: FFI lowerings emitted from a plan.

Problem:
  Once ``jaxoverlap.dispatch`` has planned a call for backend "cuda", the
  lowering must emit the matching XLA FFI custom call with the attributes the
  C++ handler decodes (``ffi/``), and nothing more.

Algorithm:
  Each function turns a ``Plan`` into ``jax.ffi.ffi_lowering(target)`` with
  the PE groups and the plan's choices as attributes. The enum attributes
  (algorithm, protocol, transport, precision) take their values from the
  enums the extension exports under the names of ``jaxoverlap.names``, so no
  table of ids is kept in Python; the handler decodes them (and the fused
  ops' attributes as one struct, ``overlap.h``'s ``Attrs``).

Example:
  >>> _cuda.all_reduce(ctx, x, plan)   # inside a lowering rule
"""

from __future__ import annotations

import jax
import numpy as np

from jaxoverlap import _ffi, names

__all__ = ["all_reduce", "all_reduce_rms_norm", "fused", "launch_floor", "reduce_scatter_stage",
           "all_gather_stage"]

_FUSED_TARGETS = {
    names.ALL_GATHER_MATMUL: "jaxoverlap_all_gather_matmul",
    names.MATMUL_REDUCE_SCATTER: "jaxoverlap_matmul_reduce_scatter",
    names.MATMUL_ALL_REDUCE: "jaxoverlap_matmul_all_reduce",
}


def _groups(plan):
  return dict(groups=np.asarray(plan.groups, dtype=np.int64).reshape(-1),
              group_size=np.int64(len(plan.groups[0])))


def _enum(kind: str, name: str) -> np.int32:
  """The C++ enum value of ``name`` in the extension's enum ``kind`` (int32 attribute)."""
  return np.int32(getattr(_ffi.load(), kind)[name].value)


def all_reduce(ctx, x, plan):
  """The all-reduce custom call of a plan with backend "cuda"."""
  return jax.ffi.ffi_lowering("jaxoverlap_all_reduce")(
      ctx, x, **_groups(plan),
      algorithm=_enum("AllReduceAlgorithm", plan.algorithm),
      protocol=_enum("Protocol", plan.protocol))


def all_reduce_rms_norm(ctx, p, residual, weight, plan, eps: float):
  """The fused all-reduce + residual + RMSNorm custom call (one-shot LL, one launch)."""
  return jax.ffi.ffi_lowering("jaxoverlap_all_reduce_rms_norm")(
      ctx, p, residual, weight, **_groups(plan), eps=np.float32(eps))


def reduce_scatter_stage(piece: jax.Array, plan, shard: int) -> jax.Array:
  """Traceable: this rank's reduced shard (float32 [shard]) of ``piece`` within its node."""
  out = jax.typeof(piece).update(shape=(shard,), dtype=np.dtype(np.float32))
  return jax.ffi.ffi_call("jaxoverlap_all_reduce_reduce_scatter", out)(piece, **_groups(plan))


def all_gather_stage(shard: jax.Array, plan, length: int, dtype) -> jax.Array:
  """Traceable: the node's shards gathered into ``length`` elements of ``dtype``."""
  out = jax.typeof(shard).update(shape=(length,), dtype=np.dtype(dtype))
  return jax.ffi.ffi_call("jaxoverlap_all_reduce_all_gather", out)(shard, **_groups(plan))


def fused(ctx, args, plan, *, gathered: bool = False):
  """The fused GEMM op's custom call of a plan with backend "cuda" (algorithm "fused").

  ``gathered`` (all_gather_matmul): the target that also returns the gathered x.
  ``plan.command_buffer`` selects the handler variant that XLA may record into
  its CUDA graphs (``ffi/overlap/overlap_ffi.cc`` says why both exist).
  """
  target = _FUSED_TARGETS[plan.op] + ("_gathered" if gathered else "")
  if plan.command_buffer:
    target += "_cmdbuf"
  g = plan.geometry
  return jax.ffi.ffi_lowering(target)(
      ctx, *args, **_groups(plan),
      transport=_enum("Transport", plan.transport),
      chunks=np.int64(plan.chunks),
      precision=_enum("Precision", plan.precision),
      outer=np.int64(g.outer), rows=np.int64(g.rows), k=np.int64(g.k), n=np.int64(g.n))


# The bookkeeping variants' parts (ffi/launch_floor.cu): 1 the epoch read before the
# stores, 2 Finish's end ticket, 4 its fence, 8 the start counter instead of the ticket,
# 16 a ticket at the start instead.
_BOOKKEEPING_PARTS = {"bookkeeping": 1 | 2 | 4, "bookkeeping_nofence": 1 | 2, "epoch_read": 1,
                      "end_ticket": 2 | 4, "start_count": 8, "start_ticket": 16}
_SHAPED = {"empty": 0, "threads128": 128}  # threads a block of the copy; 0: no kernel
LAUNCH_FLOOR_VARIANTS = ("plain", "pdl", *_BOOKKEEPING_PARTS, *_SHAPED)


def launch_floor(x: jax.Array, *, variant: str = "plain") -> jax.Array:
  """A custom call that copies ``x`` with one kernel and no communication.

  A benchmark aid: timed in the same chain as the all-reduces, it is the cost
  any single-kernel FFI call pays inside XLA (ffi/launch_floor.cu).

  Args:
    x: any array on one GPU.
    variant: "plain"; "pdl" (launched with programmatic dependent launch); or
      parts of the all-reduce kernels' per-call bookkeeping, without
      communication: "bookkeeping" (every thread reads the call's epoch before
      its first store; at the end each block takes a ticket and the last one
      advances the epoch and fences, as ``Finish`` did until it stopped
      fencing), "bookkeeping_nofence" (the same without the fence: today's
      ``Finish``), "epoch_read" (the read alone),
      "end_ticket" (the end alone), "start_count" (one read per block, then a
      release add to a start counter; at the end block 0 waits for every
      block's add and advances the epoch: no ticket at the end), "start_ticket"
      (one read per block, a barrier, then a ticket; the last block to take one
      advances the epoch at its start: nothing at the end); "threads128" (the
      copy in blocks of 128 threads, as XLA's small fusions, instead of 512);
      "empty" (no kernel: the output aliases ``x``, so the call is only XLA's
      custom-call node).

  Raises:
    ValueError: an unknown ``variant``.
  """
  if variant not in LAUNCH_FLOOR_VARIANTS:
    raise ValueError(f"launch_floor: variant must be one of {LAUNCH_FLOOR_VARIANTS}, got "
                     f"{variant!r}")
  _ffi.load()
  if variant in _SHAPED:
    aliases = {0: 0} if _SHAPED[variant] == 0 else {}
    return jax.ffi.ffi_call("jaxoverlap_launch_floor_shaped", jax.typeof(x),
                            input_output_aliases=aliases)(x, threads=np.int32(_SHAPED[variant]))
  if variant in _BOOKKEEPING_PARTS:
    return jax.ffi.ffi_call("jaxoverlap_launch_floor_bookkeeping", jax.typeof(x))(
        x, parts=np.int32(_BOOKKEEPING_PARTS[variant]))
  target = "jaxoverlap_launch_floor_pdl" if variant == "pdl" else "jaxoverlap_launch_floor"
  return jax.ffi.ffi_call(target, jax.typeof(x))(x)
