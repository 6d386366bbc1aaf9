"""The fused ops (backend "cuda") in several processes of one node (tests/gpu/ranks).

Each case is one launch of ranks/rank_overlap.py; every rank's outcome of
every test is checked (_harness.py). World 2 runs everything (the sweeps, the
gradients, rotation and CUDA graphs with both handler kinds, the MLP step, the
slot error); worlds 4 and 8 (one node: ranks per node = world) run the quick
tests, where the rank-adaptive order differs from 2 ranks.
"""

import pytest

import _harness
from _harness import Case, World

pytestmark = [pytest.mark.gpu, _harness.requires_gpus]


# Timeouts: about 2.5x the expected time (world 2 on 2x H200: ~2 minutes).
CASES = [
    Case(World(2, 2), timeout_s=360),
    Case(World(4, 4), ("-m", "quick"), timeout_s=240),
    Case(World(8, 8), ("-m", "quick"), timeout_s=300),
]


@pytest.mark.parametrize("case", CASES, ids=[c.world.label() for c in CASES])
def test_fused_ops(case, tmp_path):
  _harness.run_case(tmp_path, "rank_overlap.py", case)
