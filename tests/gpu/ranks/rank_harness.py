"""Rank side of tests/gpu/test_gpu_harness.py: the harness itself, on CPU processes.

Run with 2 CPU processes (``JAX_PLATFORMS=cpu``, one device each) through the
launcher; no GPU, no NVSHMEM. ``JAXOVERLAP_HARNESS_PLANT=1`` plants a failure
on rank 1 only, which the outer test must report with that rank's message;
``JAXOVERLAP_HARNESS_HANG=1`` makes rank 1 hang in the first test, before any
test finished there, which the outer test's start-up watchdog must stop.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PLANTED = "planted failure on rank 1"


def test_hang_when_asked(rank):
  if os.environ.get("JAXOVERLAP_HARNESS_HANG") == "1" and rank == 1:
    time.sleep(600)


def test_psum_across_processes(mesh, kv, rank, nproc):
  # A real collective between the processes, checked against every rank's input.
  xs = [np.arange(8, dtype=np.float32) * (r + 1) for r in range(nproc)]
  x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), xs[rank], (8 * nproc,))
  f = jax.jit(jax.shard_map(lambda a: jax.lax.pcast(jax.lax.psum(a, "x"), "x", to="varying"),
                            mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  got = np.asarray(f(x).addressable_shards[0].data)
  same, digests = kv.same_on_all_ranks(got)
  assert np.array_equal(got, np.sum(xs, axis=0)), got
  assert same, digests
  assert kv.gather(str(rank)) == [str(r) for r in range(nproc)]


def test_planted_failure(rank):
  planted = os.environ.get("JAXOVERLAP_HARNESS_PLANT") == "1"
  assert not (planted and rank == 1), PLANTED


def test_skipped_on_every_rank():
  pytest.skip("skipped alike on every rank")
