"""Starts one process per GPU with jax.distributed (and jaxoverlap) set up.

Usage:
  python -m jaxoverlap.launch --nproc 2 examples/train/main.py --distributed ...
  python -m jaxoverlap.launch --nproc 2 --share_gpu -m pytest tests/gpu/ranks/rank_all_reduce.py \
      --confcutdir tests/gpu/ranks

Each child gets ``JAXOVERLAP_COORDINATOR``, ``JAXOVERLAP_NUM_PROCESSES``,
``JAXOVERLAP_PROCESS_ID`` and ``JAXOVERLAP_LOCAL_DEVICE`` in its environment,
and calls ``initialize_from_env()``. Under SLURM (``srun``, one task per GPU)
no launcher is needed: ``initialize_from_env()`` reads SLURM's variables and
``jax.distributed.initialize`` finds the coordinator itself.

The launcher prefixes each line of output with the rank, stops the others when
one fails, and exits with the first non-zero exit code.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["main", "initialize_from_env", "slurm_local_devices", "free_port"]

_ENV_PREFIX = "JAXOVERLAP_"


def free_port() -> int:
  """A TCP port that was free a moment ago (bind to port 0)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launched() -> bool:
  """True when this process was started by the launcher, or by SLURM as one of several tasks."""
  env = os.environ
  return _ENV_PREFIX + "COORDINATOR" in env or (
      "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1)


# Settings that change what a run measures; recorded in results' commands.
SETTINGS = ("FUSED_CMD_BUFFER", "GEMM_ALIGNMENT_CAP", "OVERLAP_HEAP_BYTES", "HEAP_BYTES",
            "RANKS_PER_NODE", "FORCE_NVSHMEM_PUT", "TUNING_FILE", "NET_ALPHA_US",
            "NET_BETA_GBPS", "TIMEOUT_S",
            # the kernels' measurement knobs (docs/design.md)
            "LAMPORT_BLOCKS_PER_SM", "LAMPORT_BLOCK_BYTES", "LAMPORT_MAX_BLOCKS",
            "LAMPORT_POLL_NS", "NORM_CLUSTER", "EPOCH_AT_START", "HIERARCHICAL_LL")


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
    are set in the environment.
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


def _driver_gpu_count() -> int | None:
  """GPUs the CUDA driver shows this process (within CUDA_VISIBLE_DEVICES), or None."""
  import ctypes

  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return None
  count = ctypes.c_int(0)
  if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
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

  Args:
    env: the environment (default ``os.environ``).
    visible_gpus: GPUs this task sees (default: from ``CUDA_VISIBLE_DEVICES``,
      else from the CUDA driver).

  Returns:
    The ids, or None where no GPU is seen (JAX's default placement).

  Raises:
    RuntimeError: the task sees several GPUs but fewer than its local id
      needs, so the placement is ambiguous; the message says what it saw.
  """
  env = os.environ if env is None else env
  if _slurm_tasks_on_node(env) == 1:
    if visible_gpus is None and "CUDA_VISIBLE_DEVICES" in env:
      visible_gpus = len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()])
    if visible_gpus is None:
      visible_gpus = _driver_gpu_count()
    return list(range(visible_gpus)) if visible_gpus else None
  local = int(env.get("SLURM_LOCALID", "0") or 0)
  if "CUDA_VISIBLE_DEVICES" not in env:
    return [local]
  visible = [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
  if len(visible) == 1:
    return [0]
  if local < len(visible):
    return [local]
  raise RuntimeError(
      f"jaxoverlap.launch: SLURM task {local} of {_slurm_tasks_on_node(env)} on this node sees "
      f"{len(visible)} GPUs (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}), so it "
      f"cannot take GPU {local}; run one task per GPU with srun --gpus-per-task=1, or one task "
      "per node")


def initialize_from_env(
    *, nvshmem: bool | None = None, heap_bytes: int | None = None
) -> dict[str, Any]:
  """Initialises jax.distributed (and the CUDA kernels' runtime) for this process.

  The CUDA kernels' runtime is NVSHMEM, or CUDA peer access in one process
  (``jaxoverlap.initialize`` picks it from the GPUs the process drives).

  Reads the launcher's ``JAXOVERLAP_*`` variables, or SLURM's
  (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the tasks per node
  and ``CUDA_VISIBLE_DEVICES``: see ``slurm_local_devices``). With neither, the
  process runs alone and jax.distributed is left untouched.

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
    ``runtime`` (``jaxoverlap.runtime_info()``).

  Raises:
    RuntimeError: ``nvshmem=True`` but the CUDA backend cannot start; or a
      SLURM placement that names no GPU this task sees.
    ValueError: ``jaxoverlap.initialize`` refuses a setting of the
      environment, e.g. a ``JAXOVERLAP_TIMEOUT_S`` or
      ``JAXOVERLAP_INIT_TIMEOUT_S`` that is not a positive, finite number.
  """
  import jax

  env = os.environ
  out: dict[str, Any] = {"process_id": 0, "num_processes": 1, "local_device": None}
  if _ENV_PREFIX + "COORDINATOR" in env:
    pid = int(env[_ENV_PREFIX + "PROCESS_ID"])
    nproc = int(env[_ENV_PREFIX + "NUM_PROCESSES"])
    local = int(env[_ENV_PREFIX + "LOCAL_DEVICE"])
    jax.distributed.initialize(
        coordinator_address=env[_ENV_PREFIX + "COORDINATOR"],
        num_processes=nproc,
        process_id=pid,
        local_device_ids=[local],
    )
    out.update(process_id=pid, num_processes=nproc, local_device=local)
  elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
    local = slurm_local_devices(env)
    jax.distributed.initialize(local_device_ids=local)
    out.update(process_id=jax.process_index(), num_processes=jax.process_count(),
               local_device=local[0] if local is not None and len(local) == 1 else None)

  if nvshmem is None:
    from jaxoverlap import _ffi

    nvshmem = jax.default_backend() == "gpu" and _ffi.unavailable_reason() is None
  if nvshmem:
    from jaxoverlap import runtime

    out["runtime"] = runtime.initialize(heap_bytes)
  return out


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


def _pump(stream, rank: int, sink) -> None:
  for raw in iter(stream.readline, b""):
    sink.write(f"[rank {rank}] {raw.decode(errors='replace')}")
    sink.flush()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m jaxoverlap.launch",
      description="Run a script in N local processes, one GPU each, with jax.distributed set up.")
  parser.add_argument("--nproc", type=int, required=True, help="number of processes (GPUs)")
  parser.add_argument("--share_gpu", action="store_true",
                      help="all processes use GPU 0 (correctness checks on a 1-GPU machine; "
                           "never for timing)")
  parser.add_argument("--num_gpus", type=int, default=0,
                      help="GPUs to spread the processes over, rank %% num_gpus (default: one "
                           "GPU per process); more processes than GPUs is for correctness "
                           "checks only, never for timing")
  parser.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
  parser.add_argument("--timeout_s", type=_timeout_seconds, default=0.0,
                      help="kill all processes after this many seconds (0: no limit)")
  parser.add_argument("--wrapper", default="",
                      help="command put in front of python in every process, e.g. "
                           "'compute-sanitizer --tool memcheck'")
  parser.add_argument("-m", dest="module", default=None,
                      help="run a module (like python -m) instead of a script")
  parser.add_argument("script", nargs="?", help="Python script (omit with -m)")
  parser.add_argument("args", nargs=argparse.REMAINDER)
  argv = list(sys.argv[1:] if argv is None else argv)
  # Everything after "-m MODULE" belongs to the module (python -m's convention),
  # also options that look like the launcher's own.
  module_args: list[str] | None = None
  if "-m" in argv and argv.index("-m") + 1 < len(argv):
    i = argv.index("-m")
    argv, module_args = argv[:i + 2], argv[i + 2:]
  a = parser.parse_args(argv)
  if module_args is not None:
    a.args = ([a.script] if a.script else []) + a.args + module_args
    a.script = None
  if a.module is None and a.script is None:
    parser.error("give a script or -m module")
  if a.nproc < 1:
    parser.error(f"--nproc must be >= 1, got {a.nproc}")

  port = a.port or free_port()
  if a.module is not None:
    target = ["-m", a.module] + a.args
  else:
    target = [a.script] + a.args
  cmd = shlex.split(a.wrapper) + [sys.executable] + target
  procs, pumps = [], []
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
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    t = threading.Thread(target=_pump, args=(p.stdout, rank, sys.stdout), daemon=True)
    t.start()
    pumps.append(t)
    procs.append(p)

  start = time.monotonic()
  code = 0
  try:
    while [p.poll() for p in procs].count(None):  # poll every process, every round
      failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
      timed_out = a.timeout_s and time.monotonic() - start > a.timeout_s
      if failed or timed_out:
        code = failed[0] if failed else 124
        if failed and code < 0:
          why = f"a process was killed by {signal.Signals(-code).name}"
        elif failed:
          why = f"a process exited with {code}"
        else:
          why = f"timeout of {a.timeout_s} s"
        sys.stderr.write(f"jaxoverlap.launch: {why}; stopping the others\n")
        _stop(procs)
        break
      time.sleep(0.1)
  except KeyboardInterrupt:
    _stop(procs)
    code = 130
  for p in procs:
    p.wait()
  for t in pumps:  # drain what the processes printed before they ended
    t.join(timeout=5.0)
  if code == 0:
    code = next((p.returncode for p in procs if p.returncode), 0)
  return code


def _stop(procs, grace_s: float = 5.0) -> None:
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for p in procs:
    while p.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
  sys.exit(main())
