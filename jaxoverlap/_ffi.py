"""Loads the CUDA extension lazily and registers its FFI targets once.

Importing jaxoverlap never imports the extension; the first op that needs the
CUDA backend (or ``jaxoverlap.initialize``) does, through ``load()``.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
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
      _error = _not_built_message()
    else:
      _error = f"the CUDA extension jaxoverlap._jaxoverlap_cuda cannot be loaded: {e}"
    return
  _ext = ext


def _built_elsewhere() -> str | None:
  """Another jaxoverlap package on ``sys.path`` that holds the compiled extension, or None.

  Run from a checkout's root, ``import jaxoverlap`` finds the source tree
  first (the working directory leads ``sys.path``), not the installed copy.
  """
  here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
  for entry in sys.path:
    package = os.path.realpath(os.path.join(entry or os.getcwd(), "jaxoverlap"))
    if package == here or not os.path.isdir(package):
      continue
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
      if os.path.exists(os.path.join(package, "_jaxoverlap_cuda" + suffix)):
        return package
  return None


def _not_built_message() -> str:
  """Why ``_jaxoverlap_cuda`` is missing from the imported package, and what to do."""
  built = _built_elsewhere()
  if built is not None:
    here = os.path.dirname(os.path.abspath(__file__))
    return (f"this process imported jaxoverlap from {here}, a source tree without the compiled "
            f"CUDA extension (Python's working directory is the repository's root), while the "
            f"installed package at {built} has it: run from outside the repository's root")
  return ("the CUDA extension jaxoverlap._jaxoverlap_cuda is not built (the package was "
          "installed without nvcc, or with JAXOVERLAP_CUDA=OFF); reinstall with nvcc on PATH "
          "and pip's --no-cache-dir, so that pip builds it again rather than reuse a cached "
          "wheel built without it (see README, 'Building')")


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
