"""The results format: benchmark and tuning files (load, save, validate).

Problem:
  Benchmarks, the tuner and the all-reduce policy exchange measurements as
  JSON files. Each must say what was measured, on which machine, with which
  command and package versions, and in which units, so that a file written
  today still loads and compares tomorrow.

Algorithm:
  One JSON object per file: ``benchmark``, ``machine``, ``command``, ``date``,
  ``versions`` and a list of ``records``; each record names the ``op``, the
  implementation (``impl``: ``"jaxoverlap:<algorithm>"``, or a baseline such as
  ``"xla:psum"``), ``dtype``, ``bytes``, ``shape``, ``world``,
  ``ranks_per_node`` and ``time_us`` (the median latency of one op, in
  microseconds). A record of more than one node may say whether its nodes
  were emulated on one host (``emulated_nodes``: true or false; see
  ``runtime.nodes_are_emulated``). Tuning tables (benchmark ``all_reduce_tuning``) add the
  cost-model ``params`` and the configurations ``rejected`` by their
  correctness check. ``save_result`` writes atomically. A table the policy
  reads (``validate_tuning_table``) is the all-reduce's and times at least one
  CUDA kernel.

Example:
  >>> from jaxoverlap.tuning import results
  >>> table = results.load_result("benchmarks/results/all_reduce-2x_H200_NV18-1x2.json")
  >>> table["records"][0]["impl"], results.parse_impl("jaxoverlap:one_shot_ll")
  ('jaxoverlap:one_shot_ll', ('one_shot', 'll'))
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from jaxoverlap.tuning import cost_model
from jaxoverlap.tuning.cost_model import ALGORITHMS, PROTOCOLS, PSUM

__all__ = [
    "impl_name",
    "parse_impl",
    "default_tuning_path",
    "package_versions",
    "make_result",
    "validate_result",
    "check_all_reduce_records",
    "parse_bytes",
    "check_kernel_measured",
    "validate_tuning_table",
    "load_result",
    "save_result",
]



def impl_name(algorithm: str, protocol: str | None) -> str:
  """The ``impl`` of a record: ``"xla:psum"`` or ``"jaxoverlap:<algorithm>[_<protocol>]"``."""
  if algorithm == PSUM:
    return "xla:psum"
  return f"jaxoverlap:{algorithm}" + (f"_{protocol}" if protocol else "")


def parse_impl(impl: str) -> tuple[str, str | None] | None:
  """Inverse of ``impl_name``; None for impls that are not a choice (auto, ppermute, ...)."""
  if impl == "xla:psum":
    return PSUM, None
  if not impl.startswith("jaxoverlap:"):
    return None
  name = impl.split(":", 1)[1]
  if name in ALGORITHMS:
    return name, None
  for protocol in PROTOCOLS:
    alg = name[: -len(protocol) - 1]
    if name.endswith("_" + protocol) and alg in ALGORITHMS:
      return alg, protocol
  return None


def parse_bytes(text: str, what: str | None = None) -> int:
  """A byte count: ``"4K"`` -> 4096, ``"512M"``, ``"1GiB"``, ``"8192"`` (K, M, G are powers of 1024).

  Args:
    text: the count, with an optional K/M/G suffix and an optional ``B`` or ``iB``.
    what: the setting it came from (a flag or variable), for the message.

  Raises:
    ValueError: not a non-negative whole number with such a suffix; names ``what``.
  """
  m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*", text)
  if not m:
    raise ValueError(f"{what + '=' if what else ''}{text!r} is not a byte count "
                     "(e.g. 8192, 64K, 512M, 1GiB)")
  return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]


def default_tuning_path() -> str:
  """``$JAXOVERLAP_TUNING_FILE``, else ``~/.cache/jaxoverlap/all_reduce-tuning.json``."""
  return os.environ.get("JAXOVERLAP_TUNING_FILE") or os.path.join(
      os.path.expanduser("~"), ".cache", "jaxoverlap", "all_reduce-tuning.json")


_RECORD_KEYS = {"op": str, "impl": str, "bytes": int, "ranks_per_node": int, "world": int,
                "time_us": (int, float)}


_VERSIONED = (("jax", "jax"), ("jaxlib", "jaxlib"), ("nvshmem", "nvidia-nvshmem-cu13"),
              ("nccl", "nvidia-nccl-cu13"))


def package_versions() -> dict[str, str | None]:
  """The installed versions of jax, jaxlib, nvidia-nvshmem-cu13 and nvidia-nccl-cu13.

  Returns:
    ``{"jax", "jaxlib", "nvshmem", "nccl"}`` -> version string, None where the
    distribution is not installed; the ``versions`` of ``make_result``.
  """
  out = {}
  for name, dist in _VERSIONED:
    try:
      out[name] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def make_result(records: Sequence[Mapping[str, Any]], *, machine: str, command: str,
                method: str, versions: Mapping[str, Any] | None = None,
                params: Mapping[str, float] | None = None,
                rejected: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
  """A tuning table in the results format of this module (benchmark ``all_reduce_tuning``).

  Args:
    records: ``{"op": "all_reduce", "impl", "dtype", "bytes", "shape", "world",
      "ranks_per_node", "time_us"}`` each.
    machine, command, method: free text, as in the benchmark files.
    versions: package versions.
    params: cost-model overrides under ``PARAM_KEYS`` (e.g. the network's).
    rejected: ``{"impl", "bytes", "reason"}`` of configurations that failed
      their correctness check and were not timed.
  """
  return {
      "benchmark": "all_reduce_tuning",
      "machine": machine,
      "command": command,
      "method": method,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "versions": dict(versions or {}),
      "params": dict(params or {}),
      "records": [dict(r) for r in records],
      "rejected": [dict(r) for r in rejected],
  }


def validate_result(result: Any, where: str = "tuning table") -> None:
  """Checks the layout of a results file and the cost-model ``params``.

  Raises:
    ValueError: a missing or mistyped field; the message names it.
  """
  if not isinstance(result, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(result).__name__}")
  for key in ("benchmark", "machine", "command", "date", "versions", "records"):
    if key not in result:
      raise ValueError(f"{where}: missing field {key!r}")
  if not isinstance(result["records"], list):
    raise ValueError(f"{where}: 'records' must be a list")
  for i, rec in enumerate(result["records"]):
    for key, typ in _RECORD_KEYS.items():
      if not isinstance(rec, dict) or not isinstance(rec.get(key), typ) or isinstance(
          rec.get(key), bool):
        raise ValueError(f"{where}: records[{i}] lacks {key!r} of type "
                         f"{getattr(typ, '__name__', 'number')}: {rec!r}")
    if not (0 < rec["time_us"] < math.inf) or rec["bytes"] < 0 or rec["ranks_per_node"] < 1 or (
        rec["world"] < 1 or rec["world"] % rec["ranks_per_node"]):
      raise ValueError(f"{where}: records[{i}] has impossible values: {rec!r}")
    if not isinstance(rec.get("emulated_nodes", False), bool):
      raise ValueError(f"{where}: records[{i}]'s 'emulated_nodes' must be true or false: {rec!r}")
  try:
    cost_model.DEFAULT_PARAMS.replace(**result.get("params", {}))
  except (TypeError, ValueError) as e:  # a bad key or value; params not an object
    raise ValueError(f"{where}: 'params': {e}") from None


# The benchmarks whose files hold all-reduce records: the tuner's tables and
# benchmarks/all_reduce.py's results.
ALL_REDUCE_BENCHMARKS = ("all_reduce_tuning", "all_reduce")


def check_all_reduce_records(result: Mapping[str, Any], where: str = "tuning table") -> None:
  """Checks that a results file is the all-reduce's: its benchmark and every record's op.

  Args:
    result: a results file (a JSON object with ``records``).
    where: the file, for the messages.

  Raises:
    ValueError: a benchmark other than ``ALL_REDUCE_BENCHMARKS`` or a record
      of another op than ``all_reduce``; the message names it.
  """
  benchmark = result.get("benchmark")
  if benchmark not in ALL_REDUCE_BENCHMARKS:
    raise ValueError(f"{where}: a results file of benchmark {benchmark!r}, not an all-reduce "
                     f"table (benchmark {' or '.join(map(repr, ALL_REDUCE_BENCHMARKS))})")
  for i, rec in enumerate(result.get("records") or ()):
    op = rec.get("op") if isinstance(rec, Mapping) else None
    if op != "all_reduce":
      raise ValueError(f"{where}: records[{i}] is of op {op!r}, not 'all_reduce'")


def check_kernel_measured(records: Sequence[Mapping[str, Any]],
                          where: str = "tuning table") -> None:
  """Checks that ``records`` time at least one CUDA all-reduce kernel.

  A table of ``xla:psum`` alone would make ``algorithm="auto"`` hand every
  all-reduce to XLA as "measured" without a kernel timed; one of no usable
  record (``auto``, floors) would leave every choice to the cost model.

  Raises:
    ValueError: no record's ``impl`` is a kernel (``parse_impl`` other than
      psum); the message lists the impls found.
  """
  impls = sorted({str(rec.get("impl")) for rec in records if isinstance(rec, Mapping)})
  parsed = [parse_impl(impl) for impl in impls]
  if not any(p is not None and p[0] != PSUM for p in parsed):
    raise ValueError(f"{where}: no record times a CUDA all-reduce kernel (impls: "
                     f"{', '.join(impls) or 'none'}); such a table would hand every all-reduce "
                     "to xla:psum or the cost model. Build it from files that time the kernels "
                     "(python -m jaxoverlap.tune, or benchmarks/all_reduce.py's default impls)")


def validate_tuning_table(result: Any, where: str = "tuning table") -> None:
  """Checks a table for the all-reduce policy: ``validate_result``, then its contents.

  The layout and ``params`` (``validate_result``), the all-reduce's benchmark
  and op (``check_all_reduce_records``) and at least one kernel timed
  (``check_kernel_measured``). ``Policy.from_result``, ``load_result``,
  ``initialize()`` and ``python -m jaxoverlap.tune`` check every table this
  way.

  Raises:
    ValueError: the table fails one of these checks; the message names it.
  """
  validate_result(result, where)
  check_all_reduce_records(result, where)
  check_kernel_measured(result["records"], where)


def load_result(path: str | None = None) -> dict[str, Any] | None:
  """Reads a tuning table and checks it (``validate_tuning_table``); None when there is no file.

  Raises:
    ValueError: the file is not valid JSON or not a valid all-reduce table.
  """
  path = path or default_tuning_path()
  try:
    with open(path) as f:
      result = json.load(f)
  except FileNotFoundError:
    return None
  except json.JSONDecodeError as e:
    raise ValueError(f"tuning table {path} is not valid JSON: {e}") from None
  validate_tuning_table(result, path)
  return result


def save_result(result: Mapping[str, Any], path: str | None = None) -> str:
  """Writes a tuning table atomically, creating folders; returns the path.

  Raises:
    ValueError: ``result`` is not a valid table.
  """
  path = path or default_tuning_path()
  validate_result(result, path)
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tuning-", suffix=".json")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(result, f, indent=1)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; the table is shared, not secret
    os.replace(tmp, path)  # readers on other ranks never see half a file
  except BaseException:
    os.unlink(tmp)
    raise
  return path
