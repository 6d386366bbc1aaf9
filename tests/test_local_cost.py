"""benchmarks/local_cost.py: the XLA chains' values and the table (the kernels need a GPU)."""

import os
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import local_cost  # noqa: E402

BF16 = ml_dtypes.bfloat16


def _inputs(rows, hidden, seed):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((rows, hidden)).astype(BF16),
          rng.standard_normal((rows, hidden)).astype(BF16),
          (1.0 + 0.1 * rng.standard_normal(hidden)).astype(BF16))


def test_one_step_of_the_xla_variants_equals_the_float64_reference():
  x, r, w = _inputs(3, 256, seed=11)
  for impl in ("xla", "norm_xla"):
    got = local_cost.make_chain(impl, 1, jnp.asarray(w))(jnp.asarray(x), jnp.asarray(r))
    for g, want in zip(got, local_cost.expected(impl, x, r, w)):
      np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=2e-2, atol=2e-2)


def test_the_reference_norm_is_not_the_identity():
  # The check of the GPU run compares against this: it must tell a norm from a copy.
  x, r, w = _inputs(2, 64, seed=12)
  y, _ = local_cost.expected("fused", x, r, w)
  p, _ = local_cost.expected("copy", x, r, w)
  np.testing.assert_allclose(np.mean((y / w.astype(np.float64)) ** 2, axis=-1), 1.0, rtol=1e-3)
  assert not np.allclose(y, p, atol=0.1)


def test_markdown_table_gives_the_norms_cost_over_the_one_shot():
  times = {"copy": 1.5, "one_shot_ll": 2.25, "norm_xla": 3.0, "unfused": 5.5, "fused": 3.5}
  records = [{"op": "local_cost", "impl": i, "rows": 1, "hidden": 4096, "bytes": 8192,
              "time_us": t, "xla_step_us": 1.25} for i, t in times.items()]
  table = local_cost.markdown_table(records).splitlines()
  assert table[0] == ("| rows x hidden | XLA step us | copy us | one_shot_ll us | norm_xla us | "
                      "unfused us | fused us | fused - one_shot_ll us |")
  assert table[2] == "| 1 x 4096 | 1.25 | 1.50 | 2.25 | 3.00 | 5.50 | 3.50 | 1.25 |"
