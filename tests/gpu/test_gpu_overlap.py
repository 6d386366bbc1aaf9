"""The fused ops (backend "cuda") in several processes of one node (tests/gpu/ranks).

Each case is one launch of ranks/rank_overlap.py; every rank's outcome of
every test is checked (_harness.py). World 2 runs everything (the sweeps, the
gradients, rotation and CUDA graphs with both handler kinds, the MLP step, the
slot error); worlds 4 and 8 (one node: ranks per node = world) run the quick
tests, where the rank-adaptive order differs from 2 ranks.
"""

import dataclasses

import pytest

import _harness
from _harness import World

pytestmark = [pytest.mark.gpu, _harness.requires_gpus]


@dataclasses.dataclass(frozen=True)
class Case:
  world: World
  select: tuple = ()
  timeout_s: int = 300


# Timeouts: about 2.5x the expected time (world 2 on 2x H200: ~2 minutes).
CASES = [
    Case(World(2, 2), timeout_s=360),
    Case(World(4, 4), ("-m", "quick"), timeout_s=240),
    Case(World(8, 8), ("-m", "quick"), timeout_s=300),
]


@pytest.mark.parametrize("case", CASES, ids=[c.world.label() for c in CASES])
def test_fused_ops(case, tmp_path):
  run = _harness.run_ranks(tmp_path, "rank_overlap.py", case.world, select=case.select,
                           timeout_s=case.timeout_s)
  run.print_summary()
  run.check()
