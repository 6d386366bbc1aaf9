"""Backend selection: which implementation ("xla" or "cuda") runs an op.

Every public op takes ``backend="auto" | "xla" | "cuda"``:

* ``"xla"``: pure JAX (``lax`` collectives, or the decomposed ``ppermute``
  schedule). Always available, on every platform.
* ``"cuda"``: the CUDA kernels of this package, registered as XLA FFI custom
  calls. Usable only when the extension was built with CUDA, the arrays live on
  NVIDIA GPUs, ``jaxoverlap.initialize()`` has run (NVSHMEM is up) and the op
  has a kernel. Asking for it when it is not usable raises ``RuntimeError``
  that says why; nothing falls back silently.
* ``"auto"``: ``"cuda"`` when usable, else ``"xla"``; each reason for falling
  back is logged once as a WARNING (logger ``jaxoverlap``), so it shows
  without any logging set-up.

``jaxoverlap.runtime_info()`` reports the same reasons for every op.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["BACKENDS", "OPS", "select_backend", "cuda_unavailable_reason", "log_once"]

logger = logging.getLogger("jaxoverlap")

BACKENDS = ("auto", "xla", "cuda")

# Ops that have a CUDA kernel in this build. The others run on "xla" only.
OPS = ("all_reduce", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
_CUDA_OPS = frozenset(OPS)

_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


def cuda_unavailable_reason(op: str) -> str | None:
  """Why ``backend="cuda"`` cannot run ``op`` right now, or None if it can.

  Args:
    op: one of ``OPS``.

  Returns:
    A sentence naming the missing piece, or None when the CUDA path is usable.
  """
  if op not in _CUDA_OPS:
    return f"no CUDA kernel for {op} in this version (it runs on the xla backend)"
  platform = _jax_platform()
  if platform != "gpu":
    return (f"JAX runs on {platform!r} here, with no GPU: the CUDA backend needs NVIDIA GPUs "
            "(backend 'xla' runs everywhere)")
  from jaxoverlap import _ffi  # local import: importing jaxoverlap never loads the extension
  reason = _ffi.unavailable_reason()
  if reason is not None:
    return reason
  from jaxoverlap import runtime
  if not runtime.is_initialized():
    return "jaxoverlap.initialize() has not been called in this process (NVSHMEM is not up)"
  return None


def _jax_platform() -> str:
  import jax

  try:
    return jax.default_backend()
  except RuntimeError as e:  # no backend could be initialised
    return f"no platform ({e})"


def select_backend(op: str, backend: str) -> str:
  """Resolves ``backend`` for ``op`` to ``"xla"`` or ``"cuda"``.

  Args:
    op: the public op's name, one of ``OPS``.
    backend: ``"auto"``, ``"xla"`` or ``"cuda"``.

  Returns:
    ``"xla"`` or ``"cuda"``.

  Raises:
    ValueError: ``backend`` is not one of ``BACKENDS``.
    RuntimeError: ``backend="cuda"`` but the CUDA path is not usable; the
      message says why.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "xla":
    return "xla"
  reason = cuda_unavailable_reason(op)
  if backend == "cuda":
    if reason is not None:
      raise RuntimeError(f"backend='cuda' was requested for {op}, but {reason}")
    return "cuda"
  if reason is None:
    return "cuda"
  with _lock:  # one line per reason, not per op: the reason is the same for all
    if ("auto", reason) not in _logged:
      _logged.add(("auto", reason))
      logger.warning("jaxoverlap: backend 'auto' runs the ops on backend 'xla' (first: %s): %s",
                     op, reason)
  return "xla"


def log_once(op: str, message: str, *, info: bool = False) -> None:
  """Logs ``"jaxoverlap: <op> <message>"`` once per (op, message) (logger ``jaxoverlap``).

  A WARNING (a fallback the user should see), or INFO with ``info=True`` (a
  choice made as documented).
  """
  with _lock:
    if (op, message) in _logged:
      return
    _logged.add((op, message))
  (logger.info if info else logger.warning)("jaxoverlap: %s %s", op, message)
