"""Example 1: ``jaxoverlap.all_reduce`` inside ``shard_map``, checked against ``lax.psum``.

Each of the devices on a 1-D "tp" mesh holds a shard of ``x``; the all-reduce
sums the shards, so every device ends up with the same ``[rows, cols]`` array.
On a CPU-only machine the devices are simulated host devices:

  python examples/01_all_reduce.py

``backend="auto"`` runs the CUDA kernels when they are usable (GPUs,
extension built, ``jaxoverlap.initialize()`` called) and XLA otherwise;
``jaxoverlap.decisions()`` says which one ran and why.
"""

import argparse
import os


def main(rows: int = 4, cols: int = 1024) -> float:
  """Runs the all-reduce on all devices; returns the max abs difference to psum."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import PartitionSpec as P

  import jaxoverlap

  num_ranks = jax.device_count()
  mesh = jax.make_mesh((num_ranks,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.random.normal(jax.random.key(0), (num_ranks * rows, cols), jnp.float32)

  def both(x_shard):  # x_shard: this rank's [rows, cols]
    return jaxoverlap.all_reduce(x_shard, "tp"), lax.psum(x_shard, "tp")

  jaxoverlap.clear_decisions()
  ours, reference = jax.jit(jax.shard_map(
      both, mesh=mesh, in_specs=P("tp"), out_specs=(P(), P())))(x)
  plan = jaxoverlap.decisions("all_reduce")[-1]  # planned when the call was compiled
  err = float(jnp.max(jnp.abs(ours - reference)))
  expected = np.asarray(x).reshape(num_ranks, rows, cols).sum(0)
  np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5)
  print(f"all_reduce of [{rows}, {cols}] float32 over {num_ranks} {jax.devices()[0].platform} "
        f"ranks: max |ours - psum| = {err:.2e}\n  ran as: {plan.backend} {plan.algorithm} "
        f"({plan.reason('backend')})")
  return err


if __name__ == "__main__":
  # No options: --help prints the docstring and exits before anything runs.
  argparse.ArgumentParser(description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
  main()
