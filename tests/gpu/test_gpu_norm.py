"""all_reduce_rms_norm(backend="cuda") in several processes (tests/gpu/ranks/rank_norm.py).

Each case is one launch of ranks/rank_norm.py; every rank's outcome of every
test is checked (_harness.py). World 2 (one node of 2 GPUs) runs everything:
the sweep of dtypes, rows and hidden sizes, the plan's refusals, the stress
loop interleaved with the plain all-reduce, and the gradient. World 4 as one
node of 4 runs the quick tests (on 2 GPUs: packed two processes per GPU,
without NCCL, so the gradient's lax.psum reference is skipped there). The
bfloat16 sweep runs again with every row forced onto one block and onto a
cluster of 8 (the measurement knob JAXOVERLAP_NORM_CLUSTER), the two ends of
the kernel's split.
"""

import pytest

import _harness
from _harness import Case, World

pytestmark = [pytest.mark.gpu, _harness.requires_gpus]

# Timeouts: about 2.5x the expected time (world 2 on 2x H200: start-up ~20 s, the sweep's
# 54 compilations ~50 s, the stress loop ~10 s).
CASES = [
    Case(World(2, 2), timeout_s=240),                   # everything, 1 node x 2
    Case(World(4, 4), ("-m", "quick"), timeout_s=180),  # 1 node x 4 (2 GPUs: 2 per GPU)
]


@pytest.mark.parametrize("case", CASES, ids=[c.world.label() for c in CASES])
def test_norm(case, tmp_path):
  _harness.run_case(tmp_path, "rank_norm.py", case)


@pytest.mark.parametrize("parts", [1, 8])
def test_norm_blocks_per_row(parts, tmp_path):
  case = Case(World(2, 2), ("-k", "test_sweep and bfloat16"), timeout_s=180)
  _harness.run_with_knob(tmp_path, "rank_norm.py", case, {"JAXOVERLAP_NORM_CLUSTER": str(parts)},
                         {"norm_blocks_per_row": parts})


def test_norm_epochs_at_start(tmp_path):
  """The measurement knob JAXOVERLAP_EPOCH_AT_START=1: the norm kernel advances the epochs at its
  start; the sweep, refusals, stress loop (interleaved with the plain all-reduce) at world 2."""
  _harness.run_with_knob(tmp_path, "rank_norm.py", Case(World(2, 2), timeout_s=240),
                         {"JAXOVERLAP_EPOCH_AT_START": "1"}, {"epochs_at_start": True})
