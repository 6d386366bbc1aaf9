"""Rank side: all_reduce(backend="cuda") in N processes, one NVSHMEM PE each.

Run by tests/gpu/test_gpu_all_reduce.py (every rank runs this module; see
conftest.py for the fixtures and the SPMD rules). What is checked:

* sweep: sizes 0 B .. 64 MiB (odd ones too) x float32/bfloat16/float16 x
  every (algorithm, protocol) valid for the topology, jit and eager (up to
  8 KiB), against a float64 NumPy reference computed from every rank's input
  (each process regenerates all ranks' inputs from seeds), every element;
  results compared bit for bit across ranks through the key-value store.
  ``sweep_quick``: float32, 4 sizes, every algorithm; ``sweep_quick_16bit``:
  bfloat16 and float16 across nodes (whose inter-node LL8 cells carry two fp32
  partials per 8-byte line of 16-bit data), the CUDA algorithms (not "auto").
* refused: algorithms that need one node raise a clear error across nodes.
* stress (2 ranks): 10,000 calls per algorithm in one jit'd ``fori_loop``
  (10 sizes straddling the protocol and chunk cut-offs, inputs changing every
  iteration), each compared in-graph bit for bit with ``lax.psum`` (for 2
  ranks one fp32 add, so both are exact); XLA may capture the loop in CUDA
  graphs, so replays are covered. Plus 200 eager calls checked on the host.
* grads: jax.grad through all_reduce equals jax.grad through lax.psum and the
  float64 gradient.
* axes: all-reduces over both axes of a 2-D mesh and over both at once.
* late: rank 1 starts its call 3 s after the others; the result is right.
* negative_zero: an element that is -0.0 on every rank sums to -0.0 (as lax.psum's: -0 is
  IEEE addition's identity), +0.0 on one rank and -0.0 on the others to +0.0, for every
  kernel, next to ordinary values.
* lamport_empty_pattern: inputs holding the Lamport protocol's empty word
  (0xffffffff: an fp32 NaN, or two bf16 NaNs) give NaN there and the sum
  elsewhere, and the calls after them are right (the slots were emptied), for
  one_shot and two_shot (whose all-gather sends sums that are NaN there).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.usefixtures("runtime")

WITHIN_NODE = (("one_shot", "ll"), ("one_shot", "simple"), ("one_shot", "lamport"),
               ("two_shot", "ll"), ("two_shot", "simple"), ("two_shot", "lamport"))
ACROSS_NODES = (("hierarchical", "ll"), ("hierarchical", "simple"))
AUTO = ("auto", "auto")

SWEEP_BYTES = [0, 2, 4, 6, 14, 32, 1000, 8190, 8192, 65534, 65536, 65538, 262146,
               1 << 20, (4 << 20) + 6, 16 << 20, 64 << 20]
QUICK_BYTES = [4, 8192, 65540, 1 << 20]
QUICK_16BIT_BYTES = [6, 8190, 65538, 1 << 20]
# One node: hierarchical is the two-shot kernel; these sizes suffice for it.
HIERARCHICAL_ONE_NODE_BYTES = (6, 65538, 1 << 20)
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}
# |got - want| / (|want| + 1), by dtype (bfloat16: the default).
TOL = {np.dtype(np.float32): 2e-6, np.dtype(np.float16): 1e-3}
TOL_DEFAULT = 8e-3


def _inputs(seed, rank: int, n: int, dtype) -> np.ndarray:
  """Rank ``rank``'s input: normal values with outliers, in ``dtype``."""
  rng = np.random.default_rng([*np.atleast_1d(seed), rank, n])
  x = rng.standard_normal(n).astype(np.float32)
  if n > 8:
    idx = rng.integers(0, n, size=max(1, n // 1000))
    x[idx] *= 100.0  # outliers
  return x.astype(dtype)


def _name(alg) -> str:
  return "auto" if alg == AUTO else f"{alg[0]}-{alg[1]}"


def algorithms(topology, nccl: bool) -> tuple:
  """(algorithm, protocol) pairs valid for the topology; "auto" where NCCL can run."""
  if topology.num_nodes == 1:
    algs = WITHIN_NODE + ACROSS_NODES  # hierarchical over one node runs as two-shot
  else:
    algs = ACROSS_NODES
  return algs + ((AUTO,) if nccl else ())


def default_algorithm(topology, nccl: bool):
  if nccl:
    return AUTO
  return WITHIN_NODE[0] if topology.num_nodes == 1 else ACROSS_NODES[0]


class AllReduce:
  """Global arrays over the 1-D mesh and the jit'd / eager all-reduces of each algorithm."""

  def __init__(self, mesh, ops, rank: int, nproc: int):
    self.mesh, self.ops, self.rank, self.nproc = mesh, ops, rank, nproc
    self.sharding = NamedSharding(mesh, P("x"))
    self._fns = {}

  def global_array(self, local, n: int):
    return jax.make_array_from_process_local_data(self.sharding, local, (n * self.nproc,))

  @staticmethod
  def local(out) -> np.ndarray:
    return np.asarray(out.addressable_shards[0].data)

  def fn(self, alg, jit: bool = True):
    key = (alg, jit)
    if key not in self._fns:
      algorithm, protocol = alg

      def f(x):
        y = self.ops.all_reduce(x, "x", algorithm=algorithm, protocol=protocol)
        return jax.lax.pcast(y, "x", to="varying")

      g = jax.shard_map(f, mesh=self.mesh, in_specs=P("x"), out_specs=P("x"))
      self._fns[key] = jax.jit(g) if jit else g
    return self._fns[key]


@pytest.fixture(scope="module")
def ar(mesh, ops, rank, nproc) -> AllReduce:
  return AllReduce(mesh, ops, rank, nproc)


def _sweep(ar, kv, topology, nccl, sizes, dtype, seed) -> list[str]:
  """Runs every call of a sweep on every rank; returns what was wrong here."""
  rank, nproc = ar.rank, ar.nproc
  algs = algorithms(topology, nccl)
  itemsize = np.dtype(dtype).itemsize
  failures = []
  for i, nbytes in enumerate(sizes):
    n = nbytes // itemsize
    for a, alg in enumerate(algs):
      if (alg in ACROSS_NODES and topology.num_nodes == 1
          and nbytes not in HIERARCHICAL_ONE_NODE_BYTES):
        continue
      for jit in ((True, False) if nbytes <= 8192 else (True,)):
        # Fresh inputs for every call: XLA hands the previous call's freed output buffer to
        # the next, so on the same inputs a kernel that skipped elements would find them
        # already holding the right sums (trial 24 saw the buffer reused 3 times in 3).
        xs = [_inputs((seed, i, a, int(jit)), r, n, dtype) for r in range(nproc)]
        want = np.sum([x.astype(np.float64) for x in xs], axis=0)
        garr = ar.global_array(xs[rank], n)
        what = (f"{np.dtype(dtype).name} {nbytes} B ({n} elements) {_name(alg)} "
                f"{'jit' if jit else 'eager'}")
        got = ar.local(ar.fn(alg, jit)(garr))
        if got.shape != want.shape:
          failures.append(f"{what}: shape {got.shape}, want {want.shape}")
        elif n:
          err = np.abs(got.astype(np.float64) - want) / (np.abs(want) + 1.0)
          tol = TOL.get(np.dtype(dtype), TOL_DEFAULT)
          bad = ~(err <= tol)  # NaN counts as bad
          if bad.any():
            j = int(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)))
            failures.append(f"{what}: {int(bad.sum())} of {n} elements off (tolerance {tol}); "
                            f"e.g. [{j}]: got {got[j]}, want {want[j]}")
        same, digests = kv.same_on_all_ranks(got)
        if not same:
          failures.append(f"{what}: results differ across ranks (digests {digests})")
  return failures


def _report(failures: list[str], limit: int = 25) -> str:
  more = f"\n... and {len(failures) - limit} more" if len(failures) > limit else ""
  return f"{len(failures)} wrong:\n" + "\n".join(failures[:limit]) + more


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sweep(dtype, ar, kv, topology, nccl):
  failures = _sweep(ar, kv, topology, nccl, SWEEP_BYTES, DTYPES[dtype],
                    seed=list(DTYPES).index(dtype))
  assert not failures, _report(failures)


@pytest.mark.quick
def test_sweep_quick(ar, kv, topology, nccl):
  failures = _sweep(ar, kv, topology, nccl, QUICK_BYTES, np.float32, seed=100)
  assert not failures, _report(failures)


@pytest.mark.quick
def test_every_pe_of_a_node_reaches_the_others(topology):
  """initialize() gathers the pairs of a node without load/store access (a PCIe machine
  without P2P would list them, and plans would leave their groups to XLA); on these GPUs,
  NVLink or one GPU shared, there are none, on every rank."""
  if topology.info.get("transport") != "nvshmem":
    pytest.skip("the in-process runtime requires peer access at start-up instead")
  assert tuple(topology.info["unreachable_pairs"]) == ()


@pytest.mark.quick
def test_sweep_quick_16bit(ar, ops, kv, topology):
  if topology.num_nodes == 1:
    pytest.skip("one node: test_sweep covers 16-bit dtypes (world 2)")
  # The tolerances hold for one rounding of an fp32 sum; XLA's 16-bit psum rounds at every
  # step, and at 4 ranks float16 exceeded 1e-3 on about 1 element in 1,500. So the CUDA
  # kernels only: no dry run, and no "auto" (nccl=False below), which may hand over to psum.
  ops.require_cuda("summing 16-bit inputs in fp32, rounded once,")
  failures = []
  for i, dtype in enumerate((jnp.bfloat16, np.float16)):
    failures += _sweep(ar, kv, topology, False, QUICK_16BIT_BYTES, dtype, seed=101 + i)
  assert not failures, _report(failures)


@pytest.mark.quick
def test_single_node_algorithms_refused_across_nodes(ar, ops, topology, rank):
  ops.require_cuda("the topology check")
  if topology.num_nodes == 1:
    pytest.skip("one node: every algorithm is valid")
  x = ar.global_array(_inputs(0, rank, 64, np.float32), 64)
  for alg in WITHIN_NODE:
    with pytest.raises(ValueError, match="needs the whole group on one node"):
      ar.fn(alg)(x)


# ---------------------------------------------------------------------------- stress

# Elements of bfloat16, straddling the LL/simple cut-off (64 KiB) and odd sizes.
STRESS_SIZES = [1, 7, 4096, 32767, 32768, 32769, 65536, 131071, 262144, 1 << 19]
STRESS_ITERS = 1000
STRESS_ALGS = (AUTO,) + WITHIN_NODE + ACROSS_NODES


def _stress_algorithms(topology, nccl: bool) -> tuple:
  algs = WITHIN_NODE if topology.num_nodes == 1 else ACROSS_NODES
  return ((AUTO,) if nccl else ()) + algs


@pytest.mark.stress
@pytest.mark.parametrize("alg", STRESS_ALGS, ids=_name)
def test_stress_jit(alg, ar, mesh, ops, topology, nccl, nproc, rank, needs_nccl):
  if nproc != 2:
    pytest.skip("2 ranks only: there psum and the kernels both make one fp32 add (bit-exact)")
  if alg not in _stress_algorithms(topology, nccl):
    pytest.skip(f"{_name(alg)} is not stressed on {topology.num_nodes} node(s)")
  algorithm, protocol = alg

  def stress(*xs):
    def body(i, bad):
      scale = (i + 1).astype(jnp.float32)
      for x in xs:
        y = (x.astype(jnp.float32) * scale).astype(x.dtype)
        ours = ops.all_reduce(y, "x", algorithm=algorithm, protocol=protocol)
        bad = bad + jnp.sum(ours != jax.lax.psum(y, "x")).astype(jnp.int32)
      return bad

    bad = jax.lax.fori_loop(0, STRESS_ITERS, body, jnp.zeros((), jnp.int32))
    return jax.lax.pcast(bad, "x", to="varying")[None]

  fn = jax.jit(jax.shard_map(stress, mesh=mesh, in_specs=(P("x"),) * len(STRESS_SIZES),
                             out_specs=P("x")))
  arrs = [ar.global_array(_inputs(7, rank, n, jnp.bfloat16) * 0.01, n) for n in STRESS_SIZES]
  t0 = time.time()
  bad = int(ar.local(fn(*arrs))[0])
  print(f"stress {_name(alg)}: {STRESS_ITERS * len(STRESS_SIZES)} calls in "
        f"{time.time() - t0:.1f} s")
  assert bad == 0, (f"{bad} elements differ from psum over "
                    f"{STRESS_ITERS * len(STRESS_SIZES)} calls")


@pytest.mark.stress
def test_stress_eager(ar, topology, nccl, nproc, rank):
  if nproc != 2:
    pytest.skip("2 ranks only: one fp32 add is exact")
  algs = _stress_algorithms(topology, nccl)
  eager = {alg: ar.fn(alg, jit=False) for alg in algs}
  wrong = []
  for i in range(200):
    n = STRESS_SIZES[i % len(STRESS_SIZES)]
    alg = algs[i % len(algs)]
    xs = [_inputs(1000 + i, r, n, np.float32) for r in range(nproc)]
    want = np.sum(xs, axis=0, dtype=np.float32)  # one fp32 add: exact
    got = ar.local(eager[alg](ar.global_array(xs[rank], n)))
    if not np.array_equal(got, want):
      wrong.append(f"call {i} ({n} elements, {_name(alg)})")
  assert not wrong, f"{len(wrong)} of 200 eager calls wrong: {wrong[:10]}"


# ---------------------------------------------------------------------------- grads, axes, late


@pytest.mark.quick
def test_grads_match_psum(ar, mesh, ops, nproc, rank, needs_nccl):
  if nproc < 2:
    pytest.skip("one rank")
  n = 4099

  def loss(x, ct, use_ours):
    def f(x, ct):
      y = ops.all_reduce(x * x, "x") if use_ours else jax.lax.psum(x * x, "x")
      return jnp.sum(y * ct)[None]  # varying: ct is

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))
    return jnp.sum(g(x, ct))

  xs = [_inputs(3, r, n, np.float32) for r in range(nproc)]
  cts = [_inputs(4, r, n, np.float32) for r in range(nproc)]
  x, ct = ar.global_array(xs[rank], n), ar.global_array(cts[rank], n)
  got = ar.local(jax.jit(jax.grad(lambda x, ct: loss(x, ct, True)))(x, ct))
  via_psum = ar.local(jax.jit(jax.grad(lambda x, ct: loss(x, ct, False)))(x, ct))
  # d/dx_r of sum_r' sum((sum_p x_p^2) * ct_r') = 2 x_r sum_r' ct_r'
  want = 2 * xs[rank].astype(np.float64) * np.sum(np.asarray(cts, np.float64), axis=0)
  assert np.allclose(got, via_psum, rtol=1e-6, atol=1e-6), (
      f"grads differ from psum's: max |diff| {np.max(np.abs(got - via_psum)):.3g}")
  err = np.abs(got - want) / (np.abs(want) + 1.0)
  assert err.max() <= 1e-5, f"grads differ from the float64 gradient: max rel err {err.max():.3g}"


@pytest.mark.quick
def test_axes_of_a_2d_mesh(ops, nccl, nproc, rank):
  if nproc < 2:
    pytest.skip("one rank")
  shape = (nproc // 2, 2) if nproc % 2 == 0 else (nproc, 1)
  if nccl:
    algorithm = "auto"
  elif 1 in shape:
    pytest.skip(f"without NCCL the algorithm is named ('hierarchical'), and mesh {shape} has an "
                "axis of one rank")
  else:
    algorithm = "hierarchical"  # "auto" may hand over to psum (NCCL)
  mesh2 = jax.make_mesh(shape, ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def step(x):
    a = ops.all_reduce(x, "tp", algorithm=algorithm)
    b = ops.all_reduce(x * 2, "dp", algorithm=algorithm)
    d = ops.all_reduce(a + b, ("dp", "tp"), algorithm=algorithm)
    return jax.lax.pcast(d, ("dp", "tp"), to="varying")

  f2 = jax.jit(jax.shard_map(step, mesh=mesh2, in_specs=P(("dp", "tp")),
                             out_specs=P(("dp", "tp"))))
  n = 1000
  xs = [_inputs(9, r, n, np.float32) for r in range(nproc)]
  garr = jax.make_array_from_process_local_data(NamedSharding(mesh2, P(("dp", "tp"))), xs[rank],
                                                (n * nproc,))
  got = np.asarray(f2(garr).addressable_shards[0].data).astype(np.float64)
  # The input of the process that owns each mesh position (make_mesh may reorder devices).
  owner = np.vectorize(lambda d: d.process_index)(mesh2.devices)
  grid = np.asarray(xs, np.float64)[owner]  # [dp, tp, n]
  a = grid.sum(axis=1, keepdims=True)
  b = (2 * grid).sum(axis=0, keepdims=True)
  want = (a + b).sum(axis=(0, 1))
  assert np.allclose(got, want, rtol=1e-5, atol=1e-4), (
      f"2-D mesh {shape} ({algorithm}): max |err| {np.max(np.abs(got - want)):.3g}")


@pytest.mark.quick
def test_late_rank(ar, topology, nccl, nproc, rank):
  n = 12345
  xs = [_inputs(11, r, n, np.float32) for r in range(nproc)]
  garr = ar.global_array(xs[rank], n)
  alg = default_algorithm(topology, nccl)
  compiled = ar.fn(alg).lower(garr).compile()
  if rank == 1:
    time.sleep(3.0)  # within the device-wait timeout (100 s by default)
  got = ar.local(compiled(garr))
  want = np.sum(np.asarray(xs, np.float64), axis=0)
  assert np.allclose(got, want, rtol=1e-6, atol=1e-5), (
      f"{_name(alg)} with rank 1 late: max |err| {np.max(np.abs(got - want)):.3g}")


@pytest.mark.quick
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lamport_empty_pattern(dtype, algorithm, ar, kv, topology, nproc, rank):
  """Data words equal to the empty pattern neither hang the receiver nor stay in the slots."""
  if topology.num_nodes != 1 or nproc < 2:
    pytest.skip(f"{algorithm} runs within one node, of at least 2 ranks")
  dt = DTYPES[dtype]
  n = 3 * 4096 + 6  # several blocks and a partial vector; whole 32-bit words in bfloat16
  words = n * np.dtype(dt).itemsize // 4
  fn = ar.fn((algorithm, "lamport"))
  failures = []
  for call in range(3):
    xs = [_inputs((13, call), r, n, dt) for r in range(nproc)]
    nan_at = np.zeros(n, bool)
    if call == 0:  # every rank sends empty words, at its own places
      for r in range(nproc):
        w = np.random.default_rng([13, r]).choice(words, size=17, replace=False)
        xs[r].view(np.uint32)[w] = 0xFFFFFFFF
        per_word = 4 // np.dtype(dt).itemsize
        for k in range(per_word):
          nan_at[w * per_word + k] = True
    want = np.sum([x.astype(np.float64) for x in xs], axis=0)
    got = ar.local(fn(ar.global_array(xs[rank], n))).astype(np.float64)
    if not np.array_equal(np.isnan(got), nan_at):
      failures.append(f"call {call}: NaN at {np.flatnonzero(np.isnan(got))[:8]}, "
                      f"want {np.flatnonzero(nan_at)[:8]}")
    ok = ~nan_at
    err = np.abs(got[ok] - want[ok]) / (np.abs(want[ok]) + 1.0)
    tol = TOL.get(np.dtype(dt), TOL_DEFAULT)
    if not (err <= tol).all():
      failures.append(f"call {call}: {int((~(err <= tol)).sum())} elements off")
    same, digests = kv.same_on_all_ranks(np.nan_to_num(got, nan=0.0))  # NaN payloads may differ
    if not same:
      failures.append(f"call {call}: results differ across ranks ({digests})")
  assert not failures, _report(failures)


@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_negative_zero(dtype, ar, kv, topology, nproc, rank):
  """Trial 29: every kernel started its sums at +0.0, so -0.0 on every rank came out +0.0
  (lax.psum: -0.0; visible through signbit, copysign, 1/x). A third of the elements are -0.0
  everywhere, a third +0.0 on one rank and -0.0 on the others, a third ordinary values."""
  dt = DTYPES[dtype]
  failures = []
  for a, alg in enumerate(algorithms(topology, nccl=False)):
    for n in (4099, 3 * 65536 + 6):  # a partial vector; several blocks
      rng = np.random.default_rng([17, a, n])
      kind = rng.integers(0, 3, size=n)  # 0: -0 everywhere; 1: +0 on rank plus[i]; 2: values
      plus = rng.integers(0, nproc, size=n)
      xs = [_inputs((17, a, n), r, n, dt) for r in range(nproc)]
      for r, x in enumerate(xs):
        x[kind == 0] = -0.0
        x[kind == 1] = np.where(plus[kind == 1] == r, 0.0, -0.0).astype(dt)
      got = ar.local(ar.fn(alg)(ar.global_array(xs[rank], n))).astype(np.float32)
      what = f"{dtype} {n} elements {_name(alg)}"
      for k, negative in ((0, True), (1, False)):
        wrong = (got[kind == k] != 0) | (np.signbit(got[kind == k]) != negative)
        if wrong.any():
          i = int(np.flatnonzero(kind == k)[np.argmax(wrong)])
          failures.append(f"{what}: {int(wrong.sum())} of {int((kind == k).sum())} "
                          f"{'-0 + ... + -0' if negative else '+0 + -0 ...'} sums wrong; "
                          f"e.g. [{i}] = {got[i]!r}")
      want = np.sum([x.astype(np.float64) for x in xs], axis=0)[kind == 2]
      err = np.abs(got[kind == 2] - want) / (np.abs(want) + 1.0)
      if not (err <= TOL.get(np.dtype(dt), TOL_DEFAULT)).all():
        failures.append(f"{what}: {int((~(err <= TOL.get(np.dtype(dt), TOL_DEFAULT))).sum())} "
                        "ordinary elements off")
      same, digests = kv.same_on_all_ranks(got)
      if not same:
        failures.append(f"{what}: results differ across ranks ({digests})")
  assert not failures, _report(failures)
