"""The launcher: N processes with jax.distributed wired, output prefixed, failures stop all."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_ROOT + os.pathsep +
             os.environ.get("PYTHONPATH", ""), **extra)
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  return env


def _run_launcher(tmp_path, body: str, *args, script_args=(), timeout=120):
  script = tmp_path / "child.py"
  script.write_text(textwrap.dedent(body))
  return subprocess.run([sys.executable, "-m", "jaxoverlap.launch", *args, str(script),
                         *script_args],
                        env=_env(), capture_output=True, text=True, timeout=timeout)


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
  assert "jaxoverlap.launch: rank 1 exited with 7; stopping rank 0" in out.stderr, out.stderr


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


@pytest.mark.parametrize("num_gpus,expected", [(None, ["0", "1", "2"]), (2, ["0", "1", "0"])])
def test_local_device_assignment(tmp_path, num_gpus, expected):
  out = _run_launcher(tmp_path, """
      import os
      print("dev", os.environ["JAXOVERLAP_LOCAL_DEVICE"], flush=True)
      """, "--nproc", "3", *(["--num_gpus", str(num_gpus)] if num_gpus else []))
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


# --------------------------------------------------------------- signals to the launcher


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_stop_every_rank(tmp_path, sig):
  """Issue: SIGTERM (kill, timeout, CI, scancel) killed the launcher alone; the ranks, each in
  its own session, ran on as orphans. Now they are stopped as on Ctrl-C, and it exits 128+N."""
  script = tmp_path / "child.py"
  script.write_text("import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(30)\n")
  launcher = subprocess.Popen([sys.executable, "-m", "jaxoverlap.launch", "--nproc", "2",
                               str(script)], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
  pids = []
  try:
    while len(pids) < 2:
      line = launcher.stdout.readline()
      assert line, launcher.stderr.read()
      pids.append(int(line.split()[-1]))
    launcher.send_signal(sig)
    assert launcher.wait(timeout=20) == 128 + sig
    assert not [pid for pid in pids if _alive(pid)], "ranks outlived the launcher"
    assert f"got {sig.name}; stopping ranks 0, 1" in launcher.stderr.read()
  finally:
    launcher.kill()
    for pid in pids:  # without the fix: the orphans this test started
      if _alive(pid):
        os.killpg(pid, signal.SIGKILL)
    launcher.wait()


# --------------------------------------------------------- the script's own arguments


def test_script_arguments_named_like_launcher_options_are_the_scripts(tmp_path):
  """Issue: a -m anywhere (also the script's own, e.g. a model name) was taken as the
  launcher's -m MODULE; only a -m before the script selects a module."""
  out = _run_launcher(tmp_path, """
      import sys
      print("args", sys.argv[1:], flush=True)
      """, "--nproc", "1", script_args=["-m", "gpt2", "--steps", "5", "--nproc", "3", "--", "x"])
  assert out.returncode == 0, out.stdout + out.stderr
  assert "[rank 0] args ['-m', 'gpt2', '--steps', '5', '--nproc', '3', '--', 'x']" in out.stdout


# ------------------------------------------------------------ failures, timeouts, status


@pytest.mark.parametrize("body,args,code,message", [
    # The last rank running fails: the loop used to end without a word.
    ("""
     import os, sys, time
     if os.environ["JAXOVERLAP_PROCESS_ID"] == "1":
         time.sleep(0.5)
         sys.exit(3)
     """, (), 3, "jaxoverlap.launch: rank 1 exited with 3\n"),
    # Rank 1 fails first, rank 0 just after (within one of the old 0.1 s polls): rank 1's code.
    ("""
     import os, time
     flag = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank1-failed")
     if os.environ["JAXOVERLAP_PROCESS_ID"] == "1":
         open(flag, "w").close()
         os._exit(5)
     while not os.path.exists(flag):
         time.sleep(0.001)
     time.sleep(0.03)
     os._exit(1)
     """, (), 5, "jaxoverlap.launch: rank 1 exited with 5"),
    # A timeout lists the ranks still running.
    ("""
     import os, time
     if os.environ["JAXOVERLAP_PROCESS_ID"] != "0":
         time.sleep(30)
     """, ("--timeout_s", "1"), 124,
     "jaxoverlap.launch: timeout of 1 s; ranks 1, 2 still running; stopping them"),
    # A rank killed by signal N: 128+N, as a shell reports it (it was 256-N).
    ("""
     import os, signal, time
     if os.environ["JAXOVERLAP_PROCESS_ID"] == "2":
         os.kill(os.getpid(), signal.SIGKILL)
     time.sleep(30)
     """, (), 137,
     "jaxoverlap.launch: rank 2 was killed by SIGKILL (exit status 137); stopping ranks 0, 1"),
], ids=["last-rank-fails", "first-to-fail-in-time", "timeout", "killed-by-signal"])
def test_failures_name_the_rank_and_pass_on_the_first(tmp_path, body, args, code, message):
  out = _run_launcher(tmp_path, body, "--nproc", "3", *args)
  assert out.returncode == code, out.stdout + out.stderr
  assert out.stderr.startswith(message), out.stderr


# ------------------------------------------------------------- initialize_from_env()


def test_initialize_from_env_again_returns_the_active_setup(tmp_path):
  """Issue: a second call (tune.py, the harness and the training example each make one)
  raised JAX's "must be called before any JAX calls"; before joining, each process says where
  and for how many it waits."""
  out = _run_launcher(tmp_path, """
      from jaxoverlap import launch
      first = launch.initialize_from_env(nvshmem=False)
      import jax
      jax.numpy.zeros(1).block_until_ready()  # the backend is up: JAX's initialize would raise
      second = launch.initialize_from_env(nvshmem=False)
      print("again", second == first, second, flush=True)
      jax.distributed.shutdown()
      """, "--nproc", "2", "--timeout_s", "100")
  assert out.returncode == 0, out.stdout + out.stderr
  assert "[rank 0] again True {'process_id': 0, 'num_processes': 2, 'local_device': 0}" \
      in out.stdout
  assert "[rank 1] again True {'process_id': 1, 'num_processes': 2, 'local_device': 1}" \
      in out.stdout
  assert re.search(r"\[rank 1\] jaxoverlap.launch: process 1 of 2 \(from the launcher\) joins "
                   r"jax.distributed at 127\.0\.0\.1:\d+ \(JAXOVERLAP_COORDINATOR\), waiting "
                   r"for all 2 processes", out.stdout), out.stdout


def test_initialize_from_env_after_your_own_jax_distributed(tmp_path):
  """The active job is returned when it is the one the environment names; another raises."""
  script = tmp_path / "own.py"
  script.write_text(textwrap.dedent("""
      import os
      import jax
      from jaxoverlap import launch
      jax.distributed.initialize(os.environ["JAXOVERLAP_COORDINATOR"], 1, 0)
      print("same", launch.initialize_from_env(nvshmem=False), flush=True)
      os.environ["JAXOVERLAP_NUM_PROCESSES"] = "2"
      try:
          launch.initialize_from_env(nvshmem=False)
      except RuntimeError as e:
          print("other", e, flush=True)
      for k in ("COORDINATOR", "NUM_PROCESSES", "PROCESS_ID", "LOCAL_DEVICE"):
          del os.environ["JAXOVERLAP_" + k]
      print("alone", launch.initialize_from_env(nvshmem=False), flush=True)
      jax.distributed.shutdown()
      """))
  from jaxoverlap import launch

  env = _env(JAXOVERLAP_COORDINATOR=f"127.0.0.1:{launch.free_port()}",
             JAXOVERLAP_NUM_PROCESSES="1", JAXOVERLAP_PROCESS_ID="0", JAXOVERLAP_LOCAL_DEVICE="0")
  out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                       env=env)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "same {'process_id': 0, 'num_processes': 1, 'local_device': 0}" in out.stdout
  assert ("other jaxoverlap.launch.initialize_from_env: jax.distributed is already initialised "
          "as process 0 of 1, but the launcher's variables make this process 0 of 2") \
      in out.stdout, out.stdout
  assert "alone {'process_id': 0, 'num_processes': 1, 'local_device': None}" in out.stdout


_LAUNCH_ENV = ("JAXOVERLAP_COORDINATOR", "JAXOVERLAP_NUM_PROCESSES", "JAXOVERLAP_PROCESS_ID",
               "JAXOVERLAP_LOCAL_DEVICE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
               "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS_PER_NODE",
               "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "JAX_COORDINATOR_ADDRESS",
               "JAX_COORDINATOR_PORT", "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def no_distributed(monkeypatch):
  """A clean launch environment, and a jax.distributed.initialize that records its calls."""
  import jax

  from jaxoverlap import launch

  for name in _LAUNCH_ENV:
    monkeypatch.delenv(name, raising=False)
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  # The job joined has the processes asked for; no exit hook in the test process.
  monkeypatch.setattr(jax, "process_count", lambda: calls[-1]["num_processes"] if calls else 1)
  monkeypatch.setattr(launch, "_exit_at_once_on_error", lambda process_id: None)
  monkeypatch.setattr(launch, "_backends_started", lambda: False)  # earlier tests computed
  return calls


@pytest.mark.parametrize("env,names", [
    (dict(JAXOVERLAP_COORDINATOR="127.0.0.1:1234"),
     ["JAXOVERLAP_NUM_PROCESSES is not set", "JAXOVERLAP_PROCESS_ID is not set",
      "JAXOVERLAP_LOCAL_DEVICE is not set", "Set all four, or unset all four"]),
    (dict(JAXOVERLAP_PROCESS_ID="0"), ["JAXOVERLAP_COORDINATOR is not set"]),
    (dict(JAXOVERLAP_COORDINATOR="node1", JAXOVERLAP_NUM_PROCESSES="two",
          JAXOVERLAP_PROCESS_ID="0", JAXOVERLAP_LOCAL_DEVICE=""),
     ["JAXOVERLAP_COORDINATOR='node1' is not host:port",
      "JAXOVERLAP_NUM_PROCESSES='two' is not an integer",
      "JAXOVERLAP_LOCAL_DEVICE='' is not an integer"]),
    (dict(JAXOVERLAP_COORDINATOR="h:1", JAXOVERLAP_NUM_PROCESSES="2",
          JAXOVERLAP_PROCESS_ID="2", JAXOVERLAP_LOCAL_DEVICE="0"),
     ["JAXOVERLAP_PROCESS_ID=2 is not below JAXOVERLAP_NUM_PROCESSES=2"]),
    (dict(SLURM_PROCID="0", SLURM_NTASKS=""), ["SLURM_NTASKS='' is not an integer"]),
    (dict(SLURM_PROCID="0", SLURM_NTASKS="many"), ["SLURM_NTASKS='many' is not an integer"]),
    (dict(SLURM_PROCID="", SLURM_NTASKS="2", SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n1"),
     ["SLURM_PROCID='' is not an integer"]),
    (dict(SLURM_PROCID="0", SLURM_NTASKS="2"),
     ["SLURM_JOB_ID and SLURM_STEP_NODELIST are not set", "JAX_COORDINATOR_ADDRESS", "srun"]),
    (dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_ID="7"),
     ["SLURM_STEP_NODELIST is not set"]),
], ids=["coordinator-alone", "process-id-alone", "malformed", "rank-out-of-range",
        "empty-ntasks", "text-ntasks", "empty-procid", "no-coordinator", "no-nodelist"])
def test_partial_or_malformed_launch_variables_raise_one_error(monkeypatch, no_distributed, env,
                                                               names):
  """Issue: a KeyError, int('') or JAX's "coordinator_address should be defined."."""
  from jaxoverlap import launch

  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ValueError) as e:
    launch.initialize_from_env(nvshmem=False)
  for name in names:
    assert name in str(e.value), str(e.value)
  assert not no_distributed  # raised before jax.distributed


def test_launched_agrees_with_initialize_from_env_on_an_empty_slurm_ntasks(monkeypatch):
  """launched() read an empty SLURM_NTASKS as 1 task, where initialize_from_env raised."""
  from jaxoverlap import launch

  for name in _LAUNCH_ENV:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("SLURM_PROCID", "0")
  monkeypatch.setenv("SLURM_NTASKS", "")
  with pytest.raises(ValueError, match="SLURM_NTASKS='' is not an integer"):
    launch.launched()


def test_slurm_passes_the_job_it_checked_and_says_so(monkeypatch, no_distributed, capsys):
  from jaxoverlap import launch

  for name, value in dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0",
                          SLURM_NTASKS_PER_NODE="1",
                          JAX_COORDINATOR_ADDRESS="node1:4321").items():
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(launch, "_driver_gpu_count", lambda: None)
  out = launch.initialize_from_env(nvshmem=False)
  assert out == {"process_id": 1, "num_processes": 2, "local_device": None}
  assert no_distributed == [dict(coordinator_address="node1:4321", num_processes=2, process_id=1,
                                 local_device_ids=None)]
  assert ("jaxoverlap.launch: process 1 of 2 (from SLURM) joins jax.distributed at node1:4321 "
          "(JAX_COORDINATOR_ADDRESS), waiting for all 2 processes (JAX waits up to 300 s) (to "
          "run this process alone, unset SLURM_PROCID and SLURM_NTASKS)\n"
          ) in capsys.readouterr().err


def test_slurm_with_jax_distributed_up_needs_no_coordinator(monkeypatch, no_distributed, capsys):
  """Your own jax.distributed (e.g. JAX_COORDINATOR_ADDRESS in a batch script) as SLURM's task."""
  from jaxoverlap import launch

  for name, value in dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1",
                          SLURM_NTASKS_PER_NODE="2").items():  # no SLURM_JOB_ID, no node list
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(launch, "_active_distributed", lambda: (1, 2))
  monkeypatch.setattr(launch, "_driver_gpu_count", lambda: None)
  assert launch.initialize_from_env(nvshmem=False) == {
      "process_id": 1, "num_processes": 2, "local_device": 1}
  assert not no_distributed and not capsys.readouterr().err
  monkeypatch.setattr(launch, "_active_distributed", lambda: (0, 1))
  with pytest.raises(RuntimeError, match=r"already initialised as process 0 of 1, but SLURM's "
                                         r"variables make this process 1 of 2"):
    launch.initialize_from_env(nvshmem=False)


def test_a_slurm_task_says_where_it_waits_before_blocking(tmp_path):
  """Issue: SLURM's variables without the other tasks (python in a batch script, no srun)
  waited in jax.distributed.initialize for 5 minutes without a word."""
  script = tmp_path / "alone.py"
  script.write_text("from jaxoverlap import launch\nlaunch.initialize_from_env()\n")
  job = 4321
  proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True,
                          env=_env(SLURM_JOB_ID=str(job), SLURM_STEP_NODELIST="localhost",
                                   SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0",
                                   SLURM_TASKS_PER_NODE="2"))
  watchdog = threading.Timer(30.0, proc.kill)  # without the line, JAX waits 300 s
  watchdog.start()
  try:
    line = proc.stderr.readline()
  finally:
    watchdog.cancel()
    proc.kill()
    proc.wait()
  port = job % 4096 + 65536 - 4096  # JAX's SLURM port
  assert line == (f"jaxoverlap.launch: process 1 of 2 (from SLURM) joins jax.distributed at "
                  f"localhost:{port} (from SLURM_STEP_NODELIST='localhost' and "
                  f"SLURM_JOB_ID={job}), waiting for all 2 processes (JAX waits up to 300 s) "
                  "(to run this process alone, unset SLURM_PROCID and SLURM_NTASKS)\n"), line


@pytest.mark.parametrize("env,visible_gpus", [
    (dict(SLURM_TASKS_PER_NODE="4(x2)", SLURM_NODEID="1", SLURM_LOCALID="2",
          CUDA_VISIBLE_DEVICES=""), None),
    (dict(SLURM_NTASKS_PER_NODE="2", SLURM_LOCALID="0", CUDA_VISIBLE_DEVICES=" , "), None),
    (dict(SLURM_NTASKS_PER_NODE="2", SLURM_LOCALID="1"), 0),
    (dict(SLURM_TASKS_PER_NODE="1(x2)", SLURM_NODEID="1", SLURM_LOCALID="0",
          CUDA_VISIBLE_DEVICES=""), None),
], ids=["several-tasks-empty", "several-tasks-blank-ids", "several-tasks-none-seen",
        "one-task-empty"])
def test_slurm_task_that_sees_no_gpu_names_none(env, visible_gpus):
  """Issue: an empty CUDA_VISIBLE_DEVICES (no GPU: JAX's CPU) raised with several tasks per
  node, against the docstring's "None where no GPU is seen"."""
  from jaxoverlap import launch

  assert launch.slurm_local_devices(env, visible_gpus=visible_gpus) is None


@pytest.mark.parametrize("local,says", [("x", "SLURM_LOCALID='x' is not an integer"),
                                        ("-1", "SLURM_LOCALID=-1 is below 0")])
def test_slurm_local_devices_refuses_a_bad_local_id(local, says):
  """Trial 30 F11: a bare int() error for "x", and [-1] for "-1" with two GPUs visible."""
  from jaxoverlap import launch

  env = {"SLURM_LOCALID": local, "SLURM_TASKS_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": "0,1"}
  with pytest.raises(ValueError, match=f"slurm_local_devices: {re.escape(says)}"):
    launch.slurm_local_devices(env)


# ------------------------------------------------------------------------ the rest


def test_reproduce_command_records_every_cost_model_override(monkeypatch):
  """Issue: only NET_ALPHA_US and NET_BETA_GBPS were recorded of the eight the policy reads."""
  from jaxoverlap import launch
  from jaxoverlap.tuning import PARAM_KEYS

  for k in launch.SETTINGS + ("COORDINATOR", "NUM_PROCESSES"):
    monkeypatch.delenv("JAXOVERLAP_" + k, raising=False)
  for i, key in enumerate(PARAM_KEYS):
    monkeypatch.setenv("JAXOVERLAP_" + key.upper(), str(i + 1))
  command = launch.reproduce_command("benchmarks/all_reduce.py", ["--impls", "auto"])
  for i, key in enumerate(PARAM_KEYS):
    assert f"JAXOVERLAP_{key.upper()}={i + 1} " in command, command
  assert command.endswith(" python benchmarks/all_reduce.py --impls auto")


def test_help_and_docs_say_the_script_must_call_initialize_from_env():
  """Issue: --help said the launcher sets jax.distributed up; it only exports the variables."""
  from jaxoverlap import launch

  out = subprocess.run([sys.executable, "-m", "jaxoverlap.launch", "--help"],
                       capture_output=True, text=True, env=_env())
  text = " ".join(out.stdout.split())
  assert out.returncode == 0
  assert "must call jaxoverlap.launch.initialize_from_env() to join the job" in text, text
  assert "with jax.distributed set up" not in text
  doc = " ".join(launch.__doc__.split())
  assert "the script must call ``initialize_from_env()``" in doc
  readme = (pathlib.Path(_ROOT) / "README.md").read_text()
  for name in ("COORDINATOR", "NUM_PROCESSES", "PROCESS_ID", "LOCAL_DEVICE"):
    assert re.search(rf"^  JAXOVERLAP_{name} +\S", out.stdout, re.M), out.stdout
    assert f"\n| `JAXOVERLAP_{name}` | set by the launcher |" in readme


@pytest.mark.parametrize("args,why", [
    (["--num_gpus", "-1"], "--num_gpus must be >= 1, got -1"),
    (["--num_gpus", "0"], "--num_gpus must be >= 1, got 0"),
    (["-m"], "argument -m: expected a module name"),
])
def test_more_usage_errors(args, why):
  out = subprocess.run([sys.executable, "-m", "jaxoverlap.launch", "--nproc", "2", *args,
                        *(["x.py"] if args[0] != "-m" else [])],
                       capture_output=True, text=True, env=_env())
  assert out.returncode == 2 and why in out.stderr, out.stderr


def test_a_wrapper_that_cannot_start_is_named_not_a_traceback(tmp_path):
  script = tmp_path / "x.py"
  script.write_text("print('ran')\n")
  out = subprocess.run([sys.executable, "-m", "jaxoverlap.launch", "--nproc", "2", "--wrapper",
                        str(tmp_path / "no-such-tool"), str(script)],
                       capture_output=True, text=True, env=_env(), timeout=60)
  assert out.returncode == 127, (out.returncode, out.stderr)
  assert "cannot start rank 0" in out.stderr and "no-such-tool" in out.stderr, out.stderr
  assert "Traceback" not in out.stderr and "ran" not in out.stdout



# ------------------------------------------------------------------------ trial 31


def test_an_uncaught_exception_ends_its_process_at_once(tmp_path):
  """Trial 31: rank 1 raised between two collectives; JAX's exit held it 300 s in the
  shutdown barrier while rank 0 waited in the next all-reduce, and then rank 0 was blamed."""
  import time

  start = time.monotonic()
  out = _run_launcher(tmp_path, """
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import NamedSharding, PartitionSpec as P
      from jaxoverlap import launch
      import jaxoverlap
      info = launch.initialize_from_env(nvshmem=False)
      mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      f = jax.jit(jax.shard_map(lambda x: jaxoverlap.all_reduce(x, "x"), mesh=mesh,
                                in_specs=P("x"), out_specs=P()))
      x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                                 np.ones(4, np.float32), (8,))
      assert float(np.asarray(f(x).addressable_data(0))[0]) == 2.0
      if info["process_id"] == 1:
        raise ValueError("a bug in rank 1")
      f(x).block_until_ready()  # waits for rank 1, which never comes
      """, "--nproc", "2", "--timeout_s", "100", timeout=150)
  waited = time.monotonic() - start
  assert out.returncode == 1, (out.returncode, out.stderr[-3000:])
  # Rank 0's collective fails when rank 1 ends, so either may exit first; rank 1 is named.
  said = [line for line in out.stderr.splitlines() if line.startswith("jaxoverlap.launch: ")]
  assert re.fullmatch(r"jaxoverlap.launch: (rank 1 exited with 1(; stopping rank 0)?|rank 1 "
                      r"failed first, with an uncaught exception \(its traceback is above\); "
                      r"rank 0 exited with 1(; stopping rank 1)?)", said[0]), out.stderr
  assert "ValueError: a bug in rank 1" in out.stdout + out.stderr
  assert "process 1 ends at once (exit status 1) after the uncaught exception" in out.stdout
  assert waited < 90, waited  # the launcher's own bound (100 s) never came


def test_the_first_rank_to_end_after_an_exception_is_named(capsys):
  """Trial 32: rank 0, whose collective failed when rank 1 ended, exited first in 3 of 10 runs
  and was named as the rank that failed."""
  import queue
  import time

  from jaxoverlap import launch

  ended = queue.SimpleQueue()
  ended.put((0, 1))  # rank 0 ended first ...
  marks = {1: time.monotonic(), 0: time.monotonic() + 0.01}  # ... but rank 1 said so first
  procs = [subprocess.Popen(["sleep", "0"]), subprocess.Popen(["sleep", "0"])]
  for p in procs:
    p.wait()
  assert launch._watch(procs, ended, 0, marks) == 1
  assert capsys.readouterr().err == (
      "jaxoverlap.launch: rank 1 failed first, with an uncaught exception (its traceback is "
      "above); rank 0 exited with 1; stopping rank 1\n")
  ended.put((1, 3))
  assert launch._watch(procs, ended, 0, {}) == 3
  assert capsys.readouterr().err == "jaxoverlap.launch: rank 1 exited with 3; stopping rank 0\n"


def test_a_job_of_another_size_than_the_variables_say_is_refused(monkeypatch, no_distributed):
  """Trial 31: tasks started with different SLURM_NTASKS joined one job silently, and the
  returned num_processes (3) contradicted jax.process_count() (2)."""
  import jax
  from jaxoverlap import launch

  for name, value in dict(SLURM_PROCID="1", SLURM_NTASKS="3", SLURM_LOCALID="0",
                          SLURM_NTASKS_PER_NODE="1",
                          JAX_COORDINATOR_ADDRESS="node0:4321").items():
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(launch, "_driver_gpu_count", lambda: None)
  monkeypatch.setattr(jax, "process_count", lambda: 2)  # the coordinator's count won
  with pytest.raises(RuntimeError, match=r"SLURM's variables give 3 processes, but the job that "
                                         r"process 1 joined has 2"):
    launch.initialize_from_env(nvshmem=False)


@pytest.mark.parametrize("address", ["node0", "node0:", "node0:http", ":1234"])
def test_a_coordinator_address_without_a_port_is_refused(monkeypatch, no_distributed, address):
  """Trial 31: JAX_COORDINATOR_ADDRESS=localhost ended in an IndexError inside JAX."""
  from jaxoverlap import launch

  for name, value in dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0",
                          JAX_COORDINATOR_ADDRESS=address).items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=f"JAX_COORDINATOR_ADDRESS={re.escape(repr(address))} is "
                                       r"not host:port"):
    launch.initialize_from_env(nvshmem=False)
  assert not no_distributed


def test_initialize_from_env_after_a_computation_says_so(monkeypatch, no_distributed, capsys):
  """Trial 31: it printed "waiting for all 2 processes", then JAX refused."""
  from jaxoverlap import launch

  for name, value in dict(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0",
                          JAX_COORDINATOR_ADDRESS="node0:4321").items():
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(launch, "_driver_gpu_count", lambda: None)
  monkeypatch.setattr(launch, "_backends_started", lambda: True)
  with pytest.raises(RuntimeError, match="JAX has already run a computation in this process"):
    launch.initialize_from_env(nvshmem=False)
  assert not no_distributed and "waiting" not in capsys.readouterr().err


def test_a_task_that_drives_fewer_gpus_than_it_sees_is_warned(monkeypatch, no_distributed,
                                                              capsys):
  """Trial 31: after the user's own jax.distributed.initialize under one task per node, JAX
  drove only the GPU at SLURM_LOCALID, and initialize_from_env said nothing."""
  import jax
  from jaxoverlap import launch

  for name, value in dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="0",
                          SLURM_NTASKS_PER_NODE="1", CUDA_VISIBLE_DEVICES="0,1,2,3").items():
    monkeypatch.setenv(name, value)
  monkeypatch.setattr(launch, "_active_distributed", lambda: (1, 2))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "local_devices", lambda: ["gpu:0"])
  launch.initialize_from_env(nvshmem=False)
  assert ("WARNING: this process drives 1 of the 4 GPUs its placement gives it (SLURM: local "
          "devices [0, 1, 2, 3])") in capsys.readouterr().err
  monkeypatch.setattr(jax, "local_devices", lambda: ["gpu:0", "gpu:1", "gpu:2", "gpu:3"])
  launch.initialize_from_env(nvshmem=False)
  assert "WARNING" not in capsys.readouterr().err


def test_the_launcher_under_srun_warns(tmp_path):
  """Trial 31: srun -n 2 python -m jaxoverlap.launch ran two unrelated jobs without a word."""
  script = tmp_path / "child.py"
  script.write_text("print('ran')\n")
  out = subprocess.run([sys.executable, "-m", "jaxoverlap.launch", "--nproc", "1", str(script)],
                       env=_env(SLURM_NTASKS="2", SLURM_PROCID="0", SLURM_STEP_ID="0"),
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  assert ("jaxoverlap.launch: WARNING: this is one of 2 tasks of a SLURM job step: under srun "
          "every task runs this launcher" in out.stderr), out.stderr
  # Trial 32: a batch script (sbatch --ntasks=2) runs the launcher once: no step, no warning.
  out = subprocess.run([sys.executable, "-m", "jaxoverlap.launch", "--nproc", "1", str(script)],
                       env=_env(SLURM_NTASKS="2", SLURM_JOB_ID="7"), capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0 and "WARNING" not in out.stderr, out.stderr


def test_more_processes_than_gpus_is_refused_before_anything_starts(monkeypatch, capsys):
  """A new GPU user ran the README's `--nproc 2` on a machine with one GPU: rank 1 died in JAX's
  CUDA start-up ("no supported devices"). The launcher now refuses it up front."""
  from jaxoverlap import launch

  monkeypatch.setattr(launch, "_driver_gpu_count", lambda: 1)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  with pytest.raises(SystemExit) as e:
    launch.main(["--nproc", "2", "script.py"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--nproc 2 gives each process a GPU of its own, but the driver shows 1 GPU;" in err
  assert "--share_gpu" in err
  started = []
  monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: started.append(a) or 1 / 0)
  for ok in (["--nproc", "2", "--share_gpu"], ["--nproc", "2", "--num_gpus", "1"],
             ["--nproc", "1"]):  # these go on to start the processes
    with pytest.raises(ZeroDivisionError):
      launch.main(ok + ["script.py"])
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # CPU processes need no GPU
  with pytest.raises(ZeroDivisionError):
    launch.main(["--nproc", "2", "script.py"])
