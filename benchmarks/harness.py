"""The harness every benchmark script shares: flags, set-up, impl names, checks, timing, results.

Problem:
  Each benchmark times implementations of one op (or of a whole model step)
  against a baseline, on one process per GPU, and writes a results file that
  later runs, plots and analyses load and pool. Flags, the process set-up,
  the names of the implementations, the correctness check before timing, the
  timer and the results file must mean the same in every script.

Algorithm:
  * Flags (``define_flags``): the shared absl flags (``--out``,
    ``--machine``, ``--dtype``, ``--reps``, ...) are defined here once, with
    each script's own defaults.
  * Set-up (``start``): ``jaxoverlap.launch.initialize_from_env``, a 1-D
    mesh over every device, rank 0's log and the topology;
    ``use_host_devices`` simulates CPU devices for smoke runs.
  * Impl names (``impl_kwargs``): the one mapping from the ``impl`` strings
    of the results files (``"jaxoverlap:one_shot_ll"``,
    ``"jaxoverlap:copy_engine/c2"``, ``"jaxoverlap:gemm_all_reduce"``,
    ``"xla:naive"``, decode's ``"jaxoverlap:cuda:auto"``, ...) to the keyword
    arguments of the public ops (backend, algorithm, protocol, transport,
    chunks).
  * Checks (``close``): an implementation is compared with the pure-JAX
    reference on every element of every rank before it is timed; one that
    fails is recorded as rejected and never gets a time.
  * Timing: the chain method of ``jaxoverlap.tuning.timing`` (a chain of ops
    in one jit minus the same chain without them; ``time_chains_us`` for
    several ops at once, interleaved); ``time_interleaved`` (several calls
    timed in turn, rep by rep, so that drift hits all alike; from
    ``jaxoverlap.tuning.timing``) where a script builds its own calls.
  * What ran (``plan_fields``, ``auto_choices``, ``fused_choices``,
    ``resolved_backends``): from the plans of ``jaxoverlap.decisions()``.
  * Results (``write_result``): the results format of
    ``jaxoverlap.tuning.results`` (``make_result``; latency tables saved and
    validated by ``save_result``), with the package versions and
    ``jaxoverlap.launch.reproduce_command``.

Example:
  >>> import harness
  >>> harness.define_flags("out", "machine", "dtype", reps=20)
  >>> run = harness.start("x")                         # in main()
  >>> harness.impl_kwargs("all_reduce", "jaxoverlap:one_shot_ll")
  {'backend': 'cuda', 'algorithm': 'one_shot', 'protocol': 'll'}
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.append(_ROOT)  # this checkout's jaxoverlap where none is installed

from jaxoverlap import names  # noqa: E402
from jaxoverlap.tuning import results  # noqa: E402
from jaxoverlap.tuning.timing import time_interleaved  # noqa: E402,F401  (benchmarks use it)

# ------------------------------------------------------------------ impl names

PSUM = "xla:psum"                  # lax.psum (all_reduce, decode)
PSUM_GRAPHS = "xla:psum_graphs"    # lax.psum with COLLECTIVES in XLA's command buffers
NAIVE = "xla:naive"                # the fused ops' xla collective next to one GEMM
PPERMUTE = "xla:ppermute"          # the fused ops' xla ppermute ring
LOCAL_GEMM = "xla:local_gemm"      # the per-rank GEMM alone: the floor of the fused ops
COLLECTIVE = "xla:collective"      # the collective alone
WINDOWED = "xla:windowed_einsum"   # XLA's SPMD partitioner under its windowed-einsum flags
GEMM_ALL_REDUCE = "jaxoverlap:gemm_all_reduce"  # matmul_all_reduce's "unfused" algorithm
LAUNCH_FLOOR = "floor:launch"      # one kernel launch, no communication
NO_ALL_REDUCE = "floor:no_all_reduce"  # a model step with its all-reduces left out
AUTO = "jaxoverlap:auto"

_XLA_ALGORITHMS = {NAIVE: names.COLLECTIVE, PPERMUTE: names.PPERMUTE}


def impl_kwargs(op: str, impl: str) -> dict[str, Any]:
  """The keyword arguments of the public op ``op`` that an ``impl`` string names.

  The one mapping from the impl names of the results files to the ops' new
  keywords:

  ============================================ ===========================================
  impl                                         keyword arguments
  ============================================ ===========================================
  ``jaxoverlap:auto`` (all_reduce)             backend "cuda", algorithm "auto"
  ``jaxoverlap:<alg>[_<protocol>]``            backend "cuda", algorithm, protocol
  ``jaxoverlap:<backend>:<alg>[_<protocol>]``  decode's form: backend, algorithm, protocol
  ``xla:psum`` (all_reduce)                    backend "xla", algorithm "collective"
  ``jaxoverlap:<transport>[/c<k>]``            backend "cuda", algorithm "fused",
                                               transport, chunks k
  ``jaxoverlap:gemm_all_reduce``               backend "cuda", algorithm "unfused"
  ``xla:naive``, ``xla:ppermute`` (GEMM ops)   backend "xla", algorithm "collective" or
                                               "ppermute"
  ============================================ ===========================================

  Args:
    op: one of ``jaxoverlap.names.OPS``.
    impl: the impl string.

  Returns:
    ``{"backend", "algorithm"}`` and, where named, ``"protocol"``,
    ``"transport"``, ``"chunks"``.

  Raises:
    ValueError: a name that is no call of ``op`` (the baselines
    ``xla:local_gemm``, ``xla:collective``, ``xla:windowed_einsum`` and the
    floors are not calls of the op).
  """
  lib, _, name = impl.partition(":")
  if op == names.ALL_REDUCE:
    if impl == PSUM:
      return {"backend": names.XLA, "algorithm": names.COLLECTIVE}
    backend, sep, rest = name.partition(":")
    backend, name = (backend, rest) if sep else (names.CUDA, name)
    parsed = results.parse_impl(f"jaxoverlap:{name}")
    if name == names.AUTO or names.backend_of_algorithm(op, name) is not None:
      out = {"backend": backend, "algorithm": name}
    elif parsed is not None and parsed[0] != results.PSUM:
      out = {"backend": backend, "algorithm": parsed[0], "protocol": parsed[1]}
    else:
      out = None
    owner = out and names.backend_of_algorithm(op, out["algorithm"])
    if lib == "jaxoverlap" and out and backend in names.BACKENDS and (
        owner is None or backend in (names.AUTO, owner)):
      return {k: v for k, v in out.items() if v is not None}
  elif op in names.FUSED_OPS:
    if impl in _XLA_ALGORITHMS:
      return {"backend": names.XLA, "algorithm": _XLA_ALGORITHMS[impl]}
    transport, slash, chunks = name.partition("/")
    if impl == GEMM_ALL_REDUCE and op == names.MATMUL_ALL_REDUCE:
      return {"backend": names.CUDA, "algorithm": names.UNFUSED}
    if lib == "jaxoverlap" and transport in names.transports(op):
      out = {"backend": names.CUDA, "algorithm": names.FUSED, "transport": transport}
      if not slash:
        return out
      if chunks[:1] == "c" and chunks[1:].isdigit() and int(chunks[1:]) >= 1:
        return dict(out, chunks=int(chunks[1:]))
  raise ValueError(f"unknown impl {impl!r} for {op}; see benchmarks/harness.py impl_kwargs")


def all_reduce_fn(impl: str, axis: str) -> Callable:
  """The per-rank function (inside ``shard_map``) of an all-reduce impl.

  ``xla:psum`` and ``xla:psum_graphs`` are ``lax.psum`` (the second is
  compiled with ``compile_options``); ``floor:launch`` one kernel launch that
  copies ``x`` (not an all-reduce); every other name ``jaxoverlap.all_reduce``
  with ``impl_kwargs``.
  """
  import jax

  import jaxoverlap

  if impl in (PSUM, PSUM_GRAPHS):
    return lambda y: jax.lax.psum(y, axis)
  if impl == LAUNCH_FLOOR:
    from jaxoverlap import _cuda

    return _cuda.launch_floor
  kw = impl_kwargs(names.ALL_REDUCE, impl)
  return lambda y: jaxoverlap.all_reduce(y, axis, **kw)


CMDBUF = "xla_gpu_enable_command_buffer"
# XLA's default command-buffer types (jaxlib 0.11/0.12), where the options proto cannot be read.
_DEFAULT_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "DYNAMIC_SLICE_FUSION",
                  "CONDITIONAL")


def default_command_buffer_types() -> list[str]:
  """The command-buffer types this process compiles with (jaxlib's defaults, or XLA_FLAGS').

  An empty list where ``XLA_FLAGS`` turned command buffers off; the known
  defaults (``_DEFAULT_TYPES``) only where the options cannot be read.
  """
  try:  # the defaults are only printed by the options proto
    from jax._src.lib import xla_client

    options = xla_client._xla.CompileOptions()  # noqa: SLF001 (held: the views below borrow it)
    build = options.executable_build_options
    text = str(build.debug_options)
  except Exception:  # noqa: BLE001 (a private API: fall back to the known list)
    return list(_DEFAULT_TYPES)
  if "xla_gpu_" not in text:  # not the options it used to print: cannot tell
    return list(_DEFAULT_TYPES)
  return [line.split(":", 1)[1].strip() for line in text.splitlines()
          if line.strip().startswith(CMDBUF + ":")]


def compile_options(impl: str) -> dict[str, Any] | None:
  """The XLA options an impl's program is compiled with, where not XLA's defaults.

  ``xla:psum_graphs`` and any impl ending in ``/graphs`` (e.g.
  ``xla:psum+norm/graphs``): XLA's default command-buffer types plus
  ``COLLECTIVES``, so that psum runs inside XLA's CUDA graphs as our
  command-buffer-compatible custom calls do (by default each psum splits the
  graphs). The option replaces XLA's list, so the list in force is named with
  it. Where ``XLA_FLAGS`` turned command buffers off, the impl runs without
  them too, as our custom calls then do: ``{CMDBUF: ""}``.
  """
  if impl == PSUM_GRAPHS or impl.endswith("/graphs"):
    types = [t for t in default_command_buffer_types() if t]
    return {CMDBUF: ",".join(sorted(set(types) | {"COLLECTIVES"})) if types else ""}
  return None


def parse_bytes(text: str) -> int:
  """``"4K"`` -> 4096 (``jaxoverlap.tuning.results.parse_bytes``)."""
  from jaxoverlap.tuning.results import parse_bytes as parse

  return parse(text)


def parse_ints(flag: str, values: str | Iterable[str]) -> list[int]:
  """The integers of a list flag (``values``: its list, or its comma-separated text).

  Raises:
    ValueError: naming ``--<flag>`` and the value that is no integer.
  """
  items = values.split(",") if isinstance(values, str) else list(values)
  out = []
  for v in items:
    try:
      out.append(int(str(v).strip()))
    except ValueError:
      raise ValueError(f"--{flag}: {str(v).strip()!r} is not an integer (want comma-separated "
                       "integers)") from None
  return out


def short_name(impl: str) -> str:
  """``"jaxoverlap:copy_engine/c4"`` -> ``"copy_engine/c4"``, ``"xla:naive"`` -> ``"naive"``."""
  return impl.split(":", 1)[1]


# ------------------------------------------------------------------ flags

_FLAGS = {
    "out": ("string", "benchmarks/results", "folder for the results (JSON, and the PNG where "
            "the script draws one)"),
    "machine": ("string", None, "machine name for the results (spaces become _ in the file "
                "names). Default: from the devices, e.g. '2x cpu' or '4x H200' "
                "(harness.machine_name)"),
    "dtype": ("string", "bfloat16", "element type"),
    "impls": ("list", [], "implementations to run (default: all of the script's)"),
    "chain": ("integer", 50, "ops per jit'd chain"),
    "reps": ("integer", 30, "timed runs per implementation (median reported)"),
    "warmup": ("integer", 2, "untimed runs per implementation before timing"),
    "seed": ("integer", 0, "random inputs and weights"),
    "merge": ("bool", False, "keep the rows of an existing results file that this run does "
              "not measure (a full run split over several invocations)"),
    "host_devices": ("integer", 0, "simulate this many CPU devices where jax runs on CPU "
                     "(set before jax starts; a count already in XLA_FLAGS is kept)"),
    "mesh": ("string", None, "dp,tp mesh shape, e.g. '1,2' (-1: the remaining devices). "
             "Default: the preset's"),
    "distributed": ("bool", None, "multi-process run: jaxoverlap.launch.initialize_from_env() "
                    "first (default: when the launcher's JAXOVERLAP_* variables are set)"),
}


def flag_module() -> str:
  """The module absl lists flags under when the caller of the calling function defines them.

  A script's flags, its own or borrowed from another module, belong under the script's
  ``--help`` (``--helpshort``), not only under ``--helpfull``: for a caller that runs as
  ``__main__`` this is the script's path (absl's key for the main module), else the caller's
  module name.
  """
  caller = sys._getframe(2).f_globals.get("__name__", "")  # pylint: disable=protected-access
  return sys.argv[0] if caller == "__main__" else caller


def define_flags(*shared: str, **defaults: Any) -> None:
  """Defines shared absl flags: ``shared`` with the defaults above, ``defaults`` with others.

  Args:
    *shared: flag names of this module, defined with its defaults.
    **defaults: flag name -> default, or -> ``(default, help)`` for a help
      text of the script's own.

  Raises:
    KeyError: a name this module does not define.
  """
  from absl import flags

  from jaxoverlap import launch

  module = flag_module()
  for name in shared + tuple(defaults):
    kind, default, helptext = _FLAGS[name]
    if name in defaults:
      value = defaults[name]
      default, helptext = value if isinstance(value, tuple) else (value, helptext)
    if name == "distributed" and default is None:
      default = launch.launched()
    getattr(flags, f"DEFINE_{kind}")(name, default, helptext, module_name=module)


def require_one_gpu(script: str) -> None:
  """Exits with a message unless this is one process on one NVIDIA GPU (the one-GPU probes)."""
  import jax

  if jax.default_backend() != "gpu" or jax.process_count() != 1 or jax.local_device_count() != 1:
    raise SystemExit(f"{script}: needs one process on one NVIDIA GPU (set CUDA_VISIBLE_DEVICES "
                     "to one GPU)")


def one_gpu_machine(machine: str | None) -> tuple[str, str]:
  """(the device kind, the machine name: ``machine``, or "1x <kind>") of a one-GPU run."""
  import jax

  kind = jax.devices()[0].device_kind
  return kind, machine or f"1x {kind.removeprefix('NVIDIA ')}"


def _nvidia_smi(*args: str) -> str | None:
  """``nvidia-smi <args>``'s output, or None where it is missing or fails (10 s at most)."""
  import subprocess

  try:
    out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout if out.returncode == 0 else None


def host_gpus() -> list[dict[str, str]]:
  """The GPUs of this host as nvidia-smi lists them (all of them, whatever is visible).

  Returns:
    One ``{"index", "name", "uuid", "pci_bus_id", "driver", "memory_total",
    "max_sm_clock", "sm_clock", "power_limit"}`` per GPU (nvidia-smi's
    strings, units included); [] without nvidia-smi.
  """
  fields = ("index", "name", "uuid", "pci.bus_id", "driver_version", "memory.total",
            "clocks.max.sm", "clocks.sm", "power.limit")
  keys = ("index", "name", "uuid", "pci_bus_id", "driver", "memory_total", "max_sm_clock",
          "sm_clock", "power_limit")
  out = _nvidia_smi(f"--query-gpu={','.join(fields)}", "--format=csv,noheader")
  rows = [[v.strip() for v in line.split(",")] for line in (out or "").splitlines() if line]
  return [dict(zip(keys, row)) for row in rows if len(row) == len(keys)]


def parse_topology(text: str) -> dict[tuple[int, int], str]:
  """The GPU-to-GPU links of ``nvidia-smi topo -m``: {(i, j): "NV18", "SYS", ...}, i != j."""
  import re

  lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text.splitlines()]
  header = next((line.split() for line in lines if re.match(r"\s*GPU\d+\b", line)
                 and line.startswith((" ", "\t"))), [])
  columns = [int(t[3:]) for t in header if re.fullmatch(r"GPU\d+", t)]
  links = {}
  for line in lines:
    tokens = line.split()
    if not tokens or not re.fullmatch(r"GPU\d+", tokens[0]) or line.startswith((" ", "\t")):
      continue
    i = int(tokens[0][3:])
    for j, link in zip(columns, tokens[1:1 + len(columns)]):
      if i != j:
        links[(i, j)] = link
  return links


def _bus_id(text: str) -> str:
  """A PCI bus id as "dddd:bb:dd.f" (nvidia-smi writes an 8-digit domain, CUDA a 4-digit one)."""
  parts = text.strip().lower().split(":")
  if len(parts) != 3:
    return text.strip().lower()
  return f"{int(parts[0] or '0', 16):04x}:{parts[1]}:{parts[2]}"


def _cuda_bus_ids(ordinals: Sequence[int]) -> list[str | None]:
  """The PCI bus ids of CUDA devices by ordinal (within CUDA_VISIBLE_DEVICES), via the driver."""
  import ctypes

  from jaxoverlap import launch

  cuda = launch._cuda_driver()
  if cuda is None:
    return [None] * len(ordinals)
  out = []
  for ordinal in ordinals:
    dev, buf = ctypes.c_int(0), ctypes.create_string_buffer(64)
    ok = (cuda.cuDeviceGet(ctypes.byref(dev), int(ordinal)) == 0
          and cuda.cuDeviceGetPCIBusId(buf, 64, dev) == 0)
    out.append(_bus_id(buf.value.decode()) if ok else None)
  return out


# (host, PCI bus id) of every device of the run, in device order, from start(): which
# physical GPUs the processes share; None where not gathered (machine_name falls back).
_RUN_GPUS: list[tuple[str, str | None]] | None = None


def _gather_run_gpus() -> None:
  """Every process's (host, PCI bus id) per local GPU, into ``_RUN_GPUS`` (all must call)."""
  global _RUN_GPUS
  import socket

  import jax

  local = jax.local_devices()
  if local[0].platform != "gpu":
    return
  ordinals = [getattr(d, "local_hardware_id", None) for d in local]
  buses = _cuda_bus_ids(ordinals) if None not in ordinals else [None] * len(local)
  mine = [[socket.gethostname(), b] for b in buses]
  _RUN_GPUS = [tuple(g) for every in gather_json(mine) for g in every]


def refuse_shared_gpus() -> None:
  """Exits with a message where two processes of the run drive one GPU (``--share_gpu``).

  NCCL, behind ``lax.psum`` (the benchmarks' baselines, the barrier before
  each timed run, the training example's collectives), refuses two ranks on
  one GPU ("Duplicate GPU detected"), after waiting 60 s for a communicator
  at every collective; and processes that share a GPU time nothing worth
  keeping. Every process runs the same check on the same gathered data, so
  all of them exit together. Nothing happens where the GPUs are unknown.

  Raises:
    SystemExit: two processes drive one GPU; the message names them.
  """
  import jax

  if not _RUN_GPUS:
    return
  first: dict[tuple[str, str], int] = {}
  for dev, (host, bus) in zip(jax.devices(), _RUN_GPUS):
    if bus is None:
      continue
    owner = first.setdefault((host, bus), dev.process_index)
    if owner != dev.process_index:
      script = os.path.basename(sys.argv[0]) or "benchmark"
      raise SystemExit(
          f"{script}: processes {owner} and {dev.process_index} both drive GPU {bus} on {host} "
          "(the launcher's --share_gpu or --num_gpus): NCCL, behind lax.psum (the baselines "
          "and the barrier before each timed run), refuses two processes on one GPU, and "
          "shared GPUs time nothing worth keeping; run one process per GPU")


def _one_host() -> bool:
  """Whether every process of this run is on this host (launcher, one SLURM node, one process)."""
  import jax

  env = os.environ
  coordinator = env.get("JAXOVERLAP_COORDINATOR", "")
  return (jax.process_count() == 1 or coordinator.startswith(("127.0.0.1:", "localhost:"))
          or env.get("SLURM_JOB_NUM_NODES") == "1")


def _used_gpu_indices(count: int) -> list[int | None]:
  """nvidia-smi indices of the first ``count`` GPUs this process is allowed to see."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is None:
    return list(range(count))
  ids = [v.strip() for v in visible.split(",") if v.strip()][:count]
  if all(v.isdigit() for v in ids):
    return [int(v) for v in ids]
  by_uuid = {g["uuid"]: int(g["index"]) for g in host_gpus() if g["index"].isdigit()}
  return [by_uuid.get(v) for v in ids]  # None where unknown (MIG, a UUID prefix): no link


def machine_name(given: str | None) -> str:
  """The machine name of a run's results: ``given`` if set, else one from the devices.

  Args:
    given: ``--machine`` (None or "": detect).

  Returns:
    ``given``, or ``f"{count}x {kind}"`` over every process's devices, kind
    the device kind without its "NVIDIA " prefix ("2x cpu", "4x H200"). On
    GPUs it adds what the devices do not tell. Processes sharing GPUs: "2x
    H200 on 1 GPU" (a correctness run, never a timing). Otherwise, on one
    host, the link every pair of the GPUs used has in ``nvidia-smi topo -m``
    ("2x H200 NV18"). The GPUs used are the PCI bus ids every process's CUDA
    driver gave ``start`` (``_RUN_GPUS``); where ``start`` did not gather
    them, the first ``count`` visible GPUs, and sharing is read from
    nvidia-smi listing fewer GPUs than there are devices.
  """
  if given:
    return given
  import jax

  devices = jax.devices()
  name = f"{len(devices)}x {devices[0].device_kind.removeprefix('NVIDIA ')}"
  if devices[0].platform != "gpu":
    return name
  if _RUN_GPUS and all(bus for _, bus in _RUN_GPUS):  # what each process's driver said
    distinct = set(_RUN_GPUS)
    if len(distinct) < len(devices):
      return f"{name} on {len(distinct)} GPU{'s' if len(distinct) > 1 else ''}"
    if len({host for host, _ in distinct}) > 1:
      return name
    index = {_bus_id(g["pci_bus_id"]): int(g["index"]) for g in host_gpus()
             if g["index"].isdigit()}
    return name + _common_link([index.get(bus) for _, bus in distinct])
  if not _one_host():
    return name
  gpus = len(host_gpus())
  if 0 < gpus < len(devices):
    return f"{name} on {gpus} GPU{'s' if gpus > 1 else ''}"
  return name + _common_link(_used_gpu_indices(len(devices)))


def _common_link(used: Sequence[int | None]) -> str:
  """" NV18" where every pair of the GPUs ``used`` (nvidia-smi indices) has that link, else ""."""
  if len(used) < 2 or None in used:
    return ""
  links = parse_topology(_nvidia_smi("topo", "-m") or "")
  kinds = {links.get((i, j)) for i in used for j in used if i != j}
  return f" {kinds.pop()}" if len(kinds) == 1 and None not in kinds else ""


# The environment variables a results file records (what changes how the ops or the
# baselines run): XLA's flags, NCCL's, NVSHMEM's, CUDA's, JAX's and jaxoverlap's.
_RECORDED_ENV = ("XLA_FLAGS", "NCCL_", "NVSHMEM_", "CUDA_", "JAX_", "JAXOVERLAP_")


def _git_commit() -> dict[str, Any] | None:
  """{"commit", "dirty", "tree", "subtrees"} of this checkout, or None outside one.

  ``dirty``: tracked files changed. ``tree``: git's tree hash of the files as
  they are (tracked, and untracked that git does not ignore), or None where
  git could not say. It equals ``git rev-parse <commit>^{tree}`` of the commit
  whose files ran, so ``git log --all --format='%H %T' | grep <tree>`` finds
  that commit even where the run's ``.git`` was older than its files (a
  working tree copied onto a test machine). Any untracked file changes it,
  results written into ``benchmarks/results`` among them: ``subtrees`` gives
  the hashes of the library's folders alone (``ffi``, ``jaxoverlap``; compare
  with ``git rev-parse <commit>:ffi``). Hashing stores the changed files'
  contents in ``.git`` as loose objects (``git gc`` prunes them).
  """
  import subprocess
  import tempfile

  try:
    head = subprocess.run(["git", "-C", _ROOT, "rev-parse", "HEAD"], capture_output=True,
                          text=True, timeout=10)
    status = subprocess.run(["git", "-C", _ROOT, "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  if head.returncode != 0:
    return None
  trees: dict[str, str | None] = {"": None, "ffi": None, "jaxoverlap": None}
  with tempfile.TemporaryDirectory() as scratch:   # a scratch index: the checkout's is untouched
    env = dict(os.environ, GIT_INDEX_FILE=os.path.join(scratch, "index"))
    try:
      added = subprocess.run(["git", "-C", _ROOT, "add", "-A"], env=env, capture_output=True,
                             timeout=30)
      for folder in trees if added.returncode == 0 else ():
        written = subprocess.run(
            ["git", "-C", _ROOT, "write-tree"] + ([f"--prefix={folder}/"] if folder else []),
            env=env, capture_output=True, text=True, timeout=30)
        if written.returncode == 0:
          trees[folder] = written.stdout.strip()
    except (OSError, subprocess.SubprocessError):
      pass
  return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()),
          "tree": trees.pop(""), "subtrees": trees}


def _loaded_versions() -> dict[str, Any]:
  """Versions reported by the libraries this process loaded (jax's CUDA plugin), where it can."""
  out: dict[str, Any] = {}
  try:
    from jax._src.lib import cuda_versions  # None without the CUDA plugin
  except ImportError:
    return out
  if cuda_versions is None:
    return out
  for name in ("cuda_runtime_get_version", "cuda_runtime_build_version",
               "cuda_driver_get_version", "cudnn_get_version", "cublas_get_version",
               "nccl_get_version"):
    fn = getattr(cuda_versions, name, None)
    if fn is not None:
      try:
        out[name.removesuffix("_get_version")] = fn()
      except Exception as e:  # noqa: BLE001 (recorded, not fatal: it is a record)
        out[name.removesuffix("_get_version")] = f"{type(e).__name__}: {e}"
  return out


def provenance() -> dict[str, Any]:
  """What a results file records beyond its command: commit, environment, GPUs, libraries.

  Returns:
    ``{"git", "environment", "host_gpus", "topology", "loaded_versions",
    "processes", "runtime"}``: the checkout's commit and whether tracked files
    were changed; every variable of ``_RECORDED_ENV`` that is set; this host's
    GPUs with their clocks and power limit (``host_gpus``) and ``nvidia-smi
    topo -m``; the CUDA runtime, driver, cuDNN and cuBLAS versions the CUDA
    plugin reports (and NCCL's where it reports one: jaxlib 0.11/0.12 do not); the process
    count; ``jaxoverlap.runtime_info()``'s
    transport and heap where the CUDA runtime is up.
  """
  import jax

  import jaxoverlap

  env = {k: v for k, v in sorted(os.environ.items())
         if k == "XLA_FLAGS" or k.startswith(_RECORDED_ENV[1:])}
  info = jaxoverlap.runtime_info()
  runtime = {k: info.get(k) for k in ("transport", "num_pes", "ranks_per_node", "heap_bytes",
                                       "timeout_s") if k in info}
  return {"git": _git_commit(), "environment": env, "host_gpus": host_gpus(),
          "topology": _nvidia_smi("topo", "-m"), "loaded_versions": _loaded_versions(),
          "processes": jax.process_count(), "runtime": runtime}


def check_merge(old: Mapping[str, Any] | None, file: str, **now: Any) -> None:
  """Refuses to merge this run into an existing results file measured elsewhere.

  Args:
    old: the existing file's object (None: nothing to merge into).
    file: its path, for the message.
    **now: this run's top-level fields (``machine``, ``platform``,
      ``world``) and ``jax`` (compared with the file's ``versions["jax"]``);
      a field the file lacks counts as differing.

  Raises:
    ValueError: naming each field whose value differs, with both values.
  """
  if not old:
    return
  diffs = []
  for key, value in now.items():
    was = (old.get("versions") or {}).get(key) if key == "jax" else old.get(key)
    if was != value:
      diffs.append(f"{key} {was!r} there, {value!r} in this run")
  if diffs:
    raise ValueError(f"--merge: {file} was measured elsewhere ({'; '.join(diffs)}); pooling "
                     "them would put this run's header over its records. Write to another "
                     "--out or --machine, or merge runs of one machine only")


def jax_version() -> str | None:
  """The installed jax version (``versions["jax"]`` of the results files)."""
  return results.package_versions()["jax"]


def use_host_devices(count: int, *, cpu_only: bool = True) -> None:
  """Simulates ``count`` CPU devices (before jax's backends start; no-op for 0).

  Args:
    count: devices; a count already in ``XLA_FLAGS`` is kept.
    cpu_only: also restrict jax to the CPU platform.
  """
  if count <= 0:
    return
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = (
        f"{xla_flags} --xla_force_host_platform_device_count={count}".strip())
  if cpu_only:
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # jax read JAX_PLATFORMS when it was imported
      sys.modules["jax"].config.update("jax_platforms", "cpu")


# ------------------------------------------------------------------ set-up


@dataclasses.dataclass
class Run:
  """One process of a benchmark run (``start``).

  Attributes:
    rank: this process's index; rank 0 prints and writes.
    world: devices in the run (one per process on GPUs).
    mesh: a 1-D mesh over every device, or None.
    platform: "gpu" or "cpu".
    ranks_per_node, num_nodes: the topology the records name.
    runtime: ``jaxoverlap.runtime_info()`` where the CUDA runtime is up, else {}.
    processes: the number of processes (1: one process drives every device).
  """

  rank: int
  world: int
  mesh: Any
  platform: str
  ranks_per_node: int
  num_nodes: int
  runtime: dict
  processes: int = 1

  def log(self, *args, **kwargs) -> None:
    """``print`` on rank 0 (flushed), nothing elsewhere."""
    if self.rank == 0:
      print(*args, **kwargs, flush=True)


def start(axis: str | None = None, *, nvshmem: bool | None = None) -> Run:
  """Starts a benchmark process: jax.distributed and NVSHMEM from the launcher's variables.

  Args:
    axis: name of the 1-D mesh over every device (None: no mesh).
    nvshmem: passed to ``jaxoverlap.launch.initialize_from_env`` (None: on
      GPUs when the extension is built).

  Returns:
    The ``Run``. ranks_per_node comes from the runtime, else
    ``JAXOVERLAP_RANKS_PER_NODE``, else one node under the launcher.
  """
  from jaxoverlap import launch

  info = launch.initialize_from_env(nvshmem=nvshmem)
  import jax

  world = jax.device_count()
  rt = dict(info.get("runtime") or {})
  rpn = rt.get("ranks_per_node") or os.environ.get("JAXOVERLAP_RANKS_PER_NODE")
  if not rpn:
    rpn = world if launch.launched() or jax.process_count() == 1 else jax.local_device_count()
  mesh = None if axis is None else jax.make_mesh(
      (world,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
  _gather_run_gpus()  # which physical GPUs the processes use (machine_name)
  refuse_shared_gpus()
  return Run(rank=info["process_id"], world=world, mesh=mesh,
             platform=jax.devices()[0].platform, ranks_per_node=int(rpn),
             num_nodes=world // int(rpn), runtime=rt, processes=jax.process_count())


# ------------------------------------------------------------------ checks and timing

RTOL, ATOL_REL = 2e-2, 1e-2


@functools.cache
def _close_fn():
  import jax
  import jax.numpy as jnp

  @jax.jit
  def f(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    atol = ATOL_REL * jnp.max(jnp.abs(b))
    err = jnp.abs(a - b)
    return jnp.all(err <= atol + RTOL * jnp.abs(b)), jnp.max(err), atol

  return f


def close(got, want) -> tuple[bool, float, float]:
  """(ok, max |got - want|, atol): ``|got - want| <= atol + RTOL |want|`` everywhere.

  ``atol = ATOL_REL * max |want|``. np.allclose's test, computed on the
  devices over the global arrays (every element of every rank), so that every
  process gets the same answer without copying outputs to the host. A NaN
  fails it.
  """
  import numpy as np

  ok, err, atol = _close_fn()(got, want)
  return bool(np.asarray(ok)), float(np.asarray(err)), float(np.asarray(atol))


_GATHERS = iter(range(1 << 62))  # a fresh key per gather_json call


def gather_json(obj: Any, *, timeout_s: float = 300.0) -> list[Any]:
  """Every process's JSON-able ``obj``, in process order (a list of one in one process).

  Goes through the coordination service's key-value store (jax.distributed),
  not through a device collective, so it also works where NCCL cannot run
  (processes sharing a GPU). Every process must call it the same number of
  times.

  Raises:
    TimeoutError: a process did not deliver within ``timeout_s`` (naming it).
  """
  import jax

  if jax.process_count() == 1:
    return [obj]
  from jax._src import distributed  # the key-value store has no public API

  client = distributed.global_state.client
  key = f"jaxoverlap_benchmarks/gather{next(_GATHERS)}"
  client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(obj))
  out = []
  for i in range(jax.process_count()):
    try:
      out.append(json.loads(client.blocking_key_value_get(f"{key}/{i}", int(timeout_s * 1e3))))
    except Exception as e:  # the client raises XlaRuntimeError (DEADLINE_EXCEEDED)
      raise TimeoutError(f"gather_json: process {i} did not deliver {key} within "
                         f"{timeout_s:.0f} s: {e}") from e
  return out


def median(values: Iterable[float]) -> float:
  return statistics.median(list(values))


# ------------------------------------------------------------------ what ran


def _choice(plan) -> tuple[str, str]:
  """(algorithm, protocol) of an all-reduce plan; ("psum", "auto") where lax.psum ran."""
  if plan.backend == names.XLA:
    return ("psum" if plan.algorithm == names.COLLECTIVE else plan.algorithm), names.AUTO
  return plan.algorithm, plan.protocol or names.AUTO


def plan_fields(plan) -> dict[str, Any]:
  """What a record of a fused op says about the plan it ran (empty on backend "xla").

  Returns:
    algorithm "fused": ``{"transport", "chunks", "chunks_source"}``
    (``"auto"`` where the rule chose the chunks, else the plan's reason, e.g.
    ``"requested"``); "unfused": ``{"all_reduce_algorithm":
    "<algorithm>/<protocol>"}`` of its all-reduce.
  """
  if plan is None or plan.backend != names.CUDA:
    return {}
  if plan.algorithm == names.UNFUSED and plan.all_reduce is not None:
    return {"all_reduce_algorithm": "/".join(_choice(plan.all_reduce))}
  if plan.algorithm == names.FUSED:
    why = plan.reason("chunks") or ""
    return {"transport": plan.transport, "chunks": plan.chunks,
            "chunks_source": "auto" if why.startswith("rule") else why}
  return {}


def last_plan(op: str):
  """The plan of the last call of ``op`` lowered in this process, or None."""
  import jaxoverlap

  plans = jaxoverlap.decisions(op)
  return plans[-1] if plans else None


def auto_choices(plans: Sequence | None = None) -> list[list]:
  """``[bytes, algorithm, protocol]`` of every all-reduce whose algorithm auto chose, sorted.

  Args:
    plans: plans (default: ``jaxoverlap.decisions("all_reduce")``).
  """
  import jaxoverlap

  plans = jaxoverlap.decisions(names.ALL_REDUCE) if plans is None else plans
  return [list(c) for c in sorted({(p.nbytes,) + _choice(p) for p in plans
                                   if p.op == names.ALL_REDUCE
                                   and p.reason("algorithm") != "requested"})]


def fused_choices(plans: Sequence | None = None) -> list[dict[str, Any]]:
  """The distinct fused-kernel plans of a run, in first-seen order.

  Args:
    plans: plans (default: ``jaxoverlap.decisions()``).

  Returns:
    ``{"op", "transport", "chunks", "chunks_source", "shape": {"outer",
    "rows", "k", "n"}}`` (the kernels' view of the shapes) of each.
  """
  import jaxoverlap

  out: list[dict[str, Any]] = []
  for p in jaxoverlap.decisions() if plans is None else plans:
    if p.backend == names.CUDA and p.algorithm == names.FUSED:
      g = p.geometry
      kept = {"op": p.op, **plan_fields(p),
              "shape": {"outer": g.outer, "rows": g.rows, "k": g.k, "n": g.n}}
      if kept not in out:
        out.append(kept)
  return out


def resolved_backends(plans: Sequence | None = None) -> dict[str, str]:
  """op -> the backend(s) its calls ran on (``"cuda"``, ``"xla"`` or ``"cuda+xla"``).

  The form of the training example's ``metrics["backend"]["resolved"]``.
  """
  import jaxoverlap

  ran: dict[str, set[str]] = {}
  for p in jaxoverlap.decisions() if plans is None else plans:
    ran.setdefault(p.op, set()).add(p.backend)
  return {op: "+".join(sorted(b)) for op, b in sorted(ran.items())}


# ------------------------------------------------------------------ the training example

TRAIN_DIR = os.path.join(_ROOT, "examples", "train")


def start_training_example(*, distributed: bool, cuda: bool, host_devices: int):
  """Starts a run of the training example (examples/train); returns its modules.

  Quiets absl's INFO logs (orbax logs every checkpoint step), simulates
  ``host_devices`` CPU devices where jax runs on CPU, then brings up
  jax.distributed and NVSHMEM.

  Args:
    distributed: one of several processes (launcher or SLURM).
    cuda: backend "cuda" is requested: NVSHMEM must come up (fails loudly).
    host_devices: see ``use_host_devices``.

  Returns:
    The example's modules ``(config, data, train)`` (its flat imports, as its main.py).
  """
  import importlib

  from absl import logging

  logging.set_verbosity(logging.WARNING)
  use_host_devices(host_devices, cpu_only=False)
  if distributed:
    from jaxoverlap import launch

    # nvshmem=None brings NVSHMEM up on GPUs when the extension is built ("auto" uses it).
    launch.initialize_from_env(nvshmem=True if cuda else None)
  elif cuda:
    import jaxoverlap

    jaxoverlap.initialize()  # one process: it must own exactly one GPU
  _gather_run_gpus()  # which physical GPUs the processes use (machine_name)
  refuse_shared_gpus()
  if TRAIN_DIR not in sys.path:
    sys.path.insert(0, TRAIN_DIR)
  return tuple(importlib.import_module(m) for m in ("config", "data", "train"))


def run_impl(backend: str, resolved: Mapping[str, str] | None) -> str:
  """The ``impl`` of a training run: ``jaxoverlap:<backend>`` when any op ran the CUDA
  kernels (``resolved``: op -> "cuda" | "xla" | "cuda+xla"), else ``xla:<backend>``."""
  uses_cuda = any("cuda" in v.split("+") for v in (resolved or {}).values())
  return f"{'jaxoverlap' if uses_cuda else 'xla'}:{backend}"


def run_shape(preset: str, config: Mapping[str, Any], dp: int, tp: int) -> dict[str, Any]:
  """The ``shape`` of a training record: the preset, its model and batch sizes, the mesh."""
  keys = ("d_model", "n_layers", "n_heads", "d_ff", "seq_len", "batch_size")
  return {"preset": preset, **{k: config[k] for k in keys}, "dp": int(dp), "tp": int(tp),
          "sequence_parallel": config["sequence_parallel"]}


# ------------------------------------------------------------------ results


def path(out_dir: str, name: str, machine: str, suffix: str = "", ext: str = "json") -> str:
  """``<out_dir>/<name>-<machine, spaces as _><suffix>.<ext>``."""
  return os.path.join(out_dir, f"{name}-{machine.replace(' ', '_')}{suffix}.{ext}")


def load_results(file: str, *benchmarks: str) -> dict:
  """A results file written by one of ``benchmarks`` (its ``benchmark`` field).

  For the analysis and plot scripts, which read other scripts' files: the
  wrong kind of file stops them with one line instead of a KeyError deep in
  the analysis.

  Raises:
    SystemExit: the file cannot be read, is not JSON, or is not a results
      file of one of ``benchmarks``; the message names the file and what it is.
  """
  try:
    result = load_json(file)
  except (OSError, ValueError) as e:
    raise SystemExit(f"{file}: not a readable JSON results file ({e})") from None
  got = result.get("benchmark") if isinstance(result, dict) else None
  if got not in benchmarks or not isinstance(result.get("records"), list):
    raise SystemExit(f"{file} is {'a results file of benchmark ' + repr(got) if got else 'no results file'}"
                     f"; this needs one of benchmark {' or '.join(map(repr, benchmarks))}")
  return result


def load_json(file: str, missing_ok: bool = False) -> dict | None:
  """A JSON file's object; None for a missing file where ``missing_ok``.

  Raises:
    FileNotFoundError: the file does not exist (and not ``missing_ok``).
  """
  if missing_ok and not os.path.exists(file):
    return None
  with open(file) as f:
    return json.load(f)


def write_result(file: str, records: Sequence[Mapping[str, Any]] | None, *, benchmark: str,
                 machine: str, method: str, script: str | None = None,
                 command: str | None = None, rejected: Sequence[Mapping[str, Any]] = (),
                 extra: Mapping[str, Any] | None = None, latency: bool = True
                 ) -> dict[str, Any]:
  """Writes a results file in the format of ``jaxoverlap.tuning.results``; returns it.

  Args:
    file: the path (``path``).
    records: the records; None for an analysis of other files (no records,
      no ``rejected``).
    benchmark: the file's ``benchmark``.
    machine, method: free text.
    script: the script's path from the repository root, for
      ``jaxoverlap.launch.reproduce_command`` (when ``command`` is None).
    command: the command that reruns this, if not the reproduce command.
    rejected: what failed its check and was not timed.
    extra: more top-level fields.
    latency: the records are per-op latencies (op, impl, bytes, world,
      ranks_per_node, time_us > 0): the file is validated and saved by
      ``results.save_result``. Whole-step benchmarks and analyses (no
      per-message bytes) are written as they are.
  """
  from jaxoverlap import launch

  result = results.make_result(
      records or [], machine=machine, command=command or launch.reproduce_command(script),
      method=method, versions=results.package_versions(), rejected=rejected)
  result["benchmark"] = benchmark
  result["provenance"] = provenance()
  del result["params"]  # the cost model's; tuning tables only
  if records is None:
    del result["records"], result["rejected"]
  result.update(extra or {})
  if latency:
    results.save_result(result, file)  # validated, written atomically
  else:
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with open(file, "w") as f:
      json.dump(result, f, indent=1)
  return result
