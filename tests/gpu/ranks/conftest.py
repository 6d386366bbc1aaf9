"""Rank side of the multi-process GPU tests: fixtures, SPMD helpers and per-rank reports.

Problem:
  The CUDA backend's tests need several processes, one NVSHMEM PE (and one GPU)
  each, that call the same collectives in the same order. pytest runs in one
  process, so the outer tests (``tests/gpu/test_gpu_*.py``) start N processes
  through the launcher, each running pytest on one module of this folder, and
  then read what every rank reported.

Algorithm:
  Each process is one rank running ordinary pytest tests with plain asserts.
  This conftest

  * brings up jax.distributed (fixture ``dist``) and jaxoverlap's NVSHMEM
    runtime (``runtime``: ``jaxoverlap.launch.initialize_from_env(nvshmem=True)``)
    once per process, when the first test asks for them;
  * gives the fixtures ``rank``, ``nproc``, ``mesh`` (1-D, axis ``"x"``, every
    process), ``kv`` (compares arrays across ranks through jax.distributed's
    key-value store), ``topology`` (from ``jaxoverlap.runtime_info()``),
    ``nccl`` (False when processes share a GPU: NCCL refuses two ranks on one
    GPU, so ``lax.psum`` references and ``algorithm="auto"``, which may hand
    over to psum, cannot run) and ``ops`` (the calls under test);
  * writes this rank's outcome of every test (nodeid, outcome, failure text,
    duration) as JSON to ``$JAXOVERLAP_RANK_REPORT_DIR/rank{process_id}.json``
    after each test and at the end. With that variable set, failed tests leave
    the exit status 0, so that the launcher does not stop the other ranks; the
    outer test reads the reports.

  SPMD rules for the tests here: every rank runs the same tests in the same
  order, and the same collectives within each test, whatever its asserts find.
  So a test runs all its collectives first (collecting what is wrong in a
  list) and asserts at the end; skip conditions depend only on what every rank
  sees alike (world size, topology, environment). A test marked
  ``ends_process`` ends the process after its teardown (the GPU context may be
  lost): select it alone.

Example:
  python -m jaxoverlap.launch --nproc 2 -m pytest tests/gpu/ranks/rank_all_reduce.py \\
      --confcutdir tests/gpu/ranks -p no:cacheprovider -q -m quick

  (``--confcutdir`` keeps tests/conftest.py, which forces JAX onto the CPU, out.)
  ``JAXOVERLAP_RANK_TESTS_XLA=1`` is a dry run without GPUs: the same tests with
  backend "xla" on CPU processes (``JAX_PLATFORMS=cpu``). It checks the tests,
  their references and this harness, not the CUDA kernels; the checks that only
  the CUDA backend has are skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time

import pytest

REPORT_DIR_ENV = "JAXOVERLAP_RANK_REPORT_DIR"
DRY_RUN = os.environ.get("JAXOVERLAP_RANK_TESTS_XLA") == "1"
KV_TIMEOUT_MS = 120_000
_LONGREPR_CHARS = 6000

MARKERS = (
    "quick: a short rank-side GPU test, run at every world size",
    "stress: a long loop of calls (world 2 only)",
    "ends_process: ends the process after its teardown (select it alone)",
)

_state: dict = {}  # "info": initialize_from_env's result; "runtime": NVSHMEM is up
_report: _Report | None = None


# ---------------------------------------------------------------------------- reports


class _Report:
  """This rank's outcomes, rewritten as JSON after every test."""

  def __init__(self, directory: str):
    self.rank = int(os.environ.get("JAXOVERLAP_PROCESS_ID", os.environ.get("SLURM_PROCID", "0")))
    self.path = os.path.join(directory, f"rank{self.rank}.json")
    self.data = {
        "rank": self.rank,
        "nproc": int(os.environ.get("JAXOVERLAP_NUM_PROCESSES",
                                    os.environ.get("SLURM_NTASKS", "1"))),
        "pid": os.getpid(),
        "stage": "configured",
        "runtime_up": False,
        "dry_run": DRY_RUN,
        "collected": [],
        "tests": {},
        "finished": False,
        "exitstatus": None,
        "started": time.time(),
    }
    os.makedirs(directory, exist_ok=True)
    self.write()

  def stage(self, stage: str, **extra) -> None:
    self.data["stage"] = stage
    self.data.update(extra)
    self.write()

  def add(self, report) -> None:
    entry = self.data["tests"].setdefault(
        report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "duration": 0.0,
                        "longrepr": ""})
    entry["duration"] += float(report.duration)
    if report.failed:
      entry["outcome"] = "failed" if report.when == "call" else "error"
      entry["longrepr"] += f"[{report.when}] {report.longreprtext}"[-_LONGREPR_CHARS:]
    elif report.skipped and entry["outcome"] == "passed":
      entry["outcome"] = "skipped"
      longrepr = report.longrepr
      entry["longrepr"] = (str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3
                           else report.longreprtext)
    if report.when == "teardown":
      self.write()

  def finish(self, exitstatus: int) -> None:
    self.data.update(finished=True, exitstatus=int(exitstatus), stage="finished",
                     ended=time.time())
    self.write()

  def write(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.data, f, indent=1)
    os.replace(tmp, self.path)


def pytest_configure(config):
  global _report
  for marker in MARKERS:
    config.addinivalue_line("markers", marker)
  directory = os.environ.get(REPORT_DIR_ENV)
  if directory and _report is None:
    _report = _Report(directory)


def pytest_collection_finish(session):
  if _report is not None:
    _report.data["collected"] = [item.nodeid for item in session.items]
    _report.write()


def pytest_runtest_logreport(report):
  if _report is None:
    return
  _report.add(report)
  if report.when == "teardown" and "ends_process" in report.keywords:
    failed = any(t["outcome"] in ("failed", "error") for t in _report.data["tests"].values())
    _report.finish(1 if failed else 0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the GPU context may be lost: no atexit handlers, no finalize


def pytest_sessionfinish(session, exitstatus):
  if _report is None:
    return
  _report.finish(int(exitstatus))
  if int(exitstatus) == 1:  # tests failed: the outer test reads the reports
    session.exitstatus = 0


# ---------------------------------------------------------------------------- bring-up


def _kernels(runtime_up: bool) -> dict:
  """For the report: which kernel variants the runtime runs (the measurement knobs' effect)."""
  if not runtime_up:
    return {}
  from jaxoverlap import runtime

  info = runtime.runtime_info()
  return {k: info[k] for k in KNOB_KEYS}


# The runtime_info keys that say which measurement knobs are in effect (docs/design.md).
KNOB_KEYS = ("hierarchical_ll_kernel", "epochs_at_start", "norm_blocks_per_row")


def _bring_up(nvshmem: bool) -> dict:
  """jax.distributed (and NVSHMEM when asked) for this process, once."""
  from jaxoverlap import launch

  if "info" not in _state:
    _state["info"] = launch.initialize_from_env(nvshmem=nvshmem and not DRY_RUN)
    _state["runtime"] = nvshmem and not DRY_RUN
    if _report is not None:
      _report.stage("runtime" if nvshmem else "distributed", runtime_up=nvshmem,
                    **_kernels(_state["runtime"]))
  elif nvshmem and not _state["runtime"] and not DRY_RUN:
    import jaxoverlap

    jaxoverlap.initialize()
    _state["runtime"] = True
    if _report is not None:
      _report.stage("runtime", runtime_up=True, **_kernels(True))
  return _state["info"]


@pytest.fixture(scope="session")
def dist() -> dict:
  """jax.distributed is up (no NVSHMEM); ``launch.initialize_from_env``'s result."""
  return _bring_up(nvshmem=False)


@pytest.fixture(scope="session")
def runtime() -> dict:
  """jax.distributed and jaxoverlap's NVSHMEM runtime are up (dry run: jax.distributed).

  ``launch.initialize_from_env(nvshmem=True)``'s result.
  """
  return _bring_up(nvshmem=True)


@pytest.fixture(scope="session")
def rank(dist) -> int:
  return int(dist["process_id"])


@pytest.fixture(scope="session")
def nproc(dist) -> int:
  return int(dist["num_processes"])


@pytest.fixture(scope="session")
def mesh(dist):
  """A 1-D mesh, axis "x", over every process's device."""
  import jax

  return jax.make_mesh((jax.device_count(),), ("x",),
                       axis_types=(jax.sharding.AxisType.Auto,))


@pytest.fixture(scope="session")
def nccl() -> bool:
  """False when processes share a GPU (the outer test sets JAXOVERLAP_NO_NCCL=1)."""
  return not os.environ.get("JAXOVERLAP_NO_NCCL")


def require_nccl(nccl: bool) -> None:
  if not nccl:
    pytest.skip("needs NCCL (a lax.psum reference, or algorithm 'auto', which may hand over to "
                "psum), and NCCL refuses two ranks on one GPU (JAXOVERLAP_NO_NCCL=1)")


@pytest.fixture(scope="session")
def needs_nccl(nccl):
  """A test that takes this fixture is skipped where NCCL cannot run."""
  require_nccl(nccl)


# ---------------------------------------------------------------------------- topology


@dataclasses.dataclass(frozen=True)
class Topology:
  """The runtime's view of the job (``jaxoverlap.runtime_info()``)."""

  num_nodes: int
  ranks_per_node: int
  slot_bytes: int
  overlap_slot_bytes: int
  info: dict


@pytest.fixture(scope="session")
def topology(runtime, nproc) -> Topology:
  if DRY_RUN:
    from jaxoverlap import runtime as rt

    rpn = int(os.environ.get("JAXOVERLAP_RANKS_PER_NODE") or nproc)
    return Topology(nproc // rpn, rpn, 0, rt.DEFAULT_OVERLAP_HEAP_BYTES // (rpn + 1),
                    {"dry_run": True})
  import jaxoverlap

  info = jaxoverlap.runtime_info()
  return Topology(int(info["num_nodes"]), int(info["ranks_per_node"]), int(info["slot_bytes"]),
                  int(info["overlap_slot_bytes"]), info)


# ---------------------------------------------------------------------------- across ranks


class RankStore:
  """Compares values across ranks through jax.distributed's key-value store.

  Every method is a collective: every rank must call it, in the same order.
  Keys are unique per test and call.
  """

  def __init__(self, client, rank: int, nproc: int, prefix: str):
    self.client, self.rank, self.nproc, self.prefix = client, rank, nproc, prefix
    self._calls = 0

  def gather(self, text: str) -> list[str]:
    """Every rank's ``text``, in rank order."""
    if self.client is None or self.nproc == 1:
      return [text]
    key = f"{self.prefix}/{self._calls}"
    self._calls += 1
    self.client.key_value_set(f"{key}/{self.rank}", text)
    return [self.client.blocking_key_value_get(f"{key}/{r}", KV_TIMEOUT_MS)
            for r in range(self.nproc)]

  def same_on_all_ranks(self, arr) -> tuple[bool, list[str]]:
    """Whether every rank holds a bit-identical ``arr``; and the digests, in rank order."""
    import numpy as np

    a = np.ascontiguousarray(np.asarray(arr))
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()[:16]
    digests = self.gather(h)
    return len(set(digests)) == 1, digests


@pytest.fixture
def kv(request, dist) -> RankStore:
  client = None
  if int(dist["num_processes"]) > 1:
    from jax._src import distributed  # the store has no public accessor in jax 0.11

    client = distributed.global_state.client
  return RankStore(client, int(dist["process_id"]), int(dist["num_processes"]),
                   f"jaxoverlap-tests/{request.node.nodeid}")


# ---------------------------------------------------------------------------- the ops


class Ops:
  """The calls under test: backend "cuda" (dry run: "xla", same shapes and math).

  Each method takes the CUDA choices; a dry run drops them.
  """

  def __init__(self, dry_run: bool):
    self.dry_run = dry_run
    self.backend = "xla" if dry_run else "cuda"

  def require_cuda(self, what: str) -> None:
    if self.dry_run:
      pytest.skip(f"dry run on backend 'xla': {what} is the CUDA backend's")

  def all_reduce(self, x, axis, algorithm="auto", protocol="auto"):
    import jaxoverlap

    if self.dry_run:
      return jaxoverlap.all_reduce(x, axis, backend="xla")
    return jaxoverlap.all_reduce(x, axis, backend="cuda", algorithm=algorithm, protocol=protocol)

  def all_reduce_rms_norm(self, p, residual, weight, axis, eps=1e-6, algorithm="auto"):
    import jaxoverlap

    if self.dry_run:
      return jaxoverlap.all_reduce_rms_norm(p, residual, weight, axis, eps=eps, backend="xla")
    return jaxoverlap.all_reduce_rms_norm(p, residual, weight, axis, eps=eps, backend="cuda",
                                          algorithm=algorithm)

  def _fused_kw(self, algorithm, transport, chunks):
    if self.dry_run:
      return dict(backend="xla", algorithm="ppermute")
    return dict(backend="cuda", algorithm=algorithm, transport=transport, chunks=chunks)

  def all_gather_matmul(self, x, w, axis, dim=0, *, algorithm="fused", transport="auto",
                        chunks=None):
    import jaxoverlap

    return jaxoverlap.all_gather_matmul(x, w, axis, gather_dimension=dim,
                                        **self._fused_kw(algorithm, transport, chunks))

  def matmul_reduce_scatter(self, x, w, axis, dim=0, *, algorithm="fused", transport="auto",
                            chunks=None):
    import jaxoverlap

    return jaxoverlap.matmul_reduce_scatter(x, w, axis, scatter_dimension=dim,
                                            **self._fused_kw(algorithm, transport, chunks))

  def matmul_all_reduce(self, x, w, axis, *, algorithm="fused", transport="auto", chunks=None):
    import jaxoverlap

    return jaxoverlap.matmul_all_reduce(x, w, axis,
                                        **self._fused_kw(algorithm, transport, chunks))

  def all_gather_matmul_gathered(self, x, w, axis, dim, num_ranks, *, transport="copy_engine",
                                 chunks=None):
    """``(AG(x) @ w, AG(x))``: the gathered variant that jax.grad's forward pass uses.

    x and w must be varying over ``axis`` alike (e.g. both from in_specs P(axis)).
    """
    from jaxoverlap import _primitives
    from jaxoverlap.dispatch import Request

    if self.dry_run:
      request = Request("all_gather_matmul", axis, backend="xla", algorithm="ppermute", dim=dim,
                        gathered=True)
    else:
      request = Request("all_gather_matmul", axis, backend="cuda", algorithm="fused",
                        transport=transport, chunks=chunks, dim=dim, gathered=True)
    return _primitives.bind_all_gather_matmul(x, w, request, num_ranks)


@pytest.fixture(scope="session")
def ops() -> Ops:
  return Ops(DRY_RUN)
