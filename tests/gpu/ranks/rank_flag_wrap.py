"""Rank side: the LL flags wrap after 2^32 calls of a pair, and every result stays right.

Run by tests/gpu/test_gpu_flag_wrap.py in 2 processes, each test in its own launch (the
pair's call count must start afresh), with

* ``JAXOVERLAP_TEST_PAIR_EPOCH=2**32 - 3``: every pair's count starts there, so the first
  two calls are the last of the LL flags' period (flags 0xFFFFFFFE and 0xFFFFFFFF) and
  the third has flag 0;
* ``JAXOVERLAP_TEST_LL_STALE=1``: every LL cell starts as if a call 2^32 earlier had left
  it, with the flags of the first calls after the wrap (0 in the even slots, 1 in the odd)
  and NaN data.

The two calls at the period end must re-stamp this PE's cells (ffi/all_reduce/all_reduce.cu,
"period end"); a call after the wrap that took a stale cell as new returns NaN. Which kernel
ends the period differs by test, since each ends its calls its own way:

* ``finish``: Finish's ticket (one-shot LL, then two-shot LL); after the wrap two-shot LL
  (its all-gather phase re-stamped by the one-shot) and one-shot LL, then the norm;
* ``cluster_end``: all_reduce_rms_norm at one row (its one-cluster end, no ticket), then
  one-shot Lamport (a kernel that uses no LL cell still re-stamps them); after the wrap the
  norm at 4 rows (several clusters: Finish) and at one row;
* ``hierarchical``: 2 emulated nodes (JAXOVERLAP_RANKS_PER_NODE=1, with or without NVSHMEM
  puts): hierarchical LL, then hierarchical simple; after the wrap hierarchical LL twice
  (the inter-node phase).

Every element of every call is checked against float64 on every rank, with fresh inputs.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.usefixtures("runtime")

START = 2**32 - 3  # the count before the first call
N = 128 * 1024  # float32 elements: 512 KiB, within one LL slot, over 128 blocks
HIDDEN = 4096
EPS = 1e-6


@pytest.fixture
def wrap_run(topology, nproc, ops):
  ops.require_cuda("the LL flags' wrap")
  if (os.environ.get("JAXOVERLAP_TEST_PAIR_EPOCH") != str(START)
      or os.environ.get("JAXOVERLAP_TEST_LL_STALE") != "1"):
    pytest.skip(f"run with JAXOVERLAP_TEST_PAIR_EPOCH={START} and JAXOVERLAP_TEST_LL_STALE=1 "
                "(tests/gpu/test_gpu_flag_wrap.py)")
  if nproc != 2:
    pytest.skip("2 processes")


def _parts(seed: int, nproc: int, shape) -> list[np.ndarray]:
  return [np.random.default_rng([seed, r]).standard_normal(shape).astype(np.float32)
          for r in range(nproc)]


def _all_reduce(mesh, ops, rank, nproc, seed, algorithm, protocol):
  """One all-reduce of N fresh float32 per rank: (got, want), float64."""
  f = jax.jit(jax.shard_map(
      lambda x: jax.lax.pcast(ops.all_reduce(x, "x", algorithm=algorithm, protocol=protocol),
                              "x", to="varying"),
      mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  parts = _parts(seed, nproc, N)
  want = np.sum(np.stack(parts).astype(np.float64), axis=0)
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), parts[rank],
                                             (N * nproc,))
  return np.asarray(f(x).addressable_data(0), np.float64), want


def _norm(mesh, rank, nproc, seed, rows):
  """One all_reduce_rms_norm of (rows, HIDDEN) float32: (got h|y, want h|y), float64."""
  import jaxoverlap

  f = jax.jit(jax.shard_map(
      lambda p, r, w: jaxoverlap.all_reduce_rms_norm(p, r, w, "x", eps=EPS, backend="cuda",
                                                     algorithm="one_shot"),
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
  got = [np.asarray(o.addressable_data(0), np.float64) for o in f(p, r, w)]
  return np.concatenate(got), np.concatenate([h, y])


def _run(calls, rank):
  """Runs ``calls`` (name, thunk) in order, the first at the period's second-to-last flag."""
  bad = []
  for i, (name, call) in enumerate(calls):
    flag = (START + 1 + i) % 2**32
    got, want = call()
    err = np.abs(got - want) / (np.abs(want) + 1)
    wrong = ~(err <= 1e-5)  # NaN counts as wrong
    if wrong.any():
      bad.append(f"call {i} ({name}, flag {flag:#x}): {int(wrong.sum())} of {wrong.size} "
                 f"elements wrong, {int(np.isnan(got).sum())} NaN")
  assert not bad, f"rank {rank}: " + "; ".join(bad)


def test_wrap_after_finish(wrap_run, topology, mesh, ops, rank, nproc):
  if topology.num_nodes != 1:
    pytest.skip("one node")
  ar = functools.partial(_all_reduce, mesh, ops, rank, nproc)
  _run([("one_shot ll, period end", functools.partial(ar, 1, "one_shot", "ll")),
        ("two_shot ll, period end", functools.partial(ar, 2, "two_shot", "ll")),
        ("two_shot ll", functools.partial(ar, 3, "two_shot", "ll")),
        ("one_shot ll", functools.partial(ar, 4, "one_shot", "ll")),
        ("norm, 4 rows", functools.partial(_norm, mesh, rank, nproc, 5, 4))], rank)


def test_wrap_after_cluster_end(wrap_run, topology, mesh, ops, rank, nproc):
  if topology.num_nodes != 1:
    pytest.skip("one node")
  norm = functools.partial(_norm, mesh, rank, nproc)
  _run([("norm, 1 row, period end", functools.partial(norm, 11, 1)),
        ("one_shot lamport, period end",
         functools.partial(_all_reduce, mesh, ops, rank, nproc, 12, "one_shot", "lamport")),
        ("norm, 4 rows", functools.partial(norm, 13, 4)),
        ("norm, 1 row", functools.partial(norm, 14, 1))], rank)


def test_wrap_hierarchical(wrap_run, topology, mesh, ops, rank, nproc):
  if topology.num_nodes != 2:
    pytest.skip("2 emulated nodes (JAXOVERLAP_RANKS_PER_NODE=1)")
  ar = functools.partial(_all_reduce, mesh, ops, rank, nproc)
  _run([("hierarchical ll, period end", functools.partial(ar, 21, "hierarchical", "ll")),
        ("hierarchical simple, period end",
         functools.partial(ar, 22, "hierarchical", "simple")),
        ("hierarchical ll", functools.partial(ar, 23, "hierarchical", "ll")),
        ("hierarchical ll", functools.partial(ar, 24, "hierarchical", "ll"))], rank)
