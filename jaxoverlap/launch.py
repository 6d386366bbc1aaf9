"""Starts one process per GPU and tells each how to join one jax.distributed job.

Problem:
  One process per GPU (what NVSHMEM and most multi-node jobs run) needs N
  processes that agree on a coordinator, a process count and each one's rank
  and GPU, and whose failures, hangs and interruptions do not leave the others
  running on their GPUs.

Algorithm:
  ``python -m jaxoverlap.launch --nproc N script.py [args]`` starts N
  processes, each in its own process group, and gives each four variables in
  its environment: ``JAXOVERLAP_COORDINATOR`` (host:port of the
  jax.distributed coordinator), ``JAXOVERLAP_NUM_PROCESSES`` (N),
  ``JAXOVERLAP_PROCESS_ID`` (its rank, 0 to N-1) and
  ``JAXOVERLAP_LOCAL_DEVICE`` (the GPU it drives). The launcher sets nothing
  up itself: the script must call ``initialize_from_env()``, which reads the
  four, calls ``jax.distributed.initialize`` and then
  ``jaxoverlap.initialize()``. A script that does not call it runs as N
  unrelated one-process jobs. Under SLURM (``srun``, one task per GPU or per
  node) no launcher is needed: ``initialize_from_env()`` reads SLURM's
  variables and finds the coordinator as ``jax.distributed.initialize`` does.

  Everything from the script (or ``-m MODULE``) on belongs to the script. The
  launcher prefixes each line of output with ``[rank N]``. When a rank fails,
  ``--timeout_s`` passes, or the launcher gets SIGINT (Ctrl-C), SIGTERM or
  SIGHUP, it stops every rank's process group (SIGTERM, then SIGKILL after
  5 s).

Errors:
  Each failure and timeout is reported on stderr with the rank and its exit
  code or signal (on a timeout: the ranks still running). The launcher exits
  with the status of the first rank to fail, in time order (128+N for a rank
  killed by signal N), 124 on a timeout, 128+N when it got signal N itself,
  127 when a rank's process cannot be started (e.g. a ``--wrapper`` that is
  not installed), else 0. ``initialize_from_env()`` raises a ValueError that names the
  variables when the launcher's or SLURM's are partial or malformed.

Usage:
  python -m jaxoverlap.launch --nproc 2 examples/train/main.py --distributed ...
  python -m jaxoverlap.launch --nproc 2 --share_gpu -m pytest tests/gpu/ranks/rank_all_reduce.py \
      --confcutdir tests/gpu/ranks
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from jaxoverlap import _settings

__all__ = ["main", "initialize_from_env", "slurm_local_devices", "free_port"]

_ENV_PREFIX = _settings.PREFIX
# What the launcher gives each process; initialize_from_env() needs all four.
_LAUNCH_VARIABLES = ("COORDINATOR", "NUM_PROCESSES", "PROCESS_ID", "LOCAL_DEVICE")


def free_port() -> int:
  """A TCP port that was free a moment ago (bind to port 0)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launched() -> bool:
  """True when this process was started by the launcher, or by SLURM as one of several tasks.

  Raises:
    ValueError: ``SLURM_PROCID`` is set and ``SLURM_NTASKS`` is empty, not an
      integer or below 1 (``initialize_from_env()`` raises the same).
  """
  env = os.environ
  return _ENV_PREFIX + "COORDINATOR" in env or (
      "SLURM_PROCID" in env and _slurm_num_tasks(env) > 1)


# Settings that change what a run measures, recorded in results' commands (names without
# the prefix; jaxoverlap._settings, every cost-model override included).
SETTINGS = _settings.names(recorded=True, prefix=False)


def reproduce_command(script: str, argv: list[str] | None = None) -> str:
  """The command line that reruns this process group, for a result file's "command".

  Args:
    script: the script's path as run from the repository root, e.g.
      "benchmarks/overlap.py".
    argv: its arguments (default ``sys.argv[1:]``).

  Returns:
    ``"[JAXOVERLAP_X=v ...] python -m jaxoverlap.launch --nproc N <script> <args>"``
    under the launcher (N = ``JAXOVERLAP_NUM_PROCESSES``), else
    ``"... python <script> <args>"``; the prefix lists the ``SETTINGS`` that
    are set in the environment, the cost model's overrides
    (``JAXOVERLAP_<KEY>`` for every key of ``tuning.PARAM_KEYS``) included.
  """
  env = os.environ
  args = shlex.join(sys.argv[1:] if argv is None else argv)
  prefix = "".join(f"{_ENV_PREFIX}{k}={shlex.quote(env[_ENV_PREFIX + k])} "
                   for k in SETTINGS if _ENV_PREFIX + k in env)
  if _ENV_PREFIX + "COORDINATOR" in env:
    nproc = env.get(_ENV_PREFIX + "NUM_PROCESSES", "?")
    return f"{prefix}python -m jaxoverlap.launch --nproc {nproc} {script} {args}".rstrip()
  return f"{prefix}python {script} {args}".rstrip()


def _slurm_tasks_on_node(env) -> int:
  """Tasks of this job on this node: SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE."""
  if env.get("SLURM_NTASKS_PER_NODE", "").strip().isdigit():
    return int(env["SLURM_NTASKS_PER_NODE"])
  # e.g. "4(x2),3": 4 tasks on each of the first two nodes, 3 on the third.
  per_node = []
  for part in env.get("SLURM_TASKS_PER_NODE", "").split(","):
    count, _, rep = part.partition("(x")
    if count.strip().isdigit():
      per_node += [int(count)] * (int(rep.rstrip(")")) if rep else 1)
  node = int(env.get("SLURM_NODEID", "0") or 0)
  return per_node[node] if node < len(per_node) else 1


def _cuda_driver():
  """The CUDA driver library (``ctypes``), initialised; None where it cannot load or start.

  Asks the driver itself, not JAX, so that nothing starts a JAX backend (the
  launcher and SLURM's placement run before ``jax.distributed.initialize``).
  """
  import ctypes

  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return None
  return cuda if cuda.cuInit(0) == 0 else None


def _driver_gpu_count() -> int | None:
  """GPUs the CUDA driver shows this process (within CUDA_VISIBLE_DEVICES), or None."""
  import ctypes

  cuda = _cuda_driver()
  count = ctypes.c_int(0)
  if cuda is None or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
    return None
  return count.value


def slurm_local_devices(env=None, visible_gpus: int | None = None) -> list[int] | None:
  """The local device ids this SLURM task should drive, from what it actually sees.

  * One task per GPU: ``srun --gpus-per-task=1`` shows each task only its own
    GPU (``CUDA_VISIBLE_DEVICES`` holds one id), which JAX then numbers 0; a
    task that sees all the node's GPUs takes the one at ``SLURM_LOCALID``.
  * One task per node: every GPU the task sees. They must be named: given
    none, ``jax.distributed.initialize`` under SLURM takes only the GPU at
    ``SLURM_LOCALID``.
  * A task that sees no GPU (e.g. an empty ``CUDA_VISIBLE_DEVICES``, which
    forces JAX onto the CPU) names none, however many tasks share its node.

  Args:
    env: the environment (default ``os.environ``).
    visible_gpus: GPUs this task sees (default: from ``CUDA_VISIBLE_DEVICES``,
      else from the CUDA driver for one task per node, else all the node's).

  Returns:
    The ids, or None where no GPU is seen (JAX's default placement).

  Raises:
    RuntimeError: the task sees several GPUs but fewer than its local id
      needs, so the placement is ambiguous; the message says what it saw.
    ValueError: ``SLURM_LOCALID`` is not an integer of at least 0.
  """
  env = os.environ if env is None else env
  if visible_gpus is None and "CUDA_VISIBLE_DEVICES" in env:
    visible_gpus = len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
  if _slurm_tasks_on_node(env) == 1:
    if visible_gpus is None:
      visible_gpus = _driver_gpu_count()
    return list(range(visible_gpus)) if visible_gpus else None
  if visible_gpus == 0:
    return None
  problems: list[str] = []
  local = _read_int(env, "SLURM_LOCALID", 0, problems) if env.get("SLURM_LOCALID") else 0
  if problems:
    raise ValueError(f"jaxoverlap.launch.slurm_local_devices: {problems[0]}")
  if visible_gpus is None:
    return [local]
  if visible_gpus == 1:
    return [0]
  if local < visible_gpus:
    return [local]
  seen = (f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}"
          if "CUDA_VISIBLE_DEVICES" in env else f"visible_gpus={visible_gpus}")
  raise RuntimeError(
      f"jaxoverlap.launch: SLURM task {local} of {_slurm_tasks_on_node(env)} on this node sees "
      f"{visible_gpus} GPUs ({seen}), so it cannot take GPU {local}; run one task per GPU with "
      "srun --gpus-per-task=1, or one task per node")


def _read_int(env, name: str, minimum: int, problems: list[str]) -> int | None:
  """``env[name]`` as an integer of at least ``minimum``; else None, and why in ``problems``."""
  text = env.get(name)
  if text is None:
    problems.append(f"{name} is not set")
    return None
  try:
    value = int(text)
  except ValueError:
    problems.append(f"{name}={text!r} is not an integer")
    return None
  if value < minimum:
    problems.append(f"{name}={value} is below {minimum}")
    return None
  return value


def _slurm_num_tasks(env) -> int:
  """``SLURM_NTASKS`` (1 where it is unset): the tasks of this SLURM job step."""
  if "SLURM_NTASKS" not in env:
    return 1
  problems: list[str] = []
  ntasks = _read_int(env, "SLURM_NTASKS", 1, problems)
  if problems:
    raise ValueError(
        f"jaxoverlap.launch: {problems[0]}, with SLURM_PROCID={env.get('SLURM_PROCID')!r}; "
        "srun sets SLURM_NTASKS to the job step's number of tasks (>= 1). Set it so, or unset "
        "SLURM_PROCID and SLURM_NTASKS to run the process alone")
  return ntasks


def _launcher_setup(env) -> dict[str, Any] | None:
  """The job the launcher's four variables describe; None where none of them is set.

  Raises:
    ValueError: some are set but not all four, or one is malformed; the
      message names each and what is needed.
  """
  names = [_ENV_PREFIX + k for k in _LAUNCH_VARIABLES]
  if not any(n in env for n in names):
    return None
  coordinator_name, nproc_name, pid_name, local_name = names
  problems: list[str] = []
  coordinator = env.get(coordinator_name)
  host, _, port = (coordinator or "").strip().rpartition(":")
  if coordinator is None:
    problems.append(f"{coordinator_name} is not set")
  elif not host or not port.isdigit():
    problems.append(f"{coordinator_name}={coordinator!r} is not host:port")
  nproc = _read_int(env, nproc_name, 1, problems)
  pid = _read_int(env, pid_name, 0, problems)
  local = _read_int(env, local_name, 0, problems)
  if nproc is not None and pid is not None and pid >= nproc:
    problems.append(f"{pid_name}={pid} is not below {nproc_name}={nproc}")
  if problems:
    raise ValueError(
        f"jaxoverlap.launch: {'; '.join(problems)}. The launcher's four variables go together "
        f"(python -m jaxoverlap.launch sets them): {coordinator_name} (host:port), {nproc_name} "
        f"(>= 1), {pid_name} (0 to {nproc_name} - 1) and {local_name} (a GPU id >= 0). Set all "
        "four, or unset all four to run the process alone")
  return {"by": "the launcher", "coordinator": coordinator.strip(),
          "where": f"{coordinator.strip()} ({coordinator_name})",
          "num_processes": nproc, "process_id": pid, "local_device_ids": [local],
          "local_device": local}


def _slurm_setup(env, find_coordinator: bool = True) -> dict[str, Any] | None:
  """The job SLURM's variables describe; None unless SLURM_PROCID is set and SLURM_NTASKS > 1.

  The coordinator is what ``jax.distributed.initialize`` derives under SLURM
  (``JAX_COORDINATOR_ADDRESS``, else the first host of
  ``SLURM_STEP_NODELIST`` at a port from ``SLURM_JOB_ID`` or
  ``JAX_COORDINATOR_PORT``); the local devices are ``slurm_local_devices``'.

  Args:
    env: the environment.
    find_coordinator: False where jax.distributed is already up: then the
      variables that only locate the coordinator are not needed.

  Raises:
    ValueError: a SLURM variable is empty or not an integer, or what JAX
      needs to find the coordinator is missing; the message names each.
    RuntimeError: ``slurm_local_devices`` finds no GPU for this task.
  """
  if "SLURM_PROCID" not in env:
    return None
  ntasks = _slurm_num_tasks(env)
  if ntasks == 1:
    return None
  problems: list[str] = []
  pid = _read_int(env, "SLURM_PROCID", 0, problems)
  if pid is not None and pid >= ntasks:
    problems.append(f"SLURM_PROCID={pid} is not below SLURM_NTASKS={ntasks}")
  if "SLURM_LOCALID" in env:
    _read_int(env, "SLURM_LOCALID", 0, problems)
  given = env.get("JAX_COORDINATOR_ADDRESS", "").strip()
  if given and not _is_host_port(given):
    problems.append(f"JAX_COORDINATOR_ADDRESS={given!r} is not host:port (e.g. node0:12345)")
  if find_coordinator and not given:
    missing = [n for n in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST") if not env.get(n, "").strip()]
    if "SLURM_JOB_ID" not in missing:
      _read_int(env, "SLURM_JOB_ID", 0, problems)
    if missing:
      problems.append(
          f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, and JAX "
          "needs SLURM_JOB_ID and SLURM_STEP_NODELIST to find the coordinator (task 0's host): "
          "start the tasks with srun, or set JAX_COORDINATOR_ADDRESS=host:port of task 0")
  if problems:
    raise ValueError(
        f"jaxoverlap.launch: SLURM_PROCID and SLURM_NTASKS={ntasks} make this process one of "
        f"{ntasks} SLURM tasks, but {'; '.join(problems)}. Unset SLURM_PROCID and SLURM_NTASKS to "
        "run the process alone")
  coordinator = env.get("JAX_COORDINATOR_ADDRESS", "").strip() or None
  where = f"{coordinator} (JAX_COORDINATOR_ADDRESS)"
  if coordinator is None and find_coordinator:
    port = env.get("JAX_COORDINATOR_PORT")
    source = (f"SLURM_STEP_NODELIST={env['SLURM_STEP_NODELIST']!r} and "
              + (f"JAX_COORDINATOR_PORT={port}" if port else f"SLURM_JOB_ID={env['SLURM_JOB_ID']}"))
    where = f"the first host of {source}"
    try:  # the address jax.distributed.initialize derives itself
      from jax._src.clusters import SlurmCluster

      coordinator = SlurmCluster.get_coordinator_address(
          timeout_secs=None, override_coordinator_port=port)
      where = f"{coordinator} (from {source})"
    except (ImportError, AttributeError, KeyError, ValueError):
      coordinator = None  # JAX derives it
  local = slurm_local_devices(env)
  return {"by": "SLURM", "coordinator": coordinator, "where": where, "num_processes": ntasks,
          "process_id": pid, "local_device_ids": local,
          "local_device": local[0] if local is not None and len(local) == 1 else None}


def _active_distributed() -> tuple[int, int] | None:
  """(process id, process count) of this process's jax.distributed, None where it is not up."""
  # jax.distributed's state has no public accessor in jax 0.11 (runtime._kv_client reads it too).
  from jax._src import distributed

  state = distributed.global_state
  if state.client is None:
    return None
  return state.process_id, state.num_processes


def initialize_from_env(
    *, nvshmem: bool | None = None, heap_bytes: int | None = None
) -> dict[str, Any]:
  """Initialises jax.distributed (and the CUDA kernels' runtime) for this process.

  The CUDA kernels' runtime is NVSHMEM, or CUDA peer access in one process
  (``jaxoverlap.initialize`` picks it from the GPUs the process drives).

  Reads the launcher's ``JAXOVERLAP_*`` variables (all four, see the module's
  docstring), or SLURM's (``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, ``SLURM_JOB_ID`` and ``SLURM_STEP_NODELIST`` for the
  coordinator, the tasks per node and ``CUDA_VISIBLE_DEVICES``: see
  ``slurm_local_devices``). With neither, the process runs alone and
  jax.distributed is left untouched. Before ``jax.distributed.initialize``
  waits for the other processes (up to 300 s, JAX's bound) it prints to stderr
  which coordinator and how many processes it waits for. Once a job of several
  processes is up (outside an interactive session), an uncaught exception ends
  the process at once after its traceback (exit status 1, without exit
  handlers: open files are not flushed): JAX's exit would otherwise hold it for
  up to 300 s in jax.distributed's shutdown barrier while its peers wait for it
  in their next collective, and neither the launcher nor srun could tell which
  process failed. ``sys.exit`` with an error status is not covered. Where
  jax.distributed was started elsewhere and drives fewer of the GPUs that the
  placement names (one SLURM task per node), it warns.

  Calling it again, or after your own ``jax.distributed.initialize``, joins
  nothing new: it returns the active setup (the same dict as the first call)
  when that is the job the environment describes.

  Args:
    nvshmem: bring up the CUDA kernels' runtime (``jaxoverlap.initialize``:
      NVSHMEM for one GPU per process, the in-process runtime for a process
      driving several). Default: when the platform is GPU and the CUDA
      extension is built.
    heap_bytes: passed to ``jaxoverlap.initialize``.

  Returns:
    dict with ``process_id``, ``num_processes``, ``local_device`` (None when
    the process drives all the GPUs it sees) and, when the CUDA kernels'
    runtime (NVSHMEM, or CUDA peer access in one process) was brought up,
    ``runtime`` (``jaxoverlap.runtime_info()``). Without the launcher's or
    SLURM's variables, ``process_id`` and ``num_processes`` are those of an
    active jax.distributed, else 0 and 1.

  Raises:
    RuntimeError: ``nvshmem=True`` but the CUDA backend cannot start; a
      SLURM placement that names no GPU this task sees; jax.distributed is
      already up as another process id or count than the environment says; JAX
      already ran a computation (jax.distributed must start first); or the job
      joined has another number of processes than this process's variables
      say (its processes were started with different counts).
    ValueError: the launcher's variables are partial or malformed (all four
      are needed together), SLURM's are empty or not integers,
      ``JAX_COORDINATOR_ADDRESS`` is not ``host:port``, or JAX could not find
      the coordinator from them; raised before jax.distributed is called,
      naming each variable. Also where ``jaxoverlap.initialize``
      refuses a setting of the environment, e.g. a ``JAXOVERLAP_TIMEOUT_S``
      or ``JAXOVERLAP_INIT_TIMEOUT_S`` that is not a positive, finite number.
  """
  import jax

  env = os.environ
  active = _active_distributed()
  setup = _launcher_setup(env) or _slurm_setup(env, find_coordinator=active is None)
  out: dict[str, Any] = {"process_id": 0, "num_processes": 1, "local_device": None}
  if setup is not None:
    job = (setup["process_id"], setup["num_processes"])
    if active is None:
      if _backends_started():
        raise RuntimeError(
            "jaxoverlap.launch.initialize_from_env: JAX has already run a computation in this "
            "process, and jax.distributed can only start before the first one; call "
            "initialize_from_env() first, before any jax.numpy or jax.jit call")
      alone = (" (to run this process alone, unset SLURM_PROCID and SLURM_NTASKS)"
               if setup["by"] == "SLURM" else "")
      sys.stderr.write(
          f"jaxoverlap.launch: process {job[0]} of {job[1]} (from {setup['by']}) joins "
          f"jax.distributed at {setup['where']}, waiting for all {job[1]} processes (JAX "
          f"waits up to {_JAX_INIT_TIMEOUT_S} s){alone}\n")
      sys.stderr.flush()
      jax.distributed.initialize(
          coordinator_address=setup["coordinator"],
          num_processes=setup["num_processes"],
          process_id=setup["process_id"],
          local_device_ids=setup["local_device_ids"],
      )
      if job[1] > 1:  # from here on, before the checks that may raise
        _exit_at_once_on_error(job[0])
      if jax.process_count() != job[1]:
        raise RuntimeError(
            f"jaxoverlap.launch.initialize_from_env: {setup['by']}'s variables give "
            f"{job[1]} processes, but the job that process {job[0]} joined has "
            f"{jax.process_count()}: its processes were started with different counts "
            "(e.g. SLURM_NTASKS); start them all with one")
    elif active != job:
      raise RuntimeError(
          f"jaxoverlap.launch.initialize_from_env: jax.distributed is already initialised as "
          f"process {active[0]} of {active[1]}, but {setup['by']}'s variables make this process "
          f"{job[0]} of {job[1]}; a process joins one job. Initialise jax.distributed once: "
          "drop the other jax.distributed.initialize call, or give it the same process id and "
          "count")
    out.update(process_id=job[0], num_processes=job[1], local_device=setup["local_device"])
    _check_devices_taken(setup)
  elif active is not None:
    out.update(process_id=active[0], num_processes=active[1])

  if nvshmem is None:
    from jaxoverlap import _ffi

    nvshmem = jax.default_backend() == "gpu" and _ffi.unavailable_reason() is None
  if nvshmem:
    from jaxoverlap import runtime

    out["runtime"] = runtime.initialize(heap_bytes)
  return out


# What the exception hook of initialize_from_env prints: the launcher names the first rank
# that printed it as the cause of a failure (_watch).
_ENDS_AT_ONCE = "ends at once (exit status 1) after the uncaught exception above"
# How long _watch lets the rank outputs arrive after a failure, before it names the cause.
_SETTLE_S = 0.3

# jax.distributed.initialize's own bound on the wait for every process (its
# initialization_timeout, left at JAX's default).
_JAX_INIT_TIMEOUT_S = 300


def _is_host_port(text: str) -> bool:
  host, _, port = text.rpartition(":")
  return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _backends_started() -> bool:
  """Whether JAX has brought up its backends (a computation ran), where JAX says so."""
  try:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # not in this JAX: jax.distributed says it instead
    return False


def _check_devices_taken(setup: dict[str, Any]) -> None:
  """Says so where this process drives fewer of the GPUs it sees than its placement names.

  One SLURM task per node names every GPU it sees; a jax.distributed started
  elsewhere without them (JAX's own SLURM detection takes only the GPU at
  SLURM_LOCALID) leaves the others idle.
  """
  import jax

  want = setup["local_device_ids"]
  if want is None or len(want) < 2 or jax.default_backend() != "gpu":
    return
  have = len(jax.local_devices())
  if have < len(want):
    sys.stderr.write(
        f"jaxoverlap.launch: WARNING: this process drives {have} of the {len(want)} GPUs its "
        f"placement gives it ({setup['by']}: local devices {want}); jax.distributed was "
        "initialised without them. Let initialize_from_env() initialise it, or pass "
        f"local_device_ids={want} to jax.distributed.initialize\n")
    sys.stderr.flush()


def _exit_at_once_on_error(process_id: int) -> None:
  """Makes an uncaught exception end this process at once, after its traceback.

  Otherwise JAX's exit holds the failing process in jax.distributed's shutdown
  barrier (up to 300 s) while its peers wait in their next collective for it:
  nothing ends, and the launcher (or srun) cannot see which process failed.
  """
  if hasattr(sys, "ps1") or sys.flags.interactive:
    return  # an interactive session: an error there ends nothing
  previous = sys.excepthook

  def hook(kind, value, tb):
    previous(kind, value, tb)
    if issubclass(kind, KeyboardInterrupt):  # every process got it: they exit together
      return
    sys.stderr.write(
        f"jaxoverlap.launch: process {process_id} {_ENDS_AT_ONCE}, without its exit handlers "
        "(open files are not flushed): its peers would wait for it in their next collective, "
        "and JAX's exit would hold it in jax.distributed's shutdown barrier for up to 300 s\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)

  sys.excepthook = hook


def _timeout_seconds(text: str) -> float:
  """``--timeout_s``: a finite number of seconds, at least 0 (argparse's type)."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
  if not math.isfinite(value) or value < 0:
    raise argparse.ArgumentTypeError(
        f"{text!r} must be a finite number of seconds >= 0 (0: no limit)")
  return value


def _pump(stream, rank: int, sink, marks: dict[int, float]) -> None:
  """Copies a rank's output with its prefix; notes when it said it ends after an exception."""
  for raw in iter(stream.readline, b""):
    line = raw.decode(errors="replace")
    if _ENDS_AT_ONCE in line:
      marks.setdefault(rank, time.monotonic())
    sink.write(f"[rank {rank}] {line}")
    sink.flush()


def _reap(proc: subprocess.Popen, rank: int, ended: queue.SimpleQueue) -> None:
  """Waits for one rank and reports (rank, return code): failures arrive in time order."""
  ended.put((rank, proc.wait()))


# The launcher's options that take a value (argparse accepts unique prefixes, e.g. --timeout).
_VALUE_OPTIONS = ("--nproc", "--num_gpus", "--port", "--timeout_s", "--wrapper")

_EPILOG = f"""\
The script (or module) must call jaxoverlap.launch.initialize_from_env() to join
the job; it calls jax.distributed.initialize, then jaxoverlap.initialize(). The
launcher sets nothing up itself: a script that does not call it runs as N
unrelated one-process jobs. Each process gets in its environment:
  {_ENV_PREFIX}COORDINATOR    host:port of the jax.distributed coordinator
  {_ENV_PREFIX}NUM_PROCESSES  N (--nproc)
  {_ENV_PREFIX}PROCESS_ID     its rank, 0 to N-1
  {_ENV_PREFIX}LOCAL_DEVICE   the GPU it drives: its rank, rank % --num_gpus,
                            or 0 with --share_gpu

Only a -m before the script selects a module; everything from the script (or
-m MODULE) on is passed to it, options like the launcher's included. Output is
prefixed with [rank N]. When a rank fails, --timeout_s passes, or the launcher
gets SIGINT, SIGTERM or SIGHUP, every rank's process group is stopped (SIGTERM,
then SIGKILL after 5 s). The exit status is that of the first rank to fail
(128+N for a rank killed by signal N), 124 on a timeout, 128+N for signal N to
the launcher, 127 when a rank cannot be started (e.g. a --wrapper not found),
else 0.
"""


def _split_target(argv: list[str]) -> tuple[list[str], list[str]]:
  """Splits a command line into the launcher's options and the target.

  The target is the script and its arguments, or ``-m MODULE`` and its
  arguments: everything from the first word that is not one of the
  launcher's options (or their values), or from ``-m``; ``--`` ends the
  options. So a ``-m`` or ``--nproc`` after the script is the script's.

  Returns:
    (options, target); the target is empty when there is neither.
  """
  i = 0
  while i < len(argv):
    word = argv[i]
    if word == "--":
      return argv[:i], argv[i + 1:]
    if word.startswith("-m") or word == "-" or not word.startswith("-"):
      return argv[:i], argv[i:]
    name = word.partition("=")[0]
    takes_value = ("=" not in word and name.startswith("--")
                   and any(option.startswith(name) for option in _VALUE_OPTIONS))
    i += 2 if takes_value else 1
  return argv, []


def _ranks(ranks) -> str:
  """"rank 3" or "ranks 0, 1"."""
  ranks = sorted(ranks)
  return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _exit_status(returncode: int) -> int:
  """A child's return code as a shell's status: 128+N for a process killed by signal N."""
  return returncode if returncode >= 0 else 128 - returncode


def _how(returncode: int) -> str:
  """How a rank ended: "exited with 3", "was killed by SIGSEGV (exit status 139)"."""
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:  # e.g. a real-time signal
      name = f"signal {-returncode}"
    return f"was killed by {name} (exit status {_exit_status(returncode)})"
  return f"exited with {returncode}"


def _say(text: str) -> None:
  sys.stderr.write(f"jaxoverlap.launch: {text}\n")
  sys.stderr.flush()


def _watch(procs: list[subprocess.Popen], ended: queue.SimpleQueue, timeout_s: float,
           marks: dict[int, float] | None = None) -> int:
  """Waits until every rank ends, one fails or the time is up; returns the exit status.

  Each rank's reaper puts (rank, return code) on ``ended`` when the rank
  ends, so the first failure taken is the first that happened. The message
  names it and the ranks still running, which the caller then stops;
  failures that had already arrived are named too. Where ranks said they end
  after an uncaught exception (``marks``: when each said so, from its
  output), the first to say so is named as the cause: its peers' collectives
  fail when it ends, and one of them may end first. On a timeout (status
  124) the message lists the ranks still running.
  """
  marks = {} if marks is None else marks
  deadline = time.monotonic() + timeout_s if timeout_s else math.inf
  running = set(range(len(procs)))
  while running:
    try:
      rank, returncode = ended.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
    except queue.Empty:
      if time.monotonic() >= deadline:
        _say(f"timeout of {timeout_s:g} s; {_ranks(running)} still running; stopping "
             f"{'them' if len(running) > 1 else 'it'}")
        return 124
      continue
    running.discard(rank)
    if returncode == 0:
      continue
    time.sleep(_SETTLE_S)  # the output before a failed rank's exit reaches the pumps
    also = []  # ranks that had failed as well before the caller's stop: not by it
    while True:
      try:
        other, other_code = ended.get_nowait()
      except queue.Empty:
        break
      running.discard(other)
      if other_code != 0:
        also.append(f"rank {other} {_how(other_code)}")
    first = min(marks, key=marks.get) if marks else rank
    cause = (f"rank {rank} {_how(returncode)}" if first == rank else
             f"rank {first} failed first, with an uncaught exception (its traceback is above); "
             f"rank {rank} {_how(returncode)}")
    _say(cause + (f"; stopping {_ranks(running)}" if running else ""))
    if also:
      _say(f"after rank {rank}: {'; '.join(also)}")
    return _exit_status(returncode)
  return 0


class _Signalled(Exception):
  """SIGTERM or SIGHUP reached the launcher (raised in the main thread by its handler)."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


def _raise_signalled(signum, frame) -> None:
  del frame
  raise _Signalled(signum)


def main(argv: list[str] | None = None) -> int:
  """``python -m jaxoverlap.launch``: runs a script in N local processes, one GPU each.

  Args:
    argv: the command line after the program name (None: ``sys.argv[1:]``);
      ``--help`` lists the options.

  Returns:
    The exit status: 0 when every rank succeeded, else the first failure's
    (128 + N for a rank killed by signal N; 124 on ``--timeout_s``).

  Raises:
    SystemExit: bad arguments (argparse's usage error, status 2) or ``--help``.
  """
  parser = argparse.ArgumentParser(
      prog="python -m jaxoverlap.launch",
      description="Run a script in N local processes, one GPU each, and give each what\n"
                  "jaxoverlap.launch.initialize_from_env() needs to join one jax.distributed job.",
      epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--nproc", type=int, required=True, help="number of processes (GPUs)")
  parser.add_argument("--share_gpu", action="store_true",
                      help="all processes use GPU 0 (correctness checks of jaxoverlap's "
                           "kernels on a 1-GPU machine; never for timing; NCCL, behind XLA's "
                           "own collectives, refuses two processes on one GPU)")
  parser.add_argument("--num_gpus", type=int, default=None,
                      help="GPUs to spread the processes over, rank %% num_gpus, at least 1 "
                           "(default: one GPU per process); more processes than GPUs is for "
                           "correctness checks only, never for timing")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  parser.add_argument("--timeout_s", type=_timeout_seconds, default=0.0,
                      help="kill all processes after this many seconds (0: no limit)")
  parser.add_argument("--wrapper", default="",
                      help="command put in front of python in every process, e.g. "
                           "'compute-sanitizer --tool memcheck'")
  parser.add_argument("-m", dest="module", metavar="MODULE", default=None,
                      help="run a module (like python -m) instead of a script; only before "
                           "the script")
  parser.add_argument("script", nargs="?", help="Python script (omit with -m)")
  parser.add_argument("args", nargs=argparse.REMAINDER,
                      help="the script's (or module's) arguments")
  argv = list(sys.argv[1:] if argv is None else argv)
  # Everything from the script or "-m MODULE" on belongs to it (python's
  # convention), also options that look like the launcher's own.
  options, target = _split_target(argv)
  a = parser.parse_args(options)
  if target and target[0].startswith("-m"):
    module, rest = (target[0][2:], target[1:]) if target[0] != "-m" else (
        target[1] if len(target) > 1 else "", target[2:])
    if not module:
      parser.error("argument -m: expected a module name")
    target = ["-m", module] + rest
  if not target:
    parser.error("give a script or -m module")
  if a.nproc < 1:
    parser.error(f"--nproc must be >= 1, got {a.nproc}")
  if a.num_gpus is not None and a.num_gpus < 1:
    parser.error(f"--num_gpus must be >= 1, got {a.num_gpus}")
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if (not a.share_gpu and a.num_gpus is None and a.nproc > 1
      and (not platforms or "cuda" in platforms or "gpu" in platforms)):
    # One GPU a process: ranks past the GPUs would fail in JAX's CUDA start-up with "no
    # supported devices". No driver (a CPU machine) or JAX_PLATFORMS=cpu: nothing to check.
    gpus = _driver_gpu_count()
    if gpus and gpus < a.nproc:
      seen = ("" if "CUDA_VISIBLE_DEVICES" not in os.environ else
              f" within CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}")
      parser.error(f"--nproc {a.nproc} gives each process a GPU of its own, but the driver shows "
                   f"{gpus} GPU{'s' if gpus > 1 else ''}{seen}; use --nproc {gpus}, or --num_gpus "
                   f"{gpus} or --share_gpu to run several processes on a GPU (correctness "
                   "checks only, never timing)")

  # A job step's tasks (srun), not a batch script's one process (sbatch --ntasks=N sets
  # SLURM_NTASKS there too, but no step).
  tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "").strip()
  if not tasks and os.environ.get("SLURM_STEP_ID", "batch") != "batch":
    tasks = os.environ.get("SLURM_NTASKS", "").strip()
  if tasks.isdigit() and int(tasks) > 1:
    # The ranks take the launcher's variables over SLURM's: each task of the step would run
    # its own job of --nproc processes on the same GPUs.
    _say(f"WARNING: this is one of {tasks} tasks of a SLURM job step: under srun every task "
         f"runs this launcher, and each starts a job of its own ({a.nproc} processes); under "
         "SLURM start the script itself, one task per GPU (srun --ntasks-per-node=<gpus> python "
         "script.py)")
  port = a.port or free_port()
  cmd = shlex.split(a.wrapper) + [sys.executable] + target
  procs: list[subprocess.Popen] = []
  pumps = []
  ended: queue.SimpleQueue = queue.SimpleQueue()
  marks: dict[int, float] = {}  # rank -> when it said it ends after an uncaught exception
  # SIGTERM (kill, timeout, CI, scancel) and SIGHUP stop the ranks as Ctrl-C does:
  # each rank runs in its own session, so nothing else would reach it.
  saved = {}  # the handlers to put back (only the main thread can set them)
  if threading.current_thread() is threading.main_thread():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s in (signal.SIGTERM, signal.SIGHUP):
      signal.signal(s, _raise_signalled)
  try:
    try:
      for rank in range(a.nproc):
        env = dict(os.environ)
        env.update({
            _ENV_PREFIX + "COORDINATOR": f"127.0.0.1:{port}",
            _ENV_PREFIX + "NUM_PROCESSES": str(a.nproc),
            _ENV_PREFIX + "PROCESS_ID": str(rank),
            _ENV_PREFIX + "LOCAL_DEVICE": ("0" if a.share_gpu else
                                           str(rank % a.num_gpus) if a.num_gpus else str(rank)),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a crash prints the Python stack
        })
        env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        if a.share_gpu or (a.num_gpus and a.num_gpus < a.nproc):
          env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(round(0.6 / a.nproc, 3)))
        try:
          p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
        except OSError as e:  # e.g. a --wrapper that is not installed
          raise _StartFailed(f"cannot start rank {rank}: {shlex.join(cmd)}: "
                             f"{e.strerror or e}") from None
        procs.append(p)
        threading.Thread(target=_reap, args=(p, rank, ended), daemon=True).start()
        t = threading.Thread(target=_pump, args=(p.stdout, rank, sys.stdout, marks),
                             daemon=True)
        t.start()
        pumps.append(t)
      code = _watch(procs, ended, a.timeout_s, marks)
    except _StartFailed as e:
      _say(str(e) + (f"; stopping {_ranks(range(len(procs)))}" if procs else ""))
      code = 127  # the shell's "command not found"
    except (KeyboardInterrupt, _Signalled) as e:
      _ignore(saved)
      signum = e.signum if isinstance(e, _Signalled) else signal.SIGINT
      running = [rank for rank, p in enumerate(procs) if p.poll() is None]
      _say(f"got {signal.Signals(signum).name}"
           + (f"; stopping {_ranks(running)}" if running else ""))
      code = 128 + signum
  finally:  # also on an unexpected error: no rank outlives the launcher
    _ignore(saved)
    _stop(procs)  # the ranks still running, after a failure, a timeout or a signal
    for s, handler in saved.items():
      if handler is not None:  # None: set outside Python, cannot be put back
        signal.signal(s, handler)
  for p in procs:
    p.wait()
  for t in pumps:  # drain what the processes printed before they ended
    t.join(timeout=5.0)
  return code


class _StartFailed(Exception):
  """A rank's process could not be started (the message says which and why)."""


def _ignore(saved) -> None:
  """From here the launcher stops the ranks; a second signal must not cut that short (<= 5 s)."""
  for s in saved:
    signal.signal(s, signal.SIG_IGN)


def _stop(procs, grace_s: float = 5.0) -> None:
  """SIGTERM to every running rank's process group, SIGKILL to those left after ``grace_s``."""
  for p in procs:
    if p.poll() is None:
      _kill_group(p, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for p in procs:
    while p.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    if p.poll() is None:
      _kill_group(p, signal.SIGKILL)


def _kill_group(p: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(p.pid, sig)
  except ProcessLookupError:  # it ended (and its group with it) since it was polled
    pass


if __name__ == "__main__":
  sys.exit(main())
