"""Pass/fail bookkeeping shared by the multi-process GPU check scripts.

Imported as ``from _checker import Checker``: a script run as ``python
tests/multiprocess/<script>.py`` has its own folder on ``sys.path``.
"""

from __future__ import annotations

import hashlib

import numpy as np


class Checker:
  """Counts passed and failed checks of one rank and prints each failure.

  Args:
    rank, nproc: this process and the number of processes.
    kv: jax.distributed's key-value client (None with one process).
    prefix: key prefix in the store, one per script (keys must not collide).
  """

  def __init__(self, rank: int, nproc: int, kv, prefix: str):
    self.rank, self.nproc, self.kv, self.prefix = rank, nproc, kv, prefix
    self.passed = self.failed = 0

  def check(self, ok: bool, what: str) -> None:
    if ok:
      self.passed += 1
    else:
      self.failed += 1
      print(f"FAIL rank {self.rank}: {what}", flush=True)

  def same_on_all_ranks(self, key: str, arr: np.ndarray) -> bool:
    """True when every rank passed bit-identical ``arr`` under ``key`` (a collective)."""
    if self.kv is None:
      return True
    digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    self.kv.key_value_set(f"{self.prefix}/{key}/{self.rank}", digest)
    got = [self.kv.blocking_key_value_get(f"{self.prefix}/{key}/{r}", 120_000)
           for r in range(self.nproc)]
    return len(set(got)) == 1
