"""examples/train/slurm.sbatch under an emulated SLURM: a fake ``srun`` starts the tasks on this
host with SLURM's variables, as trial 31 emulated it (CPU, one device a task)."""

import json
import os
import random
import subprocess
import sys

import pytest

_ROOT = os.path.join(os.path.dirname(__file__), "..")
_SBATCH = os.path.join("examples", "train", "slurm.sbatch")

# What srun would do on one node: start --ntasks-per-node tasks (times the job's nodes) with
# the variables initialize_from_env() reads. It logs its options and the command first.
_FAKE_SRUN = r'''#!PYTHON
import json, os, subprocess, sys
args = sys.argv[1:]
opts = {}
while args and args[0].startswith("--"):
  k, _, v = args.pop(0)[2:].partition("=")
  opts[k] = v
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
  f.write(json.dumps({"opts": opts, "cmd": args}) + "\n")
if os.environ.get("FAKE_SRUN_DRY"):
  sys.exit(0)
n = int(opts["ntasks-per-node"]) * int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
procs = [subprocess.Popen(args, env=dict(
    os.environ, SLURM_PROCID=str(i), SLURM_NTASKS=str(n), SLURM_LOCALID=str(i),
    SLURM_NODEID="0", SLURM_NTASKS_PER_NODE=str(n), SLURM_TASKS_PER_NODE=str(n),
    SLURM_STEP_NODELIST="localhost")) for i in range(n)]
sys.exit(max(p.wait() for p in procs))
'''


def _sbatch(tmp_path, *args, cwd=_ROOT, **env):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  srun = bin_dir / "srun"
  srun.write_text(_FAKE_SRUN.replace("PYTHON", sys.executable, 1))
  srun.chmod(0o755)
  log = tmp_path / "srun.log"
  full = {k: v for k, v in os.environ.items()   # the tests' 8 simulated devices too (XLA_FLAGS)
          if not k.startswith(("SLURM_", "JAXOVERLAP_", "CUDA_VISIBLE", "XLA_FLAGS", "SCRATCH"))}
  full.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_SRUN_LOG=str(log),
              PYTHON=sys.executable, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu",
              SLURM_JOB_ID=str(random.randint(1000, 99999)), SLURM_JOB_NAME="t")
  full.update(env)   # the job id (the coordinator's port) random unless given
  run = subprocess.run(["bash", os.path.join(os.path.abspath(_ROOT), _SBATCH), *args], cwd=cwd,
                       env=full, capture_output=True, text=True, timeout=600)
  calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
  return run, calls


_OPTS = {"gpu-bind": "none", "distribution": "block:block", "kill-on-bad-exit": "1", "label": ""}


def test_one_task_per_gpu_trains_and_resumes(tmp_path):
  workdir = tmp_path / "run"
  run, calls = _sbatch(tmp_path, "--steps", "3", "--host_devices", "1", GPUS_PER_NODE="2",
                       CONFIG="tiny", WORKDIR=str(workdir))
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "1 node(s) x 2 GPUs, 2 task(s), one per gpu" in run.stdout
  (call,) = calls
  # Every task sees the node's GPUs and takes its own (trial 42: --gpus-per-task=1 may hide
  # the peers' GPUs, which NVSHMEM's transfers need).
  assert call["opts"] == {"ntasks-per-node": "2", **_OPTS}
  assert call["cmd"][1:] == ["examples/train/main.py", "--distributed", "--config", "tiny",
                             "--mesh", "-1,2", "--workdir", str(workdir), "--steps", "3",
                             "--host_devices", "1"]
  metrics = json.loads((workdir / "metrics.json").read_text())
  assert metrics["steps"] == 3 and metrics["mesh"]["processes"] == 2
  assert (metrics["mesh"]["dp"], metrics["mesh"]["tp"]) == (1, 2)
  # The same job again with more steps trains on from the checkpoint.
  run, _ = _sbatch(tmp_path, "--steps", "5", "--host_devices", "1", GPUS_PER_NODE="2",
                   CONFIG="tiny", WORKDIR=str(workdir))
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  metrics = json.loads((workdir / "metrics.json").read_text())
  assert (metrics["start_step"], metrics["steps"]) == (3, 5)


@pytest.mark.parametrize("nodes,distributed", [("2", True), ("1", False)])
def test_one_task_per_node(tmp_path, nodes, distributed):
  run, calls = _sbatch(tmp_path, PLACEMENT="node", SLURM_JOB_NUM_NODES=nodes,
                       SLURM_GPUS_ON_NODE="8", SLURM_JOB_NAME="job", SCRATCH=str(tmp_path),
                       FAKE_SRUN_DRY="1")
  assert run.returncode == 0, run.stderr
  (call,) = calls
  assert call["opts"] == {"ntasks-per-node": "1", **_OPTS}
  # One task alone drives its GPUs: main.py's --distributed would refuse it.
  assert ("--distributed" in call["cmd"]) == distributed
  # The default workdir has no job id: submitting again resumes (trial 42).
  assert call["cmd"][-6:] == ["--config", "gpu_small", "--mesh", "-1,8", "--workdir",
                              str(tmp_path / "jaxoverlap-runs" / "job")]


@pytest.mark.parametrize("env,gpus", [(dict(SLURM_GPUS_PER_NODE="h100:4"), "4"),
                                      (dict(SLURM_GPUS_PER_NODE="4"), "4"),
                                      (dict(SLURM_GPUS_ON_NODE="2", SLURM_GPUS_PER_NODE="8"), "2"),
                                      (dict(GPUS_PER_NODE="1", SLURM_GPUS_ON_NODE="8"), "1")])
def test_gpus_per_node_from_the_job(tmp_path, env, gpus):
  run, calls = _sbatch(tmp_path, FAKE_SRUN_DRY="1", **env)
  assert run.returncode == 0, run.stderr
  assert calls[0]["opts"]["ntasks-per-node"] == gpus and f"-1,{gpus}" in calls[0]["cmd"]


@pytest.mark.parametrize("env,says", [
    (dict(), "the job has no GPUs (SLURM_GPUS_ON_NODE and SLURM_GPUS_PER_NODE are unset)"),
    (dict(GPUS_PER_NODE="0"), "GPUS_PER_NODE must be a count of GPUs, 1 or more, not '0'"),
    (dict(GPUS_PER_NODE="2x"), "not '2x'"),
    (dict(GPUS_PER_NODE="2", PLACEMENT="rack"), "PLACEMENT must be gpu or node, not 'rack'"),
    (dict(GPUS_PER_NODE="2", CONFIG="gpu_smal"), "CONFIG: config.ConfigError: unknown config "
                                                 "'gpu_smal'; presets are"),
    (dict(GPUS_PER_NODE="2", PYTHON="/bin/false"),
     "/bin/false cannot import jaxoverlap: set PYTHON"),
])
def test_bad_settings_stop_before_srun(tmp_path, env, says):
  run, calls = _sbatch(tmp_path, **env)
  assert run.returncode == 2 and says in run.stderr, run.stderr
  assert calls == []


def test_submitted_elsewhere_it_says_where_to_submit_from(tmp_path):
  """Trial 42: submitted from another folder every rank failed to open main.py."""
  run, calls = _sbatch(tmp_path, cwd=str(tmp_path), GPUS_PER_NODE="2")
  assert run.returncode == 2 and "submit from the repository's root" in run.stderr, run.stderr
  assert calls == []
  # SLURM runs the batch script in a copy elsewhere, from the folder it was submitted from.
  run, calls = _sbatch(tmp_path, cwd=str(tmp_path), GPUS_PER_NODE="2",
                       SLURM_SUBMIT_DIR=os.path.abspath(_ROOT), FAKE_SRUN_DRY="1")
  assert run.returncode == 0 and len(calls) == 1, run.stderr
