"""Fused GEMM + collective: jaxoverlap's CUDA kernels against XLA's variants, in one run.

Run one process per GPU through the launcher:

  python -m jaxoverlap.launch --nproc 2 benchmarks/overlap.py --quick
  python -m jaxoverlap.launch --nproc 2 benchmarks/overlap.py
  python -m jaxoverlap.launch --nproc 2 benchmarks/overlap.py --windowed_einsum
  # the full list in parts (--merge keeps the rows of the shapes a part does not measure):
  python -m jaxoverlap.launch --nproc 2 benchmarks/overlap.py --merge --shapes "ag:..."
  # CPU smoke run on simulated devices (xla impls only):
  python benchmarks/overlap.py --host_devices 2 --shapes "ag:64,32,32;rs:64,32,32" \\
      --out /tmp/overlap

Ops, for the global product Y = X @ W (X [M, K], W [K, N]) with tensor
parallelism over the mesh axis "x" of P ranks (``--shapes`` entries
"op:M,K,N"):
  ag  all_gather_matmul (column-parallel, sequence-parallel input): per rank
      x [M/P, K], w [K, N/P]; y = AG(x) @ w, [M, N/P].
  rs  matmul_reduce_scatter (row-parallel): per rank x [M, K/P], w [K/P, N];
      y = RS(x @ w) over the rows, [M/P, N].
  ar  matmul_all_reduce: x, w as rs; y = psum(x @ w), [M, N].

Implementations (the ``impl`` of the results format; ``harness.impl_kwargs``
maps each to the public op's keywords):
  jaxoverlap:copy_engine, jaxoverlap:nvshmem  the public op, backend "cuda",
      algorithm "fused", that transport; jaxoverlap:<transport>/c<k> passes
      chunks=k (``--chunks``);
  jaxoverlap:gemm_all_reduce  (ar) algorithm "unfused": the GEMM, then the
      CUDA all_reduce;
  xla:naive      backend "xla", algorithm "collective" (collective, then GEMM;
                 or GEMM, then collective);
  xla:ppermute   backend "xla", algorithm "ppermute" (ring of shard GEMMs);
  xla:local_gemm the per-rank GEMM alone, no communication (the floor): ag
                 [M, K] @ [K, N/P]; rs and ar [M, K/P] @ [K/P, N];
  xla:collective the collective alone (T_comm): ag all_gather of x; rs
                 psum_scatter, ar psum, of an [M, N] array per rank;
  pallas:all_gather_lhs_matmul/<config>  (ag) JAX's Pallas Mosaic GPU collective
                 matmul (jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.
                 all_gather_lhs_matmul: the all-gather of x and the GEMM in one
                 kernel, bf16/f16), with the tile configuration <config> of
                 ``PALLAS_CONFIGS``; run by default where one process drives every
                 GPU (the kernel needs that, or XLA's NVSHMEM, which this
                 benchmark does not set up), the only case it applies to here;
  xla:windowed_einsum  plain jax.jit of X @ W with NamedSharding inputs and
                 output (XLA's SPMD partitioner, no shard_map) under
                 --xla_gpu_multi_streamed_windowed_einsum=true
                 --xla_gpu_threshold_for_windowed_einsum_mib=0. These flags
                 change every XLA computation of the process, so this impl
                 runs only with --windowed_einsum, in a run of its own with
                 xla:local_gemm and xla:collective timed again, written to
                 overlap_windowed_einsum-<machine>.json. For ar the
                 partitioner has no windowed loop (it all-reduces).

Method: for each (op, shape), every impl is one jit of a chain of --chain
dependent ops. Link i+1's input carries element [0, 0] of link i's output
times a runtime zero, so XLA can neither drop, merge nor overlap the links,
and a runtime step of 64 added to column 0 of each rank's shard, so that every
link (and every run) multiplies other data in every row: a kernel that skipped
a transfer, or read a slot left by the link before, gives wrong rows (--chain
is at most 8: the step accumulates, and over longer chains a link's step
becomes small beside the values the check's tolerance scales with). Every
link's output is an output of the jit, so no GEMM can be cut down to the
element the next link reads. The chained input is
donated and written in place. Every impl is first checked against xla:naive,
both from the same fresh input, on two runs of the chain: every link's
output, every element of every rank (``harness.close``: |a - b| <= 1e-2 *
max|ref| + 2e-2 * |ref|, computed on the devices); a mismatch is reported as
WRONG and not timed, an impl that raises (e.g. the CUDA path refusing a
shape) as ERROR; both are listed under "rejected" in the JSON. Then --warmup
untimed runs per impl, and --reps timed runs with the impls interleaved run
by run, each after a small psum that lines the processes up
(``harness.time_interleaved``: drift hits all alike). time_us = the median
over runs of (the run - the same round's run of the chain without the ops) /
chain, on rank 0's clock (at least 0.01); time_us_p10 and time_us_p90 are
the 10th and 90th percentiles of the same. exposed_us = time_us -
xla:local_gemm, hidden_fraction = 1 - exposed_us / xla:collective (raw, not clipped: negative when slower than GEMM
+ collective in series). bytes = what the collective moves per rank: x's
shard (ag) or the [M, N] partial product (rs, ar).

Records of jaxoverlap:copy_engine/nvshmem also carry what the lowering chose,
from the plan of ``jaxoverlap.decisions()`` (transport, chunks,
chunks_source: "auto" or "requested"); gemm_all_reduce's carry
all_reduce_algorithm ("<algorithm>/<protocol>" of its all-reduce).

Inputs: bf16 (--dtype) normal values, x scaled by 1, w by 1/sqrt(K), each
rank's shards from numpy.random.default_rng([rank, M, K, N]).

Rank 0 prints one row per (op, shape) and writes <out>/overlap-<machine>.json
(the results format of jaxoverlap.tuning.results, rewritten after every row,
so a killed run keeps the rows it finished); benchmarks/plot_overlap.py draws
the PNG and the tables.
"""

from __future__ import annotations

import os

import numpy as np

import harness
from harness import LOCAL_GEMM as FLOOR, COLLECTIVE as COMM, NAIVE, PPERMUTE, WINDOWED
from harness import GEMM_ALL_REDUCE as GEMM_AR

OPS = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter", "ar": "matmul_all_reduce"}
AXIS = "x"
TRANSPORTS = ("copy_engine", "nvshmem")
BASELINES = (FLOOR, COMM)  # not the op: no correctness check, no exposed/hidden fields
# What each link of a chain adds to column 0 of each rank's input shard (_depend). 64 moves
# every row of the product by 64 x a row of W (about 1 at K = 4096), far above
# harness.close's tolerance, so a link computed from the link before's data fails the check.
# The same rounding happens in every impl's chain, so all of them see the same inputs.
STEP = 64.0
# The longest chain whose check still sees a link that repeats the link before: two runs of
# 8 links accumulate 16 steps, where one step still moves a product row by about 6% of its
# size, twice what harness.close allows (2% of it + 1% of the largest value).
MAX_CHAIN = 8

# JAX's Pallas collective matmul, with tile configurations from the kernel's own tuning space
# (collective_matmul_mgpu._run_example); each is timed as an impl of its own. tile_m=256 with
# tile_n=128 needs 288 KiB of shared memory, above the H200's 227 KiB (jax 0.11.2).
PALLAS = "pallas:all_gather_lhs_matmul"
PALLAS_CONFIGS = {
    "m128n128": dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                     grid_minor_dim="M", grid_tile_width=8, wg_dimension="N"),
    "m128n128wgm": dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                        grid_minor_dim="N", grid_tile_width=8, wg_dimension="M"),
    "m128n64": dict(tile_m=128, tile_n=64, tile_k=64, max_concurrent_steps=4,
                    grid_minor_dim="N", grid_tile_width=4, wg_dimension="N"),
}

WINDOWED_XLA_FLAGS = ("--xla_gpu_multi_streamed_windowed_einsum=true",
                      "--xla_gpu_threshold_for_windowed_einsum_mib=0")

# The shapes of docs/results.md's baseline table ("Baselines measured at the start", AG+GEMM and
# GEMM+RS in JAX), then Llama-style TP=2 projections (d_model 4096 / d_ff 14336 and 8192 /
# 28672: the column-parallel up projection, the row-parallel down projection).
_BASELINE = "ag:16384,4096,4096;rs:16384,4096,4096;ag:8192,8192,28672;rs:8192,8192,28672"
_LLAMA = ";".join(f"ag:{m},4096,14336;ag:{m},8192,28672;rs:{m},14336,4096;rs:{m},28672,8192;"
                  f"ar:{m},14336,4096;ar:{m},28672,8192" for m in (2048, 8192, 32768))
DEFAULT_SHAPES = _BASELINE + ";" + _LLAMA
QUICK_SHAPES = ("ag:16384,4096,4096;rs:16384,4096,4096;ar:16384,4096,4096;"
                "ag:2048,4096,14336;rs:2048,14336,4096;ar:2048,14336,4096")


# --------------------------------------------------------------------------- pure helpers


def parse_shapes(text: str) -> list[tuple[str, tuple[int, int, int]]]:
  """Parses "op:M,K,N;op:M,K,N;..." (op in ag, rs, ar) into ``[(op, (M, K, N))]``.

  Whitespace and empty entries are ignored; repeated entries are kept once, in
  first-seen order.

  Raises:
    ValueError: an entry without "op:", an unknown op, not three integers, or
      a size < 1; the message names the entry.
  """
  out: list[tuple[str, tuple[int, int, int]]] = []
  for entry in text.split(";"):
    entry = "".join(entry.split())
    if not entry:
      continue
    op, sep, dims = entry.partition(":")
    if not sep:
      raise ValueError(f"shape entry {entry!r}: expected 'op:M,K,N' with op in ag, rs, ar")
    if op not in OPS:
      raise ValueError(f"shape entry {entry!r}: unknown op {op!r}; expected ag, rs or ar")
    parts = dims.split(",")
    try:
      mkn = tuple(int(p) for p in parts)
    except ValueError:
      mkn = ()
    if len(mkn) != 3:
      raise ValueError(f"shape entry {entry!r}: expected three integers M,K,N after '{op}:'")
    if min(mkn) < 1:
      raise ValueError(f"shape entry {entry!r}: M, K and N must be >= 1")
    item = (op, mkn)
    if item not in out:
      out.append(item)
  if not out:
    raise ValueError(f"no shapes in {text!r}")
  return out


def check_divisible(op: str, mkn: tuple[int, int, int], world: int) -> None:
  """Raises ValueError unless the sharded sizes of ``op`` divide by ``world``."""
  m, k, n = mkn
  need = {"ag": (("M", m), ("N", n)), "rs": (("M", m), ("K", k)), "ar": (("M", m), ("K", k))}
  for name, size in need[op]:
    if size % world:
      raise ValueError(f"{op}:{m},{k},{n}: {name}={size} does not divide by the {world} ranks")


def local_shapes(op: str, mkn: tuple[int, int, int], world: int) -> dict[str, tuple[int, int]]:
  """Per-rank shapes: ``x``, ``w``, ``y`` (the op's output), ``gemm`` (local_gemm's output)
  and ``comm`` (what the collective moves: x's shard for ag, the partial product for rs, ar)."""
  m, k, n = mkn
  p = world
  if op == "ag":
    return {"x": (m // p, k), "w": (k, n // p), "y": (m, n // p), "gemm": (m, n // p),
            "comm": (m // p, k)}
  y = (m // p, n) if op == "rs" else (m, n)
  return {"x": (m, k // p), "w": (k // p, n), "y": y, "gemm": (m, n), "comm": (m, n)}


def pallas_impls() -> list[str]:
  """The Pallas collective matmul's impl names, one per tile configuration."""
  return [f"{PALLAS}/{name}" for name in PALLAS_CONFIGS]


def is_pallas(impl: str) -> bool:
  return impl.startswith(PALLAS + "/")


def pallas_config(impl: str):
  """The ``TuningConfig`` of a Pallas impl name.

  Raises:
    ValueError: an unknown configuration name.
  """
  from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm

  name = impl.removeprefix(PALLAS + "/")
  if name not in PALLAS_CONFIGS:
    raise ValueError(f"unknown Pallas configuration {name!r}; known: {sorted(PALLAS_CONFIGS)}")
  fields = dict(PALLAS_CONFIGS[name])
  for key in ("grid_minor_dim", "wg_dimension"):
    fields[key] = cm.MatmulDimension[fields[key]]
  return cm.TuningConfig(**fields)


def chunks_of(impl: str, op: str = "ar") -> int | None:
  """The chunk count an impl of ``op`` requests (``jaxoverlap:<transport>/c<k>``), else None.

  Args:
    impl: the impl name.
    op: "ag", "rs" or "ar" (ar, the default, has every op's names). A name
      of another op only (``jaxoverlap:gemm_all_reduce`` for ag) gives None.

  Raises:
    ValueError: a name that is neither a baseline nor an impl of any op
      (``harness.impl_kwargs``), naming ``op``.
  """
  if impl in (FLOOR, COMM, WINDOWED) or is_pallas(impl):
    return None
  try:
    return harness.impl_kwargs(OPS[op], impl).get("chunks")
  except ValueError as e:
    error = e
  try:
    harness.impl_kwargs(OPS["ar"], impl)
  except ValueError:
    raise error from None
  return None  # another op's name (left out of this op's run)


def impls_for(op: str, *, chunks=(), windowed: bool = False, requested=(),
              pallas: bool = False) -> list[str]:
  """The impls run for ``op``, in run order (floor and collective first, naive before ours).

  Args:
    op: "ag", "rs" or "ar".
    chunks: chunk counts k that add ``jaxoverlap:copy_engine/c<k>``.
    windowed: the --windowed_einsum run: local_gemm, collective, windowed_einsum
      (and naive when requested).
    requested: --impls; empty: all of the mode's defaults. Names of the other
      mode, jaxoverlap:gemm_all_reduce for ag/rs and the Pallas impls for rs/ar
      are left out; chunked variants may be named directly.
    pallas: the Pallas collective matmul applies (one process drives every
      GPU): its impls join ag's defaults.

  Raises:
    ValueError: an unknown name in ``requested``.
  """
  if windowed:
    default = [FLOOR, COMM, WINDOWED]
    allowed = [FLOOR, COMM, NAIVE, WINDOWED]
  else:
    ours = ["jaxoverlap:copy_engine"] + [f"jaxoverlap:copy_engine/c{k}" for k in chunks]
    ours += ["jaxoverlap:nvshmem"] + ([GEMM_AR] if op == "ar" else [])
    theirs = pallas_impls() if op == "ag" else []
    default = [FLOOR, COMM, NAIVE, PPERMUTE] + ours + (theirs if pallas else [])
    allowed = [FLOOR, COMM, NAIVE, PPERMUTE] + ours + theirs
  if not requested:
    return default
  for i in requested:
    if is_pallas(i) and i.removeprefix(PALLAS + "/") not in PALLAS_CONFIGS:
      raise ValueError(f"unknown Pallas configuration in {i!r}; known: {sorted(PALLAS_CONFIGS)}")
  extra = [i for i in requested
           if i not in allowed and not is_pallas(i) and chunks_of(i, op) is not None]
  return [i for i in allowed if i in requested] + [i for i in extra if i not in allowed]


def add_overlap_metrics(records: list[dict]) -> list[dict]:
  """Adds exposed_us and hidden_fraction to the records of every (op, shape), in place.

  exposed_us = time_us - time of xla:local_gemm; hidden_fraction = 1 -
  exposed_us / time of xla:collective (raw: negative when slower than the two
  in series). Not added to the floor and collective themselves, nor where the
  reference was not measured. Returns ``records``.
  """
  ref: dict = {}
  for r in records:
    if r["impl"] in BASELINES:
      ref[(r["op"], tuple(r["shape"]), r["impl"])] = r["time_us"]
  for r in records:
    if r["impl"] in BASELINES:
      continue
    key = (r["op"], tuple(r["shape"]))
    floor, comm = ref.get(key + (FLOOR,)), ref.get(key + (COMM,))
    if floor is None:
      continue
    exposed = r["time_us"] - floor
    r["exposed_us"] = round(exposed, 2)
    if comm:
      r["hidden_fraction"] = round(1.0 - exposed / comm, 4)
  return records


def progress_row(op: str, mkn, records: list[dict], failed: dict[str, str]) -> str:
  """One line: op, shape, then impl=us (exposed, hidden) for every impl; failed as impl=WHY."""
  parts = []
  for r in records:
    s = f"{harness.short_name(r['impl'])}={r['time_us']:.1f}"
    if "exposed_us" in r:
      s += f" (exposed {r['exposed_us']:.0f}"
      if "hidden_fraction" in r:
        s += f", hidden {100 * r['hidden_fraction']:.0f}%"
      s += ")"
    parts.append(s)
  parts += [f"{harness.short_name(i)}={why}" for i, why in failed.items()]
  return f"{op} {'x'.join(map(str, mkn))}  " + "  ".join(parts)


def result_path(out_dir: str, machine: str, windowed: bool) -> str:
  """<out_dir>/overlap-<tag>.json, or overlap_windowed_einsum-<tag>.json; tag: spaces -> _."""
  tag = machine.replace(" ", "_")
  name = "overlap_windowed_einsum" if windowed else "overlap"
  return os.path.join(out_dir, f"{name}-{tag}.json")


def merge_results(old: dict | None, new_records: list[dict], new_rejected: list[dict],
                  measured) -> tuple[list[dict], list[dict]]:
  """--merge: the records of ``old`` for (op, shape)s not in ``measured``, then the new ones.

  ``measured``: ``(op abbreviation, (M, K, N))`` of this run. Rows of one
  (op, shape) thus always come from one run.
  """
  keys = {(OPS[op], tuple(mkn)) for op, mkn in measured}
  keep = lambda r: (r.get("op"), tuple(r.get("shape", ()))) not in keys  # noqa: E731
  old = old or {}
  return ([r for r in old.get("records", []) if keep(r)] + list(new_records),
          [r for r in old.get("rejected", []) if keep(r)] + list(new_rejected))


def method_text(chain: int, reps: int, warmup: int) -> str:
  return (f"per (op, shape) and impl: one jit of a chain of {chain} dependent ops (link i+1's "
          "input carries element [0,0] of link i's output times a runtime zero, and a "
          "runtime step of 64 added to column 0 of each shard, so every link multiplies other "
          "data in every row; every link's "
          "output is a jit output; the chained input donated); every impl first checked "
          "against xla:naive from the same fresh input, every link of two runs "
          "(|a-b| <= 1e-2*max|ref| + 2e-2*|ref|); then "
          f"{warmup} warm-up runs each and {reps} timed runs, impls interleaved run by run, "
          "each after a small psum that lines the processes up; time_us = median over runs of "
          "(run - the round's run of the chain without the ops) / chain length (p10/p90: "
          "time_us_p10, time_us_p90), rank 0's clock; exposed_us = time_us - xla:local_gemm; "
          "hidden_fraction = 1 - exposed_us / xla:collective (not clipped)")


# --------------------------------------------------------------------------- JAX part


def _depend(carrier, y, zero, step):
  """``carrier`` with ``step`` added to its column 0 and y[0, 0] * zero to element [0, 0].

  This is the link between two ops of a chain (per rank). ``zero`` is a jit
  argument (0.0 at run time), so XLA cannot fold the product away: the next
  op's input really depends on this op's output, whatever XLA knows about
  float arithmetic. ``step`` (a jit argument, ``STEP``) makes each link's
  input differ from the one before in every row, so every row of the product
  changes too and stale data anywhere shows in the check. A non-finite
  y[0, 0] is replaced by 0 first, so the zero term adds exactly 0 and every
  impl's chain carries the same inputs (the check then compares like with
  like). The update is one column, in place (dynamic-update-slice).
  """
  import jax.numpy as jnp
  from jax import lax

  from jaxoverlap import _xla

  v = y[:1, :1].astype(jnp.float32)
  v = jnp.where(jnp.isfinite(v), v, 0.0) * zero
  column = carrier[:, :1].astype(jnp.float32) + step
  column = jnp.concatenate([column[:1] + v, column[1:]]).astype(carrier.dtype)
  return lax.dynamic_update_slice(carrier, _xla.to_varying(column, AXIS), (0, 0))


class _Case:
  """Inputs, specs and chain functions for one (op, shape) on one mesh."""

  def __init__(self, op, mkn, mesh, dtype, chain):
    import jax
    from jax.sharding import PartitionSpec as P

    self.op, self.mkn, self.mesh, self.dtype, self.chain = op, mkn, mesh, dtype, chain
    self.world = mesh.shape[AXIS]
    check_divisible(op, mkn, self.world)
    row, col = P(AXIS, None), P(None, AXIS)
    # Global specs of the named arrays: x and w (the op's inputs), xl (ag's
    # local-GEMM input, [M, K] per rank), yc (rs/ar's collective input, [M, N]
    # per rank).
    self.specs = {"x": row if op == "ag" else col, "w": col if op == "ag" else row,
                  "xl": row, "yc": row, "zero": P(), "step": P()}
    self.out_spec = {"ag": col, "rs": row, "ar": P()}[op]
    self.arrays: dict = {}
    self._jax = jax

  # ----------------------------------------------------------------- inputs

  def _global(self, name, local, global_shape):
    from jax.sharding import NamedSharding

    return self._jax.make_array_from_process_local_data(
        NamedSharding(self.mesh, self.specs[name]), local, global_shape)

  def _positions(self):
    """Mesh positions of this process's devices (contiguous), in order."""
    pos = {d.id: i for i, d in enumerate(self.mesh.devices.flat)}
    mine = sorted(pos[d.id] for d in self.mesh.devices.flat
                  if d.process_index == self._jax.process_index())
    if mine != list(range(mine[0], mine[0] + len(mine))):
      raise ValueError(f"this process's devices sit at mesh positions {mine}, not contiguous")
    return mine

  def _missing(self, name):
    return name not in self.arrays or self.arrays[name].is_deleted()

  def build(self, names):
    """Creates the arrays ``names`` (and the ones they are made from) that do not exist yet.

    Arrays donated by a chain that failed half-way are made again.
    """
    import numpy as np

    wanted = set(names) | ({"x", "w"} if "yc" in names and self._missing("yc") else set())
    wanted = {nm for nm in wanted if self._missing(nm)}
    if not wanted:
      return
    op, (m, k, n), p = self.op, self.mkn, self.world
    shapes = local_shapes(op, self.mkn, p)
    if wanted & {"x", "w", "xl"}:
      xs, ws = [], []
      for rank in self._positions():
        rng = np.random.default_rng([rank, m, k, n])
        xs.append(rng.standard_normal(shapes["x"], dtype=np.float32).astype(self.dtype))
        ws.append((rng.standard_normal(shapes["w"], dtype=np.float32) / np.sqrt(k))
                  .astype(self.dtype))
      xa, wa = (0, 1) if op == "ag" else (1, 0)
      if "x" in wanted:
        self.arrays["x"] = self._global("x", np.concatenate(xs, xa), (m, k))
      if "w" in wanted:
        self.arrays["w"] = self._global("w", np.concatenate(ws, wa), (k, n))
      if "xl" in wanted:
        # ag's floor multiplies a full [M, K] per rank: this rank's shard tiled P times.
        xl = np.concatenate([np.tile(x, (p, 1)) for x in xs], 0)
        self.arrays["xl"] = self._global("xl", xl, (p * m, k))
      del xs, ws
    if "yc" in wanted:
      # rs/ar's collective reduces this rank's real partial product x @ w ([M, N]).
      fn = self._jax.jit(self._jax.shard_map(
          self._local_gemm, mesh=self.mesh, in_specs=(self.specs["x"], self.specs["w"]),
          out_specs=self.specs["yc"]))
      self.arrays["yc"] = fn(self.arrays["x"], self.arrays["w"])
    if "zero" in wanted:
      self.arrays["zero"] = self._global("zero", np.zeros((), np.float32), ())
    if "step" in wanted:
      self.arrays["step"] = self._global("step", np.full((), STEP, np.float32), ())

  # ----------------------------------------------------------------- kernels

  def _local_gemm(self, x, w):
    from jaxoverlap import _xla

    return _xla.matmul(x, w).astype(x.dtype)

  def kernel(self, impl):
    """(per-rank function, carrier name, other input names, output spec) of ``impl``."""
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jaxoverlap

    op = self.op
    if impl == FLOOR:  # per rank [M, N/P] (ag) or [M, N] (rs, ar)
      if op == "ag":
        return self._local_gemm, "xl", ("w",), P(None, AXIS)
      return self._local_gemm, "x", ("w",), P(AXIS, None)
    if impl == COMM:
      if op == "ag":
        return (lambda x: lax.all_gather(x, AXIS, axis=0, tiled=True)), "x", (), P(AXIS, None)
      if op == "rs":
        return (lambda y: lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)), "yc", (
            ), P(AXIS, None)
      return (lambda y: lax.psum(y, AXIS)), "yc", (), P()
    if is_pallas(impl):
      if op != "ag":
        raise ValueError(f"{impl} is an all-gather matmul; the op is {OPS[op]}")
      from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm

      config = pallas_config(impl)
      return (lambda x, w: cm.all_gather_lhs_matmul(x, w, AXIS, config=config, dtype=x.dtype)
              ), "x", ("w",), self.out_spec
    fn, kw = getattr(jaxoverlap, OPS[op]), harness.impl_kwargs(OPS[op], impl)
    return (lambda x, w: fn(x, w, AXIS, **kw)), "x", ("w",), self.out_spec

  def chain_fn(self, impl, carrier="x"):
    """(jitted chain, carrier name, other input names) of ``impl``.

    The jit returns (the outputs of every link, the carried input); the
    carried input (argument 0) is donated. ``impl=None``: the same chain
    without the ops, on the input ``carrier`` (no outputs but the carried one).
    """
    import jax
    from jax.sharding import PartitionSpec as P

    length = self.chain
    if impl == WINDOWED:
      return self._windowed_fn(), "x", ("w",)
    if impl is None:
      kernel, rest, out_specs = None, (), ()
    else:
      kernel, carrier, rest, out_spec = self.kernel(impl)
      out_specs = (out_spec,) * length

    def body(c, *args):
      *others, zero, step = args
      ys = []
      for _ in range(length):
        y = c if kernel is None else kernel(c, *others)
        if kernel is not None:
          ys.append(y)
        c = _depend(c, y, zero, step)
      return tuple(ys), c

    in_specs = tuple(self.specs[a] for a in (carrier,) + rest) + (P(), P())
    # The Pallas kernel's output carries no varying-axes type (its own example
    # runs it under check_vma=False).
    sm = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                       out_specs=(out_specs, self.specs[carrier]),
                       check_vma=not (impl and is_pallas(impl)))
    return jax.jit(sm, donate_argnums=0), carrier, rest

  def _windowed_fn(self):
    """X @ W partitioned by XLA (no shard_map) from NamedSharding inputs and output."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sh = lambda spec: NamedSharding(self.mesh, spec)  # noqa: E731
    xs, ws, ys = self.specs["x"], self.specs["w"], self.out_spec
    dep = jax.shard_map(_depend, mesh=self.mesh, in_specs=(xs, ys, P(), P()), out_specs=xs)
    length, dtype = self.chain, self.dtype

    def body(x, w, zero, step):
      outs = []
      for _ in range(length):
        y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)
        y = jax.lax.with_sharding_constraint(y, sh(ys))
        outs.append(y)
        x = dep(x, y, zero, step)
      return tuple(outs), x

    return jax.jit(body, in_shardings=(sh(xs), sh(ws), sh(P()), sh(P())),
                   out_shardings=(tuple(sh(ys) for _ in range(length)), sh(xs)),
                   donate_argnums=0)

  def call(self, fn, carrier, rest):
    """Runs a chain once (blocking); updates the donated carrier; returns the link outputs."""
    args = [self.arrays[carrier]] + [self.arrays[r] for r in rest] + [
        self.arrays["zero"], self.arrays["step"]]
    ys, c = self._jax.block_until_ready(fn(*args))
    self.arrays[carrier] = c
    return ys


def _first_difference(runs, ref) -> str | None:
  """Where an impl's chain outputs first differ from xla:naive's, or None (every link, run)."""
  for r, (got, want) in enumerate(zip(runs, ref)):
    for i, (g, w) in enumerate(zip(got, want)):
      ok, err, atol = harness.close(g, w)
      if not ok:
        return (f"differs from xla:naive at run {r + 1}, link {i + 1}: max |diff| {err:.4g} "
                f"(atol {atol:.4g}, rtol {harness.RTOL})")
  return None


def run_case(op, mkn, impls, *, mesh, dtype, chain, reps, warmup, ranks_per_node=None,
             log=print):
  """Checks and times ``impls`` for one (op, shape).

  Returns:
    (records, rejected, failed): records of the results format of
    jaxoverlap.tuning.results with exposed_us and hidden_fraction;
    ``{"op", "impl", "shape", "reason"}`` of impls that were not timed;
    ``{impl: "WRONG" or "ERROR"}`` for the progress row.
  """
  import jax
  import jax.numpy as jnp

  import jaxoverlap
  from jaxoverlap import tuning

  dtype = jnp.dtype(dtype)
  case = _Case(op, mkn, mesh, dtype, chain)
  world = case.world
  records, rejected, failed = [], [], {}
  fns = {}
  checked = [i for i in impls if i not in BASELINES]
  ref = None

  def reject(impl, kind, reason):
    failed[impl] = kind
    rejected.append({"op": OPS[op], "impl": impl, "shape": list(mkn), "reason": reason})
    log(f"{kind}: {op} {mkn} {impl}: {reason}")

  # Baselines first, then xla:naive (the reference; not timed unless asked for), then the rest.
  order = [i for i in impls if i in BASELINES]
  order += [NAIVE] if checked or NAIVE in impls else []
  order += [i for i in impls if i not in order]
  for impl in order:
    jaxoverlap.clear_decisions()
    try:
      fn, carrier, rest = case.chain_fn(impl)
      case.arrays.pop(carrier, None)  # the same fresh input for every impl's check
      case.build((carrier, "zero", "step") + rest)
      # Two runs (the first compiles: the plans are made there); every link's input differs.
      runs = [case.call(fn, carrier, rest) for _ in range(2 if impl not in BASELINES else 1)]
    except Exception as e:  # noqa: BLE001: lowering or runtime refusal, reported per impl
      reject(impl, "ERROR", f"{type(e).__name__}: {e}"[:500])
      continue
    choice = harness.plan_fields(harness.last_plan(OPS[op])) if impl.startswith(
        "jaxoverlap:") else {}
    if impl == NAIVE:
      ref = runs
    elif impl not in BASELINES:
      if ref is None:
        reject(impl, "ERROR", "no xla:naive reference to check against")
        continue
      wrong = _first_difference(runs, ref)
      if wrong:
        reject(impl, "WRONG", wrong)
        continue
    del runs
    if impl in impls:
      fns[impl] = (fn, carrier, rest, choice)
  del ref
  if not fns:
    return records, rejected, failed

  # The chain without the ops, once per carried input (compiled before timing).
  empties = {c: case.chain_fn(None, c)[0] for c in sorted({c for _, c, _, _ in fns.values()})}
  for carrier, fn in empties.items():
    case.call(fn, carrier, ())
  calls = {("empty", c): (lambda fn=fn, c=c: case.call(fn, c, ())) for c, fn in empties.items()}
  calls.update({(impl, None): (lambda f=f: case.call(*f[:3])) for impl, f in fns.items()})

  # A tiny all-reduce before every timed run lines the processes up: a fused
  # op waits for its peer, so a process that starts late would otherwise add
  # its lateness (host dispatch jitter, ~0.1 ms) to the other's time.
  spec = jax.sharding.PartitionSpec(AXIS)
  ones = jax.device_put(np.ones((case.world,), np.float32),
                        jax.sharding.NamedSharding(mesh, spec))
  barrier = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, AXIS), mesh=mesh, in_specs=spec,
                                  out_specs=spec))
  times = harness.time_interleaved(calls, reps=reps, warmup=warmup,
                                   before=lambda: barrier(ones).block_until_ready())
  comm_bytes = int(np.prod(local_shapes(op, mkn, world)["comm"])) * dtype.itemsize
  for impl, (_, carrier, _, choice) in fns.items():
    spread = tuning.spread_us([(t - e) / chain * 1e6 for t, e in zip(
        times[(impl, None)], times[("empty", carrier)])])  # paired by round
    records.append({"op": OPS[op], "impl": impl, "dtype": dtype.name, "shape": list(mkn),
                    "bytes": comm_bytes, "world": world,
                    "ranks_per_node": ranks_per_node or world,
                    "time_us": round(max(spread["time_us"], 0.01), 2),
                    "time_us_p10": round(max(spread["p10_us"], 0.01), 2),
                    "time_us_p90": round(max(spread["p90_us"], 0.01), 2), **choice})
  add_overlap_metrics(records)
  return records, rejected, failed


def define_flags():
  """Defines the command-line flags (only when run as a script, so importing is free)."""
  from absl import flags

  harness.define_flags("out", "machine", "dtype", "merge", "host_devices",
                       impls=([], "implementations to run (default: all of the mode)"),
                       chain=(5, "ops per jit'd chain"), reps=(10, "timed runs per impl (median "
                                                                  "reported)"),
                       warmup=(2, "untimed runs per impl before timing"))
  flags.DEFINE_string("shapes", DEFAULT_SHAPES,
                      "global shapes 'op:M,K,N;...' of Y = X @ W, op in ag, rs, ar")
  flags.DEFINE_bool("quick", False, "only the shapes " + QUICK_SHAPES + " (replaces --shapes)")
  flags.DEFINE_list("chunks", [], "chunk counts k: adds jaxoverlap:copy_engine/c<k>")
  flags.DEFINE_bool("windowed_einsum", False,
                    "run xla:windowed_einsum (with local_gemm and collective) under "
                    + " ".join(WINDOWED_XLA_FLAGS) + "; writes overlap_windowed_einsum-*.json")


def main(argv):
  del argv
  from absl import app, flags

  fl = flags.FLAGS
  try:
    shapes = parse_shapes(QUICK_SHAPES if fl.quick else fl.shapes)
    chunks = harness.parse_ints("chunks", fl.chunks)
    for op in dict.fromkeys(op for op, _ in shapes):  # the requested ops, in order
      impls_for(op, chunks=chunks, windowed=fl.windowed_einsum, requested=fl.impls,
                pallas=True)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if fl.chain < 1 or fl.reps < 1 or fl.warmup < 0:
    raise app.UsageError("--chain and --reps must be >= 1, --warmup >= 0")
  if fl.chain > MAX_CHAIN:
    raise app.UsageError(f"--chain {fl.chain}: at most {MAX_CHAIN}, or the check could miss a "
                         "stale link (the per-link step becomes small beside the accumulated "
                         "values; module docstring)")
  if any(i == WINDOWED for i in fl.impls) and not fl.windowed_einsum:
    raise app.UsageError(f"{WINDOWED} runs only with --windowed_einsum (a run of its own)")

  # XLA reads XLA_FLAGS once, when its first backend starts: before any jax use.
  if fl.windowed_einsum:
    os.environ["XLA_FLAGS"] = " ".join(os.environ.get("XLA_FLAGS", "").split()
                                       + list(WINDOWED_XLA_FLAGS))
  harness.use_host_devices(fl.host_devices)
  run = harness.start(AXIS)
  for op, mkn in shapes:
    try:
      check_divisible(op, mkn, run.world)
    except ValueError as e:
      raise app.UsageError(str(e)) from e
  run.log(f"overlap: world {run.world} ({run.platform}), ranks_per_node {run.ranks_per_node}, "
          f"chain {fl.chain}, reps {fl.reps}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")

  from jaxoverlap import launch

  command = launch.reproduce_command("benchmarks/overlap.py")
  machine = harness.machine_name(fl.machine)
  path = result_path(fl.out, machine, fl.windowed_einsum)
  old = harness.load_json(path, missing_ok=True) if fl.merge else None
  try:
    harness.check_merge(old, path, machine=machine, platform=run.platform, world=run.world,
                        jax=harness.jax_version())
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  commands = (old.get("commands") or [old.get("command")]) if old else []
  if run.platform != "gpu":
    run.log(f"platform {run.platform}: the jaxoverlap:* impls (CUDA only) are not run")
  elif run.runtime.get("transport") == "peer":
    run.log("one process drives every GPU (transport 'peer'): jaxoverlap:nvshmem is not run")
  pallas = run.platform == "gpu" and run.processes == 1
  if not pallas:
    run.log(f"{PALLAS} needs GPUs driven by one process: not run")
  records, rejected = [], []
  for op, mkn in shapes:
    impls = impls_for(op, chunks=chunks, windowed=fl.windowed_einsum, requested=fl.impls,
                      pallas=pallas)
    if not pallas:
      impls = [i for i in impls if not is_pallas(i)]
    if run.platform != "gpu":
      impls = [i for i in impls if not i.startswith("jaxoverlap:")]
    elif run.runtime.get("transport") == "peer" and "jaxoverlap:nvshmem" in impls:
      impls.remove("jaxoverlap:nvshmem")  # NVSHMEM puts need a process per GPU
    recs, rej, failed = run_case(op, mkn, impls, mesh=run.mesh, dtype=fl.dtype, chain=fl.chain,
                                 reps=fl.reps, warmup=fl.warmup,
                                 ranks_per_node=run.ranks_per_node, log=run.log)
    for r in recs:
      r.update(processes=run.processes, transport=run.runtime.get("transport"))
    records += recs
    rejected += rej
    run.log(progress_row(op, mkn, recs, failed))
    if run.rank == 0:
      done = shapes[:shapes.index((op, mkn)) + 1]
      all_records, all_rejected = merge_results(old, records, rejected, done)
      extra = {"commands": commands + [command]} if commands else {}
      extra.update(platform=run.platform, world=run.world,
                   xla_flags=os.environ.get("XLA_FLAGS", ""), chain=fl.chain, reps=fl.reps)
      harness.write_result(
          path, all_records, rejected=all_rejected, machine=machine, command=command,
          benchmark="overlap_windowed_einsum" if fl.windowed_einsum else "overlap",
          method=method_text(fl.chain, fl.reps, fl.warmup), extra=extra,
          latency=all("bytes" in r for r in all_records))
  run.log(f"wrote {path}")
  return 1 if rejected else 0


if __name__ == "__main__":
  from absl import app

  define_flags()
  app.run(main)
