"""Outer side of the multi-process GPU tests: start the ranks, read and check their reports.

Problem:
  The CUDA backend's tests (tests/gpu/ranks/rank_*.py) must run in several
  processes at once, one NVSHMEM PE each, in several world sizes and
  placements; a hang must not stall the suite, and a failure on one rank must
  show which rank, which test and why.

Algorithm:
  ``run_ranks`` starts ``python -m jaxoverlap.launch --nproc N [--num_gpus G |
  --share_gpu] --timeout_s T -m pytest tests/gpu/ranks/<module> ...``; each rank
  writes its per-test outcomes as JSON (tests/gpu/ranks/conftest.py). While it
  runs, a watchdog stops the launch when the ranks have not brought their
  runtime up within the start-up bound. ``RankRun.check`` then asserts that
  the launcher succeeded, every rank reported and finished, the same tests ran
  on every rank, none failed (rank, test and failure text in the message) and
  something passed; on a launcher failure it adds the tail of the output.

  Placement (``World``): one process per GPU where the machine has enough GPUs,
  else packed evenly over the largest number of GPUs that divides the world
  (rank % G; never unevenly: 3 processes on 2 GPUs hung in NVSHMEM's start-up).
  Processes that share a GPU run without NCCL (``JAXOVERLAP_NO_NCCL=1``: NCCL
  refuses two ranks on one GPU).

  With ``JAXOVERLAP_RANK_TESTS_XLA=1`` (a dry run of the harness and the tests
  on CPU processes, backend "xla"; ranks/conftest.py) the ranks keep
  ``JAX_PLATFORMS=cpu``.

Example:
  >>> run = run_ranks(tmp_path, "rank_all_reduce.py", World(2, 2), select=["-m", "quick"],
  ...                 timeout_s=300)
  >>> run.print_summary()
  >>> run.check()
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RANKS_DIR = Path(__file__).resolve().parent / "ranks"
# pytest options of every rank: no shared cache, this folder's conftest only (tests/conftest.py
# would force JAX onto the CPU), markers checked.
# tee-sys: what the kernels and libraries print reaches the output as it happens (the tail of a
# hung launch shows it).
RANK_PYTEST_ARGS = ("-p", "no:cacheprovider", "-q", "--tb=short", "--strict-markers",
                    "--capture=tee-sys", "--confcutdir", str(RANKS_DIR))
_MAX_FAILURES = 12
LOG_ENV = "JAXOVERLAP_GPU_TEST_LOG"  # every launch's output is appended here when set
_NOISE = re.compile(r"GRPC|WatchTasks|coordination_service|Connection refused|CANCELLED|"
                    r"Source Location|grpc_util|^\[rank \d+\] $|^\[rank \d+\] [WI]\d{4}")
# World.per_gpu of packed launches whose ranks did not bring their runtime up, and their labels:
# a later launch packing as many processes per GPU or more is skipped (it would only wait out its
# start-up bound too).
_PACKED_STARTUP_FAILURES: list[tuple[int, str]] = []


# ---------------------------------------------------------------------------- the machine


@functools.cache
def gpu_count() -> int:
  """NVIDIA GPUs this process may use (``nvidia-smi -L``, within CUDA_VISIBLE_DEVICES)."""
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return 0
  try:
    out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.SubprocessError):
    return 0
  count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    count = min(count, len([v for v in visible.split(",") if v.strip()]))
  return count


def extension_built() -> bool:
  """Whether the CUDA extension is installed (not imported here)."""
  return importlib.util.find_spec("jaxoverlap._jaxoverlap_cuda") is not None


@functools.cache
def skip_reason() -> str | None:
  """Why the GPU tests cannot run on this machine, or None.

  A machine with GPUs but without the extension is not a reason to skip: the
  GPU tests then fail (``missing_extension``, tests/gpu/conftest.py), so that
  a build that left the CUDA backend out cannot pass as a green GPU suite.
  ``JAXOVERLAP_GPU_TESTS_WITHOUT_EXTENSION=skip`` skips them there instead.
  """
  if gpu_count() == 0:
    return ("no NVIDIA GPU here (nvidia-smi lists none): the GPU suite runs on GPU machines "
            "(bash scripts/gpu_check.sh suite)")
  if not extension_built() and os.environ.get("JAXOVERLAP_GPU_TESTS_WITHOUT_EXTENSION") == "skip":
    return ("the CUDA extension jaxoverlap._jaxoverlap_cuda is not built "
            "(JAXOVERLAP_GPU_TESTS_WITHOUT_EXTENSION=skip)")
  return None


def missing_extension() -> str | None:
  """Why a GPU test must fail here: GPUs but no CUDA extension (see ``skip_reason``), or None."""
  if gpu_count() and not extension_built() and skip_reason() is None:
    return ("this machine has NVIDIA GPUs, but the CUDA extension jaxoverlap._jaxoverlap_cuda "
            "is not built: install with nvcc on PATH (README, 'Building'); "
            "JAXOVERLAP_GPU_TESTS_WITHOUT_EXTENSION=skip skips instead")
  return None


requires_gpus = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


# ---------------------------------------------------------------------------- worlds


@dataclasses.dataclass(frozen=True)
class World:
  """N processes as nodes of ``rpn`` ranks (JAXOVERLAP_RANKS_PER_NODE), optionally all puts.

  ``start`` says how the processes start: "launcher" (``python -m jaxoverlap.launch``, one
  GPU each or packed), "in_process" (one process, no launcher, driving every GPU it sees:
  the in-process runtime), "slurm" (the processes started directly with SLURM's variables
  as ``srun --gpus-per-task=1`` sets them: each sees only its own GPU) or "slurm_per_node"
  (SLURM's one task per node, each "node" a process that drives every GPU of the host, seen
  in rotated order so that the GPUs with one local rank differ from process to process).
  """

  nproc: int
  rpn: int
  put: bool = False  # JAXOVERLAP_FORCE_NVSHMEM_PUT=1: NVSHMEM puts across "nodes"
  start: str = "launcher"

  def gpus(self, available: int) -> int:
    """GPUs the processes spread over: one each if there are enough, else packed evenly."""
    limit = max(1, min(self.nproc, available))
    return max(g for g in range(1, limit + 1) if self.nproc % g == 0)

  def per_gpu(self, available: int) -> int:
    return self.nproc // self.gpus(available)

  def label(self, available: int | None = None) -> str:
    available = gpu_count() or self.nproc if available is None else available
    if self.start == "in_process":
      return f"p1-{available}gpus-in-process"
    if self.start == "slurm_per_node":
      return f"p{self.nproc}x{available}gpus-slurm-per-node"
    k = self.per_gpu(available)
    return (f"w{self.nproc}-rpn{self.rpn}" + (f"-{k}pergpu" if k > 1 else "")
            + ("-put" if self.put else "") + ("-slurm" if self.start == "slurm" else ""))

  def launcher_args(self, available: int) -> list[str]:
    g = self.gpus(available)
    if g == self.nproc:
      return []
    return ["--share_gpu"] if g == 1 else ["--num_gpus", str(g)]

  def env(self, available: int) -> dict[str, str]:
    if self.start == "in_process":
      return {}
    if self.start == "slurm_per_node":  # every process holds memory on every GPU
      return {"XLA_PYTHON_CLIENT_MEM_FRACTION": str(round(0.6 / self.nproc, 3))}
    env = {"JAXOVERLAP_RANKS_PER_NODE": str(self.rpn)}
    if self.per_gpu(available) > 1:
      env["JAXOVERLAP_NO_NCCL"] = "1"
    if self.put:
      env["JAXOVERLAP_FORCE_NVSHMEM_PUT"] = "1"
    return env


@dataclasses.dataclass(frozen=True)
class Case:
  """One parametrized launch of a rank module: its world, a pytest selection, a time bound."""

  world: World
  select: tuple = ()
  timeout_s: int = 300


def run_case(tmp_path: Path, module: str, case: Case) -> None:
  """Runs ``module`` as ``case`` says, prints every rank's outcomes, checks every rank."""
  run = run_ranks(tmp_path, module, case.world, select=case.select, timeout_s=case.timeout_s)
  run.print_summary()
  run.check()


def run_with_knob(tmp_path: Path, module: str, case: Case, env: dict[str, str],
                  expect: dict) -> None:
  """Runs ``module`` as ``case`` says with a measurement knob set in ``env``, checks every rank,
  and checks that every rank's runtime reported the knob in effect: ``expect`` maps
  ``runtime_info`` keys to their values (ranks/conftest.py records them at start-up). The
  knob's message on stderr is not what is checked: it went missing from the ranks' log of two
  launches of 6 ranks once.
  """
  run = run_ranks(tmp_path, module, case.world, select=case.select, timeout_s=case.timeout_s,
                  env=env)
  run.print_summary()
  run.check()
  for key, value in expect.items():
    seen = {r: (rep or {}).get(key) for r, rep in run.reports.items()}
    assert set(seen.values()) == {value}, f"{key}: expected {value!r} on every rank, got {seen}"


# ---------------------------------------------------------------------------- a run


@dataclasses.dataclass
class RankRun:
  """One launch: its command, exit code, output and every rank's report."""

  label: str
  nproc: int
  cmd: list[str]
  returncode: int | None
  seconds: float
  log_path: Path
  reports: dict[int, dict | None]
  stopped: str | None = None  # why the watchdog stopped the launch, or None

  def output(self) -> str:
    try:
      return self.log_path.read_text(errors="replace")
    except OSError:
      return ""

  def tail(self, lines: int = 60) -> str:
    kept = [ln for ln in self.output().splitlines() if not _NOISE.search(ln)]
    return "\n".join(kept[-lines:])

  def outcomes(self, rank: int) -> dict[str, str]:
    report = self.reports.get(rank) or {}
    return {k: v["outcome"] for k, v in report.get("tests", {}).items()}

  def problems(self) -> list[str]:
    """What is wrong with this run, one entry per finding (empty: it passed)."""
    out = []
    if self.stopped:
      out.append(self.stopped)
    if self.returncode != 0:
      why = {124: " (its --timeout_s passed)", None: " (killed)"}.get(self.returncode, "")
      out.append(f"the launcher exited with {self.returncode}{why}")
    missing = [r for r in range(self.nproc) if not self.reports.get(r)]
    if missing:
      out.append(f"ranks {missing} wrote no report (pytest did not start there)")
    present = {r: rep for r, rep in self.reports.items() if rep}
    unfinished = {r: rep for r, rep in present.items() if not rep.get("finished")}
    for r, rep in sorted(unfinished.items()):
      done = list(rep.get("tests", {}))
      todo = [k for k in rep.get("collected", []) if k not in rep.get("tests", {})]
      out.append(f"rank {r} did not finish its session (stage {rep.get('stage')!r}, "
                 f"{len(done)} of {len(rep.get('collected', []))} tests done"
                 + (f"; stopped in or before {todo[0]}" if todo else "") + ")")
    collected = {r: tuple(rep.get("collected", [])) for r, rep in present.items()}
    if len(set(collected.values())) > 1:
      first = min(collected)
      for r, c in sorted(collected.items()):
        if c != collected[first]:
          only = sorted(set(c) ^ set(collected[first]))[:5]
          out.append(f"rank {r} collected other tests than rank {first} (e.g. {only})")
    ran = {r: {k: v != "skipped" for k, v in self.outcomes(r).items()} for r in present}
    finished = [r for r in present if r not in unfinished]
    for k in sorted({k for r in finished for k in ran[r]}):
      kinds = {r: ran[r].get(k) for r in finished}
      if len(set(kinds.values())) > 1:
        out.append(f"{k} ran on some ranks and not on others: "
                   + ", ".join(f"rank {r}: {'ran' if v else 'skipped' if v is False else 'absent'}"
                               for r, v in sorted(kinds.items())))
    # Failures, ranks with the same text together, the first _MAX_FAILURES of them.
    failed: dict[tuple[str, str, str], list[int]] = {}
    for r, rep in sorted(present.items()):
      for k, t in rep.get("tests", {}).items():
        if t["outcome"] in ("failed", "error"):
          text = t.get("longrepr", "")[-3000:]
          failed.setdefault((k, t["outcome"], text), []).append(r)
    for (k, outcome, text), ranks in list(failed.items())[:_MAX_FAILURES]:
      who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
      out.append(f"{who}: {k} {outcome.upper()}:\n" + _indent(text))
    if len(failed) > _MAX_FAILURES:
      out.append(f"... and {len(failed) - _MAX_FAILURES} more failures (the reports: "
                 f"{self.log_path.parent / 'reports'})")
    for r in finished:
      if not any(v == "passed" for v in self.outcomes(r).values()):
        out.append(f"rank {r}: no test passed (all skipped or deselected)")
    return out

  def check(self) -> None:
    """Asserts that the run passed (see ``problems``)."""
    problems = self.problems()
    if not problems:
      return
    msg = f"{self.label}: {len(problems)} problem(s)\n" + "\n".join(f"- {p}" for p in problems)
    if self.stopped or self.returncode != 0 or any(
        not rep or not rep.get("finished") for rep in
        (self.reports.get(r) for r in range(self.nproc))):
      msg += f"\n--- last lines of the output (all of it: {self.log_path}) ---\n{self.tail()}"
    raise AssertionError(msg)

  def print_summary(self) -> None:
    """One line per test: its outcome and its longest duration over the ranks."""
    print(f"{self.label}: launcher exit {self.returncode} after {self.seconds:.0f} s; "
          f"{shlex.join(self.cmd)}")
    merged: dict[str, tuple[set, float, str]] = {}
    for r in range(self.nproc):
      for k, t in ((self.reports.get(r) or {}).get("tests") or {}).items():
        kinds, dur, why = merged.get(k, (set(), 0.0, ""))
        kinds.add(t["outcome"])
        why = why or (t.get("longrepr", "") if t["outcome"] == "skipped" else "")
        merged[k] = (kinds, max(dur, t["duration"]), why)
    for k, (kinds, dur, why) in merged.items():
      line = f"  {'/'.join(sorted(kinds)):8s} {dur:7.1f} s  {k}"
      print(line + (f"  ({why[:150]})" if why else ""))


def _indent(text: str) -> str:
  return "\n".join("    " + ln for ln in text.splitlines())


def _child_env(extra: dict[str, str], report_dir: Path) -> dict[str, str]:
  env = dict(os.environ)
  dry_run = env.get("JAXOVERLAP_RANK_TESTS_XLA") == "1"  # ranks/conftest.py: CPU processes
  if env.get("JAX_PLATFORMS") == "cpu" and not dry_run:  # tests/conftest.py's CPU default
    env.pop("JAX_PLATFORMS")
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  if flags.strip():
    env["XLA_FLAGS"] = flags.strip()
  else:
    env.pop("XLA_FLAGS", None)
  env.update(NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
             JAXOVERLAP_RANK_REPORT_DIR=str(report_dir))
  env.update(extra)
  return env


def _started(report_dir: Path, nproc: int) -> list[int]:
  """Ranks whose runtime is up, or that got through a test (a report may be mid-write)."""
  up = []
  for r in range(nproc):
    try:
      rep = json.loads((report_dir / f"rank{r}.json").read_text())
    except (OSError, ValueError):
      continue
    if rep.get("runtime_up") or rep.get("tests"):
      up.append(r)
  return up


def _stop(proc: subprocess.Popen, report_dir: Path, nproc: int) -> None:
  """Stops the launcher as Ctrl-C would (it stops its ranks), then what is left of ours."""
  if proc.poll() is None:
    proc.send_signal(signal.SIGINT)
    try:
      proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
  for r in range(nproc):  # ranks the launcher could not stop (their pids from their reports)
    try:
      pid = json.loads((report_dir / f"rank{r}.json").read_text()).get("pid")
    except (OSError, ValueError):
      continue
    if pid:
      try:
        os.kill(int(pid), signal.SIGKILL)
      except OSError:
        pass


def run_ranks(tmp_path: Path, module: str, world: World, *, select=(), timeout_s: float,
              startup_s: float | None = None, env: dict[str, str] | None = None,
              wrapper: str | None = None, available_gpus: int | None = None,
              label: str | None = None, needs_runtime: bool = True) -> RankRun:
  """Runs ``tests/gpu/ranks/<module>`` in ``world.nproc`` processes and collects the reports.

  Args:
    tmp_path: a fresh folder for the reports and the output.
    module: the rank-side module's file name, e.g. "rank_all_reduce.py".
    world: the processes and their topology.
    select: extra pytest arguments of every rank (e.g. ``["-m", "quick"]``).
    timeout_s: the launcher's --timeout_s (it stops every rank after that).
    startup_s: stop the launch when the ranks have not brought their runtime up
      (or got through a test) within this many seconds (default: 45 + 10 per
      rank).
    env: extra environment of the ranks.
    wrapper: the launcher's --wrapper (e.g. compute-sanitizer).
    available_gpus: GPUs to place the ranks on (default: ``gpu_count()``).
    label: the run's name in messages (default: the world's label).
    needs_runtime: the module's tests bring the CUDA runtime up; a packed world
      (several processes per GPU) whose runtime did not come up makes later
      launches with as many processes per GPU or more skip.

  Returns:
    The ``RankRun``; call ``check()`` on it.
  """
  available = gpu_count() if available_gpus is None else available_gpus
  label = label or world.label(available)
  per_gpu = world.per_gpu(available)
  earlier = [lab for k, lab in _PACKED_STARTUP_FAILURES if per_gpu > 1 and k <= per_gpu]
  if earlier:
    pytest.skip(f"{per_gpu} processes per GPU: the runtime did not come up in {earlier[0]} "
                f"with as many or fewer per GPU (see that test)")
  report_dir = tmp_path / "reports"
  report_dir.mkdir(parents=True, exist_ok=True)
  log_path = tmp_path / "ranks.log"
  startup_s = 45 + 10 * world.nproc if startup_s is None else startup_s
  child_env = _child_env({**world.env(available), **(env or {})}, report_dir)
  # Each rank's own start-up bound (jaxoverlap.initialize), inside ours.
  child_env.setdefault("JAXOVERLAP_INIT_TIMEOUT_S", str(int(max(30, startup_s - 20))))
  pytest_cmd = [sys.executable, "-m", "pytest", str(RANKS_DIR / module), *RANK_PYTEST_ARGS,
                *select]
  if world.start == "in_process":
    cmd = ["timeout", str(int(timeout_s)), *pytest_cmd]
  elif world.start == "slurm":
    # srun --ntasks=N --gpus-per-task=1 on one node, as its variables say (JAX's SLURM
    # cluster finds the coordinator from SLURM_JOB_ID and SLURM_STEP_NODELIST).
    child_env.update(SLURM_JOB_ID=str(1000 + os.getpid() % 3000), SLURM_STEP_NODELIST="localhost",
                     SLURM_NTASKS=str(world.nproc), SLURM_NTASKS_PER_NODE=str(world.nproc),
                     SLURM_STEP_NUM_NODES="1", SLURM_NODEID="0")
    tasks = [f"SLURM_PROCID={r} SLURM_LOCALID={r} CUDA_VISIBLE_DEVICES={r % max(1, available)} "
             f"{shlex.join(pytest_cmd)}" for r in range(world.nproc)]
    cmd = ["timeout", str(int(timeout_s)), "bash", "-c", " & ".join(tasks) + " & wait"]
  elif world.start == "slurm_per_node":
    # srun --ntasks-per-node=1 on N "nodes" of this host: every task sees every GPU.
    g = max(1, available)
    child_env.update(SLURM_JOB_ID=str(1000 + os.getpid() % 3000), SLURM_STEP_NODELIST="localhost",
                     SLURM_NTASKS=str(world.nproc), SLURM_NTASKS_PER_NODE="1",
                     SLURM_STEP_NUM_NODES=str(world.nproc), SLURM_LOCALID="0")
    tasks = [f"SLURM_PROCID={r} SLURM_NODEID={r} CUDA_VISIBLE_DEVICES="
             f"{','.join(str((r + i) % g) for i in range(g))} {shlex.join(pytest_cmd)}"
             for r in range(world.nproc)]
    cmd = ["timeout", str(int(timeout_s)), "bash", "-c", " & ".join(tasks) + " & wait"]
  else:
    cmd = [sys.executable, "-m", "jaxoverlap.launch", "--nproc", str(world.nproc),
           *world.launcher_args(available), "--timeout_s", str(int(timeout_s))]
    if wrapper:
      cmd += ["--wrapper", wrapper]
    cmd += ["-m", "pytest", str(RANKS_DIR / module), *RANK_PYTEST_ARGS, *select]
  start = time.monotonic()
  stopped = None
  with open(log_path, "wb") as log:
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=log, stderr=subprocess.STDOUT)
    checked_startup = False
    while proc.poll() is None:
      elapsed = time.monotonic() - start
      if not checked_startup and elapsed > startup_s:
        up = _started(report_dir, world.nproc)
        if len(up) < world.nproc:
          stopped = (f"start-up did not finish within {startup_s:.0f} s: ranks "
                     f"{sorted(set(range(world.nproc)) - set(up))} never brought their runtime "
                     "up (stopped the launch)")
          _stop(proc, report_dir, world.nproc)
          break
        checked_startup = True
      if elapsed > timeout_s + 60:  # the launcher's own bound did not act
        stopped = f"the launch outlived its --timeout_s {timeout_s:.0f} s by 60 s (stopped it)"
        _stop(proc, report_dir, world.nproc)
        break
      time.sleep(0.5)
  seconds = time.monotonic() - start
  reports = {}
  for r in range(world.nproc):
    try:
      reports[r] = json.loads((report_dir / f"rank{r}.json").read_text())
    except (OSError, ValueError):
      reports[r] = None
  run = RankRun(label, world.nproc, cmd, proc.returncode, seconds, log_path, reports, stopped)
  if per_gpu > 1 and needs_runtime and not all(rep and rep.get("runtime_up")
                                               for rep in reports.values()):
    _PACKED_STARTUP_FAILURES.append((per_gpu, label))
  combined = os.environ.get(LOG_ENV)
  if combined:
    with open(combined, "a", errors="replace") as f:
      f.write(f"\n===== {label} ({module}): exit {proc.returncode} after {seconds:.0f} s"
              f"{'; ' + stopped if stopped else ''}\n$ {shlex.join(cmd)}\n")
      f.write(run.output())
  return run
