"""Rank side: the LL flags wrap after 2^32 calls of a pair, and every result stays right.

Run by tests/gpu/test_gpu_flag_wrap.py in 2 or 4 processes, each test in its own launch (the
pair's call count must start afresh), with

* ``JAXOVERLAP_TEST_PAIR_EPOCH=2**32 - 3``: every pair's count starts there, so the first
  two calls are the last of the LL flags' period (flags 0xFFFFFFFE and 0xFFFFFFFF) and
  the third has flag 0;
* ``JAXOVERLAP_TEST_LL_STALE=1``: every LL cell starts as if a call 2^32 earlier had left
  it, with the flags of the first calls after the wrap (0 in the even slots, 1 in the odd)
  and NaN data.

The two calls at the period end must re-stamp this PE's cells (ffi/all_reduce/all_reduce.cu,
"period end"); a call after the wrap that took a stale cell as new returns NaN. So that the
calls after the wrap read cells that only the re-stamp can have changed:

* the period-end calls are small (``SMALL`` elements), and the all-reduces after the wrap
  fill their LL slots to the last cell (sizes from ``runtime_info()["ll_slot_bytes"]``; each
  call is one launch, which the test checks), so a re-stamp of part of a slot fails too;
* in each call after the wrap one rank starts late (``LATE_S``), so the other polls its
  cells before any of the late rank's stores can have landed: a stale cell is read, not
  raced over. The late rank rotates (rank i % nproc in call i), so at 2 processes each rank
  is checked (at 4, three of them). Every call is compiled
  ahead (AOT), so that compilation cannot eat the delay.

Which kernel ends the period differs by test, since each ends its calls its own way:

* ``finish``: Finish's ticket (one-shot LL, then two-shot LL); after the wrap two-shot LL
  (its all-gather phase re-stamped by the one-shot) and one-shot LL, then the norm;
* ``cluster_end``: all_reduce_rms_norm at one row (its one-cluster end, no ticket), then
  one-shot Lamport (a kernel that uses no LL cell still re-stamps them); after the wrap the
  norm at 4 rows (several clusters: Finish) and at one row;
* ``hierarchical``: 2 or 4 emulated nodes of one rank (JAXOVERLAP_RANKS_PER_NODE=1, with or
  without NVSHMEM puts; 4 nodes take two recursive-doubling steps): hierarchical LL, then
  hierarchical simple; after the wrap hierarchical LL twice (the inter-node phase).

Every element of every call is checked against float64 on every rank, with fresh inputs.
With ``JAXOVERLAP_RANK_TESTS_XLA=1`` (a CPU dry run on backend "xla") the same sequences run
without the wrap, which checks the test itself.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.usefixtures("runtime")

START = 2**32 - 3  # the count before the first call
SMALL = 4096  # float32 elements of a period-end call
HIDDEN = 4096
EPS = 1e-6
LATE_S = 0.5  # how much later the late rank starts a call after the wrap
DRY_RUN_LL_SLOT_BYTES = 2 << 20  # the slot of the default heap, for the CPU dry run


@pytest.fixture
def ll_slot_bytes(topology, nproc, ops) -> int:
  """The LL slot per sender, bytes; skips unless this is a wrap launch (or a dry run)."""
  if nproc not in (2, 4):
    pytest.skip("2 or 4 processes")
  if ops.dry_run:
    return DRY_RUN_LL_SLOT_BYTES
  if (os.environ.get("JAXOVERLAP_TEST_PAIR_EPOCH") != str(START)
      or os.environ.get("JAXOVERLAP_TEST_LL_STALE") != "1"):
    pytest.skip(f"run with JAXOVERLAP_TEST_PAIR_EPOCH={START} and JAXOVERLAP_TEST_LL_STALE=1 "
                "(tests/gpu/test_gpu_flag_wrap.py)")
  ll = int(topology.info["ll_slot_bytes"])
  # A two-shot or hierarchical shard of ll / 8 floats fills an LL slot; one launch takes it
  # only if the simple slots hold it too (ffi/all_reduce/all_reduce.cu, ChunkCapacity).
  assert topology.slot_bytes >= ll // 2, (
      f"slots of {topology.slot_bytes} bytes split a shard of {ll // 8} floats over several "
      "launches, which moves the period end: run with the default JAXOVERLAP_HEAP_BYTES")
  return ll


@dataclasses.dataclass
class Call:
  """One compiled call, its arguments and its float64 reference."""

  name: str
  compiled: Any
  args: tuple
  want: np.ndarray
  values: Callable[[Any], np.ndarray]  # this rank's float64 values of the result


def _parts(seed: int, nproc: int, shape) -> list[np.ndarray]:
  return [np.random.default_rng([seed, r]).standard_normal(shape).astype(np.float32)
          for r in range(nproc)]


def _all_reduce(mesh, ops, rank, nproc, seed, n, algorithm, protocol) -> Call:
  """An all-reduce of n fresh float32 per rank."""
  f = jax.jit(jax.shard_map(
      lambda x: jax.lax.pcast(ops.all_reduce(x, "x", algorithm=algorithm, protocol=protocol),
                              "x", to="varying"),
      mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  parts = _parts(seed, nproc, n)
  want = np.sum(np.stack(parts).astype(np.float64), axis=0)
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), parts[rank],
                                             (n * nproc,))
  return Call(f"{algorithm} {protocol}, {n} floats", f.lower(x).compile(), (x,), want,
              lambda out: np.asarray(out.addressable_data(0), np.float64))


def _norm(mesh, ops, rank, nproc, seed, rows) -> Call:
  """An all_reduce_rms_norm of (rows, HIDDEN) float32: h and y."""
  f = jax.jit(jax.shard_map(
      lambda p, r, w: ops.all_reduce_rms_norm(p, r, w, "x", eps=EPS, algorithm="one_shot"),
      mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P(), P())))
  parts = _parts(seed, nproc, (rows, HIDDEN))
  res = np.random.default_rng([seed, 100]).standard_normal((rows, HIDDEN)).astype(np.float32)
  weight = (1 + 0.1 * np.random.default_rng([seed, 101]).standard_normal(HIDDEN)).astype(
      np.float32)
  h = res.astype(np.float64) + np.sum(np.stack(parts).astype(np.float64), axis=0)
  y = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * weight
  p = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), parts[rank],
                                             (rows * nproc, HIDDEN))
  rep = NamedSharding(mesh, P())  # no device_put: its cross-process check needs NCCL
  r = jax.make_array_from_process_local_data(rep, res, (rows, HIDDEN))
  w = jax.make_array_from_process_local_data(rep, weight, (HIDDEN,))
  return Call(f"norm, {rows} rows", f.lower(p, r, w).compile(), (p, r, w),
              np.concatenate([h, y]),
              lambda out: np.concatenate([np.asarray(o.addressable_data(0), np.float64)
                                          for o in out]))


def _run(calls: list[Call], rank: int, nproc: int) -> None:
  """Runs ``calls`` in order, the first two at the period's end; checks every element.

  From the third call on, rank (i % nproc) starts LATE_S late.
  """
  bad = []
  for i, call in enumerate(calls):
    if i >= 2 and rank == i % nproc:
      time.sleep(LATE_S)
    got = call.values(call.compiled(*call.args))
    err = np.abs(got - call.want) / (np.abs(call.want) + 1)
    wrong = ~(err <= 1e-5)  # NaN counts as wrong
    if wrong.any():
      flag = (START + 1 + i) % 2**32
      bad.append(f"call {i} ({call.name}, flag {flag:#x}): {int(wrong.sum())} of {wrong.size} "
                 f"elements wrong, {int(np.isnan(got).sum())} NaN")
  assert not bad, f"rank {rank}: " + "; ".join(bad)


def test_wrap_after_finish(ll_slot_bytes, topology, mesh, ops, rank, nproc):
  if topology.num_nodes != 1:
    pytest.skip("one node")
  full = ll_slot_bytes // 8  # floats of one sender that fill an LL slot (2 a 16-byte cell)
  calls = [_all_reduce(mesh, ops, rank, nproc, 1, SMALL, "one_shot", "ll"),
           _all_reduce(mesh, ops, rank, nproc, 2, SMALL, "two_shot", "ll"),
           _all_reduce(mesh, ops, rank, nproc, 3, full * nproc, "two_shot", "ll"),
           _all_reduce(mesh, ops, rank, nproc, 4, full, "one_shot", "ll"),
           _norm(mesh, ops, rank, nproc, 5, 4)]
  _run(calls, rank, nproc)


def test_wrap_after_cluster_end(ll_slot_bytes, topology, mesh, ops, rank, nproc):
  if topology.num_nodes != 1:
    pytest.skip("one node")
  calls = [_norm(mesh, ops, rank, nproc, 11, 1),
           _all_reduce(mesh, ops, rank, nproc, 12, SMALL, "one_shot", "lamport"),
           _norm(mesh, ops, rank, nproc, 13, 4),
           _norm(mesh, ops, rank, nproc, 14, 1)]
  _run(calls, rank, nproc)


def test_wrap_hierarchical(ll_slot_bytes, topology, mesh, ops, rank, nproc):
  if topology.num_nodes != nproc:
    pytest.skip("emulated nodes of one rank (JAXOVERLAP_RANKS_PER_NODE=1)")
  # Floats of the inter-node exchange that fill an LL slot. The v4 kernel cuts them into
  # launches of at most 128 blocks x 512 lines (ChunkCapacity), each of which fills the cells
  # a v4 launch uses; the cells above those, v4 neither writes nor polls (the v3 kernel,
  # JAXOVERLAP_HIERARCHICAL_LL=v3, fills the whole slot).
  full = ll_slot_bytes // 8
  calls = [_all_reduce(mesh, ops, rank, nproc, 21, SMALL, "hierarchical", "ll"),
           _all_reduce(mesh, ops, rank, nproc, 22, SMALL, "hierarchical", "simple"),
           _all_reduce(mesh, ops, rank, nproc, 23, full, "hierarchical", "ll"),
           _all_reduce(mesh, ops, rank, nproc, 24, full, "hierarchical", "ll")]
  _run(calls, rank, nproc)
