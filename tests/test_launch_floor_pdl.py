"""benchmarks/launch_floor_pdl.py: the chains' values and the table (the timing needs a GPU)."""

import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import launch_floor_pdl as pdl  # noqa: E402


def test_the_xla_chain_equals_the_numpy_reference():
  x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
  got = np.asarray(pdl.make_chain("xla", 7)(jnp.asarray(x)))
  want = x.astype(np.float64)
  for _ in range(7):
    want = want * 1.0001 + 0.5
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(pdl.expected(x, 7), want, rtol=1e-5)


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


def test_launch_floor_refuses_an_unknown_variant():
  import pytest

  from jaxoverlap import _cuda

  with pytest.raises(ValueError, match="variant must be one of"):
    _cuda.launch_floor(jnp.zeros(4), variant="fast")
