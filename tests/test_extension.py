"""The CUDA extension: built, loadable and registered, on a machine without a GPU.

CI compiles the CUDA code on every run (.ci/run sets
JAXOVERLAP_REQUIRE_CUDA_BUILD=1, which makes CMake fail without nvcc and makes
these tests fail instead of skipping when the extension is missing). Without a
GPU nothing can run on it, but the chain up to the kernels can be checked:
the module loads with NVSHMEM's host library, exposes one capsule per FFI
target, the targets register with jax, and the backend refuses "cuda" with a
reason until jaxoverlap.initialize() has run.
"""

import glob
import os

import jax
import pytest

import jaxoverlap
from jaxoverlap import _ffi, backend

_REQUIRED = os.environ.get("JAXOVERLAP_REQUIRE_CUDA_BUILD") == "1"


def _built() -> bool:
  pkg = os.path.dirname(jaxoverlap.__file__)
  return bool(glob.glob(os.path.join(pkg, "_jaxoverlap_cuda*.so"))) or _ffi.unavailable_reason() is None


needs_extension = pytest.mark.skipif(
    not _REQUIRED and not _built(), reason="the CUDA extension is not built (no nvcc at install)")


@needs_extension
def test_extension_loads_and_registers_targets():
  assert _ffi.unavailable_reason() is None, _ffi.unavailable_reason()
  ext = _ffi.load()
  regs = ext.registrations()
  assert set(regs) == {"jaxoverlap_all_reduce", "jaxoverlap_launch_floor",
                       "jaxoverlap_all_gather_matmul", "jaxoverlap_all_gather_matmul_gathered",
                       "jaxoverlap_matmul_reduce_scatter", "jaxoverlap_matmul_all_reduce",
                       "jaxoverlap_all_gather_matmul_cmdbuf",
                       "jaxoverlap_all_gather_matmul_gathered_cmdbuf",
                       "jaxoverlap_matmul_reduce_scatter_cmdbuf",
                       "jaxoverlap_matmul_all_reduce_cmdbuf"}
  info = ext.info()
  assert info["initialized"] is False and info["pe"] == -1
  assert info["max_group_size"] == 8
  assert info["max_chunks"] == 32 and info["gemm_plans"] == 0
  assert ext.device_error() is None


@needs_extension
def test_cuda_backend_refused_until_initialized(monkeypatch):
  monkeypatch.setattr(backend, "_jax_platform", lambda: "gpu")  # as on a GPU machine
  reason = backend.cuda_unavailable_reason("all_reduce")
  assert reason is not None and "initialize()" in reason
  with pytest.raises(RuntimeError, match=r"backend='cuda' was requested for all_reduce, but "
                                         r"jaxoverlap.initialize\(\) has not been called"):
    backend.select_backend("all_reduce", "cuda")
  assert backend.select_backend("all_reduce", "auto") == "xla"
  info = jaxoverlap.runtime_info()
  assert info["extension"] == "loaded" and info["initialized"] is False
  for op in backend.OPS:
    assert "initialize()" in info["backends"][op]


@needs_extension
def test_initialize_refuses_without_one_gpu_per_process():
  with pytest.raises(RuntimeError, match="needs exactly one GPU per process"):
    jaxoverlap.initialize()


@needs_extension
@pytest.mark.parametrize("cap", ["0", "24", "512", "16 ", "x"])
def test_initialize_refuses_a_bad_gemm_alignment_cap(monkeypatch, cap):
  monkeypatch.setenv("JAXOVERLAP_GEMM_ALIGNMENT_CAP", cap)
  with pytest.raises(ValueError, match="JAXOVERLAP_GEMM_ALIGNMENT_CAP=.*power of two"):
    jaxoverlap.initialize()


@needs_extension
def test_initialize_accepts_a_good_gemm_alignment_cap(monkeypatch):
  monkeypatch.setenv("JAXOVERLAP_GEMM_ALIGNMENT_CAP", "256")
  with pytest.raises(RuntimeError, match="needs exactly one GPU per process"):
    jaxoverlap.initialize()  # got past the check; refused for the CPU


def test_initialize_refuses_xla_nvshmem(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") +
                     " --xla_gpu_experimental_enable_nvshmem=true")
  if _ffi.unavailable_reason() is not None and not _REQUIRED:
    with pytest.raises(RuntimeError):
      jaxoverlap.initialize()
    return
  with pytest.raises(RuntimeError, match="XLA's own NVSHMEM is switched on"):
    jaxoverlap.initialize()


def test_missing_extension_is_reported_not_silent():
  info = jaxoverlap.runtime_info()
  assert set(info["backends"]) == set(backend.OPS)
  for op, why in info["backends"].items():
    assert why == "cuda" or len(why) > 20, (op, why)
  assert jax.default_backend() == "cpu"
