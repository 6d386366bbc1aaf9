"""GPU checks of the fused ops with backend="cuda" in N processes, one PE each.

Run through the launcher (one process per GPU, or --share_gpu on a 1-GPU box):

  python -m jaxoverlap.launch --nproc 2 tests/multiprocess/check_overlap.py [sections]

Sections (default: all but quick):

* sweep: all_gather_matmul, matmul_reduce_scatter and matmul_all_reduce for a
  sweep of shapes (odd M/N/K, tiny M, large K, leading batch dimensions with
  the gather/scatter dimension in the middle) x float32/bfloat16/float16 x
  both transports x auto and odd chunk counts, against a float64 NumPy
  reference computed from every rank's inputs (each process regenerates all
  ranks' inputs from seeds); every element of every rank is checked, with a
  bound of a few units of rounding of the dtype (TF32 for float32 at JAX's
  default precision) times the sum of |products|. float32 is also run under
  jax.default_matmul_precision("highest") with a float32-level bound.
  matmul_all_reduce's result must be bit-identical on every rank.
* quick: a short sweep (one shape per op, bf16 and f32) for compute-sanitizer.
* grads: jax.grad of each op (value and both gradients) against the float64
  gradients of the pure expressions; all_gather_matmul's backward runs the
  fused GEMM+RS and vice versa.
* rotation: 24 calls in one jit'd lax.scan, each with fresh inputs and 4
  chunks per shard, every output checked on the host (with
  JAXOVERLAP_FUSED_CMD_BUFFER=1, XLA replays the scan body from a CUDA graph).
  Slots keep the previous call's data, so waiting on one chunk and reading
  another, or reading a rank's slot for another rank, gives wrong rows.
* graphs: one jit'd step (three calls of an op among elementwise work) run
  four times on new buffers each time, for each op, 1-D and batched, and the
  gathered AG variant. With JAXOVERLAP_FUSED_CMD_BUFFER=1 (the handlers with
  the command-buffer trait) XLA records the calls into a CUDA graph and
  updates it for the new addresses; by default the calls run between the
  graphs. Before the fix in NOTES.md ("CUDA graphs"), the batched and
  gathered AG failed here with CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE.
* multi: an MLP step with AG+GEMM, GEMM+RS, GEMM+AR and jaxoverlap.all_reduce
  in flight in one jit, checked against float64.
* errors: a shard larger than the fused-op slot raises ValueError at lowering,
  before any kernel runs.

Exits non-zero on the first failing section; prints "N passed, N failed".
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time

import _checker
import numpy as np

SECTIONS = ("sweep", "quick", "grads", "rotation", "graphs", "multi", "errors")
TRANSPORTS = ("copy_engine", "nvshmem")


def _randn(seed, shape, dtype, scale=1.0, outliers=True):
  rng = np.random.default_rng(seed)
  a = rng.standard_normal(shape).astype(np.float32) * scale
  if outliers and a.size > 16:
    idx = rng.choice(a.size, size=max(1, a.size // 200), replace=False)
    a.flat[idx] *= 30.0
  return a.astype(dtype)


def _f64(a):
  return np.asarray(np.asarray(a).astype(np.float32), np.float64)


def _matmul(x, w):
  return np.einsum("...k,kn->...n", x, w)


def _contract_leading(a, b):
  lead = tuple(range(a.ndim - 1))
  return np.tensordot(a, b, axes=(lead, lead))


# ----------------------------------------------------------------------------
# float64 references: xs[p], ws[p] are the inputs at axis position p.


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


class Checker(_checker.Checker):
  """The shared checker plus element-wise bounds against a float64 reference."""

  def __init__(self, rank, nproc, kv):
    super().__init__(rank, nproc, kv, "overlap")
    self.worst = {}

  def close(self, got, want, bound, eps, what, factor=4.0):
    """|got - want| <= factor * eps * bound (+ tiny), every element."""
    got = _f64(got)
    if got.shape != want.shape:
      self.check(False, f"{what}: shape {got.shape} != {want.shape}")
      return
    lim = factor * eps * bound + 1e-30
    err = np.abs(got - want)
    bad = ~(err <= lim)  # NaN counts as bad
    ratio = float(np.max(err / lim)) if err.size else 0.0
    key = what.split(" ")[0]
    self.worst[key] = max(self.worst.get(key, 0.0), ratio)
    where = np.argwhere(bad)[:3].tolist() if bad.any() else []
    self.check(not bad.any(), f"{what}: {int(bad.sum())} of {err.size} elements off "
                              f"(worst err/limit {ratio:.3g}, first at {where})")


def main(argv) -> int:
  from jaxoverlap import launch

  logging.basicConfig(level=logging.WARNING)
  info = launch.initialize_from_env(nvshmem=True)
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxoverlap
  from jaxoverlap import _cuda

  sections = [a for a in argv[1:] if a in SECTIONS] or [s for s in SECTIONS if s != "quick"]
  rank, nproc = info["process_id"], info["num_processes"]
  rt = jaxoverlap.runtime_info()
  print(f"rank {rank}: {nproc} PEs, fused-op slot {rt['overlap_slot_bytes']} B, "
        f"sections {sections}", flush=True)
  kv = None
  if nproc > 1:
    from jax._src import distributed

    kv = distributed.global_state.client
  c = Checker(rank, nproc, kv)
  mesh = jax.make_mesh((nproc,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  owner = [d.process_index for d in mesh.devices.reshape(-1)]
  pos = owner.index(rank)  # this process's position along the axis
  sharded = NamedSharding(mesh, P("x"))

  def put(local):
    """The global array whose shard at this process's position is `local`."""
    local = np.asarray(local)
    return jax.make_array_from_process_local_data(
        sharded, local, (local.shape[0] * nproc,) + local.shape[1:])

  def mine(out):
    return np.asarray(out.addressable_shards[0].data)

  eps = {np.dtype(np.float32): 2.0 ** -10, np.dtype(np.float16): 2.0 ** -10,
         np.dtype(jnp.bfloat16): 2.0 ** -7}

  def op_call(op, dim, transport, chunks):
    if op == "ag":
      return lambda x, w: jaxoverlap.all_gather_matmul(
          x, w, "x", gather_dimension=dim, backend="cuda", algorithm=transport, chunks=chunks)
    if op == "rs":
      return lambda x, w: jaxoverlap.matmul_reduce_scatter(
          x, w, "x", scatter_dimension=dim, backend="cuda", algorithm=transport, chunks=chunks)
    return lambda x, w: jaxoverlap.matmul_all_reduce(x, w, "x", backend="cuda",
                                                     algorithm=transport, chunks=chunks)

  @functools.cache
  def fused_fn(op, dim, transport, chunks):
    f = op_call(op, dim, transport, chunks)

    def body(x, w):
      y = f(x[0], w[0])
      if op == "ar":
        y = jax.lax.pcast(y, "x", to="varying")
      return y[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))

  def inputs(seed, op, x_shape, w_shape, dtype):
    k = w_shape[0]
    xs = [_randn([seed, p, 0], x_shape, dtype) for p in range(nproc)]
    ws = [_randn([seed, p, 1], w_shape, dtype, scale=1 / math.sqrt(k), outliers=False)
          for p in range(nproc)]
    return xs, ws

  def reference(op, xs, ws, dim):
    x64, w64 = [_f64(x) for x in xs], [_f64(w) for w in ws]
    xa, wa = [np.abs(x) for x in x64], [np.abs(w) for w in w64]
    if op == "ag":
      return ref_ag(x64, w64, dim, pos), ref_ag(xa, wa, dim, pos)
    if op == "rs":
      return ref_rs(x64, w64, dim, pos), ref_rs(xa, wa, dim, pos)
    return ref_ar(x64, w64, pos), ref_ar(xa, wa, pos)

  def run_case(op, x_shape, w_shape, dim, dtype, transport, chunks, seed, tag=""):
    xs, ws = inputs(seed, op, x_shape, w_shape, dtype)
    want, bound = reference(op, xs, ws, dim)
    got = mine(fused_fn(op, dim, transport, chunks)(put(xs[pos][None]), put(ws[pos][None])))[0]
    what = (f"{op} x{list(x_shape)} w{list(w_shape)} dim {dim} {np.dtype(dtype).name} "
            f"{transport} chunks={chunks}{tag}")
    e = eps[np.dtype(dtype)] if not tag else 2.0 ** -22
    c.close(got, want, bound, e, what)
    if op == "ar":
      c.check(c.same_on_all_ranks(f"{seed}/{transport}/{chunks}/{tag}", got),
              f"{what}: ranks differ")

  # (op, x shape per rank, w shape per rank, gather/scatter dim). For rs/ar,
  # x's rows are the full M; for ag, x holds this rank's M/P rows.
  P_ = nproc
  cases = [
      ("ag", (1, 8), (8, 8), 0),
      ("ag", (3, 17), (17, 5), 0),
      ("ag", (5, 40), (40, 24), 0),             # tiny M
      ("ag", (257, 96), (96, 130), 0),          # odd everything
      ("ag", (64, 8192), (8192, 40), 0),        # large K
      ("ag", (1024, 1024), (1024, 512), 0),
      ("ag", (2, 5, 3, 24), (24, 16), 1),       # batch dims, gather in the middle
      ("ag", (3, 7, 24), (24, 10), 0),          # gather the outermost of 3-D
      ("rs", (2 * P_, 8), (8, 8), 0),
      ("rs", (6 * P_, 17), (17, 5), 0),
      ("rs", (129 * P_, 96), (96, 130), 0),
      ("rs", (16 * P_, 8192), (8192, 40), 0),
      ("rs", (1024 * P_, 1024), (1024, 512), 0),
      ("rs", (3, 4 * P_, 5, 24), (24, 16), 1),
      ("ar", (2 * P_, 8), (8, 8), None),
      ("ar", (129 * P_, 96), (96, 130), None),
      ("ar", (4 * P_, 3, 2048), (2048, 33), None),
      ("ar", (512 * P_, 1024), (1024, 512), None),
  ]

  if "sweep" in sections or "quick" in sections:
    t0 = time.time()
    quick = "sweep" not in sections
    dtypes = (jnp.bfloat16, np.float32) if quick else (np.float32, jnp.bfloat16, np.float16)
    todo = [cs for cs in cases if cs[1][0] in (5, 6 * P_, 129 * P_)] if quick else cases
    seed = 0
    for op, xs_shape, ws_shape, dim in todo:
      for dtype in dtypes:
        for transport in TRANSPORTS:
          for chunks in ((None,) if quick else (None, 3)):
            seed += 1
            run_case(op, xs_shape, ws_shape, dim, dtype, transport, chunks, seed)
    if not quick:
      with jax.default_matmul_precision("highest"):
        fused_fn.cache_clear()
        for op, xs_shape, ws_shape, dim in cases[3:4] + cases[10:11] + cases[15:16]:
          seed += 1
          run_case(op, xs_shape, ws_shape, dim, np.float32, "copy_engine", None, seed,
                   tag=" (precision highest)")
      fused_fn.cache_clear()
    print(f"rank {rank}: sweep done in {time.time() - t0:.1f} s; worst err/limit "
          f"{ {k: round(v, 3) for k, v in c.worst.items()} }", flush=True)

  if "grads" in sections:
    t0 = time.time()
    gcases = [("ag", (37, 64), (64, 48), 0), ("ag", (2, 6, 32), (32, 24), 1),
              ("rs", (20 * P_, 64), (64, 48), 0), ("rs", (3, 4 * P_, 32), (32, 24), 1),
              ("ar", (9 * P_, 64), (64, 48), None)]
    for gi, (op, x_shape, w_shape, dim) in enumerate(gcases):
      for dtype in (np.float32, jnp.bfloat16):
        for transport in TRANSPORTS:
          f = op_call(op, dim, transport, None)

          def loss(x, w, ct, f=f):
            y = f(x[0], w[0])
            return jnp.sum(y.astype(jnp.float32) * ct[0].astype(jnp.float32))[None]

          per_rank = jax.shard_map(loss, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
          g = jax.jit(jax.grad(lambda x, w, ct: jnp.sum(per_rank(x, w, ct)), argnums=(0, 1)))
          xs, ws = inputs(100 + gi, op, x_shape, w_shape, dtype)
          if op == "ag":
            y_shape = list(x_shape)
            y_shape[dim] *= nproc
            y_shape[-1] = w_shape[1]
          elif op == "rs":
            y_shape = list(x_shape[:-1]) + [w_shape[1]]
            y_shape[dim] //= nproc
          else:
            y_shape = list(x_shape[:-1]) + [w_shape[1]]
          cs = [_randn([200 + gi, p], tuple(y_shape), dtype) for p in range(nproc)]
          dx, dw = g(put(xs[pos][None]), put(ws[pos][None]), put(cs[pos][None]))
          x64, w64, c64 = ([_f64(a) for a in xs], [_f64(a) for a in ws],
                           [_f64(a) for a in cs])
          absx, absw, absc = ([np.abs(a) for a in x64], [np.abs(a) for a in w64],
                              [np.abs(a) for a in c64])
          if op == "ag":
            want, bound = grads_ag(x64, w64, c64, dim, pos), grads_ag(absx, absw, absc, dim, pos)
          elif op == "rs":
            want, bound = grads_rs(x64, w64, c64, dim, pos), grads_rs(absx, absw, absc, dim, pos)
          else:
            want, bound = grads_ar(x64, w64, c64, pos), grads_ar(absx, absw, absc, pos)
          what = f"grad {op} x{list(x_shape)} {np.dtype(dtype).name} {transport}"
          e = eps[np.dtype(dtype)]
          c.close(mine(dx)[0], want[0], bound[0], e, what + " dx", factor=8.0)
          c.close(mine(dw)[0], want[1], bound[1], e, what + " dw", factor=8.0)
    print(f"rank {rank}: grads done in {time.time() - t0:.1f} s", flush=True)

  if "rotation" in sections:
    t0 = time.time()
    iters = 24
    for op, x_shape, w_shape, dim in [("ag", (64, 96), (96, 40), 0),
                                      ("rs", (64 * P_, 96), (96, 40), 0),
                                      ("ar", (64 * P_, 96), (96, 40), None)]:
      for transport in TRANSPORTS:
        f = op_call(op, dim, transport, 4)

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
        per_iter = [inputs(1000 + i, op, x_shape, w_shape, jnp.bfloat16) for i in range(iters)]
        xs_all = np.stack([it[0][pos] for it in per_iter])
        ws_all = np.stack([it[1][pos] for it in per_iter])
        got = mine(fn(put(xs_all[None]), put(ws_all[None])))[0]
        bad = []
        for i, (xs, ws) in enumerate(per_iter):
          want, bound = reference(op, xs, ws, dim)
          lim = 4 * eps[np.dtype(jnp.bfloat16)] * bound + 1e-30
          if not np.all(np.abs(_f64(got[i]) - want) <= lim):
            bad.append(i)
        c.check(not bad, f"rotation {op} {transport}: calls {bad} of {iters} wrong")
    print(f"rank {rank}: rotation done in {time.time() - t0:.1f} s", flush=True)

  if "graphs" in sections:
    t0 = time.time()
    target = "cmdbuf" if os.environ.get("JAXOVERLAP_FUSED_CMD_BUFFER") == "1" else "plain"
    gcases = [("ag", (64, 96), (96, 40), 0), ("ag", (2, 32, 96), (96, 40), 1),
              ("rs", (64 * P_, 96), (96, 40), 0), ("rs", (2, 32 * P_, 96), (96, 40), 1),
              ("ar", (64 * P_, 96), (96, 40), None), ("ag_gathered", (2, 32, 96), (96, 40), 1)]
    for gi, (op, x_shape, w_shape, dim) in enumerate(gcases):
      base = "ag" if op == "ag_gathered" else op
      if op == "ag_gathered":
        def f(x, w, dim=dim):
          return _cuda.all_gather_matmul(x, w, "x", dim, "copy_engine", 2, True)
      else:
        f1 = op_call(op, dim, "copy_engine", 2)

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
      keep = []  # keeps earlier inputs alive so that every call gets new buffers
      bad = []
      for it in range(4):
        xs, ws = inputs(3000 + 10 * gi + it, base, x_shape, w_shape, jnp.bfloat16)
        want, bound = reference(base, xs, ws, dim)
        args = (put(xs[pos][None]), put(ws[pos][None]))
        keep.append(args)
        try:
          total, g = fn(*args)
          got = _f64(mine(total)[0])
        except Exception as e:  # noqa: BLE001 - the failure is the finding
          bad.append(f"call {it}: {type(e).__name__}: {str(e)[:300]}")
          break
        # 6 x the product; bf16 rounding of three results, their sum and the output.
        if not np.all(np.abs(got - 6 * want) <= 8 * eps[np.dtype(jnp.bfloat16)] * 6 * bound):
          bad.append(f"call {it}: wrong values")
        if op == "ag_gathered" and not np.array_equal(
            _f64(mine(g)[0]), np.concatenate([_f64(a) for a in xs], axis=dim)):
          bad.append(f"call {it}: wrong gathered x")
      c.check(not bad, f"graphs ({target} handlers) {op} x{list(x_shape)}: {bad}")
    print(f"rank {rank}: graphs ({target} handlers) done in {time.time() - t0:.1f} s",
          flush=True)

  if "multi" in sections:
    d, f_, m = 64, 96, 16 * nproc  # model dim, hidden (per rank), tokens

    def step(x, w1, w2, w3):
      h = jaxoverlap.all_gather_matmul(x[0], w1[0], "x", backend="cuda")      # [m, f]
      y = jaxoverlap.matmul_reduce_scatter(h, w2[0], "x", backend="cuda",
                                           algorithm="nvshmem")              # [m/P, d]
      z = jaxoverlap.matmul_all_reduce(h, w3[0], "x", backend="cuda",
                                       algorithm="copy_engine")              # [m, d]
      s = jaxoverlap.all_reduce(y, "x", backend="cuda")                       # [m/P, d]
      return y[None], jax.lax.pcast(z, "x", to="varying")[None], \
          jax.lax.pcast(s, "x", to="varying")[None]

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"),) * 4,
                               out_specs=(P("x"),) * 3))
    dt = jnp.bfloat16
    xs = [_randn([7, p, 0], (m // nproc, d), dt) for p in range(nproc)]
    w1 = [_randn([7, p, 1], (d, f_), dt, 1 / 8, False) for p in range(nproc)]
    w2 = [_randn([7, p, 2], (f_, d), dt, 1 / 8, False) for p in range(nproc)]
    w3 = [_randn([7, p, 3], (f_, d), dt, 1 / 8, False) for p in range(nproc)]
    y, z, s = fn(*(put(a[pos][None]) for a in (xs, w1, w2, w3)))
    # The references round h to bf16 as the kernels do before the second GEMMs.
    xg = np.concatenate([_f64(a) for a in xs])
    hs = [_f64(np.asarray(xg @ _f64(w), np.float32).astype(dt)) for w in w1]
    ys = [_f64(np.asarray(ref_rs(hs, [_f64(w) for w in w2], 0, p), np.float32).astype(dt))
          for p in range(nproc)]
    want_y = ys[pos]
    want_z = ref_ar(hs, [_f64(w) for w in w3], pos)
    want_s = sum(ys)
    by = ref_rs([np.abs(h) for h in hs], [np.abs(_f64(w)) for w in w2], 0, pos)
    bz = ref_ar([np.abs(h) for h in hs], [np.abs(_f64(w)) for w in w3], pos)
    e = eps[np.dtype(dt)]
    c.close(mine(y)[0], want_y, by, e, "multi rs", factor=8)
    c.close(mine(z)[0], want_z, bz, e, "multi ar", factor=8)
    c.close(mine(s)[0], want_s, sum(np.abs(a) for a in ys) + by, e, "multi all_reduce", factor=8)

  if "errors" in sections:
    slot = rt["overlap_slot_bytes"]
    k = 4096
    rows = slot // (k * 2) + 1  # one row more than a bf16 shard the slot holds
    fn = fused_fn("ag", 0, "copy_engine", None)
    try:
      fn.lower(jax.ShapeDtypeStruct((nproc, rows, k), jnp.bfloat16, sharding=sharded),
               jax.ShapeDtypeStruct((nproc, k, 8), jnp.bfloat16, sharding=sharded))
      c.check(False, "a shard larger than the slot did not raise")
    except ValueError as e:
      c.check("bytes of fused-op slot per sender" in str(e) and "overlap_heap_bytes" in str(e),
              f"slot error message: {e}")

  if rank == 0:
    seen = sorted({(d["op"], d["transport"], d["chunks"], d["chunks_source"])
                   for d in _cuda.fused_decisions})[:12]
    print(f"rank 0: some lowering decisions (op, transport, chunks, source): {seen}", flush=True)
  print(f"rank {rank}: {c.passed} passed, {c.failed} failed", flush=True)
  return 1 if c.failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
