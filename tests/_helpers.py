"""Helpers shared by test_all_reduce.py, test_grads.py and test_overlap_ops.py.

Imported as ``from _helpers import ...``: pytest's default (prepend) import
mode puts tests/ on sys.path. The ``rng`` fixture lives in conftest.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

AUTO = jax.sharding.AxisType.Auto


@functools.cache
def make_mesh(shape, names):
  num = int(np.prod(shape))
  return jax.make_mesh(shape, names, axis_types=(AUTO,) * len(shape),
                       devices=jax.devices()[:num])


def randn(rng, shape, dtype, outlier=100.0):
  """Normal values with ~2% of them (at least one) scaled by ``outlier``.

  Returns the array in ``dtype`` and its exact float64 copy.
  """
  a = rng.standard_normal(shape).astype(np.float32)
  if a.size:
    idx = rng.choice(a.size, size=max(1, a.size // 50), replace=False)
    a.flat[idx] *= outlier
  arr = jnp.asarray(a).astype(dtype)
  return arr, np.asarray(arr.astype(jnp.float32), np.float64)


def assert_close(got, want, bound, dtype, what):
  """|got - want| <= eps(dtype)**(2/3) * bound, element by element."""
  got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
  assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
  lim = float(jnp.finfo(dtype).eps) ** (2 / 3) * bound
  err = np.abs(got - want)
  bad = ~(err <= lim)  # NaN counts as bad
  if bad.any():
    i = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(err - lim, nan=np.inf), -1)),
                         got.shape)
    raise AssertionError(
        f"{what}: {bad.sum()} of {bad.size} elements off; e.g. at {i}: got {got[i]}, "
        f"want {want[i]}, allowed error {lim[i]:.3g}")
