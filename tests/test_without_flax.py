"""The ops need no Flax; only jaxoverlap.nnx does, and says how to install it.

Flax (with optax, orbax and tensorstore behind it) is the ``nnx`` extra, not a dependency of
the package: a user of the ops in their own ``shard_map`` code does not install it.
"""

import pathlib
import subprocess
import sys
import textwrap
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_flax_is_an_extra_not_a_dependency():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert not any(d.startswith("flax") for d in project["dependencies"]), project["dependencies"]
  extras = project["optional-dependencies"]
  for extra in ("nnx", "examples", "test"):  # the layers, the training example, the tests
    assert any(d.startswith("flax>=") for d in extras[extra]), extra


def test_the_ops_run_without_flax_and_nnx_says_what_to_install():
  # In a fresh interpreter with flax unimportable (None in sys.modules makes import raise).
  code = textwrap.dedent("""
      import os, sys
      os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
      os.environ["JAX_PLATFORMS"] = "cpu"
      sys.modules["flax"] = None
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import PartitionSpec as P
      import jaxoverlap
      mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
      x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
      f = jax.jit(jax.shard_map(lambda y: jaxoverlap.all_reduce(y, "tp"), mesh=mesh,
                                in_specs=P("tp"), out_specs=P("tp")))
      np.testing.assert_allclose(np.asarray(f(x)), np.tile(x.sum(0), (2, 1)), rtol=1e-6)
      assert not any(m == "flax" or m.startswith("flax.") for m in sys.modules if sys.modules[m])
      try:
        import jaxoverlap.nnx
      except ImportError as e:
        print("IMPORT-ERROR:", e)
      """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, cwd=ROOT / "tests")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("IMPORT-ERROR: jaxoverlap.nnx needs Flax (flax>=0.12), which is not installed: pip "
          'install "jaxoverlap[nnx]"') in proc.stdout, proc.stdout + proc.stderr[-3000:]
