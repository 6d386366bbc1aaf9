"""The launcher: N processes with jax.distributed wired, output prefixed, failures stop all."""

import os
import subprocess
import sys
import textwrap

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_launcher(tmp_path, body: str, *args, timeout=120):
  script = tmp_path / "child.py"
  script.write_text(textwrap.dedent(body))
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_ROOT + os.pathsep +
             os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  return subprocess.run([sys.executable, "-m", "jaxoverlap.launch", *args, str(script)],
                        env=env, capture_output=True, text=True, timeout=timeout)


def test_two_processes_join_one_distributed_job(tmp_path):
  out = _run_launcher(tmp_path, """
      from jaxoverlap import launch
      info = launch.initialize_from_env(nvshmem=False)
      import jax
      print("joined", info["process_id"], info["num_processes"], jax.process_count(),
            jax.process_index(), flush=True)
      jax.distributed.shutdown()
      """, "--nproc", "2", "--timeout_s", "100")
  assert out.returncode == 0, out.stdout + out.stderr
  assert "[rank 0] joined 0 2 2 0" in out.stdout
  assert "[rank 1] joined 1 2 2 1" in out.stdout


def test_a_failing_process_stops_the_others(tmp_path):
  out = _run_launcher(tmp_path, """
      import os, sys, time
      if os.environ["JAXOVERLAP_PROCESS_ID"] == "1":
          sys.exit(7)
      time.sleep(60)
      """, "--nproc", "2", "--timeout_s", "50")
  assert out.returncode == 7
  assert "a process exited with 7; stopping the others" in out.stderr


def test_usage_errors():
  out = subprocess.run([sys.executable, "-m", "jaxoverlap.launch", "--nproc", "2"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=_ROOT))
  assert out.returncode == 2 and "give a script or -m module" in out.stderr
  out = subprocess.run([sys.executable, "-m", "jaxoverlap.launch", "--nproc", "0", "x.py"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=_ROOT))
  assert out.returncode == 2 and "--nproc must be >= 1" in out.stderr



@pytest.mark.parametrize("value,why", [
    ("-5", "must be a finite number of seconds >= 0 (0: no limit)"),
    ("-0.5", "must be a finite number of seconds >= 0"),
    ("inf", "must be a finite number of seconds >= 0"),
    ("nan", "must be a finite number of seconds >= 0"),
    ("soon", "is not a number of seconds"),
])
def test_timeout_must_be_a_finite_number_of_seconds(tmp_path, value, why):
  """A negative --timeout_s killed the children at the first poll; now nothing starts."""
  out = _run_launcher(tmp_path, """
      print("started", flush=True)
      """, "--nproc", "2", "--timeout_s", value)
  assert out.returncode == 2, out.stdout + out.stderr
  assert f"argument --timeout_s: {value!r} {why}" in out.stderr, out.stderr
  assert "started" not in out.stdout


def test_timeout_zero_means_no_limit(tmp_path):
  out = _run_launcher(tmp_path, """
      import time
      time.sleep(1.5)
      print("done", flush=True)
      """, "--nproc", "1", "--timeout_s", "0")
  assert out.returncode == 0, out.stdout + out.stderr
  assert "[rank 0] done" in out.stdout


@pytest.mark.parametrize("num_gpus,expected", [(0, ["0", "1", "2"]), (2, ["0", "1", "0"])])
def test_local_device_assignment(tmp_path, num_gpus, expected):
  out = _run_launcher(tmp_path, """
      import os
      print("dev", os.environ["JAXOVERLAP_LOCAL_DEVICE"], flush=True)
      """, "--nproc", "3", "--num_gpus", str(num_gpus))
  assert out.returncode == 0, out.stderr
  for rank, dev in enumerate(expected):
    assert f"[rank {rank}] dev {dev}" in out.stdout


def test_launched_reads_the_launcher_and_slurm(monkeypatch):
  from jaxoverlap import launch
  for var in ("JAXOVERLAP_COORDINATOR", "SLURM_PROCID", "SLURM_NTASKS"):
    monkeypatch.delenv(var, raising=False)
  assert not launch.launched()
  monkeypatch.setenv("SLURM_PROCID", "0")
  monkeypatch.setenv("SLURM_NTASKS", "1")
  assert not launch.launched()  # one SLURM task runs alone
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert launch.launched()
  monkeypatch.delenv("SLURM_PROCID")
  monkeypatch.setenv("JAXOVERLAP_COORDINATOR", "localhost:1234")
  assert launch.launched()


def test_reproduce_command_names_the_launcher_and_the_settings(monkeypatch):
  from jaxoverlap import launch
  for k in launch.SETTINGS + ("COORDINATOR", "NUM_PROCESSES"):
    monkeypatch.delenv("JAXOVERLAP_" + k, raising=False)
  assert (launch.reproduce_command("benchmarks/x.py", ["--out", "a b"])
          == "python benchmarks/x.py --out 'a b'")
  assert launch.reproduce_command("benchmarks/x.py", []) == "python benchmarks/x.py"
  monkeypatch.setenv("JAXOVERLAP_COORDINATOR", "127.0.0.1:1")
  monkeypatch.setenv("JAXOVERLAP_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAXOVERLAP_FUSED_CMD_BUFFER", "1")
  monkeypatch.setenv("JAXOVERLAP_PROCESS_ID", "1")  # the launcher's own: not a setting
  assert (launch.reproduce_command("benchmarks/x.py", ["--quick"])
          == "JAXOVERLAP_FUSED_CMD_BUFFER=1 python -m jaxoverlap.launch --nproc 2 "
             "benchmarks/x.py --quick")


def test_module_arguments_pass_through_even_when_they_look_like_options(tmp_path):
  """python -m's convention: everything after -m MODULE is the module's (--out, --nproc...)."""
  module = tmp_path / "echo_args.py"
  module.write_text("import sys\nprint('args', sys.argv[1:], flush=True)\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=str(tmp_path) + os.pathsep + _ROOT + os.pathsep +
             os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-m", "jaxoverlap.launch", "--nproc", "1", "-m",
                        "echo_args", "--out", "x", "--nproc", "3"],
                       env=env, capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "[rank 0] args ['--out', 'x', '--nproc', '3']" in out.stdout
