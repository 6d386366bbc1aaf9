"""Training configuration: one frozen dataclass and named presets.

Presets:
  default:   CPU, 8 simulated host devices, dp=4 x tp=2; trains in a few
             minutes on a 2-core machine and beats the unigram baseline.
  tiny:      a few steps, seconds; for tests.
  gpu_small: hidden 4096, 4 layers (0.8B parameters), sequence parallel,
             bf16; tp over all GPUs of the job.
  gpu_large: hidden 8192, 4 layers (3.0B parameters), sequence parallel,
             bf16; tp over all GPUs of the job.
  The GPU presets use plain (materialized) causal attention; seq_len 2048
  keeps its [b, h/tp, s, s] fp32 logits within H200 memory at tp >= 2.

Launch values (workdir, mesh shape, backend) come from ``main.py``'s flags,
which override the preset with ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
  """A run that cannot start as configured (a value, the mesh, the folder, a resume); main.py
  prints it in one line, before anything trains."""


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything that defines a training run.

  Attributes:
    d_model: model width (``d``).
    n_layers: number of transformer blocks.
    n_heads: attention heads (``h``); divisible by the tp size.
    d_ff: MLP hidden width (``f``); divisible by the tp size.
    seq_len: tokens (bytes) per example (``s``).
    batch_size: global batch (``b``); divisible by the dp size.
    steps: total optimizer steps (a resumed run stops at the same step).
    lr: peak learning rate.
    warmup: linear warm-up steps (at most a tenth of ``steps``, so that a short run
      reaches ``lr`` too) before cosine decay to ``lr * min_lr_ratio``.
    min_lr_ratio: final learning rate as a fraction of ``lr``.
    weight_decay: AdamW decoupled weight decay.
    grad_clip: global-norm gradient clipping threshold.
    eval_every: steps between validation evaluations.
    eval_batches: number of fixed validation batches per evaluation.
    ckpt_every: steps between checkpoints (one is also written at the end).
    log_every: steps between refreshes of the progress bar's loss.
    seed: seed of the parameter init and of the data order.
    val_percent: percentage of corpus files held out for validation.
    dtype: activation/compute dtype, "float32" or "bfloat16"; parameters and
      optimizer state stay float32.
    mesh: (dp, tp) device mesh; -1 in one place means "the remaining devices".
    sequence_parallel: shard activations between blocks over tp along the
      sequence (Megatron-SP).
    backend: jaxoverlap backend, "auto", "xla" or "cuda".
    algorithm: the GEMM ops' algorithm, or "auto" (``ParallelConfig.algorithm``);
      the all-reduces keep "auto".
  """

  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  d_ff: int = 512
  seq_len: int = 128
  batch_size: int = 32
  steps: int = 800
  lr: float = 3e-3
  warmup: int = 50
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  eval_every: int = 100
  eval_batches: int = 4
  ckpt_every: int = 200
  log_every: int = 10
  seed: int = 0
  val_percent: int = 5
  dtype: str = "float32"
  mesh: tuple[int, int] = (4, 2)
  sequence_parallel: bool = False
  backend: str = "auto"
  algorithm: str = "auto"

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16"):
      raise ConfigError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
    if self.d_model % self.n_heads:
      raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
    if len(self.mesh) != 2:
      raise ConfigError(f"mesh must be (dp, tp), got {self.mesh!r}")
    for name in ("steps", "eval_every", "eval_batches", "ckpt_every", "log_every"):
      if getattr(self, name) < 1:
        raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


PRESETS: dict[str, Config] = {
    "default": Config(),
    "tiny": Config(
        d_model=32, n_layers=1, n_heads=4, d_ff=64, seq_len=32, batch_size=8,
        steps=4, lr=1e-3, warmup=2, eval_every=2, eval_batches=1, ckpt_every=2,
        log_every=1),
    "gpu_small": Config(
        d_model=4096, n_layers=4, n_heads=32, d_ff=16384, seq_len=2048, batch_size=16,
        steps=1000, lr=3e-4, warmup=100, eval_every=200, eval_batches=8, ckpt_every=500,
        dtype="bfloat16", mesh=(1, -1), sequence_parallel=True),
    "gpu_large": Config(
        d_model=8192, n_layers=4, n_heads=64, d_ff=28672, seq_len=2048, batch_size=8,
        steps=1000, lr=1.5e-4, warmup=100, eval_every=200, eval_batches=8, ckpt_every=500,
        dtype="bfloat16", mesh=(1, -1), sequence_parallel=True),
}


def get_config(name: str) -> Config:
  """Returns the preset called ``name``.

  Raises:
    ConfigError: no such preset.
  """
  if name not in PRESETS:
    raise ConfigError(f"unknown config {name!r}; presets are {sorted(PRESETS)}")
  return PRESETS[name]
