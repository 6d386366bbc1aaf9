"""benchmarks/fused_contention.py: pairing GEMMs and transfers on synthetic traces, a CPU run.

The events mimic one rank's device streams in a trace of the fused ops: a
compute stream with the shard GEMMs (cuBLASLt names) and the flag kernels, a
communication stream with the copy-engine memcpys or the NVSHMEM put kernel.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location(
    "fused_contention_benchmark", os.path.join(_ROOT, "benchmarks", "fused_contention.py"))
fc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fc
_spec.loader.exec_module(fc)
Event = fc.profile_step.Event

GEMM = "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT"
COPY = "Memcpy PtoP (Device -> Device)"
COMPUTE, COMM = ("gpu", 1), ("gpu", 2)


def _ag_call(t0, gemm_alone, gemm_beside, copy):
  """One all_gather_matmul call: own GEMM beside the send, the wait, the peer's GEMM."""
  return [
      Event(COMM, COPY, t0, t0 + copy),
      Event(COMPUTE, GEMM, t0, t0 + gemm_beside),
      Event(COMPUTE, "WaitKernel", t0 + max(gemm_beside, copy), t0 + max(gemm_beside, copy) + 1),
      Event(COMPUTE, GEMM, t0 + max(gemm_beside, copy) + 1,
            t0 + max(gemm_beside, copy) + 1 + gemm_alone),
  ]


def test_gemm_beside_a_transfer_against_the_same_gemm_alone():
  events = []
  for i, (alone, beside) in enumerate([(100, 120), (102, 118), (98, 125)]):
    events += _ag_call(1000 * i, alone, beside, copy=90)
  s = fc.kernel_stats(events)
  assert s["gemm_kernel"] == GEMM
  assert s["gemm_alone_us"] == pytest.approx(100)
  assert s["gemm_concurrent_us"] == pytest.approx(120)
  assert s["gemm_slowdown"] == pytest.approx(0.2)
  assert s["transfers"] == 3 and s["transfer_us"] == pytest.approx(90)
  assert s["gemms"][GEMM]["concurrent_n"] == 3 and s["gemms"][GEMM]["alone_n"] == 3


def test_the_flag_kernels_are_not_transfers():
  # A wait kernel on the communication stream beside a GEMM does not make it concurrent.
  events = [Event(COMPUTE, GEMM, 0, 100), Event(COMM, "WaitKernel", 0, 100),
            Event(COMM, "SignalKernel", 100, 101), Event(COMPUTE, GEMM, 200, 300)]
  s = fc.kernel_stats(events)
  assert s["transfers"] == 0 and s["gemm_kernel"] is None
  assert s["gemms"][GEMM]["alone_n"] == 2


def test_put_kernel_counts_as_a_transfer():
  assert fc.is_transfer("PutKernel(char*, char const*, unsigned long)")
  assert fc.is_transfer(COPY)
  assert not fc.is_transfer("AddKernel<__nv_bfloat16>")


def test_partly_overlapped_gemms_are_neither():
  # 30% beside the copy: neither concurrent (>= 50%) nor alone (<= 5%).
  events = [Event(COMM, COPY, 0, 30), Event(COMPUTE, GEMM, 0, 100),
            Event(COMPUTE, GEMM, 200, 300)]
  s = fc.kernel_stats(events)
  assert s["gemms"][GEMM]["partly_n"] == 1 and s["gemm_slowdown"] is None


def test_copies_on_a_gemm_stream_are_not_transfers():
  # matmul_all_reduce's local slot -> out copies run on the compute stream: not sends.
  events = [Event(COMPUTE, COPY, 0, 100), Event(COMPUTE, GEMM, 50, 150),
            Event(COMM, COPY, 200, 300, {"memcpy_details": "size:1000000 dest:1 async:1"})]
  s = fc.kernel_stats(events)
  assert s["transfers"] == 1 and s["transfer_us"] == pytest.approx(100)
  assert s["transfer_gbps"] == pytest.approx(1e6 / 100 / 1e3)
  assert s["gemms"][GEMM]["alone_n"] == 1


def test_memcpy_bytes_from_the_trace_args():
  ev = Event(COMM, COPY, 0, 1, {"memcpy_details": "kind_src:unknown kind_dst:unknown "
                                                  "size:67108864 dest:1 async:1"})
  assert fc.memcpy_bytes(ev) == 67108864
  assert fc.memcpy_bytes(Event(COMM, COPY, 0, 1)) is None
  assert fc.memcpy_bytes(Event(COMM, COPY, 0, 1, {"memcpy_details": "size:x"})) is None


def test_small_shape_keeps_the_transferred_block():
  assert fc.small_shape("ag", (16384, 4096, 4096), 2, 128) == (16384, 4096, 256)
  assert fc.small_shape("rs", (16384, 4096, 4096), 2, 128) == (16384, 256, 4096)


@pytest.mark.parametrize("op,chunks", [("ag", 1), ("ag", 2), ("rs", 2), ("ar", 1)])
def test_transfer_bytes_per_chunk(op, chunks):
  m, k, n, world, calls = 16384, 4096, 2048, 2, 5
  block = (m // world) * (k if op == "ag" else n) * 2
  transfers = calls * (world - 1) * chunks * (2 if op == "ar" else 1)
  assert fc.transfer_bytes(op, (m, k, n), world, 2, transfers, calls) == block / chunks
  assert fc.transfer_bytes(op, (m, k, n), world, 2, 0, calls) is None


def test_record_compares_bandwidth_across_chunk_counts():
  # Put kernels: no size in the trace, so the block over the chunks counted.
  main = {"gemm_kernel": GEMM, "gemm_alone_us": 100.0, "gemm_concurrent_us": 110.0,
          "gemm_slowdown": 0.1, "transfer_us": 200.0, "transfer_gbps": None, "transfers": 10,
          "gemms": {}}
  # The small run sent the same block in two chunks of half the time each: no slowdown.
  small = dict(main, transfer_us=100.0, transfers=20)
  r = fc.contention_record("ag", (16384, 4096, 4096), "jaxoverlap:copy_engine", main, small,
                           (16384, 4096, 256), world=2, rank=0, itemsize=2, calls=10)
  assert r["transfer_gbps"] == pytest.approx(8192 * 4096 * 2 / 200.0 / 1e3)
  assert r["transfer_slowdown"] == pytest.approx(0.0)
  assert r["gemm_slowdown"] == pytest.approx(0.1)
  # Memcpys: the trace's sizes win.
  r = fc.contention_record("ag", (16384, 4096, 4096), "jaxoverlap:copy_engine",
                           dict(main, transfer_gbps=300.0), dict(small, transfer_gbps=400.0),
                           (16384, 4096, 256), world=2, rank=0, itemsize=2, calls=10)
  assert r["transfer_slowdown"] == pytest.approx(400 / 300 - 1)


def test_script_in_two_processes_on_cpu(tmp_path):
  # Two processes through the launcher: rank 0 writes both ranks' records (harness.gather_json).
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_ROOT)
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, "-m", "jaxoverlap.launch", "--nproc", "2", "--timeout_s", "240",
         os.path.join(_ROOT, "benchmarks", "fused_contention.py"), "--shapes", "ag:64,32,32",
         "--impls", "xla:naive", "--calls", "2", "--warmup", "1", "--out", str(tmp_path),
         "--logdir", str(tmp_path / "traces")]
  proc = subprocess.run(cmd, env=env, cwd=_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  # Named after every process's devices (harness.machine_name), not a fixed GPU machine.
  result = json.loads((tmp_path / "fused_contention-2x_cpu.json").read_text())
  assert result["benchmark"] == "fused_contention" and result["processes"] == 2
  assert result["machine"] == "2x cpu"
  assert [r["rank"] for r in result["records"]] == [0, 1]
  assert all(r["transfers"] == 0 for r in result["records"])  # CPU: no device kernels


def test_one_device_is_refused(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_ROOT)
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(_ROOT, "benchmarks", "fused_contention.py"),
         "--host_devices", "1", "--shapes", "ag:64,32,32", "--impls", "xla:naive",
         "--out", str(tmp_path), "--logdir", str(tmp_path / "traces")]
  proc = subprocess.run(cmd, env=env, cwd=_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "at least 2 devices" in proc.stderr, proc.stderr[-2000:]
