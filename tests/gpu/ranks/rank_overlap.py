"""Rank side: the fused ops with backend="cuda" in N processes, one PE each, one node.

Run by tests/gpu/test_gpu_overlap.py (every rank runs this module; see
conftest.py for the fixtures and the SPMD rules). What is checked:

* sweep: all_gather_matmul, matmul_reduce_scatter and matmul_all_reduce
  (algorithm "fused") for a sweep of shapes (odd M/N/K, tiny M, large K,
  leading batch dimensions with the gather/scatter dimension in the middle)
  x float32/bfloat16/float16 x both transports x automatic and 3 chunks,
  against a float64 NumPy reference computed from every rank's inputs (each
  process regenerates all ranks' inputs from seeds); every element of every
  rank within a few units of rounding of the dtype (TF32 for float32 at JAX's
  default precision) times the sum of |products|. float32 also under
  ``jax.default_matmul_precision("highest")`` with a float32-level bound.
  matmul_all_reduce's result must be bit-identical on every rank.
  ``sweep_quick``: one shape per op, bfloat16 and float32.
* unfused: matmul_all_reduce's "unfused" algorithm (the GEMM, then the CUDA
  all-reduce).
* grads: the value and both gradients of each op against float64, through
  ``jax.grad`` outside the shard_map (as in training; needs NCCL for the
  loss's sum) and through ``jax.vjp`` inside it (no NCCL); all_gather_matmul's
  backward runs the fused GEMM+RS and vice versa.
* rotation: 24 calls in one jit'd ``lax.scan``, each with fresh inputs and 4
  chunks per shard, every output checked on the host, with the plain and the
  command-buffer handlers (``JAXOVERLAP_FUSED_CMD_BUFFER=1``: XLA may replay
  the scan body from a CUDA graph). Slots keep the previous call's data, so
  waiting on one chunk and reading another, or reading a rank's slot for
  another rank, gives wrong rows.
* graphs: one jit'd step (three calls of an op among elementwise work) run
  four times on new buffers, for each op, 1-D and batched, and the gathered
  all_gather_matmul variant, with both handler kinds. Captured, XLA records
  the calls into a CUDA graph and updates it for the new addresses (before
  the fix in docs/kernels.md, "CUDA graphs", the batched and gathered AG failed
  with CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE).
* multi: an MLP step with AG+GEMM, GEMM+RS, GEMM+AR and all_reduce in flight
  in one jit, against float64.
* errors: a shard larger than the fused-op slot raises ValueError at lowering,
  before any kernel runs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.usefixtures("runtime")

TRANSPORTS = ("copy_engine", "nvshmem")
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}
# Unit roundoff used in the bounds (float32: TF32 at JAX's default precision).
EPS = {np.dtype(np.float32): 2.0 ** -10, np.dtype(np.float16): 2.0 ** -10,
       np.dtype(jnp.bfloat16): 2.0 ** -7}
EPS_HIGHEST = 2.0 ** -22
BF16 = np.dtype(jnp.bfloat16)
CMD_BUFFER_ENV = "JAXOVERLAP_FUSED_CMD_BUFFER"


def _randn(seed, shape, dtype, scale=1.0, outliers=True) -> np.ndarray:
  rng = np.random.default_rng(seed)
  a = rng.standard_normal(shape).astype(np.float32) * scale
  if outliers and a.size > 16:
    idx = rng.choice(a.size, size=max(1, a.size // 200), replace=False)
    a.flat[idx] *= 30.0
  return a.astype(dtype)


def _f64(a) -> np.ndarray:
  return np.asarray(np.asarray(a).astype(np.float32), np.float64)


def _matmul(x, w):
  return np.einsum("...k,kn->...n", x, w)


def _contract_leading(a, b):
  lead = tuple(range(a.ndim - 1))
  return np.tensordot(a, b, axes=(lead, lead))


# ---------------------------------------------------------------------------- float64 references
# xs[p], ws[p] (and cs[p], the cotangents) are the inputs at axis position p.


def ref_ag(xs, ws, dim, pos):
  return _matmul(np.concatenate(xs, axis=dim), ws[pos])


def ref_rs(xs, ws, dim, pos):
  full = sum(_matmul(x, w) for x, w in zip(xs, ws))
  return np.split(full, len(xs), axis=dim)[pos]


def ref_ar(xs, ws, pos):
  del pos
  return sum(_matmul(x, w) for x, w in zip(xs, ws))


def grads_ag(xs, ws, cs, dim, pos):
  xg = np.concatenate(xs, axis=dim)
  dxg = sum(_matmul(c, w.T) for c, w in zip(cs, ws))
  return np.split(dxg, len(xs), axis=dim)[pos], _contract_leading(xg, cs[pos])


def grads_rs(xs, ws, cs, dim, pos):
  cfull = np.concatenate(cs, axis=dim)
  return _matmul(cfull, ws[pos].T), _contract_leading(xs[pos], cfull)


def grads_ar(xs, ws, cs, pos):
  call = sum(cs)
  return _matmul(call, ws[pos].T), _contract_leading(xs[pos], call)


def cases(nproc: int) -> list[tuple]:
  """(op, x shape per rank, w shape per rank, gather/scatter dim).

  For rs/ar, x's rows are the full M; for ag, x holds this rank's M/P rows.
  """
  p = nproc
  return [
      ("ag", (1, 8), (8, 8), 0),
      ("ag", (3, 17), (17, 5), 0),
      ("ag", (5, 40), (40, 24), 0),             # tiny M
      ("ag", (257, 96), (96, 130), 0),          # odd everything
      ("ag", (64, 8192), (8192, 40), 0),        # large K
      ("ag", (1024, 1024), (1024, 512), 0),
      ("ag", (2, 5, 3, 24), (24, 16), 1),       # batch dims, gather in the middle
      ("ag", (3, 7, 24), (24, 10), 0),          # gather the outermost of 3-D
      ("rs", (2 * p, 8), (8, 8), 0),
      ("rs", (6 * p, 17), (17, 5), 0),
      ("rs", (129 * p, 96), (96, 130), 0),
      ("rs", (16 * p, 8192), (8192, 40), 0),
      ("rs", (1024 * p, 1024), (1024, 512), 0),
      ("rs", (3, 4 * p, 5, 24), (24, 16), 1),
      ("ar", (2 * p, 8), (8, 8), None),
      ("ar", (129 * p, 96), (96, 130), None),
      ("ar", (4 * p, 3, 2048), (2048, 33), None),
      ("ar", (512 * p, 1024), (1024, 512), None),
  ]


def _report(failures: list[str], limit: int = 25) -> str:
  more = f"\n... and {len(failures) - limit} more" if len(failures) > limit else ""
  return f"{len(failures)} wrong:\n" + "\n".join(failures[:limit]) + more


def close(got, want, bound, eps, what, factor=4.0) -> str | None:
  """Why ``|got - want| <= factor * eps * bound`` fails somewhere (None: every element holds)."""
  got = _f64(got)
  if got.shape != want.shape:
    return f"{what}: shape {got.shape} != {want.shape}"
  lim = factor * eps * bound + 1e-30
  err = np.abs(got - want)
  bad = ~(err <= lim)  # NaN counts as bad
  if not bad.any():
    return None
  ratio = float(np.nanmax(np.where(np.isnan(err), np.inf, err) / lim))
  where = np.argwhere(bad)[:3].tolist()
  return (f"{what}: {int(bad.sum())} of {err.size} elements off (worst err/limit {ratio:.3g}, "
          f"first at {where})")


class Fused:
  """Inputs, references and the jit'd fused calls of this process's axis position."""

  def __init__(self, mesh, ops, rank: int, nproc: int):
    self.mesh, self.ops, self.rank, self.nproc = mesh, ops, rank, nproc
    owner = [d.process_index for d in mesh.devices.reshape(-1)]
    self.pos = owner.index(rank)  # this process's position along the axis
    self.sharded = NamedSharding(mesh, P("x"))
    self.replicated = NamedSharding(mesh, P())

  def put(self, local):
    """The global array whose shard at this process's position is ``local``."""
    local = np.asarray(local)
    return jax.make_array_from_process_local_data(
        self.sharded, local, (local.shape[0] * self.nproc,) + local.shape[1:])

  def put_replicated(self, value):
    value = np.asarray(value)
    return jax.make_array_from_process_local_data(self.replicated, value, value.shape)

  @staticmethod
  def mine(out) -> np.ndarray:
    return np.asarray(out.addressable_shards[0].data)

  def op_call(self, op, dim, transport, chunks, algorithm="fused"):
    ops = self.ops
    if op == "ag":
      return lambda x, w: ops.all_gather_matmul(x, w, "x", dim, algorithm=algorithm,
                                                transport=transport, chunks=chunks)
    if op == "rs":
      return lambda x, w: ops.matmul_reduce_scatter(x, w, "x", dim, algorithm=algorithm,
                                                    transport=transport, chunks=chunks)
    return lambda x, w: ops.matmul_all_reduce(x, w, "x", algorithm=algorithm,
                                              transport=transport, chunks=chunks)

  def fused_fn(self, op, dim, transport, chunks, algorithm="fused"):
    """jit(shard_map) of one call: x, w are [1, ...] per rank, so is the output."""
    f = self.op_call(op, dim, transport, chunks, algorithm)

    def body(x, w):
      y = f(x[0], w[0])
      if op == "ar":
        y = jax.lax.pcast(y, "x", to="varying")
      return y[None]

    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=(P("x"), P("x")),
                                 out_specs=P("x")))

  def inputs(self, seed, x_shape, w_shape, dtype):
    k = w_shape[0]
    xs = [_randn([*np.atleast_1d(seed), p, 0], x_shape, dtype) for p in range(self.nproc)]
    ws = [_randn([*np.atleast_1d(seed), p, 1], w_shape, dtype, scale=1 / math.sqrt(k),
                 outliers=False) for p in range(self.nproc)]
    return xs, ws

  def reference(self, op, xs, ws, dim):
    """The float64 result at this position, and the same expression on |x|, |w| (the bound)."""
    x64, w64 = [_f64(x) for x in xs], [_f64(w) for w in ws]
    xa, wa = [np.abs(x) for x in x64], [np.abs(w) for w in w64]
    if op == "ag":
      return ref_ag(x64, w64, dim, self.pos), ref_ag(xa, wa, dim, self.pos)
    if op == "rs":
      return ref_rs(x64, w64, dim, self.pos), ref_rs(xa, wa, dim, self.pos)
    return ref_ar(x64, w64, self.pos), ref_ar(xa, wa, self.pos)

  def run_case(self, kv, op, x_shape, w_shape, dim, dtype, transport, chunks, seed,
               highest=False, algorithm="fused") -> list[str]:
    """One call on every rank; what is wrong on this rank."""
    xs, ws = self.inputs(seed, x_shape, w_shape, dtype)
    want, bound = self.reference(op, xs, ws, dim)
    fn = self.fused_fn(op, dim, transport, chunks, algorithm)
    got = self.mine(fn(self.put(xs[self.pos][None]), self.put(ws[self.pos][None])))[0]
    what = (f"{op} x{list(x_shape)} w{list(w_shape)} dim {dim} {np.dtype(dtype).name} "
            f"{algorithm} {transport} chunks={chunks}{' (precision highest)' if highest else ''}")
    failures = []
    msg = close(got, want, bound, EPS_HIGHEST if highest else EPS[np.dtype(dtype)], what)
    if msg:
      failures.append(msg)
    if op == "ar":
      same, digests = kv.same_on_all_ranks(got)
      if not same:
        failures.append(f"{what}: results differ across ranks (digests {digests})")
    return failures


@pytest.fixture(scope="module")
def fx(mesh, ops, rank, nproc) -> Fused:
  return Fused(mesh, ops, rank, nproc)


def _handlers(monkeypatch, handlers: str) -> None:
  if handlers == "cmdbuf":
    monkeypatch.setenv(CMD_BUFFER_ENV, "1")
  else:
    monkeypatch.delenv(CMD_BUFFER_ENV, raising=False)


# ---------------------------------------------------------------------------- sweeps


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
def test_sweep(op, dtype, fx, kv, monkeypatch):
  _handlers(monkeypatch, "plain")
  failures = []
  for ci, (case_op, x_shape, w_shape, dim) in enumerate(cases(fx.nproc)):
    if case_op != op:
      continue
    for ti, transport in enumerate(TRANSPORTS):
      for chunks in (None, 3):
        seed = (ci, list(DTYPES).index(dtype), ti, chunks or 0)
        failures += fx.run_case(kv, op, x_shape, w_shape, dim, DTYPES[dtype], transport, chunks,
                                seed)
  assert not failures, _report(failures)


def test_sweep_precision_highest(fx, kv, monkeypatch):
  _handlers(monkeypatch, "plain")
  todo = [c for c in cases(fx.nproc) if c[2] == (96, 130)]  # one shape per op
  failures = []
  with jax.default_matmul_precision("highest"):  # read when the calls are lowered
    for i, (op, x_shape, w_shape, dim) in enumerate(todo):
      failures += fx.run_case(kv, op, x_shape, w_shape, dim, np.float32, "copy_engine", None,
                              seed=(50, i), highest=True)
  assert not failures, _report(failures)


@pytest.mark.quick
def test_sweep_quick(fx, kv, monkeypatch):
  _handlers(monkeypatch, "plain")
  p = fx.nproc
  todo = [c for c in cases(p) if c[1][0] in (5, 6 * p, 129 * p)]
  failures = []
  for ci, (op, x_shape, w_shape, dim) in enumerate(todo):
    for di, dtype in enumerate((jnp.bfloat16, np.float32)):
      for ti, transport in enumerate(TRANSPORTS):
        failures += fx.run_case(kv, op, x_shape, w_shape, dim, dtype, transport, None,
                                seed=(60, ci, di, ti))
  assert not failures, _report(failures)


def test_matmul_all_reduce_unfused(fx, kv, needs_nccl):
  # The all-reduce of the GEMM's output picks its algorithm ("auto"), which may be psum.
  failures = []
  for i, (x_shape, w_shape) in enumerate([((2 * fx.nproc, 8), (8, 8)),
                                          ((129 * fx.nproc, 96), (96, 130))]):
    for di, dtype in enumerate((np.float32, jnp.bfloat16)):
      failures += fx.run_case(kv, "ar", x_shape, w_shape, None, dtype, "auto", None,
                              seed=(70, i, di), algorithm="unfused")
  assert not failures, _report(failures)


# ---------------------------------------------------------------------------- grads

GRAD_CASES = [("ag", (37, 64), (64, 48), 0), ("ag", (2, 6, 32), (32, 24), 1),
              ("rs", (20, 64), (64, 48), 0), ("rs", (3, 4, 32), (32, 24), 1),
              ("ar", (9, 64), (64, 48), None)]


def _grad_case(op, x_shape, w_shape, dim, nproc):
  """Per-rank x shape (rs/ar rows scale with the ranks) and the output's shape."""
  x_shape = list(x_shape)
  if op in ("rs", "ar"):
    x_shape[0 if dim is None else dim] *= nproc
  y_shape = list(x_shape[:-1]) + [w_shape[1]]
  if op == "ag":
    y_shape[dim] *= nproc
  elif op == "rs":
    y_shape[dim] //= nproc
  return tuple(x_shape), tuple(y_shape)


@pytest.mark.quick
@pytest.mark.parametrize("form", ["grad", "vjp"])
def test_grads(form, fx, mesh, nccl):
  """Value and gradients of each op; "grad": jax.grad outside shard_map, "vjp": inside."""
  if form == "grad" and not nccl:
    pytest.skip("jax.grad of the summed per-rank losses sums across devices (NCCL), and NCCL "
                "refuses two ranks on one GPU; the 'vjp' form covers the same backward passes")
  nproc, pos = fx.nproc, fx.pos
  failures = []
  for gi, (op, x0, w_shape, dim) in enumerate(GRAD_CASES):
    x_shape, y_shape = _grad_case(op, x0, w_shape, dim, nproc)
    for dtype in (np.float32, jnp.bfloat16):
      for transport in TRANSPORTS:
        f = fx.op_call(op, dim, transport, None)
        xs, ws = fx.inputs((100, gi), x_shape, w_shape, dtype)
        if form == "vjp" and op == "ar":
          # The output is the same on every rank: one cotangent, replicated.
          cs = [_randn([200, gi], y_shape, dtype)]
        else:
          cs = [_randn([200, gi, p], y_shape, dtype) for p in range(nproc)]
        x, w = fx.put(xs[pos][None]), fx.put(ws[pos][None])
        if form == "grad":
          def loss(x, w, ct, f=f):
            y = f(x[0], w[0])
            return jnp.sum(y.astype(jnp.float32) * ct[0].astype(jnp.float32))[None]

          per_rank = jax.shard_map(loss, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
          g = jax.jit(jax.grad(lambda x, w, ct: jnp.sum(per_rank(x, w, ct)), argnums=(0, 1)))
          dx, dw = g(x, w, fx.put(cs[pos][None]))
        else:
          def body(x, w, ct, f=f):
            _, vjp = jax.vjp(f, x[0], w[0])
            dx, dw = vjp(ct[0])
            return dx[None], dw[None]

          replicated = form == "vjp" and op == "ar"
          g = jax.jit(jax.shard_map(body, mesh=mesh,
                                    in_specs=(P("x"), P("x"), P() if replicated else P("x")),
                                    out_specs=(P("x"), P("x"))))
          ct = fx.put_replicated(cs[0][None]) if replicated else fx.put(cs[pos][None])
          dx, dw = g(x, w, ct)
        x64, w64, c64 = [_f64(a) for a in xs], [_f64(a) for a in ws], [_f64(a) for a in cs]
        ax, aw, ac = ([np.abs(a) for a in x64], [np.abs(a) for a in w64],
                      [np.abs(a) for a in c64])
        if op == "ag":
          want, bound = grads_ag(x64, w64, c64, dim, pos), grads_ag(ax, aw, ac, dim, pos)
        elif op == "rs":
          want, bound = grads_rs(x64, w64, c64, dim, pos), grads_rs(ax, aw, ac, dim, pos)
        else:
          want, bound = grads_ar(x64, w64, c64, pos), grads_ar(ax, aw, ac, pos)
        what = f"{form} {op} x{list(x_shape)} {np.dtype(dtype).name} {transport}"
        e = EPS[np.dtype(dtype)]
        for name, got, wnt, bnd in (("dx", dx, want[0], bound[0]), ("dw", dw, want[1], bound[1])):
          msg = close(fx.mine(got)[0], wnt, bnd, e, f"{what} {name}", factor=8.0)
          if msg:
            failures.append(msg)
  assert not failures, _report(failures)


# ---------------------------------------------------------------------------- rotation, graphs


@pytest.mark.quick
@pytest.mark.parametrize("handlers", ["plain", "cmdbuf"])
def test_rotation(handlers, fx, mesh, monkeypatch):
  _handlers(monkeypatch, handlers)
  iters, p, pos = 24, fx.nproc, fx.pos
  failures = []
  for op, x_shape, w_shape, dim in [("ag", (64, 96), (96, 40), 0),
                                    ("rs", (64 * p, 96), (96, 40), 0),
                                    ("ar", (64 * p, 96), (96, 40), None)]:
    for transport in TRANSPORTS:
      f = fx.op_call(op, dim, transport, 4)

      def scan_body(xs, ws, f=f, op=op):
        def step(carry, xw):
          y = f(xw[0], xw[1])
          if op == "ar":
            y = jax.lax.pcast(y, "x", to="varying")
          return carry, y

        _, ys = jax.lax.scan(step, 0, (xs[0], ws[0]))
        return ys[None]

      fn = jax.jit(jax.shard_map(scan_body, mesh=mesh, in_specs=(P("x"), P("x")),
                                 out_specs=P("x")))
      per_iter = [fx.inputs(1000 + i, x_shape, w_shape, jnp.bfloat16) for i in range(iters)]
      xs_all = np.stack([it[0][pos] for it in per_iter])
      ws_all = np.stack([it[1][pos] for it in per_iter])
      got = fx.mine(fn(fx.put(xs_all[None]), fx.put(ws_all[None])))[0]
      bad = []
      for i, (xs, ws) in enumerate(per_iter):
        want, bound = fx.reference(op, xs, ws, dim)
        lim = 4 * EPS[BF16] * bound + 1e-30
        if not np.all(np.abs(_f64(got[i]) - want) <= lim):
          bad.append(i)
      if bad:
        failures.append(f"rotation ({handlers} handlers) {op} {transport}: calls {bad} of "
                        f"{iters} wrong")
  assert not failures, _report(failures)


@pytest.mark.quick
@pytest.mark.parametrize("handlers", ["plain", "cmdbuf"])
def test_graphs(handlers, fx, mesh, monkeypatch):
  _handlers(monkeypatch, handlers)
  p, pos, nproc = fx.nproc, fx.pos, fx.nproc
  gcases = [("ag", (64, 96), (96, 40), 0), ("ag", (2, 32, 96), (96, 40), 1),
            ("rs", (64 * p, 96), (96, 40), 0), ("rs", (2, 32 * p, 96), (96, 40), 1),
            ("ar", (64 * p, 96), (96, 40), None), ("ag_gathered", (2, 32, 96), (96, 40), 1),
            # gathered rows of 30, 12 and 24 bytes (bf16): copied 2, 4 and 8 bytes at a time
            # (trial 19: anything not 16-byte aligned was copied byte by byte)
            ("ag_gathered", (2, 5, 3), (3, 40), 1), ("ag_gathered", (2, 3, 2), (2, 40), 1),
            ("ag_gathered", (2, 2, 6), (6, 40), 1)]
  failures = []
  for gi, (op, x_shape, w_shape, dim) in enumerate(gcases):
    base = "ag" if op == "ag_gathered" else op
    if op == "ag_gathered":
      def f(x, w, dim=dim):
        return fx.ops.all_gather_matmul_gathered(x, w, "x", dim, nproc, transport="copy_engine",
                                                 chunks=2)
    else:
      f1 = fx.op_call(op, dim, "copy_engine", 2)

      def f(x, w, f1=f1):
        return f1(x, w), None

    def body(x, w, f=f, base=base):
      ys, g = [], None
      for scale in (1, 2, 3):  # three calls among elementwise work
        y, g_ = f(x[0] * scale, w[0])
        g = g_ if g is None else g
        ys.append(y.astype(jnp.float32))
      total = (ys[0] + ys[1] + ys[2]).astype(x.dtype)
      if base == "ar":
        total = jax.lax.pcast(total, "x", to="varying")
      if g is None:
        g = jnp.zeros((1,), x.dtype)
      return total[None], g[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                               out_specs=(P("x"), P("x"))))
    keep = []  # keeps earlier inputs alive, so that every call gets new buffers
    bad = []
    for it in range(4):
      xs, ws = fx.inputs((3000, gi, it), x_shape, w_shape, jnp.bfloat16)
      want, bound = fx.reference(base, xs, ws, dim)
      args = (fx.put(xs[pos][None]), fx.put(ws[pos][None]))
      keep.append(args)
      try:
        total, g = fn(*args)
        got = _f64(fx.mine(total)[0])
      except Exception as e:  # noqa: BLE001 - the failure is the finding
        bad.append(f"call {it}: {type(e).__name__}: {str(e)[:300]}")
        break
      # 6 x the product; bf16 rounding of three results, their sum and the output.
      if not np.all(np.abs(got - 6 * want) <= 8 * EPS[BF16] * 6 * bound):
        bad.append(f"call {it}: wrong values")
      if op == "ag_gathered" and not np.array_equal(
          _f64(fx.mine(g)[0]), np.concatenate([_f64(a) for a in xs], axis=dim)):
        bad.append(f"call {it}: wrong gathered x")
    if bad:
      failures.append(f"graphs ({handlers} handlers) {op} x{list(x_shape)}: {bad}")
  assert not failures, _report(failures)


# ---------------------------------------------------------------------------- multi, errors


@pytest.mark.quick
def test_multi(fx, mesh, nccl):
  nproc, pos, ops = fx.nproc, fx.pos, fx.ops
  d, f_, m = 64, 96, 16 * nproc  # model dim, hidden (per rank), tokens
  # "auto" may hand the all-reduce to psum (NCCL); name the algorithm where NCCL cannot run.
  ar_algorithm = "auto" if nccl else "one_shot"

  def step(x, w1, w2, w3):
    h = ops.all_gather_matmul(x[0], w1[0], "x", algorithm="auto")                   # [m, f]
    y = ops.matmul_reduce_scatter(h, w2[0], "x", transport="nvshmem")              # [m/P, d]
    z = ops.matmul_all_reduce(h, w3[0], "x", transport="copy_engine")              # [m, d]
    s = ops.all_reduce(y, "x", algorithm=ar_algorithm)                             # [m/P, d]
    return (y[None], jax.lax.pcast(z, "x", to="varying")[None],
            jax.lax.pcast(s, "x", to="varying")[None])

  fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=(P("x"),) * 3))
  dt = jnp.bfloat16
  xs = [_randn([7, p, 0], (m // nproc, d), dt) for p in range(nproc)]
  w1 = [_randn([7, p, 1], (d, f_), dt, 1 / 8, False) for p in range(nproc)]
  w2 = [_randn([7, p, 2], (f_, d), dt, 1 / 8, False) for p in range(nproc)]
  w3 = [_randn([7, p, 3], (f_, d), dt, 1 / 8, False) for p in range(nproc)]
  y, z, s = fn(*(fx.put(a[pos][None]) for a in (xs, w1, w2, w3)))
  # The references round h (and y) to bf16 as the kernels do before the next op.
  xg = np.concatenate([_f64(a) for a in xs])
  hs = [_f64(np.asarray(xg @ _f64(w), np.float32).astype(dt)) for w in w1]
  ys = [_f64(np.asarray(ref_rs(hs, [_f64(w) for w in w2], 0, p), np.float32).astype(dt))
        for p in range(nproc)]
  by = ref_rs([np.abs(h) for h in hs], [np.abs(_f64(w)) for w in w2], 0, pos)
  bz = ref_ar([np.abs(h) for h in hs], [np.abs(_f64(w)) for w in w3], pos)
  e = EPS[np.dtype(dt)]
  failures = [msg for msg in (
      close(fx.mine(y)[0], ys[pos], by, e, "multi matmul_reduce_scatter", factor=8),
      close(fx.mine(z)[0], ref_ar(hs, [_f64(w) for w in w3], pos), bz, e,
            "multi matmul_all_reduce", factor=8),
      close(fx.mine(s)[0], sum(ys), sum(np.abs(a) for a in ys) + by, e, "multi all_reduce",
            factor=8),
  ) if msg]
  assert not failures, _report(failures)


@pytest.mark.quick
def test_shard_larger_than_the_slot_raises(fx, ops, topology):
  ops.require_cuda("the fused-op slot")
  k = 4096
  rows = topology.overlap_slot_bytes // (k * 2) + 1  # one row more than a bf16 shard the slot holds
  fn = fx.fused_fn("ag", 0, "copy_engine", None)
  with pytest.raises(ValueError) as e:
    fn.lower(jax.ShapeDtypeStruct((fx.nproc, rows, k), jnp.bfloat16, sharding=fx.sharded),
             jax.ShapeDtypeStruct((fx.nproc, k, 8), jnp.bfloat16, sharding=fx.sharded))
  msg = str(e.value)
  assert "bytes of fused-op slot per sender" in msg and "overlap_heap_bytes" in msg, msg


@pytest.mark.quick
def test_handlers_refuse_calls_the_planner_would_not_make(fx, ops, mesh, topology, rank, nproc):
  """Trial 50: the fused handlers checked the buffers only against products of the shape
  attributes, so an empty dimension passed (outer 0: the row chunks' GEMMs, batch 1, then
  wrote past the empty output) and products past int64 could wrap; the launch-floor copy
  wrote x's size into any output. Called without the planner, each is now refused by name
  before anything runs, and the runtime stays usable: a right call after them is checked."""
  ops.require_cuda("the handlers' own checks")
  from jaxoverlap import _ffi

  ext = _ffi.load()
  attrs = dict(groups=np.arange(nproc, dtype=np.int64), group_size=np.int64(nproc),
               transport=np.int32(ext.Transport["copy_engine"].value), chunks=np.int64(1),
               precision=np.int32(ext.Precision["default"].value))
  sharded = NamedSharding(mesh, P("x"))

  def ag_call(x_local, w_local, out_local_shape, **dims):
    def body(x, w):
      # The input's type with the output's shape: it carries the mesh axis (as _cuda.py's).
      out = jax.typeof(x[0]).update(shape=out_local_shape, dtype=np.dtype(jnp.bfloat16))
      dims64 = {k: np.int64(v) for k, v in dims.items()}
      return jax.ffi.ffi_call("jaxoverlap_all_gather_matmul", out)(x[0], w[0], **attrs,
                                                                    **dims64)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    x = jax.make_array_from_process_local_data(sharded, x_local[None],
                                               (nproc, *x_local.shape))
    w = jax.make_array_from_process_local_data(sharded, w_local[None],
                                               (nproc, *w_local.shape))
    return f(x, w)

  k, n, rows = 8, 8, 4
  w = np.ones((k, n), jnp.bfloat16)
  refused = [
      # outer 0: x and out empty, w 64 elements; every size check of the products passed.
      (dict(outer=0, rows=rows, k=k, n=n), np.zeros((0, rows, k), jnp.bfloat16),
       (0, nproc * rows, n), "every dimension must be at least 1"),
      # rows * k past int64: refused as such, not matched against a wrapped count.
      (dict(outer=1, rows=2**40, k=2**40, n=n), np.zeros((1, rows, k), jnp.bfloat16),
       (1, nproc * rows, n), "overflows int64"),
  ]
  for dims, x_local, out_shape, want in refused:
    with pytest.raises(Exception, match=want):
      jax.block_until_ready(ag_call(x_local, w, out_shape, **dims))

  device = jax.local_devices()[0]
  x = jax.device_put(np.arange(16, dtype=np.float32), device)
  short = jax.ShapeDtypeStruct((8,), jnp.float32)
  with pytest.raises(Exception, match="out has 32 bytes, x 64; they must be equal"):
    jax.block_until_ready(jax.jit(lambda v: jax.ffi.ffi_call("jaxoverlap_launch_floor",
                                                               short)(v))(x))

  # The runtime still runs a right call, every element checked against float64.
  xs = [np.random.default_rng([50, r]).standard_normal((1, rows, k)).astype(np.float32)
        for r in range(nproc)]
  got = ag_call(xs[rank].astype(jnp.bfloat16), w, (1, nproc * rows, n), outer=1, rows=rows,
                k=k, n=n)
  want = np.concatenate([x64.astype(jnp.bfloat16).astype(np.float64) for x64 in xs], axis=1)
  want = want @ np.ones((k, n))
  mine = np.asarray(got.addressable_shards[0].data, np.float64)[0]
  err = np.max(np.abs(mine - want) / (np.abs(want) + 1.0))
  assert err <= 2e-2, f"max rel err {err:.3g} after the refused calls"
