"""Example 2: a tensor-parallel MLP, forward and gradient, against the unsharded MLP.

``jaxoverlap.nnx.ParallelMLP`` on a (dp=2 x tp=4) mesh: the up projection is
column parallel (hidden units sharded over tp), the down projection row
parallel, and the forward all-reduce is ``matmul_all_reduce``. The same
module with ``ParallelConfig(mesh=None)`` runs unsharded; with the same
parameters both give the same output and the same gradients.

  python examples/02_tp_mlp.py      # needs Flax: pip install ".[nnx]"
"""

import argparse
import os


def main(dp: int = 2, tp: int = 4, batch: int = 4, seq: int = 16, d: int = 64,
         f: int = 256) -> tuple[float, float]:
  """Returns the max abs differences (output, gradients) to the unsharded MLP."""
  import jax
  import jax.numpy as jnp

  from jaxoverlap.nnx import ParallelConfig, ParallelMLP  # first: says what to install
  from flax import nnx

  mesh = jax.make_mesh((dp, tp), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharded_config = ParallelConfig(mesh=mesh)

  @nnx.jit
  def create():  # parameters are created sharded, as their metadata says
    return ParallelMLP(d, f, config=sharded_config, rngs=nnx.Rngs(0))

  mlp = create()
  reference = ParallelMLP(d, f, config=ParallelConfig(mesh=None), rngs=nnx.Rngs(1))
  nnx.update(reference, jax.device_get(nnx.state(mlp)))  # same parameters, unsharded

  x_bsd = jax.random.normal(jax.random.key(2), (batch, seq, d), jnp.float32)
  x_bsd = jax.device_put(x_bsd, jax.sharding.NamedSharding(mesh, sharded_config.spec(
      "batch", "seq", "embed")))

  @nnx.jit
  def forward_and_grad(model, x_bsd):
    loss_fn = lambda model: jnp.mean(jnp.square(model(x_bsd)))
    y_bsd = model(x_bsd)
    grads = nnx.grad(loss_fn)(model)
    return y_bsd, grads

  y, grads = forward_and_grad(mlp, x_bsd)
  y_ref, grads_ref = forward_and_grad(reference, jax.device_get(x_bsd))
  out_err = float(jnp.max(jnp.abs(y - y_ref)))
  grad_err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(grads_ref)))
  kernel = mlp.up.kernel[...]
  print(f"ParallelMLP d={d} f={f} on dp={dp} x tp={tp}: up kernel {kernel.shape} sharded "
        f"{kernel.sharding.spec}; max |y - y_ref| = {out_err:.2e}, "
        f"max |grad - grad_ref| = {grad_err:.2e}")
  if out_err > 1e-4 or grad_err > 1e-4:
    raise AssertionError(f"TP MLP differs from the unsharded MLP: {out_err}, {grad_err}")
  return out_err, grad_err


if __name__ == "__main__":
  # No options: --help prints the docstring and exits before anything runs.
  argparse.ArgumentParser(description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
  main()
