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
  # Trial 34: the pure-Python wheel was tagged with the build machine's platform.
  off = {"a": "b", "cmake.define.JAXOVERLAP_CUDA": "OFF",
         "cmake.define.JAXOVERLAP_CUDA_OFF_REASON": "no-nvcc", "wheel.platlib": "false"}
  assert backend._requires({}) == [] and backend._settings({"a": "b"}) == off  # noqa: SLF001
  monkeypatch.setattr(backend, "off_reason", lambda *args: None)
  monkeypatch.setattr(backend.shutil, "which", NVCC)  # nvcc on PATH: CMake finds it itself
  assert backend._requires({}) == list(backend.CUDA_BUILD_REQUIRES)  # noqa: SLF001
  assert backend._settings({"a": "b"}) == {"a": "b"}  # noqa: SLF001


def test_explicit_on_without_nvcc_is_an_error_not_a_pure_python_install():
  """Trial 34: -Ccmake.define.JAXOVERLAP_CUDA=ON with no nvcc installed as pure Python, rc 0."""
  with pytest.raises(RuntimeError, match="JAXOVERLAP_CUDA=ON was asked for, but nvcc was not"):
    backend.off_reason({"cmake.define.JAXOVERLAP_CUDA": "ON"}, {}, NONE, NO_FILE)
  with pytest.raises(RuntimeError, match="nvcc was not found"):
    backend.off_reason(None, {"SKBUILD_CMAKE_DEFINE": "JAXOVERLAP_CUDA=1"}, NONE, NO_FILE)
  # OFF wins over ON; ON with nvcc builds.
  assert backend.off_reason({"cmake.define.JAXOVERLAP_CUDA": ["ON", "OFF"]}, {}, NONE,
                            NO_FILE) == "requested"
  assert backend.off_reason({"cmake.define.JAXOVERLAP_CUDA": "ON"}, {}, NVCC, NO_FILE) is None


def test_nvcc_in_the_default_location_is_handed_to_cmake(monkeypatch):
  """Trial 34: the backend counted /usr/local/cuda/bin/nvcc and downloaded the CUDA build
  requirements, but CMake's check_language(CUDA) does not look there: a pure-Python wheel."""
  monkeypatch.delenv("CUDACXX", raising=False)
  monkeypatch.setattr(backend.shutil, "which", NONE)  # what _settings asks at call time
  monkeypatch.setattr(backend, "off_reason", lambda *args: None)  # a CUDA build
  assert backend.nvcc({}, NONE, lambda p: p == backend.DEFAULT_NVCC) == backend.DEFAULT_NVCC
  assert backend.nvcc({}, NONE, NO_FILE) is None
  assert backend._settings({"a": "b"}) == {  # noqa: SLF001
      "a": "b", "cmake.define.CMAKE_CUDA_COMPILER": backend.DEFAULT_NVCC}
  mine = {"cmake.define.CMAKE_CUDA_COMPILER": "/opt/nvcc"}  # the user's choice stays
  assert backend._settings(mine) == mine  # noqa: SLF001
  monkeypatch.setattr(backend.shutil, "which", NVCC)  # on PATH: CMake finds it itself
  assert backend._settings({}) == {}  # noqa: SLF001


def test_the_version_and_the_license_are_said_once():
  """Trial 34: the version was written in two places with no test tying them, and the
  license was declared with no text to ship."""
  import re
  import tomllib

  import jaxoverlap

  root = os.path.join(os.path.dirname(__file__), "..")
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  assert jaxoverlap.__version__ == project["version"]
  with open(os.path.join(root, "LICENSE")) as f:
    text = f.read()
  assert project["license"] == "Apache-2.0" and "Apache License" in text
  assert re.search(r"Version 2\.0, January 2004", text)
  assert os.path.exists(os.path.join(root, "NOTICE"))
  assert os.path.exists(os.path.join(root, "jaxoverlap", "py.typed"))


@pytest.mark.parametrize("settings,env", [
    (None, {"CMAKE_ARGS": "-DCMAKE_BUILD_TYPE=Release -DJAXOVERLAP_CUDA=OFF"}),
    ({"cmake.args": "-DJAXOVERLAP_CUDA:BOOL=OFF"}, {}),
    ({"cmake.args": ["-DFOO=1", "-DJAXOVERLAP_CUDA=IGNORE"]}, {}),
    (None, {"CMAKE_ARGS": "-D JAXOVERLAP_CUDA=OFF"}),                  # a space after -D
    (None, {"CMAKE_ARGS": "-DJAXOVERLAP_CUDA="}),                      # empty: false
    ({"cmake.define.JAXOVERLAP_CUDA": "nvcc-NOTFOUND"}, {}),
])
def test_cmake_args_that_turn_cuda_off_are_heard(settings, env):
  """Trial 34: CMake was told OFF through CMAKE_ARGS or -Ccmake.args, which scikit-build-core
  passes on, but the backend still downloaded the CUDA build requirements."""
  assert backend.off_reason(settings, env, NVCC, NO_FILE) == "requested"
  assert backend.off_reason(None, {"CMAKE_ARGS": "-DJAXOVERLAP_CUDA=ON"}, NVCC, NO_FILE) is None


def test_a_build_without_scikit_build_core_says_which_python_lacks_it():
  """Seen on the GPU machine: the `pip` on PATH belonged to another Python than `python3`, and
  --no-build-isolation failed with pip's bare "Cannot import 'jaxoverlap_build'"."""
  import subprocess

  code = ("import sys; sys.modules['scikit_build_core'] = None; "
          f"sys.path.insert(0, {os.path.dirname(backend.__file__)!r}); import jaxoverlap_build")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert run.returncode == 1
  assert "RuntimeError: jaxoverlap's build backend needs scikit-build-core" in run.stderr
  assert f"{sys.executable} -m pip install 'scikit-build-core>=0.10'" in run.stderr
