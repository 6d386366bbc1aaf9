"""benchmarks/l2_prefetch.py: the variants, the XLA visit and the table (the probe needs a GPU)."""

import math
import os
import re
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import l2_prefetch  # noqa: E402


def test_variant_names_round_trip():
  names = l2_prefetch.variants([4, 64], [0.0, 4.0], ["bulk", "lines"], ["8", "all"])
  assert names[:4] == ["xla", "b4:wait0", "b4:wait0+bulk8", "b4:wait0+bulkall"]
  assert len(names) == 1 + 2 * 2 * (1 + 2 * 2) and len(set(names)) == len(names)
  assert l2_prefetch.parse_variant("xla") == (None, None, "", None)
  assert l2_prefetch.parse_variant("b64:wait4") == (64, 4.0, "", None)
  assert l2_prefetch.parse_variant("b16:wait2.5+lines8") == (16, 2.5, "lines", 8.0)
  blocks, wait, method, mib = l2_prefetch.parse_variant("wait4+bulkall")  # the first run's names
  assert (blocks, wait, method) == (None, 4.0, "bulk") and math.isinf(mib)


@pytest.mark.parametrize("bad", ["wait", "b4:sleep4", "bx:wait4", "b4:wait4+tma8", "wait4+bulk"])
def test_bad_variant_names_are_refused(bad):
  with pytest.raises(ValueError, match=r"^l2_prefetch: bad .*" + re.escape(repr(bad))):
    l2_prefetch.parse_variant(bad)


def test_the_xla_visit_is_the_product_plus_its_first_column():
  rng = np.random.default_rng(5)
  bf16 = ml_dtypes.bfloat16
  x = rng.standard_normal((2, l2_prefetch.HIDDEN)).astype(bf16)
  ws = [(0.02 * rng.standard_normal((l2_prefetch.HIDDEN, 32))).astype(bf16) for _ in range(3)]
  got = l2_prefetch.make_chain("xla", 2, blocks=4, chunk=65536)(
      jnp.asarray(x), [jnp.asarray(w) for w in ws])
  want = x.astype(np.float64)
  for w in ws[:2]:  # two visits: layers 0 and 1
    y = (want.astype(bf16).astype(np.float64) @ w.astype(np.float64)).astype(bf16)
    want = (want + y[:, :1].astype(np.float64)).astype(bf16).astype(np.float64)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2)
  assert not np.allclose(np.asarray(got, np.float64), x.astype(np.float64), atol=1e-3)


def test_markdown_table_gives_the_saving_and_the_bytes_at_hbm_speed():
  records = [{"n": 1536, "impl": "b16:wait4", "time_us": 15.5, "saved_us": None,
              "prefetch_bytes": 0},
             {"n": 1536, "impl": "b16:wait4+bulk8", "time_us": 15.0, "saved_us": 0.5,
              "prefetch_bytes": 8 * l2_prefetch.MIB}]
  table = l2_prefetch.markdown_table(records, bandwidth_tbs=4.0).splitlines()
  assert table[2] == "| 1536 | b16:wait4 | 15.50 |  |  |"
  assert table[3] == "| 1536 | b16:wait4+bulk8 | 15.00 | 0.50 | 2.10 |"
