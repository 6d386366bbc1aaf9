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
  untimed ones. ``time_chains_us`` times several ops' chains interleaved
  (one run of each, the empty chain included, per round), so that a slow
  spell of the host or the GPUs falls on all of them alike rather than on
  whichever was being timed then. With several processes, a barrier (a small
  psum) lines the processes up before each timed run, and a round's time is
  the slowest process's: a process that starts late would otherwise hide
  its lateness in its peer's first collective, and one clock would speak for
  all. ``time_chains_stats_us`` also gives the 10th and 90th percentiles
  over rounds, the spread a figure must be read against. ``run_tuning``
  checks every configuration against a reference before it times it, and
  records the ones that fail as rejected.

Example:
  >>> from jaxoverlap.tuning import timing
  >>> us = timing.time_chain_us(lambda y: jax.lax.psum(y, "x"), x, mesh=mesh, axis_name="x")
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["run_tuning", "chain_time_s", "time_chain_us", "time_chains_us",
           "time_chains_stats_us", "time_interleaved", "spread_us"]


def _itemsize(dtype: str) -> int:
  import jax.numpy as jnp  # bfloat16 is registered by ml_dtypes through jax

  return jnp.dtype(dtype).itemsize



def run_tuning(
    measure: Callable[[str, int], float] | None,
    check: Callable[[str, int], str | None],
    impls: Sequence[str],
    sizes: Sequence[int],
    *,
    dtype: str,
    ranks_per_node: int,
    world: int,
    log: Callable[[str], None] = lambda s: None,
    measure_row: Callable[[Sequence[str], int], Mapping[str, float]] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """Checks, then times, every impl at every size.

  Args:
    measure: ``measure(impl, nbytes) -> us``, median latency of one op; None
      when ``measure_row`` is given.
    check: ``check(impl, nbytes) -> None`` when the impl's result equals
      psum's, else the reason it does not (or why it cannot run). An impl that
      fails is not timed at that size, so a wrong but fast one never wins.
    impls: ``impl_name`` strings, ``"xla:psum"`` among them.
    sizes: message sizes per rank, bytes.
    dtype: element type name (e.g. ``"bfloat16"``).
    ranks_per_node, world: the topology measured.
    log: receives one line per size.
    measure_row: ``measure_row(impls, nbytes) -> {impl: us}``, the impls that
      passed their check at one size timed together (``time_chains_us``);
      used instead of ``measure`` when given. A value may also be a
      ``spread_us`` dict (``time_chains_stats_us``): its percentiles go into
      the record as ``time_us_p10`` and ``time_us_p90``.

  Returns:
    ``(records, rejected)``: records of the results format
    (``jaxoverlap.tuning.results``), and ``{"impl", "bytes", "reason"}`` for
    each configuration that failed its check or was timed at a value that is
    not a finite number.

  Raises:
    ValueError: neither ``measure`` nor ``measure_row`` given.
  """
  if measure is None and measure_row is None:
    raise ValueError("run_tuning: give measure or measure_row")
  itemsize = _itemsize(dtype)
  records, rejected = [], []
  for nbytes in sizes:
    reasons = {impl: check(impl, nbytes) for impl in impls}
    passed = [impl for impl in impls if reasons[impl] is None]
    if measure_row is not None:
      times = dict(measure_row(passed, nbytes)) if passed else {}
    else:
      times = {impl: measure(impl, nbytes) for impl in passed}
    row = []
    for impl in impls:
      if reasons[impl] is not None:
        rejected.append({"impl": impl, "bytes": nbytes, "reason": reasons[impl]})
        row.append(f"{impl}=rejected")
        continue
      timed = times[impl]
      spread = timed if isinstance(timed, Mapping) else {"time_us": timed}
      us = float(spread["time_us"])
      if not math.isfinite(us):  # a broken timer: not a time a policy may compare
        rejected.append({"impl": impl, "bytes": nbytes, "reason": f"timed {us} us"})
        row.append(f"{impl}=rejected")
        continue
      records.append({"op": "all_reduce", "impl": impl, "dtype": dtype, "bytes": nbytes,
                      "shape": [nbytes // itemsize], "world": world,
                      "ranks_per_node": ranks_per_node, "time_us": round(max(us, 0.01), 2),
                      **{f"time_us_{q}": round(max(float(spread[f"{q}_us"]), 0.01), 2)
                         for q in ("p10", "p90") if f"{q}_us" in spread}})
      row.append(f"{impl}={us:.1f}us")
    log(f"{nbytes:>10} B  " + "  ".join(row))
  return records, rejected


def _chain_fn(op: Callable | None, *, mesh, axis_name: str, length: int,
              compiler_options: Mapping[str, Any] | None = None, x=None):
  """The jit'd chain of ``length`` links of ``op`` (None: the links without the op).

  With ``compiler_options`` (XLA options for this program alone, e.g.
  ``{"xla_gpu_enable_command_buffer": ...}``) the chain is compiled for ``x``
  at once with them.
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
  if compiler_options:
    return fn.lower(x).compile(compiler_options=dict(compiler_options))
  return fn


def spread_us(values: Sequence[float]) -> dict[str, float]:
  """The median and the 10th and 90th percentiles of ``values``, us.

  Returns:
    ``{"time_us", "p10_us", "p90_us"}`` (inclusive percentiles; one value
    gives itself for all three).

  Raises:
    ValueError: no values.
  """
  values = [float(v) for v in values]
  if not values:
    raise ValueError("spread_us: no values")
  if len(values) == 1:
    return {"time_us": values[0], "p10_us": values[0], "p90_us": values[0]}
  deciles = statistics.quantiles(values, n=10, method="inclusive")
  return {"time_us": statistics.median(values), "p10_us": deciles[0], "p90_us": deciles[-1]}


def _process_barrier(mesh, axis_name: str) -> Callable[[], None] | None:
  """A small psum over ``mesh`` that lines the processes up; None with one process."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  if jax.process_count() == 1:
    return None
  spec = P(axis_name)
  ones = jax.make_array_from_process_local_data(
      NamedSharding(mesh, spec), np.ones(len(mesh.local_devices), np.float32),
      (mesh.devices.size,))
  psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, axis_name), mesh=mesh,
                               in_specs=spec, out_specs=spec))
  return lambda: psum(ones).block_until_ready()


def _slowest_process(times: dict[Any, list[float]]) -> dict[Any, list[float]]:
  """Each round's time of every key, the largest over the processes (all must call it)."""
  import jax
  import numpy as np

  if jax.process_count() == 1:
    return times
  from jax.experimental import multihost_utils

  keys = list(times)
  table = np.asarray([times[k] for k in keys], np.float64)
  every = np.asarray(multihost_utils.process_allgather(table))  # [processes, keys, rounds]
  return {k: [float(v) for v in row] for k, row in zip(keys, every.max(axis=0))}


def _run_s(fn, x) -> float:
  t = time.perf_counter()
  fn(x).block_until_ready()
  return time.perf_counter() - t


def chain_time_s(op: Callable | None, x, *, mesh, axis_name: str, length: int = 50,
                 reps: int = 30, warmup: int = 3) -> float:
  """Median wall time of one run of a chain of ``length`` ops in one jit, seconds.

  Each link applies ``op`` to the previous result and casts it back to varying
  over ``axis_name``; ``op=None`` gives the same chain without the ops. An
  all-reduce multiplies the values by the group size at every link: with 8
  ranks, bf16 and 50 links the last links carry inf, which does not change
  what is timed (no kernel here branches on the values' size).

  Args:
    op: per-shard function (inside ``shard_map``), e.g. ``lambda y:
      lax.psum(y, "x")``; None for the empty chain.
    x: global array sharded over ``axis_name`` along dimension 0.
    mesh: the mesh; axis_name: its axis.
    length: ops per chain. reps: timed runs (median). warmup: untimed runs.
  """
  fn = _chain_fn(op, mesh=mesh, axis_name=axis_name, length=length)
  for _ in range(warmup):
    fn(x).block_until_ready()
  return statistics.median(_run_s(fn, x) for _ in range(reps))


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


def time_interleaved(calls: Mapping[Any, Callable[[], Any]], *, reps: int, warmup: int,
                     before: Callable[[], Any] | None = None) -> dict[Any, list[float]]:
  """Wall seconds of each call, ``reps`` times, the calls in turn within each rep.

  Interleaving makes slow drift (clocks, temperature, other load) hit every
  call alike, so the figures of one table compare.

  Args:
    calls: key -> a function that runs once (its result is waited for).
    reps: timed runs of each call.
    warmup: untimed runs of each call first.
    before: run (untimed) before each timed call, e.g. a barrier.

  Returns:
    key -> ``reps`` durations, seconds; entry i of every key comes from round i.
  """
  import jax

  for call in calls.values():
    for _ in range(warmup):
      jax.block_until_ready(call())
  times: dict[Any, list[float]] = {key: [] for key in calls}
  for _ in range(reps):
    for key, call in calls.items():
      if before is not None:
        before()
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      times[key].append(time.perf_counter() - t0)
  return times


def time_chains_stats_us(ops: Mapping[str, Callable], x, *, mesh, axis_name: str,
                         length: int = 50, reps: int = 30, warmup: int = 3,
                         compiler_options: Mapping[str, Mapping[str, Any]] | None = None,
                         ) -> dict[str, dict[str, float]]:
  """Latency of each of ``ops``, us, timed interleaved, with its spread over rounds.

  Each round runs the empty chain and then every op's chain once, in turn
  (``time_interleaved``); an op's round gives (its chain - that round's
  empty chain) / length. Where ``time_chain_us`` times one op after the
  other, a slow spell of the host (launch jitter) or of the GPUs lands on one
  op; here it lands on every op of the round, and the median drops it. With
  several processes, a small psum lines them up before every timed run, and
  a round's time of a chain is the largest over the processes (gathered with
  ``multihost_utils.process_allgather``): both are device collectives, so
  processes that share a GPU, where NCCL refuses to run, cannot be timed.

  Args:
    ops: name -> per-shard function, as ``op`` of ``chain_time_s``.
    x, mesh, axis_name, length: as ``chain_time_s``.
    reps: rounds. warmup: untimed runs of each chain first.
    compiler_options: name -> XLA options for that op's chain alone (e.g.
      psum with ``COLLECTIVES`` in XLA's command buffers beside the default
      psum, in one run); the empty chain keeps XLA's defaults.

  Returns:
    name -> ``spread_us`` of its rounds (``time_us``: the median; ``p10_us``,
    ``p90_us``), in the order of ``ops``.
  """
  kw = dict(mesh=mesh, axis_name=axis_name, length=length)
  options = compiler_options or {}
  empty = object()  # a key no op name can equal
  fns = {empty: _chain_fn(None, **kw),
         **{name: _chain_fn(op, **kw, compiler_options=options.get(name), x=x)
            for name, op in ops.items()}}
  times = time_interleaved({key: (lambda fn=fn: fn(x)) for key, fn in fns.items()}, reps=reps,
                           warmup=warmup, before=_process_barrier(mesh, axis_name))
  times = _slowest_process(times)
  base = times.pop(empty)
  return {name: spread_us([(t - b) / length * 1e6 for t, b in zip(ts, base)])
          for name, ts in times.items()}


def time_chains_us(ops: Mapping[str, Callable], x, *, mesh, axis_name: str, length: int = 50,
                   reps: int = 30, warmup: int = 3) -> dict[str, float]:
  """Latency of each of ``ops``, us: the medians of ``time_chains_stats_us``.

  Returns:
    name -> us, in the order of ``ops``.
  """
  stats = time_chains_stats_us(ops, x, mesh=mesh, axis_name=axis_name, length=length, reps=reps,
                               warmup=warmup)
  return {name: s["time_us"] for name, s in stats.items()}
