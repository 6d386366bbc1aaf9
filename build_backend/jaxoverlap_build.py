"""The package's build backend: scikit-build-core's, asking for the CUDA build requirements only
where the CUDA backend is built.

Problem:
  Building the CUDA backend needs jaxlib's FFI headers, NVSHMEM and cuBLAS in the build
  environment (about 700 MB of wheels). A CPU-only install does not build it, yet static
  ``build-system.requires`` would download them on every install.

Algorithm:
  The CUDA backend is built unless ``JAXOVERLAP_CUDA`` is off
  (``-Ccmake.define.JAXOVERLAP_CUDA=OFF``, ``SKBUILD_CMAKE_DEFINE`` holding
  ``JAXOVERLAP_CUDA=OFF``, or ``-DJAXOVERLAP_CUDA=OFF`` in ``-Ccmake.args`` or
  ``CMAKE_ARGS``; any of CMake's false values) or no ``nvcc`` is found
  (``CUDACXX``, ``PATH``, ``/usr/local/cuda/bin``). Only then are the CUDA build requirements
  asked for; otherwise the build is told ``JAXOVERLAP_CUDA=OFF`` too, so that this choice and
  CMake's agree, and ``JAXOVERLAP_CUDA_OFF_REASON`` (requested, or no nvcc), which CMake's
  warning names (CMakeLists.txt); that wheel is pure Python (``wheel.platlib=false``: tagged
  ``py3-none-any``, not with this machine's platform). An nvcc found only in
  ``/usr/local/cuda/bin`` is handed to CMake as ``CMAKE_CUDA_COMPILER``, which does not look
  there itself. ``JAXOVERLAP_CUDA=ON`` asked for explicitly where no nvcc is found is an error
  before anything is downloaded, not a pure-Python install. Everything else is
  scikit-build-core's (PEP 517 hooks passed through, ``pyproject.toml``'s ``backend-path``).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping

try:
  from scikit_build_core import build as _skbuild
  from scikit_build_core.build import build_sdist, get_requires_for_build_sdist  # noqa: F401
except ImportError as e:  # pip would say only "Cannot import 'jaxoverlap_build'"
  raise RuntimeError(
      f"jaxoverlap's build backend needs scikit-build-core (0.10 or newer) in the Python that "
      f"runs the build, {sys.executable}, which lacks it. pip installs it into an isolated "
      f"build environment; with --no-build-isolation install it there first ({sys.executable} "
      f"-m pip install 'scikit-build-core>=0.10' 'nanobind>=2.4'), and run pip as "
      f"'python -m pip' from the Python you mean: a 'pip' on PATH may belong to another "
      f"Python") from e

CUDA_BUILD_REQUIRES = ("jax>=0.11.2,<0.13", "jaxlib>=0.11.2,<0.13", "nvidia-nvshmem-cu13>=3.4",
                       "nvidia-cublas>=13,<14")
_SETTING = "cmake.define.JAXOVERLAP_CUDA"
_REASON = "cmake.define.JAXOVERLAP_CUDA_OFF_REASON"
_OFF = {"off", "0", "false", "no", "n", "ignore", "notfound"}
_ON = {"on", "1", "true", "yes", "y"}
_COMPILER = "cmake.define.CMAKE_CUDA_COMPILER"
DEFAULT_NVCC = "/usr/local/cuda/bin/nvcc"


def _values(config_settings: Mapping | None, key: str) -> list[str]:
  value = (config_settings or {}).get(key)
  if value is None:
    return []
  return [value] if isinstance(value, str) else list(value)


def off_reason(config_settings: Mapping | None = None, env: Mapping[str, str] | None = None,
               which=shutil.which, exists=os.path.exists) -> str | None:
  """Why this build skips the CUDA backend: "requested" (``JAXOVERLAP_CUDA`` off), "no-nvcc",
  or None where it compiles it (module docstring)."""
  env = os.environ if env is None else env
  choices = _choices(config_settings, env)
  if any(_is_off(c) for c in choices):
    return "requested"
  if nvcc(env, which, exists) is not None:
    return None
  if any(c in _ON for c in choices):
    raise RuntimeError(
        f"jaxoverlap: JAXOVERLAP_CUDA=ON was asked for, but nvcc was not found (CUDACXX, PATH, "
        f"{DEFAULT_NVCC}): put nvcc on PATH, or build without it (JAXOVERLAP_CUDA=OFF)")
  return "no-nvcc"


def _choices(config_settings: Mapping | None, env: Mapping[str, str]) -> list[str]:
  """The JAXOVERLAP_CUDA values asked for, lowercase: ``-Ccmake.define.JAXOVERLAP_CUDA``,
  ``SKBUILD_CMAKE_DEFINE``, and ``-DJAXOVERLAP_CUDA[:BOOL]=...`` in ``-Ccmake.args`` or
  ``CMAKE_ARGS`` (scikit-build-core passes all of them to CMake)."""
  settings = _values(config_settings, _SETTING)
  defines = [d.split("=", 1) for d in env.get("SKBUILD_CMAKE_DEFINE", "").split(";") if "=" in d]
  args = " ".join(_values(config_settings, "cmake.args") + [env.get("CMAKE_ARGS", "")])
  flags = re.findall(r"-D\s*JAXOVERLAP_CUDA(?::[A-Za-z]+)?=(\S*)", args.replace(";", " "))
  return [c.strip().lower() for c in settings + flags
          + [v for k, v in defines if k.strip() == "JAXOVERLAP_CUDA"]]


def _is_off(value: str) -> bool:
  """CMake's false constants: 0, OFF, NO, FALSE, N, IGNORE, NOTFOUND, "" and *-NOTFOUND."""
  return value in _OFF or value == "" or value.endswith("-notfound")


def nvcc(env: Mapping[str, str] | None = None, which=shutil.which,
         exists=os.path.exists) -> str | None:
  """The nvcc a build would use: ``CUDACXX``, else ``nvcc`` on PATH, else ``DEFAULT_NVCC``."""
  env = os.environ if env is None else env
  return env.get("CUDACXX") or which("nvcc") or (DEFAULT_NVCC if exists(DEFAULT_NVCC) else None)


def cuda_build(config_settings: Mapping | None = None, env: Mapping[str, str] | None = None,
               which=shutil.which, exists=os.path.exists) -> bool:
  """Whether this build compiles the CUDA backend (module docstring)."""
  return off_reason(config_settings, env, which, exists) is None


def _settings(config_settings: Mapping | None) -> dict:
  """``config_settings`` with ``JAXOVERLAP_CUDA=OFF`` where the CUDA backend is not built, and
  ``JAXOVERLAP_CUDA_OFF_REASON`` (``off_reason``) for CMake's message."""
  out = dict(config_settings or {})
  reason = off_reason(config_settings)
  if reason is not None:
    out[_SETTING] = "OFF"
    out[_REASON] = reason
    out["wheel.platlib"] = "false"  # pure Python: a py3-none-any wheel, not a platform's
  elif not (os.environ.get("CUDACXX") or shutil.which("nvcc") or _values(out, _COMPILER)):
    out[_COMPILER] = DEFAULT_NVCC  # CMake's check_language(CUDA) does not look there
  return out


def _requires(config_settings: Mapping | None) -> list[str]:
  return list(CUDA_BUILD_REQUIRES) if cuda_build(config_settings) else []


def get_requires_for_build_wheel(config_settings=None):
  return [*_skbuild.get_requires_for_build_wheel(_settings(config_settings)),
          *_requires(config_settings)]


def get_requires_for_build_editable(config_settings=None):
  return [*_skbuild.get_requires_for_build_editable(_settings(config_settings)),
          *_requires(config_settings)]


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
  return _skbuild.prepare_metadata_for_build_wheel(metadata_directory,
                                                   _settings(config_settings))


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
  return _skbuild.prepare_metadata_for_build_editable(metadata_directory,
                                                      _settings(config_settings))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
  return _skbuild.build_wheel(wheel_directory, _settings(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
  return _skbuild.build_editable(wheel_directory, _settings(config_settings), metadata_directory)
