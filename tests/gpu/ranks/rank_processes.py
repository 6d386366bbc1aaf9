"""Several processes, several GPUs each: the all-reduce across processes (test_gpu_models.py).

Every process drives all the GPUs it sees (the in-process runtime), as SLURM's one task per
node does. A group that spans processes runs the hierarchical all-reduce whose inter-node step
is XLA's all-reduce (NCCL) over the same-local-rank GPUs, between the kernels' intra-node
reduce-scatter and all-gather. On one host the outer test emulates two nodes with two
processes that both see every GPU, in rotated order, so that each inter-node group holds
distinct GPUs (NCCL refuses a GPU twice in one communicator); for the same reason nothing here
runs an XLA collective over a whole mesh axis that spans both processes.

Inputs come from ``JAXOVERLAP_TEST_SEED`` (the same in every process, fresh per run); each
process checks every element of its own shards against a float64 reference.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap

pytestmark = pytest.mark.skipif(os.environ.get("JAXOVERLAP_RANK_TESTS_XLA") == "1",
                                reason="the in-process runtime across processes: no dry run")

SEED = int(os.environ.get("JAXOVERLAP_TEST_SEED", "0"))
EPS = {np.dtype(np.float32): 2.0 ** -22, np.dtype(jnp.bfloat16): 2.0 ** -7,
       np.dtype(np.float16): 2.0 ** -10}
DTYPES = (np.float32, jnp.bfloat16, np.float16)


def _randn(key, shape, dtype):
  rng = np.random.default_rng([SEED, *key])
  return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _f64(a):
  return np.asarray(np.asarray(a).astype(np.float32), np.float64)


def _put(mesh, host, spec):
  return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec),
                                      lambda idx: host[idx])


@pytest.fixture(scope="session")
def grid(runtime):
  """The mesh ("node", "tp"): one row per process, its GPUs along "tp"."""
  info = jaxoverlap.runtime_info()
  assert info["transport"] == "peer" and info["num_nodes"] == jax.process_count() > 1, info
  devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
  return Mesh(devices.reshape(jax.process_count(), -1), ("node", "tp"))


@pytest.fixture(autouse=True)
def _fresh_decisions():
  jaxoverlap.clear_decisions()


def _check(out, want, bound, eps, what):
  bad = []
  for shard in out.addressable_shards:
    got = _f64(shard.data)
    lim = 2 * eps * bound[shard.index] + 1e-30
    off = ~(np.abs(got - want[shard.index]) <= lim)
    if off.any():
      bad.append(f"{shard.device}: {int(off.sum())} of {off.size} elements off")
  assert not bad, f"{what}: {bad}"


def _all_reduce(grid, axes, n, dtype, key, **kw):
  """all_reduce of a fresh [ranks, n] input over ``axes``; checks every element."""
  ranks = grid.size
  host = _randn(key, (ranks, n), dtype)
  spec = P(("node", "tp"))
  others = tuple(a for a in ("node", "tp") if a not in (axes if isinstance(axes, tuple)
                                                         else (axes,)))
  f = jax.jit(jax.shard_map(lambda x: jaxoverlap.all_reduce(x[0], axes, **kw)[None],
                            mesh=grid, in_specs=spec, out_specs=P(others or None)))
  out = f(_put(grid, host, spec))
  parts = _f64(host).reshape(grid.shape["node"], grid.shape["tp"], n)
  reduce_over = tuple(i for i, a in enumerate(("node", "tp")) if a not in others)
  want = parts.sum(reduce_over).reshape(-1, n)
  bound = np.abs(parts).sum(reduce_over).reshape(-1, n)
  _check(out, want, bound, EPS[np.dtype(dtype)], f"all_reduce over {axes} {np.dtype(dtype).name} "
         f"n={n}")
  return jaxoverlap.decisions("all_reduce")[-1]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("axes", [("node", "tp"), ("tp", "node"), "node"], ids=str)
def test_hierarchical_across_processes(grid, axes, dtype):
  """Sizes below, at and off the 16-byte vector; every element of every shard."""
  for i, n in enumerate([1, 7, 1000, 4096, 65537, 1 << 20]):
    plan = _all_reduce(grid, axes, n, dtype, (i, len(str(axes))), algorithm="hierarchical")
    assert (plan.backend, plan.algorithm, plan.inter_node) == ("cuda", "hierarchical", "xla"), \
        plan.summary()
    assert plan.num_nodes == jax.process_count(), plan.summary()


def test_several_pieces(grid):
  """A message larger than one launch's slot runs as several pieces, each exact."""
  slot = jaxoverlap.runtime_info()["slot_bytes"]
  n = (5 * slot) // 2  # float32 over 2 local ranks: at least two pieces
  plan = _all_reduce(grid, ("node", "tp"), n, np.float32, (99,), algorithm="hierarchical")
  assert len(plan.pieces) >= 2, plan.summary()


def test_within_a_process_runs_the_peer_kernels(grid):
  for algorithm in ("one_shot", "two_shot"):
    plan = _all_reduce(grid, "tp", 4096, jnp.bfloat16, (7,), backend="cuda", algorithm=algorithm)
    assert (plan.backend, plan.transport, plan.inter_node) == ("cuda", "peer", None)


def test_auto_and_fused_ops_say_what_runs_across_processes(grid):
  """Lowered only: what auto picks across processes, and why (no run: see the module doc)."""
  x = jax.ShapeDtypeStruct((grid.size, 4096), jnp.bfloat16,
                           sharding=NamedSharding(grid, P(("node", "tp"))))
  jax.jit(jax.shard_map(lambda x: jaxoverlap.all_reduce(x, ("node", "tp")), mesh=grid,
                        in_specs=P(("node", "tp")), out_specs=P())).lower(x)
  plan = jaxoverlap.decisions("all_reduce")[-1]
  assert "cost model" in plan.summary(), plan.summary()
  assert (plan.backend == "xla") == ("lax.psum" in plan.reason("backend")), plan.summary()
  x = jax.ShapeDtypeStruct((grid.size * 16, 256), jnp.bfloat16,
                           sharding=NamedSharding(grid, P(("node", "tp"))))
  w = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16, sharding=NamedSharding(grid, P()))
  jax.jit(jax.shard_map(lambda x, w: jaxoverlap.matmul_reduce_scatter(x, w, ("node", "tp")),
                        mesh=grid, in_specs=(P(("node", "tp")), P()),
                        out_specs=P(("node", "tp")))).lower(x, w)
  plan = jaxoverlap.decisions("matmul_reduce_scatter")[-1]
  assert plan.backend == "xla" and "spans 2 processes" in plan.reason("backend"), plan.summary()


def test_gradient_across_processes(grid):
  """grad of sum(c * all_reduce(x)) is psum's transpose: c summed over the group, per rank."""
  n = 3000
  host = _randn((5,), (grid.size, n), np.float32)
  c = _randn((6,), (n,), np.float32)
  spec = P(("node", "tp"))

  def loss(x):
    y = jaxoverlap.all_reduce(x[0], ("node", "tp"), algorithm="hierarchical")
    return jnp.sum(y * c)

  f = jax.jit(jax.shard_map(jax.grad(loss), mesh=grid, in_specs=spec, out_specs=spec))
  out = f(_put(grid, host, spec))
  # Each rank's cotangent of y is c; the transpose of an all-reduce hands it to every input.
  want = np.broadcast_to(_f64(c), (grid.size, n))
  _check(out, want, np.abs(want), EPS[np.dtype(np.float32)], "grad of all_reduce")


def test_many_calls_in_one_loop(grid):
  """200 dependent calls in one jit'd loop (epochs and slots reused); the last is checked."""
  n = 2048
  host = _randn((8,), (grid.size, n), np.float32) / grid.size
  spec = P(("node", "tp"))

  def body(x):
    def step(_, y):
      y = jaxoverlap.all_reduce(y, ("node", "tp"), algorithm="hierarchical") / grid.size
      return jax.lax.pcast(y, ("node", "tp"), to="varying")  # the loop's carry stays varying
    return jax.lax.fori_loop(0, 200, step, x[0])[None]

  f = jax.jit(jax.shard_map(body, mesh=grid, in_specs=spec, out_specs=spec))
  out = f(_put(grid, host, spec))
  # The first call gives the mean of the ranks' inputs, every later one keeps it.
  want = np.broadcast_to(_f64(host).mean(0), host.shape)
  bound = np.broadcast_to(np.abs(_f64(host)).mean(0) * 8, host.shape)
  _check(out, want, bound, 2.0 ** -20, "200 calls")
