"""scripts/gpu_check.sh refuses what it cannot run before it builds anything.

Each call runs the script with PYTHON pointing at a stub that only logs its arguments (so
nothing is built or run, whatever the call) and an nvidia-smi stub listing a chosen number of
GPUs ahead on PATH (so the result is the same on any machine).
"""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
ONE_GPU = ["decodefloor", "localcost", "pdlfloor", "l2prefetch", "childgraph"]


def _gpu_check(tmp_path: Path, *args: str, gpus: int = 0, **env: str):
  """Runs gpu_check.sh with stubs; returns (the process, the stub python's calls)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  smi = bin_dir / "nvidia-smi"
  smi.write_text("#!/bin/sh\n" + "".join(f'echo "GPU {i}: stub (UUID: GPU-{i})"\n'
                                         for i in range(gpus)))
  smi.chmod(0o755)
  log = tmp_path / "python.log"
  py = bin_dir / "python"
  py.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')
  py.chmod(0o755)
  full_env = {k: v for k, v in os.environ.items() if k not in ("SKIP_BUILD", "SANITIZE")}
  full_env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(py),
                  OUT=str(tmp_path / "out"), **env)
  proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=full_env,
                        capture_output=True, text=True, timeout=60)
  calls = log.read_text().splitlines() if log.exists() else []
  return proc, calls


@pytest.mark.parametrize("args", [("nosuch",), ("build", "nosuch"), ("localcost", "nosuch"),
                                  ("bench", "autobnech"), ("bench autobench",), ()])
def test_unknown_verb_refused_before_anything(tmp_path, args):
  proc, calls = _gpu_check(tmp_path, *args, gpus=2)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert "usage: bash scripts/gpu_check.sh <verb>" in proc.stderr
  if args:
    bad = args[-1]
    assert f"unknown verb '{bad}'" in proc.stderr
  assert calls == []  # nothing built or run
  assert "== build" not in proc.stdout


@pytest.mark.parametrize("verb", ONE_GPU)
def test_one_gpu_verb_refused_without_gpu(tmp_path, verb):
  proc, calls = _gpu_check(tmp_path, verb, gpus=0)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert f"gpu_check.sh: {verb} needs 1 GPU; this machine has 0" in proc.stderr
  assert calls == []
  assert "== build" not in proc.stdout
  assert verb in (tmp_path / "out" / "too-few-gpus.txt").read_text()


def test_several_verbs_each_checked(tmp_path):
  proc, calls = _gpu_check(tmp_path, "bench", "decodefloor", gpus=0)
  assert proc.returncode == 2
  assert "bench needs 2 GPUs; this machine has 0" in proc.stderr
  assert "decodefloor needs 1 GPU; this machine has 0" in proc.stderr
  assert calls == []
  proc, calls = _gpu_check(tmp_path, "decodefloor", "bench", gpus=1)
  assert proc.returncode == 2
  assert "bench needs 2 GPUs; this machine has 1" in proc.stderr
  assert "decodefloor needs" not in proc.stderr
  assert calls == []


def test_one_gpu_verb_runs_on_one_gpu(tmp_path):
  proc, calls = _gpu_check(tmp_path, "localcost", "l2prefetch", gpus=1)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert calls[0] == "-m pip install --no-build-isolation --no-deps -e ."
  assert [c.split()[0] for c in calls[1:]] == ["benchmarks/local_cost.py"] * 2 + [
      "benchmarks/l2_prefetch.py"]


def test_build_and_suite_run_without_gpu(tmp_path):
  proc, calls = _gpu_check(tmp_path, "build", gpus=0)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "== build (0 GPUs)" in proc.stdout
  assert calls == ["-m pip install --no-build-isolation --no-deps -e ."]
  # suite's further arguments are pytest's, not verbs
  proc, calls = _gpu_check(tmp_path, "suite", "-k", "nosuch", gpus=0, SKIP_BUILD="1")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert len(calls) == 2 and calls[1].startswith("-m pytest -m gpu tests/gpu")
  assert calls[1].endswith("-k nosuch")


def test_procrepeat_alternates_the_process_models(tmp_path):
  """procrepeat: one process, then two through the launcher, PROC_REPEATS times, each with the
  command results.md's repeats name; a count that is not a positive number stops before the
  build."""
  proc, calls = _gpu_check(tmp_path, "procrepeat", gpus=2, PROC_REPEATS="2")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  args = "--impls jaxoverlap:auto,xla:psum --sizes 8K,64K,256K,512K,1M --reps 50"
  out = tmp_path / "out"
  assert calls[1:] == [
      f"benchmarks/all_reduce.py --out {out}/p1_run1 {args}",
      f"-m jaxoverlap.launch --nproc 2 --timeout_s 110 benchmarks/all_reduce.py --out "
      f"{out}/p2_run1 {args}",
      f"benchmarks/all_reduce.py --out {out}/p1_run2 {args}",
      f"-m jaxoverlap.launch --nproc 2 --timeout_s 110 benchmarks/all_reduce.py --out "
      f"{out}/p2_run2 {args}"]
  for bad in ("0", "abc", "-1"):
    (tmp_path / bad).mkdir()
    proc, calls = _gpu_check(tmp_path / bad, "procrepeat", gpus=2, PROC_REPEATS=bad)
    assert proc.returncode == 2 and "is not a positive whole number" in proc.stderr
    assert calls == []
