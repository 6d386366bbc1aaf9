"""The CUDA kernels in each process model (tests/gpu/ranks/rank_models.py).

* One process driving every GPU of the machine (JAX's default, a notebook, SLURM one
  task per node): the in-process runtime, transport "peer", started without a launcher.
* One process per GPU through the launcher (NVSHMEM): the transformations, the graph replay
  and the NNX training steps (the values are swept by test_gpu_all_reduce/overlap).
* SLURM one task per GPU, emulated on this host: each process sees only its own GPU as
  device 0 (CUDA_VISIBLE_DEVICES), JAX's SLURM cluster finds the coordinator.
* SLURM one task per node, emulated on this host (tests/gpu/ranks/rank_processes.py): two
  processes that each drive every GPU; the all-reduce across them.
* The training example with ``--backend cuda`` and no launcher, on every GPU.
"""

import json
import os
import random
import subprocess
import sys

import pytest

import _harness
from _harness import World

pytestmark = [pytest.mark.gpu, _harness.requires_gpus]


def _needs_two_gpus():
  if _harness.gpu_count() < 2:
    pytest.skip("one process driving several GPUs needs at least 2 GPUs")


def test_one_process_drives_every_gpu(tmp_path):
  _needs_two_gpus()
  run = _harness.run_ranks(tmp_path, "rank_models.py",
                           World(1, _harness.gpu_count(), start="in_process"), timeout_s=480,
                           env={"JAXOVERLAP_EXPECT_TRANSPORT": "peer"})
  run.print_summary()
  run.check()


def test_one_process_per_gpu_transformations_and_model(tmp_path):
  _needs_two_gpus()
  run = _harness.run_ranks(tmp_path, "rank_models.py", World(2, 2), timeout_s=300,
                           select=("-k", "transport or vmap or jacrev or graph or nnx or grads "
                                         "or profiler"),
                           env={"JAXOVERLAP_EXPECT_TRANSPORT": "nvshmem"})
  run.print_summary()
  run.check()


def test_slurm_one_gpu_per_task(tmp_path):
  _needs_two_gpus()
  run = _harness.run_ranks(tmp_path, "rank_models.py", World(2, 2, start="slurm"),
                           timeout_s=240,
                           select=("-k", "transport or (all_reduce and float32) or "
                                         "(fused_ops and bfloat16 and None)"),
                           env={"JAXOVERLAP_EXPECT_TRANSPORT": "nvshmem"})
  run.print_summary()
  run.check()


def test_slurm_one_task_per_node_drives_every_gpu(tmp_path):
  """Two "nodes" of one process each, every process driving all GPUs: the all-reduce across
  processes (intra-node steps on the kernels, XLA's all-reduce between the processes)."""
  _needs_two_gpus()
  run = _harness.run_ranks(tmp_path, "rank_processes.py", World(2, 2, start="slurm_per_node"),
                           timeout_s=420,
                           env={"JAXOVERLAP_TEST_SEED": str(random.randrange(1 << 31)),
                                "JAXOVERLAP_HEAP_BYTES": "64M"})
  run.print_summary()
  run.check()


def test_training_example_on_every_gpu_without_a_launcher(tmp_path):
  _needs_two_gpus()
  workdir = tmp_path / "run"
  env = _harness._child_env({}, tmp_path / "reports")
  cmd = [sys.executable, "examples/train/main.py", "--workdir", str(workdir), "--backend", "cuda",
         "--mesh", f"1,{_harness.gpu_count()}", "--steps", "100"]
  out = subprocess.run(cmd, cwd=_harness.REPO, env=env, capture_output=True, text=True,
                       timeout=300)
  log = out.stdout + out.stderr
  if os.environ.get(_harness.LOG_ENV):
    with open(os.environ[_harness.LOG_ENV], "a") as f:
      f.write(f"\n===== training example without a launcher: exit {out.returncode}\n{log}")
  assert out.returncode == 0, log[-4000:]
  metrics = json.loads((workdir / "metrics.json").read_text())
  ran = metrics["backend"]["resolved"]
  assert ran and all("cuda" in v for v in ran.values()), ran
  assert metrics["backend"]["runtime"]["transport"] == "peer", metrics["backend"]["runtime"]
  assert metrics["val_loss"] < metrics["unigram_loss"], metrics
