"""Every op on the CUDA kernels in each process model (tests/gpu/test_gpu_models.py).

The same tests run as one process per GPU (the launcher or SLURM's one task per GPU: the
NVSHMEM runtime) and as one process driving every GPU (the in-process runtime). Inputs are
global arrays made from seeds, so every process knows every rank's input, and each process
checks every element of each of its addressable shards against a float64 reference of the
pure expression. ``JAXOVERLAP_EXPECT_TRANSPORT`` names the runtime the outer test started.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoverlap
from jaxoverlap import reference

pytestmark = pytest.mark.skipif(os.environ.get("JAXOVERLAP_RANK_TESTS_XLA") == "1",
                                reason="the CUDA kernels in each process model: no dry run")

EPS = {np.dtype(np.float32): 2.0 ** -10,  # TF32 GEMMs at JAX's default precision
       np.dtype(jnp.bfloat16): 2.0 ** -7, np.dtype(np.float16): 2.0 ** -10}
DTYPES = (np.float32, jnp.bfloat16, np.float16)


def _randn(seed, shape, dtype, scale=1.0):
  rng = np.random.default_rng(seed)
  a = rng.standard_normal(shape).astype(np.float32) * scale
  if a.size > 16:  # outliers
    idx = rng.choice(a.size, size=max(1, a.size // 200), replace=False)
    a.flat[idx] *= 30.0
  return a.astype(dtype)


def _f64(a):
  return np.asarray(np.asarray(a).astype(np.float32), np.float64)


def _put(mesh, host, spec):
  return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec),
                                      lambda idx: host[idx])


def _check_shards(out, want, bound, eps, what, factor=4.0):
  """Every element of every addressable shard of ``out`` against ``want`` (float64)."""
  bad = []
  for shard in out.addressable_shards:
    got = _f64(shard.data)
    w, b = want[shard.index], bound[shard.index]
    lim = factor * eps * b + 1e-30
    err = np.abs(got - w)
    off = ~(err <= lim)
    if off.any():
      bad.append(f"{shard.device}: {int(off.sum())} of {off.size} off, worst err/limit "
                 f"{float(np.max(err / lim)):.3g}")
  assert not bad, f"{what}: {bad}"


def _assert_close(got, want, what, rtol=2e-5, atol=2e-5):
  """Every addressable shard of ``got`` against the same shard of ``want`` (global arrays).

  With a process per GPU the arrays span devices of other processes; each process checks
  its own shards (and the outer test collects every process's outcome).
  """
  assert got.shape == want.shape, (what, got.shape, want.shape)
  want_shards = {s.device: s for s in want.addressable_shards}
  assert got.addressable_shards, what
  for shard in got.addressable_shards:
    ref = want_shards[shard.device]
    assert shard.index == ref.index, (what, shard.device, shard.index, ref.index)
    np.testing.assert_allclose(np.asarray(shard.data), np.asarray(ref.data), rtol=rtol,
                               atol=atol, err_msg=f"{what} on {shard.device}")


def _expect_plan(op, backend="cuda"):
  plans = jaxoverlap.decisions(op)
  assert plans, f"this test lowered no {op}"
  plan = plans[-1]
  assert plan.backend == backend, plan.summary()
  transport = os.environ.get("JAXOVERLAP_EXPECT_TRANSPORT")
  if backend == "cuda" and op == "all_reduce" and transport:
    assert plan.transport == transport, plan.summary()
  return plan


@pytest.fixture(autouse=True)
def _fresh_decisions():
  """Each test's plan checks see the plans of its own lowerings only."""
  jaxoverlap.clear_decisions()


@pytest.fixture(scope="session")
def R(runtime):
  return jax.device_count()


def test_runtime_transport(runtime):
  info = jaxoverlap.runtime_info()
  want = os.environ.get("JAXOVERLAP_EXPECT_TRANSPORT")
  assert info["initialized"] and (want is None or info["transport"] == want), info
  assert all(v == "cuda" for v in info["backends"].values()), info["backends"]
  # The Lamport grid's cap: at least one block an SM (the occupancy calculator's answer).
  assert info["lamport_blocks_per_sm"] >= 1, info


# ---------------------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("algorithm,protocol", [("one_shot", "ll"), ("one_shot", "simple"),
                                                ("one_shot", "lamport"),
                                                ("two_shot", "ll"), ("two_shot", "simple"),
                                                ("two_shot", "lamport"),
                                                ("auto", "auto")])
def test_all_reduce(runtime, mesh, R, dtype, algorithm, protocol):
  for seed, n in enumerate([0, 3, 4096, 32769, 1 << 19]):
    host = _randn([seed, n], (R * n,), dtype)
    f = jax.jit(jax.shard_map(
        lambda x: jaxoverlap.all_reduce(x, "x", backend="cuda", algorithm=algorithm,
                                        protocol=protocol),
        mesh=mesh, in_specs=P("x"), out_specs=P()))
    out = f(_put(mesh, host, P("x")))
    parts = _f64(host).reshape(R, n)
    _check_shards(out, parts.sum(0), np.abs(parts).sum(0), EPS[np.dtype(dtype)],
                  f"all_reduce {algorithm}/{protocol} {np.dtype(dtype).name} n={n}", factor=2)
    if n:
      plan = _expect_plan("all_reduce", "cuda" if algorithm != "auto" else
                          jaxoverlap.decisions("all_reduce")[-1].backend)
      if algorithm != "auto":
        assert (plan.algorithm, plan.protocol) == (algorithm, protocol), plan.summary()


def _gemm_case(op, R, dtype, seed, m=24, k=64, n=40):
  """Global x, w, their specs, the output spec and the float64 reference (and its bound)."""
  if op == "all_gather_matmul":
    x = _randn([seed, 0], (R * m, k), dtype)
    w = _randn([seed, 1], (k, n), dtype, 1 / math.sqrt(k))
    specs, out_spec = (P("x"), P()), P("x")
    want, bound = _f64(x) @ _f64(w), np.abs(_f64(x)) @ np.abs(_f64(w))
    return x, w, specs, out_spec, np.tile(want, (R, 1)), np.tile(bound, (R, 1))
  x = _randn([seed, 0], (R * m, R * k), dtype)
  w = _randn([seed, 1], (R * k, n), dtype, 1 / math.sqrt(R * k))
  specs = (P(None, "x"), P("x"))
  want, bound = _f64(x) @ _f64(w), np.abs(_f64(x)) @ np.abs(_f64(w))
  return x, w, specs, (P("x") if op == "matmul_reduce_scatter" else P()), want, bound


GEMM_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
# The fused op in each op's backward (matmul_all_reduce's and all_reduce's have no collective).
BACKWARD = {"all_gather_matmul": "matmul_reduce_scatter",
            "matmul_reduce_scatter": "all_gather_matmul"}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", GEMM_OPS)
@pytest.mark.parametrize("chunks", [None, 3])
def test_fused_ops(runtime, mesh, R, op, dtype, chunks):
  # A seed every process derives alike (str hashes differ between processes).
  x, w, specs, out_spec, want, bound = _gemm_case(op, R, dtype, seed=100 + GEMM_OPS.index(op))
  algorithms = ("fused", "unfused") if op == "matmul_all_reduce" else ("fused",)
  for algorithm in algorithms:
    kw = dict(backend="cuda", algorithm=algorithm)
    if algorithm == "fused":
      kw.update(transport="copy_engine", chunks=chunks)
    fn = getattr(jaxoverlap, op)
    f = jax.jit(jax.shard_map(lambda a, b: fn(a, b, "x", **kw), mesh=mesh, in_specs=specs,
                              out_specs=out_spec))
    out = f(_put(mesh, x, specs[0]), _put(mesh, w, specs[1]))
    _check_shards(out, want, bound, EPS[np.dtype(dtype)],
                  f"{op} {algorithm} chunks={chunks} {np.dtype(dtype).name}")
    plan = _expect_plan(op)
    assert plan.algorithm == algorithm, plan.summary()


def test_fused_nvshmem_transport_needs_its_runtime(runtime, mesh, R):
  x, w, specs, out_spec, _, _ = _gemm_case("matmul_reduce_scatter", R, jnp.bfloat16, 7)
  f = jax.jit(jax.shard_map(
      lambda a, b: jaxoverlap.matmul_reduce_scatter(a, b, "x", transport="nvshmem"),
      mesh=mesh, in_specs=specs, out_specs=out_spec))
  args = (_put(mesh, x, specs[0]), _put(mesh, w, specs[1]))
  if jaxoverlap.runtime_info()["transport"] == "nvshmem":
    f(*args).block_until_ready()
  else:
    with pytest.raises(ValueError, match="transport='nvshmem' needs the NVSHMEM runtime"):
      f.lower(*args)


# ---------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("op", GEMM_OPS + ("all_reduce",))
def test_grads(runtime, mesh, R, op):
  dtype = np.float32
  with jax.default_matmul_precision("highest"):
    if op == "all_reduce":
      x = _randn([11, 0], (R * 96,), dtype)
      w = np.zeros((1, 1), dtype)
      specs, out_spec = (P("x"), P()), P()
      ct = _randn([11, 2], (96,), dtype)
      ours = lambda a, b: jaxoverlap.all_reduce(a * a, "x", backend="cuda")  # noqa: E731
      ref = lambda a, b: reference.all_reduce(a * a, "x")  # noqa: E731
    else:
      x, w, specs, out_spec, want, _ = _gemm_case(op, R, dtype, 12)
      ct = _randn([12, 2], want.shape, dtype)
      fn, rf = getattr(jaxoverlap, op), getattr(reference, op)
      ours = lambda a, b: fn(a, b, "x", backend="cuda")  # noqa: E731
      ref = lambda a, b: rf(a, b, "x")  # noqa: E731

    def loss(f):  # the value too, so that the forward op runs (a bare grad drops it)
      g = jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out_spec)
      return jax.jit(jax.value_and_grad(lambda a, b, c: jnp.sum(g(a, b) * c), argnums=(0, 1)))

    args = (_put(mesh, x, specs[0]), _put(mesh, w, specs[1]), _put(mesh, ct, P()))
    (got_loss, got), (want_loss, want) = loss(ours)(*args), loss(ref)(*args)
  _assert_close(got_loss, want_loss, f"{op} loss")
  for g, r, name in zip(got, want, ("dx", "dw")):
    _assert_close(g, r, f"{op} {name}")
  _expect_plan(op)
  if op in BACKWARD:
    _expect_plan(BACKWARD[op])


# ---------------------------------------------------------------------------- transformations


@pytest.mark.parametrize("op", GEMM_OPS + ("all_reduce",))
def test_vmap_on_the_kernels(runtime, mesh, R, op):
  """vmap of each op (backend cuda) equals vmap of the pure expression."""
  dtype = np.float32
  b = 3
  with jax.default_matmul_precision("highest"):
    if op == "all_reduce":
      x = _randn([21, 0], (b, R * 1000), dtype)
      specs, out_spec = (P(None, "x"),), P()
      ours = lambda a: jax.vmap(lambda y: jaxoverlap.all_reduce(y, "x", backend="cuda"))(a)  # noqa
      ref = lambda a: jax.vmap(lambda y: reference.all_reduce(y, "x"))(a)  # noqa: E731
      args = (_put(mesh, x, specs[0]),)
    else:
      x, w, (xs, ws), out_spec, _, _ = _gemm_case(op, R, dtype, 22)
      x = np.stack([x, 2 * x, -x])  # a batched x with a shared w: folded into one call
      specs, out_spec = (P(None, *xs), ws), P(None, *out_spec)
      fn, rf = getattr(jaxoverlap, op), getattr(reference, op)
      ours = lambda a, c: jax.vmap(lambda y: fn(y, c, "x", backend="cuda"))(a)  # noqa: E731
      ref = lambda a, c: jax.vmap(lambda y: rf(y, c, "x"))(a)  # noqa: E731
      args = (_put(mesh, x, specs[0]), _put(mesh, w, specs[1]))
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs,  # noqa: E731
                                          out_specs=out_spec))(*args)
    got, want = run(ours), run(ref)
  _assert_close(got, want, f"vmap of {op}")
  _expect_plan(op)


@pytest.mark.parametrize("op", ("all_gather_matmul", "matmul_reduce_scatter"))
def test_jacrev_on_the_kernels(runtime, mesh, R, op):
  dtype = np.float32
  with jax.default_matmul_precision("highest"):
    x, w, specs, out_spec, _, _ = _gemm_case(op, R, dtype, 23, m=4, k=6, n=3)
    fn, rf = getattr(jaxoverlap, op), getattr(reference, op)
    jac = lambda f: jax.jit(jax.shard_map(  # noqa: E731
        lambda a, c: jax.jacrev(lambda y: f(y, c, "x"))(a), mesh=mesh, in_specs=specs,
        out_specs=P("x")))
    args = (_put(mesh, x, specs[0]), _put(mesh, w, specs[1]))
    got = jac(lambda *a: fn(*a, backend="cuda"))(*args)
    want = jac(rf)(*args)
  _assert_close(got, want, f"jacrev of {op}")
  _expect_plan(BACKWARD[op])


# ---------------------------------------------------------------------------- repetition


def test_ten_thousand_calls_of_random_sizes(runtime, mesh, R):
  """1,000 iterations x 10 sizes in one jit'd loop, each call compared with lax.psum."""
  sizes = [1, 7, 4096, 32767, 32768, 32769, 65536, 131071, 262144, 1 << 19]
  iters = 1000

  def body(xs):
    def step(i, bad):
      scale = (i + 1).astype(jnp.float32)
      for x in xs:
        y = (x.astype(jnp.float32) * scale).astype(x.dtype)
        ours = jaxoverlap.all_reduce(y, "x", backend="cuda")
        # Two ranks: one fp32 add, exact on both sides; more ranks: order may differ.
        ref = jax.lax.psum(y, "x")
        bad = bad + jnp.sum(jnp.abs(ours.astype(jnp.float32) - ref.astype(jnp.float32))
                            > 1e-2 * jnp.abs(ref.astype(jnp.float32)) + 1e-3).astype(jnp.int32)
      return bad

    return jax.lax.pcast(jax.lax.fori_loop(0, iters, step, jnp.zeros((), jnp.int32)), "x",
                         to="varying")[None]

  f = jax.jit(jax.shard_map(lambda *xs: body(xs), mesh=mesh, in_specs=(P("x"),) * len(sizes),
                            out_specs=P("x")))
  arrays = [_put(mesh, (_randn([31, n], (R * n,), np.float32) * 0.01).astype(jnp.bfloat16),
                 P("x")) for n in sizes]
  bad = np.concatenate([np.asarray(s.data) for s in f(*arrays).addressable_shards])
  assert not bad.any(), f"elements off per rank over {iters * len(sizes)} calls: {bad}"


def _run_on_new_buffers(mesh, R, calls: int, seed: int, what: str, before_call=None) -> None:
  """matmul_reduce_scatter then all_reduce in one jit'd step, run ``calls`` times on new
  buffers (all kept alive, so every call gets new addresses); every value checked.
  ``before_call(it)`` runs before call ``it``."""
  _, _, specs, _, _, _ = _gemm_case("matmul_reduce_scatter", R, jnp.bfloat16, seed)

  def step(x, w):
    y = jaxoverlap.matmul_reduce_scatter(x, w, "x", backend="cuda", chunks=2)
    z = jaxoverlap.all_reduce(y * 2, "x", backend="cuda")
    return y, z

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P("x"), P())))
  keep = []
  eps = EPS[np.dtype(jnp.bfloat16)]
  for it in range(calls):
    if before_call is not None:
      before_call(it)
    x, w, _, _, want, bound = _gemm_case("matmul_reduce_scatter", R, jnp.bfloat16, seed + 1 + it)
    args = (_put(mesh, x, specs[0]), _put(mesh, w, specs[1]))
    keep.append(args)
    y, z = f(*args)
    _check_shards(y, want, bound, eps, f"{what} {it} y")
    m = want.shape[0] // R
    _check_shards(z, 2 * want.reshape(R, m, -1).sum(0), 2 * bound.reshape(R, m, -1).sum(0), eps,
                  f"{what} {it} z", factor=8)


def test_new_buffers_under_graph_replay(runtime, mesh, R, monkeypatch):
  """One jit'd step run on new buffers each time: XLA replays and updates its CUDA graphs."""
  monkeypatch.setenv("JAXOVERLAP_FUSED_CMD_BUFFER", "1")  # the fused ops captured too
  _run_on_new_buffers(mesh, R, 4, 40, "graph replay")
  assert jaxoverlap.decisions("matmul_reduce_scatter")[-1].command_buffer


@pytest.mark.parametrize("handlers,start", [("plain", "mid_run"), ("captured", "from_the_start")])
def test_profiler(runtime, mesh, R, monkeypatch, tmp_path, handlers, start):
  """jax.profiler as docs/kernels.md ("CUDA graphs") says it works: the default (plain)
  handlers with a trace started after XLA recorded its graphs, and the captured handlers with a
  trace active from the first call. New buffers every call, every value checked."""
  if handlers == "captured":
    monkeypatch.setenv("JAXOVERLAP_FUSED_CMD_BUFFER", "1")
  else:
    monkeypatch.delenv("JAXOVERLAP_FUSED_CMD_BUFFER", raising=False)
  jax.clear_caches()  # lowered afresh, with this handler choice
  logdir = str(tmp_path / f"trace-rank{jax.process_index()}")
  traced = []

  def start_trace(it):
    if not traced and it == (0 if start == "from_the_start" else 3):
      jax.profiler.start_trace(logdir)
      traced.append(it)

  try:
    _run_on_new_buffers(mesh, R, 6, 60, f"{handlers} call", before_call=start_trace)
  finally:
    if traced:
      jax.profiler.stop_trace()
  assert traced, "the trace never started"
  plan = jaxoverlap.decisions("matmul_reduce_scatter")[-1]
  assert plan.command_buffer == (handlers == "captured"), plan.summary()


# ---------------------------------------------------------------------------- a model


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_nnx_block_training_matches_xla(runtime, mesh, R, sequence_parallel):
  """Training steps of an NNX TransformerBlock: backend cuda against backend xla."""
  import optax
  from flax import nnx

  from jaxoverlap import nnx as jnnx

  tp_mesh = jax.make_mesh((1, R), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def losses(backend):
    config = jnnx.ParallelConfig(mesh=tp_mesh, sequence_parallel=sequence_parallel,
                                 backend=backend)
    block = jnnx.TransformerBlock(64, 4, 128, config=config, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(block, optax.sgd(0.05), wrt=nnx.Param)

    @nnx.jit
    def train_step(block, opt, x):
      def loss_fn(block):
        return jnp.mean(jnp.square(block(x) - jnp.roll(x, 1, axis=1)))

      loss, grads = nnx.value_and_grad(loss_fn)(block)
      opt.update(block, grads)
      return loss

    out = []
    for i in range(4):
      x = jnp.asarray(_randn([50, i], (2, 8 * R, 64), np.float32) * 0.1)
      out.append(float(train_step(block, opt, x)))
    return np.asarray(out)

  with jax.default_matmul_precision("highest"):
    jaxoverlap.clear_decisions()
    ours = losses("cuda")
    assert jaxoverlap.decisions() and all(p.backend == "cuda" or p.op == "all_reduce"
                                          for p in jaxoverlap.decisions()), [
        p.summary() for p in jaxoverlap.decisions()]
    theirs = losses("xla")
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
  assert ours[-1] < ours[0]
