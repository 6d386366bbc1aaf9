"""Test set-up: 8 simulated host devices on CPU-only machines.

XLA_FLAGS must be set before jax is imported, so it happens here, at
collection time, and only when the caller has not set a device count.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import zlib

import numpy as np
import pytest


@pytest.fixture
def rng(request):
  """A generator seeded by the test's id: fresh inputs for every test."""
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
