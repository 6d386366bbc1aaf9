"""Loads the CUDA extension lazily and registers its FFI targets once.

Importing jaxoverlap never imports the extension; the first op that needs the
CUDA backend (or ``jaxoverlap.initialize``) does, through ``load()``.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_ext = None
_error: str | None = None
_registered = False


def _import():
  global _ext, _error
  if _ext is not None or _error is not None:
    return
  try:
    from jaxoverlap import _jaxoverlap_cuda as ext  # built by CMake when nvcc is found
  except ImportError as e:
    if "libnvshmem" in str(e):
      _error = (
          f"the CUDA extension is built but cannot load NVSHMEM's host library ({e}); "
          "install it with pip install 'jaxoverlap[cuda]' or nvidia-nvshmem-cu13>=3.4")
    elif "libcublas" in str(e):
      _error = (
          f"the CUDA extension is built but cannot load cuBLASLt ({e}); install it with "
          "pip install 'jaxoverlap[cuda]' or nvidia-cublas>=13")
    elif "cannot import name" in str(e) or "No module named" in str(e):
      _error = (
          "the CUDA extension jaxoverlap._jaxoverlap_cuda is not built (the package was "
          "installed without nvcc, or with JAXOVERLAP_CUDA=OFF); reinstall with nvcc on PATH "
          "(see README, 'Building')")
    else:
      _error = f"the CUDA extension jaxoverlap._jaxoverlap_cuda cannot be loaded: {e}"
    return
  _ext = ext


def unavailable_reason() -> str | None:
  """Why the CUDA extension is not usable, or None when it is loaded."""
  with _lock:
    _import()
    return _error


def load():
  """Returns the extension module, registering its FFI targets on first use.

  Raises:
    RuntimeError: the extension is not built or fails to load.
  """
  global _registered
  with _lock:
    _import()
    if _ext is None:
      raise RuntimeError(_error)
    if not _registered:
      import jax
      for name, capsule in _ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
      _registered = True
    return _ext
