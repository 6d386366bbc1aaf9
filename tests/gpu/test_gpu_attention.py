"""Decode steps of NNX blocks on one GPU: cuDNN attention, padding (ranks/rank_attention.py)."""

import pytest

import _harness
from _harness import World

pytestmark = [pytest.mark.gpu, _harness.requires_gpus]


def test_cudnn_attention(tmp_path):
  run = _harness.run_ranks(tmp_path, "rank_attention.py", World(1, 1), timeout_s=180)
  run.print_summary()
  run.check()
