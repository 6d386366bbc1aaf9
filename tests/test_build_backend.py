"""build_backend/jaxoverlap_build.py: which builds ask for the CUDA build requirements."""

import os
import sys

import pytest

pytest.importorskip("scikit_build_core")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "build_backend"))
import jaxoverlap_build as backend  # noqa: E402

NVCC = lambda name: "/opt/cuda/bin/nvcc" if name == "nvcc" else None  # noqa: E731
NONE = lambda name: None  # noqa: E731
NO_FILE = lambda path: False  # noqa: E731


@pytest.mark.parametrize("settings,env,which,want", [
    (None, {}, NVCC, True),                                            # nvcc on PATH
    (None, {}, NONE, False),                                           # no nvcc anywhere
    (None, {"CUDACXX": "/x/nvcc"}, NONE, True),                        # CMake's variable
    ({"cmake.define.JAXOVERLAP_CUDA": "OFF"}, {}, NVCC, False),        # -C... =OFF
    ({"cmake.define.JAXOVERLAP_CUDA": ["ON", "off"]}, {}, NVCC, False),
    ({"cmake.define.JAXOVERLAP_CUDA": "ON"}, {}, NVCC, True),
    (None, {"SKBUILD_CMAKE_DEFINE": "CMAKE_CUDA_ARCHITECTURES=90;JAXOVERLAP_CUDA=OFF"}, NVCC,
     False),
    (None, {"SKBUILD_CMAKE_DEFINE": "CMAKE_CUDA_ARCHITECTURES=90"}, NVCC, True),
])
def test_cuda_build(settings, env, which, want):
  assert backend.cuda_build(settings, env, which, NO_FILE) is want


def test_default_toolkit_location_counts():
  assert backend.cuda_build(None, {}, NONE, lambda p: p == "/usr/local/cuda/bin/nvcc")


def test_off_reason_says_why():
  assert backend.off_reason({"cmake.define.JAXOVERLAP_CUDA": "OFF"}, {}, NVCC, NO_FILE) == (
      "requested")
  assert backend.off_reason(None, {}, NONE, NO_FILE) == "no-nvcc"
  assert backend.off_reason(None, {}, NVCC, NO_FILE) is None


def test_requires_and_settings_follow_the_choice(monkeypatch):
  monkeypatch.setattr(backend, "off_reason", lambda *args: "no-nvcc")
  off = {"a": "b", "cmake.define.JAXOVERLAP_CUDA": "OFF",
         "cmake.define.JAXOVERLAP_CUDA_OFF_REASON": "no-nvcc"}
  assert backend._requires({}) == [] and backend._settings({"a": "b"}) == off  # noqa: SLF001
  monkeypatch.setattr(backend, "off_reason", lambda *args: None)
  assert backend._requires({}) == list(backend.CUDA_BUILD_REQUIRES)  # noqa: SLF001
  assert backend._settings({"a": "b"}) == {"a": "b"}  # noqa: SLF001
