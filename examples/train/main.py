"""Trains a byte-level GPT on the Python standard library with jaxoverlap's TP layers.

  python examples/train/main.py --workdir ~/jaxoverlap-runs/cpu    # CPU, 8 host devices
  python examples/train/main.py --workdir ~/jaxoverlap-runs/gpu --config gpu_small --mesh 1,2

Flags are launch values only; the model and optimization live in config.py.
Re-running with the same --workdir resumes from its latest checkpoint.
"""

import dataclasses
import os
import signal
import sys

from absl import app
from absl import flags
from absl import logging

import config as config_lib  # no jax import: XLA_FLAGS can still be set in main()

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.",
                               required=True)
_CONFIG = flags.DEFINE_enum("config", "default", list(config_lib.PRESETS),
                            "Preset in config.py.")
_MESH = flags.DEFINE_string("mesh", None, "dp,tp mesh shape, e.g. '4,2'; -1 takes the "
                            "remaining devices. Default: the preset's.")
flags.register_validator(
    "mesh", lambda v: v is None or (len(v.split(",")) == 2 and all(
        p.strip().lstrip("-").isdigit() for p in v.split(","))),
    message="--mesh must be two integers 'dp,tp', e.g. '4,2' or '1,-1'")
_STEPS = flags.DEFINE_integer("steps", None, "Override the preset's total steps.")
_CKPT_EVERY = flags.DEFINE_integer(
    "ckpt_every", None, "Steps between checkpoints (one is also written at the end, and at "
    "Ctrl-C or SIGTERM in a run of one process). Default: the preset's.")
_BACKEND = flags.DEFINE_enum("backend", None, ["auto", "xla", "cuda"],
                             "jaxoverlap backend. Default: the preset's.")
_ALGORITHM = flags.DEFINE_string(
    "algorithm", None,
    "the GEMM ops' algorithm (ParallelConfig.algorithm: matmul_all_reduce, or all_gather_matmul "
    "and matmul_reduce_scatter under sequence parallelism); the all-reduces keep auto. One of "
    "auto, collective, ppermute (backend xla), fused, unfused (backend cuda). Default: the "
    "preset's.")
_SEQUENCE_PARALLEL = flags.DEFINE_bool(
    "sequence_parallel", None, "Shard the activations between blocks over tp along the "
    "sequence (Megatron-SP: the GEMMs become all_gather_matmul and matmul_reduce_scatter). "
    "Default: the preset's (--nosequence_parallel turns it off).")
_HOST_DEVICES = flags.DEFINE_integer(
    "host_devices", 8, "Simulated CPU devices (XLA --xla_force_host_platform_device_count); "
    "only the CPU platform uses them.", lower_bound=1)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Multi-process run: require the environment of jaxoverlap.launch or "
    "SLURM (without this flag a process alone also runs; either way "
    "jaxoverlap.launch.initialize_from_env() brings up jax.distributed when there are several "
    "processes, and jaxoverlap's runtime on GPUs).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: every setting is a --flag")
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  # Set before jax is imported: it only affects the CPU platform.
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = (
        f"{xla_flags} --xla_force_host_platform_device_count={_HOST_DEVICES.value}").strip()

  from jaxoverlap import launch
  if _DISTRIBUTED.value and not launch.launched():
    raise app.UsageError("--distributed: no jaxoverlap.launch or SLURM environment found; start "
                         "with python -m jaxoverlap.launch --nproc N or srun")
  # One process per GPU (launcher, SLURM) or one process driving all its GPUs: both bring
  # up jaxoverlap's runtime on GPUs, so that backend "cuda" can run.
  launch.initialize_from_env()

  import train  # imports jax

  config = config_lib.get_config(_CONFIG.value)
  overrides = {name: flag.value for name, flag in (
      ("steps", _STEPS), ("ckpt_every", _CKPT_EVERY), ("backend", _BACKEND),
      ("algorithm", _ALGORITHM), ("sequence_parallel", _SEQUENCE_PARALLEL))
      if flag.value is not None}
  if _MESH.value is not None:
    overrides["mesh"] = tuple(int(v) for v in _MESH.value.split(","))
  # Ctrl-C and SIGTERM (kill, SLURM's time limit) stop the run: one process at the end of
  # the step in flight, saving the steps since its last checkpoint (train.StopRequest).
  stop = train.StopRequest()
  signal.signal(signal.SIGTERM, stop.handle)
  signal.signal(signal.SIGINT, stop.handle)
  try:
    config = dataclasses.replace(config, **overrides)
    train.train_and_evaluate(config, _WORKDIR.value, stop)
  except config_lib.ConfigError as e:
    # The run cannot start as configured: one line, no traceback, before any training.
    print(f"main.py: error: {e}", file=sys.stderr, flush=True)
    return 2
  except KeyboardInterrupt as e:  # once training began, train.py said what it saved
    if getattr(e, "reported", False):
      pass
    elif stop.trained:  # after the loop: the final evaluation or the results
      print("\ninterrupted after training, while its last checkpoint, evaluation or results "
            "were being written; run the same command: it goes on from the last complete "
            "checkpoint", file=sys.stderr, flush=True)
    else:
      print("\ninterrupted before training began: nothing new to save; run the same command "
            "to start again", file=sys.stderr, flush=True)
    return 128 + (signal.SIGTERM if isinstance(e, train.Terminated) else signal.SIGINT)


if __name__ == "__main__":
  app.run(main)
