"""The CUDA extension: built, loadable and registered, on a machine without a GPU.

CI compiles the CUDA code on every run (.ci/run sets
JAXOVERLAP_REQUIRE_CUDA_BUILD=1, which makes CMake fail without nvcc and makes
these tests fail instead of skipping when the extension is missing). Without a
GPU nothing can run on it, but the chain up to the kernels can be checked:
the module loads with NVSHMEM's host library, exposes one capsule per FFI
target, the targets register with jax, its enums carry exactly the names of
jaxoverlap.names, and backend "cuda" is refused with a reason until
jaxoverlap.initialize() has run.
"""

import glob
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxoverlap
from _helpers import make_mesh
from jaxoverlap import _checks, _ffi, names, runtime

_REQUIRED = os.environ.get("JAXOVERLAP_REQUIRE_CUDA_BUILD") == "1"


def _built() -> bool:
  pkg = os.path.dirname(jaxoverlap.__file__)
  return bool(glob.glob(os.path.join(pkg, "_jaxoverlap_cuda*.so"))) or _ffi.unavailable_reason() is None


needs_extension = pytest.mark.skipif(
    not _REQUIRED and not _built(),
    reason="the CUDA extension is not built (no nvcc at install, or JAXOVERLAP_CUDA=OFF)")


@needs_extension
def test_extension_loads_and_registers_targets():
  assert _ffi.unavailable_reason() is None, _ffi.unavailable_reason()
  ext = _ffi.load()
  regs = ext.registrations()
  assert set(regs) == {"jaxoverlap_all_reduce", "jaxoverlap_all_reduce_reduce_scatter",
                       "jaxoverlap_all_reduce_all_gather", "jaxoverlap_all_reduce_rms_norm",
                       "jaxoverlap_launch_floor", "jaxoverlap_launch_floor_pdl",
                       "jaxoverlap_launch_floor_bookkeeping", "jaxoverlap_launch_floor_prefetch",
                       "jaxoverlap_launch_floor_shaped",
                       "jaxoverlap_all_gather_matmul", "jaxoverlap_all_gather_matmul_gathered",
                       "jaxoverlap_matmul_reduce_scatter", "jaxoverlap_matmul_all_reduce",
                       "jaxoverlap_all_gather_matmul_cmdbuf",
                       "jaxoverlap_all_gather_matmul_gathered_cmdbuf",
                       "jaxoverlap_matmul_reduce_scatter_cmdbuf",
                       "jaxoverlap_matmul_all_reduce_cmdbuf"}
  info = ext.info()
  assert info["initialized"] is False and info["pe"] == -1
  assert ext.limits()["max_group_size"] == 8
  assert ext.limits()["max_chunks"] == _checks.MAX_CHUNKS == 32  # trace-time check = kernels'
  assert info["gemm_plans"] == 0
  assert ext.device_error() is None


@needs_extension
def test_exported_enums_carry_the_vocabulary():
  ext = _ffi.load()
  assert set(ext.AllReduceAlgorithm.__members__) == set(
      names.algorithms(names.ALL_REDUCE, names.CUDA))
  assert set(ext.Protocol.__members__) == set(names.PROTOCOLS)
  assert set(ext.Transport.__members__) == set().union(
      *(names.transports(op) for op in names.FUSED_OPS))
  assert set(ext.Precision.__members__) == {"default", "highest"}
  # Distinct values within each enum.
  for enum in (ext.AllReduceAlgorithm, ext.Protocol, ext.Transport, ext.Precision):
    values = [m.value for m in enum]
    assert len(set(values)) == len(values), enum


@needs_extension
def test_cuda_backend_refused_until_initialized(monkeypatch):
  monkeypatch.setattr(runtime, "_platform", lambda: "gpu")  # as on a GPU machine
  reason = runtime.unavailable_reason()
  assert reason is not None and "initialize()" in reason
  mesh = make_mesh((2,), ("tp",))
  x = jnp.ones((4, 8), jnp.float32)

  def lower(backend):
    f = jax.shard_map(lambda x: jaxoverlap.all_reduce(x, "tp", backend=backend), mesh=mesh,
                      in_specs=P("tp"), out_specs=P())
    return jax.jit(f).lower(x)

  with pytest.raises(RuntimeError, match=r"all_reduce: backend='cuda' was requested, but "
                                         r"jaxoverlap.initialize\(\) has not been called"):
    lower("cuda")
  jaxoverlap.clear_decisions()
  lower("auto")
  (plan,) = jaxoverlap.decisions()
  assert plan.backend == "xla" and "initialize()" in plan.reason("backend")
  info = jaxoverlap.runtime_info()
  assert info["extension"] == "loaded" and info["initialized"] is False
  for op in names.OPS:
    assert "initialize()" in info["backends"][op]


@needs_extension
def test_initialize_refuses_without_a_gpu():
  with pytest.raises(RuntimeError, match="the CUDA backend needs NVIDIA GPUs"):
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
  with pytest.raises(RuntimeError, match="the CUDA backend needs NVIDIA GPUs"):
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
  assert set(info["backends"]) == set(names.OPS)
  for op, why in info["backends"].items():
    assert why == "cuda" or len(why) > 20, (op, why)
  assert jax.default_backend() == "cpu"


@needs_extension
@pytest.mark.parametrize("num_pes,rpn", [(2, 2), (8, 8), (16, 8), (384, 8), (480, 8), (512, 8),
                                         (512, 1), (3, 1)])
def test_heap_layout_gives_lamport_room_without_refusing_a_job(num_pes, rpn):
  """Lamport slots come out of what the other slots leave: the smallest heap is unchanged."""
  import re

  ext = _ffi.load()
  default = ext.heap_layout(num_pes, rpn, runtime.DEFAULT_HEAP_BYTES,
                            runtime.DEFAULT_OVERLAP_HEAP_BYTES)
  assert 64 << 10 <= default["lamport_slot_bytes"] <= 16 << 20
  assert default["lamport_slot_bytes"] % (64 << 10) == 0
  assert default["slot_bytes"] >= 64 << 10
  with pytest.raises(RuntimeError, match="needs at least") as err:
    ext.heap_layout(num_pes, rpn, 1 << 20, runtime.DEFAULT_OVERLAP_HEAP_BYTES)
  least = int(re.search(r"needs at least (\d+) bytes", str(err.value)).group(1))
  tight = ext.heap_layout(num_pes, rpn, least, runtime.DEFAULT_OVERLAP_HEAP_BYTES)
  assert tight["lamport_slot_bytes"] == 0 and tight["slot_bytes"] >= 64 << 10


def test_a_source_tree_without_the_extension_names_the_installed_copy(tmp_path, monkeypatch):
  """Trial 21: run from the repository's root, `import jaxoverlap` finds the source tree, and
  the message said to reinstall a build that had succeeded (into site-packages)."""
  import importlib.machinery

  from jaxoverlap import _ffi

  installed = tmp_path / "site" / "jaxoverlap"
  installed.mkdir(parents=True)
  suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
  monkeypatch.setattr(_ffi.sys, "path", [str(tmp_path / "site"), *_ffi.sys.path])
  assert _ffi._built_elsewhere() != str(installed.resolve())  # no extension there yet
  (installed / ("_jaxoverlap_cuda" + suffix)).write_bytes(b"")
  assert _ffi._built_elsewhere() == str(installed.resolve())
  message = _ffi._not_built_message()
  assert message.startswith("this process imported jaxoverlap from ")
  assert f"while the installed package at {installed.resolve()} has it: run from outside the "\
         "repository's root" in message
