"""benchmarks/profile_step.py: event classes, overlap arithmetic, trace parsing, a CPU run.

The synthetic GPU trace below mimics what jax's profiler writes on GPUs: a
"/host:CPU" process with the Python thread (and the step annotations), and a
"/device:GPU:0" process whose threads are the CUDA streams plus derived lines
("XLA Ops") that repeat the stream events and must not be counted. On CPU,
the real trace has host threads only; the script must still draw them.
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))  # the scripts import their harness
_PATH = os.path.join(_ROOT, "benchmarks", "profile_step.py")
_spec = importlib.util.spec_from_file_location("profile_step_benchmark", _PATH)
ps = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ps  # dataclasses look their module up
_spec.loader.exec_module(ps)

GEMM, COMM, OTHER = ps.GEMM, ps.COMM, ps.OTHER


# ------------------------------------------------------------------ classification


@pytest.mark.parametrize("name,want", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", GEMM),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", GEMM),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>(...)", GEMM),
    ("cublasLt::splitKreduce_kernel", GEMM),
    ("gemm_fusion_dot_general_3", GEMM),
    ("dot.12", GEMM),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", COMM),
    ("void jaxoverlap::overlap::(anonymous namespace)::PutKernel(char*, const char*)", COMM),
    ("void jaxoverlap::all_reduce::OneShotLLKernel<__nv_bfloat16>(Params)", COMM),
    ("WaitKernel(const unsigned long*, int)", COMM),
    ("SignalKernel", COMM),
    ("nvshmemi_barrier_all_kernel", COMM),
    ("MemcpyP2P", COMM),
    ("Memcpy PtoP (Device -> Device)", COMM),
    ("Memcpy DtoD (Device -> Device)", COMM),
    ("all-gather-start.1", COMM),
    ("reduce-scatter.3", COMM),
    ("all-reduce.12", COMM),
    ("collective-permute-start", COMM),
    ("Memcpy HtoD (Pageable -> Device)", OTHER),
    ("input_reduce_fusion_2", OTHER),  # "put" in lower case is not "Put"
    ("loop_multiply_fusion", OTHER),
    ("output_fusion", OTHER),
    ("softmax_kernel", OTHER),
])
def test_classify(name, want):
  assert ps.classify(name) == want


# ------------------------------------------------------------------ overlap arithmetic


def test_overlap_on_two_streams():
  s = ps.overlap_summary([("A", GEMM, 0.0, 10.0), ("B", COMM, 5.0, 15.0)])
  assert s["gemm_us"] == 10.0 and s["comm_us"] == 10.0
  assert s["overlap_us"] == 5.0 and s["overlap_fraction"] == 0.5
  assert s["same_row_us"] == 0.0


def test_same_stream_is_not_overlap():
  s = ps.overlap_summary([("A", GEMM, 0.0, 10.0), ("A", COMM, 5.0, 15.0)])
  assert s["overlap_us"] == 0.0 and s["same_row_us"] == 5.0
  assert s["overlap_fraction"] == 0.0


def test_union_counts_nested_and_concurrent_events_once():
  s = ps.overlap_summary([("A", GEMM, 0.0, 10.0), ("A", GEMM, 2.0, 4.0),
                          ("C", GEMM, 8.0, 12.0), ("B", OTHER, 0.0, 100.0)])
  assert s["gemm_us"] == 12.0 and s["gemm_sum_us"] == 16.0
  assert s["comm_us"] == 0.0 and s["overlap_us"] == 0.0 and s["overlap_fraction"] == 0.0


def test_touching_intervals_do_not_overlap():
  s = ps.overlap_summary([("A", GEMM, 0.0, 5.0), ("B", COMM, 5.0, 10.0)])
  assert s["overlap_us"] == 0.0 and s["gemm_us"] == 5.0 and s["comm_us"] == 5.0


def test_overlap_with_several_streams():
  # A: GEMM 0-10 and a jaxoverlap wait 10-20; B: transfers 0-4 and 6-14; C: GEMM 12-16.
  s = ps.overlap_summary([("A", GEMM, 0.0, 10.0), ("A", COMM, 10.0, 20.0),
                          ("B", COMM, 0.0, 4.0), ("B", COMM, 6.0, 14.0),
                          ("C", GEMM, 12.0, 16.0)])
  # GEMM on A with B's comm: 0-4, 6-10; GEMM on C with A's comm (and B's): 12-16.
  assert s["overlap_us"] == pytest.approx(4.0 + 4.0 + 4.0)
  assert s["gemm_us"] == pytest.approx(14.0) and s["comm_us"] == pytest.approx(18.0)
  assert s["comm_sum_us"] == pytest.approx(22.0)
  assert s["overlap_fraction"] == pytest.approx(12.0 / 18.0)


def test_gemm_and_comm_on_one_stream_overlap_comm_on_another():
  s = ps.overlap_summary([("A", GEMM, 0.0, 10.0), ("A", COMM, 0.0, 10.0),
                          ("B", COMM, 3.0, 4.0)])
  assert s["overlap_us"] == 1.0 and s["same_row_us"] == 9.0


# ------------------------------------------------------------------ trace parsing


def _meta(pid, name, tid=None, kind="thread_name", sort=0):
  e = {"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}
  if tid is not None:
    e["tid"] = tid
  out = [e]
  if tid is not None:
    out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                "args": {"sort_index": sort}})
  return out


def _x(pid, tid, name, ts, dur, **args):
  return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def gpu_trace():
  """Two traced steps (100-300 and 400-600 us) on a host thread; kernels on two streams."""
  ev = (_meta(1, "/host:CPU", kind="process_name") + _meta(1, "python", tid=11, sort=1)
        + _meta(2, "/device:GPU:0", kind="process_name")
        + _meta(2, "Stream #7(Compute)", tid=7, sort=1)
        + _meta(2, "Stream #20(MemcpyP2P)", tid=20, sort=2)
        + _meta(2, "XLA Ops", tid=99, sort=3))
  ev += [_x(1, 11, ps.STEP_NAME, 100, 200, step_num="0"),
         _x(1, 11, ps.STEP_NAME, 400, 200, step_num="1"),
         _x(1, 11, "PjitFunction(train_step)", 400, 20)]
  for base in (100, 400):
    ev += [_x(2, 7, "nvjet_tst_128x256_gemm", base + 20, 100),       # GEMM 20-120
           _x(2, 7, "loop_add_fusion", base + 120, 30),              # other 120-150
           _x(2, 7, "ncclDevKernel_AllReduce_Sum", base + 150, 20),  # comm 150-170
           _x(2, 20, "MemcpyP2P", base + 60, 80),                    # comm 60-140
           _x(2, 20, "marker", base + 70, 1e-6),                     # instant: dropped
           _x(2, 99, "dot.3", base + 20, 100)]                       # derived line: ignored
  return {"displayTimeUnit": "ns", "traceEvents": ev}


def test_parse_select_and_window_of_a_gpu_trace():
  rows, events, steps = ps.parse_trace(gpu_trace())
  assert steps == [(100.0, 300.0), (400.0, 600.0)]
  assert all(e.name != "marker" and e.name != ps.STEP_NAME for e in events)
  chosen, source = ps.select_rows(rows, events)
  assert source == "device streams"
  assert [r.thread for r in chosen] == ["Stream #7(Compute)", "Stream #20(MemcpyP2P)"]
  # The last step, shrunk to its stream events: 420-570.
  assert ps.step_window(steps, events, chosen) == (420.0, 570.0)


def test_analyze_a_gpu_trace():
  a = ps.analyze(gpu_trace())
  s = a["summary"]
  assert a["source"] == "device streams" and a["window"] == (420.0, 570.0)
  assert s["window_us"] == 150.0
  assert s["gemm_us"] == 100.0 and s["comm_us"] == pytest.approx(80.0 + 20.0)
  assert s["overlap_us"] == pytest.approx(60.0)  # memcpy 460-520 under the GEMM
  assert s["overlap_fraction"] == pytest.approx(0.6)
  assert [r["row"] for r in a["per_row"]] == ["GPU:0 Stream #7(Compute)",
                                               "GPU:0 Stream #20(MemcpyP2P)"]
  assert a["per_row"][0]["other_us"] == 30.0 and a["per_row"][1]["comm_us"] == 80.0
  assert a["top"][GEMM][0]["name"] == "nvjet_tst_128x256_gemm"
  assert a["step_us"] == [200.0, 200.0]


def test_cpu_like_trace_falls_back_to_host_threads(tmp_path):
  ev = (_meta(1, "/host:CPU", kind="process_name") + _meta(1, "python", tid=1, sort=1)
        + _meta(1, "tf_XLAPjRtCpuClient/1", tid=2, sort=2)
        + _meta(1, "tf_XLAEigen/3", tid=3, sort=3))
  ev += [_x(1, 1, ps.STEP_NAME, 0, 50), _x(1, 2, "dot.1", 5, 10),
         _x(1, 2, "all-reduce.2", 15, 10), _x(1, 3, "all-gather.1", 8, 4)]
  trace = {"traceEvents": ev}
  path = tmp_path / "t.json"
  path.write_text(json.dumps(trace))
  a = ps.analyze(ps.load_trace(str(path)))
  assert a["source"] == "host threads"
  assert [r.thread for r in a["rows"]] == ["tf_XLAPjRtCpuClient/1", "tf_XLAEigen/3"]
  assert a["window"] == (5.0, 25.0)
  assert a["summary"]["overlap_us"] == 4.0  # all-gather on thread 3 during dot.1 on thread 2
  png = str(tmp_path / "t.png")
  ps.plot_timeline(png, a["rows"], a["events"], a["window"], "cpu", a["summary"])
  assert os.path.getsize(png) > 1000


def test_find_trace_file_prefers_perfetto(tmp_path):
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  assert ps.find_trace_file(str(tmp_path)) is None
  (d / "host.trace.json.gz").write_bytes(b"")
  assert ps.find_trace_file(str(tmp_path)).endswith("host.trace.json.gz")
  (d / "perfetto_trace.json.gz").write_bytes(b"")
  assert ps.find_trace_file(str(tmp_path)).endswith("perfetto_trace.json.gz")


# ------------------------------------------------------------------ end to end


def _run_tiny(tmp_path, *extra):
  """profile_step.py on the tiny preset (xla, dp=4 x tp=2): (process, out dir, log dir)."""
  out, logdir = tmp_path / "out", tmp_path / "log"
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXOVERLAP_")}
  env.setdefault("JAX_PLATFORMS", "cpu")
  cmd = [sys.executable, _PATH, "--preset", "tiny", "--backend", "xla", "--mesh", "4,2",
         "--warmup", "1", "--steps_traced", "2", "--logdir", str(logdir), "--out", str(out),
         *extra]
  proc = subprocess.run(cmd, env=env, cwd=_ROOT, capture_output=True, text=True, timeout=300)
  return proc, out, logdir


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_script_end_to_end_on_cpu(tmp_path):
  proc, out, _ = _run_tiny(tmp_path, "--machine", "cpu test")
  if proc.returncode == ps.NO_TRACE_EXIT and "NO_PERFETTO_TRACE" in proc.stdout:
    pytest.skip("jax.profiler.trace wrote no perfetto trace on this CPU build")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

  assert (out / "profile_step-xla-cpu_test.png").stat().st_size > 1000
  result = json.loads((out / "profile_step-xla-cpu_test.json").read_text())
  for key in ("benchmark", "machine", "command", "date", "versions", "method", "records",
              "summary", "rows", "row_source"):
    assert key in result, key
  assert result["benchmark"] == "profile_step" and result["platform"] == "cpu"
  assert result["row_source"] == "host threads" and result["rows"]
  (record,) = result["records"]
  assert record["op"] == "train_step" and record["impl"] == "xla:xla"
  # Where each op ran, from the plans of the first (compiling) step.
  assert record["resolved"] and set(record["resolved"].values()) == {"xla"}, record["resolved"]
  assert record["shape"]["preset"] == "tiny" and record["time_us"] > 0
  s = result["summary"]
  assert 0 < s["window_us"] and 0 <= s["overlap_us"] <= min(s["gemm_us"], s["comm_us"]) + 1e-6
  assert 0.0 <= s["overlap_fraction"] <= 1.0
  assert len(result["traced_step_us"]) == 2 and len(result["traced_losses"]) == 2
  assert os.path.exists(result["trace_file"])


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_notrace_runs_the_steps_and_writes_nothing(tmp_path):
  proc, out, logdir = _run_tiny(tmp_path, "--notrace")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "profile_step --notrace: 1 + 2 steps ran" in proc.stdout
  assert not out.exists() and not logdir.exists()
