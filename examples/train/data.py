"""Byte-level corpus: the Python standard library's own source files.

Every machine that runs Python has this corpus, so the example needs no
download. Files are found under ``sysconfig.get_paths()["stdlib"]``, sorted by
relative path, and split into train and validation BY FILE, using a CRC32 of
the relative path (deterministic across runs and processes, unlike
``hash()``). Tokens are bytes (vocabulary 256).

Batches are pure functions of ``(seed, step)``: resuming at step ``n`` sees
exactly the batches an uninterrupted run would have seen from step ``n`` on.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
import zlib

import numpy as np

VOCAB_SIZE = 256

# Directories skipped anywhere in the tree: test suites (large, repetitive
# generated data), third-party packages and caches.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
# Machine-specific generated files.
_SKIP_PREFIXES = ("_sysconfigdata",)


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Train and validation bytes, each the concatenation of its files.

  Attributes:
    train: uint8 ``[num_train_bytes]``.
    val: uint8 ``[num_val_bytes]``.
    num_train_files: files in the train split.
    num_val_files: files in the validation split.
    root: the directory the files came from.
  """

  train: np.ndarray
  val: np.ndarray
  num_train_files: int
  num_val_files: int
  root: str


def stdlib_files(root: str | None = None) -> list[str]:
  """Relative paths of the standard library's ``*.py`` files, sorted.

  Args:
    root: directory to scan; defaults to this interpreter's stdlib.

  Returns:
    Paths relative to ``root``, with ``/`` separators, sorted.
  """
  root = root or sysconfig.get_paths()["stdlib"]
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    for name in filenames:
      if name.endswith(".py") and not name.startswith(_SKIP_PREFIXES):
        rel = os.path.relpath(os.path.join(dirpath, name), root)
        paths.append(rel.replace(os.sep, "/"))
  return sorted(paths)


def is_validation(relpath: str, val_percent: int) -> bool:
  """Whether a file belongs to the validation split (CRC32 of its path)."""
  return zlib.crc32(relpath.encode("utf-8")) % 100 < val_percent


def load_corpus(root: str | None = None, val_percent: int = 5) -> Corpus:
  """Reads the corpus and splits it by file.

  Args:
    root: directory to scan; defaults to this interpreter's stdlib.
    val_percent: percentage (0-100) of files that go to validation.

  Returns:
    The ``Corpus``.

  Raises:
    ValueError: either split ends up empty.
  """
  root = root or sysconfig.get_paths()["stdlib"]
  train, val = [], []
  for rel in stdlib_files(root):
    with open(os.path.join(root, rel), "rb") as f:
      (val if is_validation(rel, val_percent) else train).append(f.read())
  if not train or not val:
    raise ValueError(
        f"corpus under {root!r} split into {len(train)} train and {len(val)} validation "
        f"files (val_percent={val_percent}); both must be non-empty")
  as_array = lambda chunks: np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
  return Corpus(as_array(train), as_array(val), len(train), len(val), root)


def unigram_loss(corpus: Corpus) -> float:
  """Cross-entropy (nats/byte) of the validation bytes under train byte frequencies.

  The baseline a model must beat: it knows which bytes are common but nothing
  about context. Counts are add-one smoothed so unseen bytes stay finite.
  """
  train_counts = np.bincount(corpus.train, minlength=VOCAB_SIZE).astype(np.float64) + 1.0
  log_p = np.log(train_counts / train_counts.sum())
  val_counts = np.bincount(corpus.val, minlength=VOCAB_SIZE).astype(np.float64)
  return float(-(val_counts * log_p).sum() / val_counts.sum())


def _windows(data: np.ndarray, offsets: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
  tokens = data[idx].astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def train_batch(corpus: Corpus, step: int, batch_size: int, seq_len: int,
                seed: int) -> dict[str, np.ndarray]:
  """The training batch of ``step``: random windows, a pure function of (seed, step).

  Returns:
    ``{"inputs": int32 [b, s], "targets": int32 [b, s]}``; targets are the
    inputs shifted by one byte.
  """
  rng = np.random.default_rng([seed, step])
  offsets = rng.integers(0, len(corpus.train) - seq_len - 1, size=batch_size)
  return _windows(corpus.train, offsets, seq_len)


def validation_batches(corpus: Corpus, num_batches: int, batch_size: int,
                       seq_len: int) -> list[dict[str, np.ndarray]]:
  """Fixed validation batches: windows evenly spaced over the validation bytes.

  The same batches are used at every evaluation, so the validation curve is
  not noisy from resampling.
  """
  total = num_batches * batch_size
  last = len(corpus.val) - seq_len - 1
  if last < 0:
    raise ValueError(f"validation split has {len(corpus.val)} bytes, fewer than seq_len + 1 = {seq_len + 1}")
  offsets = np.linspace(0, last, total).astype(np.int64)
  return [_windows(corpus.val, offsets[i * batch_size:(i + 1) * batch_size], seq_len)
          for i in range(num_batches)]
