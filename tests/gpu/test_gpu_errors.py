"""Failures of the CUDA backend are clear errors, never hangs (2 processes; tests/gpu/ranks).

Each test is its own launch of ranks/rank_errors.py: the too-small heap needs a
process without the runtime, and the device-wait timeout loses rank 0's GPU
context.
"""

import pytest

import _harness
from _harness import World

pytestmark = [pytest.mark.gpu, _harness.requires_gpus]


def _run_timing_out(tmp_path, rank_test: str):
  """One launch of rank_test in 2 processes with 2 s device waits; checked on every rank."""
  run = _harness.run_ranks(tmp_path, "rank_errors.py", World(2, 2), select=("-k", rank_test),
                           timeout_s=150, env={"JAXOVERLAP_TIMEOUT_S": "2"})
  run.print_summary()
  run.check()
  return run


def test_heap_too_small(tmp_path):
  # Its ranks are meant not to bring the runtime up: later packed launches must still run.
  run = _harness.run_ranks(tmp_path, "rank_errors.py", World(2, 2),
                           select=("-k", "test_heap_too_small_is_refused"), timeout_s=120,
                           needs_runtime=False)
  run.print_summary()
  run.check()


def test_finalize_then_initialize(tmp_path):
  """Trial 19: after finalize() and a new initialize(), a function jitted before ran its
  recorded CUDA graph on the freed heap; finalize() now clears JAX's caches."""
  run = _harness.run_ranks(tmp_path, "rank_errors.py", World(2, 2),
                           select=("-k", "test_finalize_then_initialize_runs_again"),
                           timeout_s=240)
  run.print_summary()
  run.check()


@pytest.mark.parametrize("protocol", ["ll", "simple", "lamport"])
def test_device_wait_timeout(tmp_path, protocol):
  """Each protocol's wait names op, peer and step in its own terms (trial 29: a Lamport
  timeout reported a "signal seen" that the protocol does not have)."""
  _run_timing_out(tmp_path, f"test_device_wait_timeout_names_the_peer and protocol_{protocol}")


def test_norm_wait_timeout(tmp_path):
  """Issue: the fused all-reduce + RMSNorm's timeouts were reported as all_reduce's."""
  run = _run_timing_out(tmp_path, "test_norm_wait_timeout_names_the_op")
  assert "jaxoverlap: all_reduce_rms_norm timed out on PE" in run.output(), run.tail()


def test_mismatched_sizes_are_named(tmp_path):
  """Issue: ranks that all-reduce different sizes got only CUDA_ERROR_LAUNCH_FAILED."""
  run = _run_timing_out(tmp_path, "test_mismatched_sizes_are_named")
  # The watchdog's line reaches stderr before the process ends.
  assert "jaxoverlap: all_reduce timed out on PE" in run.output(), run.tail()


@pytest.mark.parametrize("rank_test", ["test_all_reduce_period_end_stops_under_epoch_knob",
                                       "test_norm_period_end_stops_under_epoch_knob"])
def test_period_end_stops_under_epoch_knob(rank_test, tmp_path):
  """The LL flags' period end, where the kernels re-stamp their cells (test_gpu_flag_wrap.py),
  stops the run loudly under JAXOVERLAP_EPOCH_AT_START=1, whose kernels advance their count
  before they read and so cannot re-stamp: never a stale line read as new.

  Both kernels the knob changes: the one-shot LL all-reduce and all_reduce_rms_norm at one row.
  """
  run = _harness.run_ranks(tmp_path, "rank_errors.py", World(2, 2),
                           select=("-k", rank_test), timeout_s=150,
                           env={"JAXOVERLAP_TEST_PAIR_EPOCH": str(2**32 - 4),
                                "JAXOVERLAP_EPOCH_AT_START": "1"})
  run.print_summary()
  run.check()
  # The watchdog's line reaches stderr before the process ends.
  assert "ends a period of the LL protocol's 32-bit flags" in run.output(), run.tail()
