"""benchmarks/launch_floor_pdl.py: the chains' values and the table (the timing needs a GPU)."""

import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import launch_floor_pdl as pdl  # noqa: E402


def test_the_xla_chain_equals_the_numpy_reference():
  x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
  want = x.astype(np.float64)
  for _ in range(7):
    want = want * 1.0001 + 0.5
  for impl in ("xla", "xla_kernel"):  # the second kernel multiplies by a runtime 1.0
    got = np.asarray(pdl.make_chain(impl, 7)(jnp.asarray(x), jnp.ones((), jnp.float32)))
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=impl)
  np.testing.assert_allclose(pdl.expected(x, 7), want, rtol=1e-5)


def test_the_xla_kernel_chain_runs_a_second_kernel_per_step():
  import jax

  x, one = jnp.zeros(1024), jnp.ones((), jnp.float32)
  hlo = jax.jit(pdl.make_chain("xla_kernel", 3)).lower(x, one).as_text()
  assert hlo.count("optimization_barrier") == 6  # two per step: one kernel each


def test_pallas_copy_copies_in_interpret_mode():
  x = np.random.default_rng(4).standard_normal(3 * pdl.PALLAS_BLOCK).astype(np.float32)
  got = np.asarray(pdl.pallas_copy(jnp.asarray(x), interpret=True))
  np.testing.assert_array_equal(got, x)


def test_run_refuses_unknown_impls_and_unaligned_sizes():
  import pytest

  with pytest.raises(ValueError, match="unknown impls"):
    pdl.run([8192], chain=1, reps=1, warmup=0, seed=0, impls=("floor", "fast"))
  with pytest.raises(ValueError, match="multiples of 4096 bytes"):
    pdl.run([6000], chain=1, reps=1, warmup=0, seed=0, impls=("pallas_copy",))


def test_markdown_table_gives_the_saving():
  records = [{"op": "launch_floor", "impl": "floor", "bytes": 8192, "time_us": 2.5,
              "xla_step_us": 1.5},
             {"op": "launch_floor", "impl": "floor_pdl", "bytes": 8192, "time_us": 1.75,
              "xla_step_us": 1.5}]
  table = pdl.markdown_table(records).splitlines()  # a file from before the bookkeeping
  assert table[0] == "| bytes | XLA step us | floor us | floor_pdl us | PDL saves us |"
  assert table[2] == "| 8192 | 1.50 | 2.50 | 1.75 | 0.75 |"


def test_markdown_table_gives_the_bookkeeping_cost():
  times = {"floor": 2.5, "floor_pdl": 1.75, "floor_bookkeeping": 3.25,
           "floor_bookkeeping_nofence": 3.0}
  records = [{"op": "launch_floor", "impl": i, "bytes": 8192, "time_us": t, "xla_step_us": 1.5}
             for i, t in times.items()]
  table = pdl.markdown_table(records).splitlines()
  assert table[0] == ("| bytes | XLA step us | floor us | floor_pdl us | floor_bookkeeping us | "
                      "floor_bookkeeping_nofence us | PDL saves us | bookkeeping costs us |")
  assert table[2] == "| 8192 | 1.50 | 2.50 | 1.75 | 3.25 | 3.00 | 0.75 | 0.75 |"


def test_markdown_table_without_the_floor_chains():
  times = {"xla_kernel": 0.75, "pallas_copy": 1.25}
  records = [{"op": "launch_floor", "impl": i, "bytes": 8192, "time_us": t, "xla_step_us": 1.5}
             for i, t in times.items()]
  table = pdl.markdown_table(records).splitlines()
  assert table[0] == "| bytes | XLA step us | xla_kernel us | pallas_copy us |"
  assert table[2] == "| 8192 | 1.50 | 0.75 | 1.25 |"


def test_launch_floor_refuses_an_unknown_variant():
  import pytest

  from jaxoverlap import _cuda

  with pytest.raises(ValueError, match="variant must be one of"):
    _cuda.launch_floor(jnp.zeros(4), variant="fast")


def test_gaps_by_kernel_counts_durations_and_the_gap_before_each():
  import collections

  Ev = collections.namedtuple("Ev", "name start end")
  events = [Ev("fusion", 0.0, 1.0), Ev("copy", 3.0, 4.0), Ev("fusion", 4.5, 5.5),
            Ev("copy", 8.5, 9.5)]
  got = {k["name"]: k for k in pdl.gaps_by_kernel(events, steps=2)}
  assert got["fusion"] == {"name": "fusion", "per_step": 1.0, "mean_us": 1.0,
                           "mean_gap_before_us": 0.5}  # only the second has one before it
  assert got["copy"] == {"name": "copy", "per_step": 1.0, "mean_us": 1.0,
                         "mean_gap_before_us": 2.5}
