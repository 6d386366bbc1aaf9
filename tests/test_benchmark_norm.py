"""benchmarks/all_reduce_rms_norm.py: its three implementations agree with float64 (CPU)."""

from __future__ import annotations

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from _helpers import make_mesh

_BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "benchmarks")
sys.path.insert(0, _BENCHMARKS)  # the script imports its harness
_spec = importlib.util.spec_from_file_location(
    "norm_benchmark", os.path.join(_BENCHMARKS, "all_reduce_rms_norm.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("impl", bench.IMPLS)
def test_each_impl_is_the_expression(impl):
  mesh = make_mesh((4,), (bench.AXIS,))
  rng = np.random.default_rng()
  rows, hidden = 3, 64
  p = rng.standard_normal((4 * rows, hidden)).astype(np.float32)
  r = rng.standard_normal((rows, hidden)).astype(np.float32)
  w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
  op = bench.make_op(impl, jnp.asarray(r), jnp.asarray(w), backend="xla")
  f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P(bench.AXIS), out_specs=(P(), P())))
  h, y = f(jax.device_put(p, NamedSharding(mesh, P(bench.AXIS))))
  h64 = r.astype(np.float64) + p.astype(np.float64).reshape(4, rows, hidden).sum(0)
  y64 = h64 / np.sqrt(np.mean(h64 ** 2, -1, keepdims=True) + bench.EPS) * w
  np.testing.assert_allclose(np.asarray(h), h64, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(y), y64, rtol=1e-4, atol=1e-5)


def test_unknown_impl_is_refused():
  with pytest.raises(ValueError, match="unknown impl"):
    bench.make_op("xla:nope", None, None, backend="xla")


def test_table_names_the_speedups(capsys):
  recs = [{"shape": [1, 4096], "impl": bench.PSUM_NORM, "time_us": 20.0},
          {"shape": [1, 4096], "impl": bench.PSUM_NORM_GRAPHS, "time_us": 16.0},
          {"shape": [1, 4096], "impl": bench.OURS_NORM, "time_us": 12.0},
          {"shape": [1, 4096], "impl": bench.FUSED, "time_us": 8.0},
          {"shape": [1, 4096], "impl": bench.AUTO, "time_us": 11.0}]
  bench._print_table(recs)
  out = capsys.readouterr().out
  assert "| 1 x 4096 | 20.0 | 16.0 | 12.0 | 8.0 | 11.0 | 2.50x | 2.00x | 1.50x |" in out
