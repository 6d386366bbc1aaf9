"""The timing harness shared by the tuner and the benchmarks.

Problem:
  A collective of a few microseconds cannot be timed call by call from Python:
  the dispatch of one jit'd call costs more than the op. And a wrong but fast
  configuration must never win a comparison.

Algorithm:
  ``chain_time_s`` times one jit'd chain of ``length`` dependent ops (each
  link casts its result back to varying, so XLA cannot drop or merge them);
  ``time_chain_us`` subtracts the same chain without the ops and divides by
  the length: the latency of one op inside XLA's program, launch included.
  Each figure is the median of ``reps`` timed runs after ``warmup``
  untimed ones. ``run_tuning`` checks every configuration against a reference
  before it times it, and records the ones that fail as rejected.

Example:
  >>> from jaxoverlap.tuning import timing
  >>> us = timing.time_chain_us(lambda y: jax.lax.psum(y, "x"), x, mesh=mesh, axis_name="x")
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["run_tuning", "chain_time_s", "time_chain_us"]


def _itemsize(dtype: str) -> int:
  import jax.numpy as jnp  # bfloat16 is registered by ml_dtypes through jax

  return jnp.dtype(dtype).itemsize



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
    ``(records, rejected)``: records of the results format (``jaxoverlap.tuning.results``), and ``{"impl", "bytes",
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
  """Latency of one ``op``, us: (chain of ops - empty chain) / length .

  Args:
    op, x, mesh, axis_name, length, reps, warmup: as ``chain_time_s``.
    empty_s: the empty chain's time if already measured, seconds (saves a
      compile per impl when several are timed at one size).
  """
  kw = dict(mesh=mesh, axis_name=axis_name, length=length, reps=reps, warmup=warmup)
  if empty_s is None:
    empty_s = chain_time_s(None, x, **kw)
  return (chain_time_s(op, x, **kw) - empty_s) / length * 1e6
