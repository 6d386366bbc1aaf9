"""The LL flags' wrap after 2^32 calls of a pair (2 and 4 processes; tests/gpu/ranks/rank_flag_wrap.py).

Issue: the LL protocol's cells carry the low 32 bits of a pair's call count, so the run used
to stop with an error after 2^32 - 1 calls (about 2.3 days of 32-layer decode). The kernels
now re-stamp the cells at the end of each period of the flags and carry on. Each case is one
launch whose count starts 3 below 2^32 with every LL cell stale, so a missing or partial
re-stamp returns NaN after the wrap.
"""

import pytest

import _harness
from _harness import World

pytestmark = [pytest.mark.gpu, _harness.requires_gpus]

WRAP_ENV = {"JAXOVERLAP_TEST_PAIR_EPOCH": str(2**32 - 3), "JAXOVERLAP_TEST_LL_STALE": "1"}


@pytest.mark.parametrize("rank_test,world", [
    ("test_wrap_after_finish", World(2, 2)),
    ("test_wrap_after_cluster_end", World(2, 2)),
    ("test_wrap_hierarchical", World(2, 1)),
    ("test_wrap_hierarchical", World(2, 1, put=True)),
    ("test_wrap_after_finish", World(4, 4)),  # 3 peers to re-stamp from
    ("test_wrap_after_cluster_end", World(4, 4)),
    ("test_wrap_hierarchical", World(4, 1)),  # 4 emulated nodes: 2 recursive-doubling steps
], ids=["finish", "cluster_end", "hierarchical", "hierarchical_put", "finish-w4",
        "cluster_end-w4", "hierarchical-w4"])
def test_ll_flags_wrap(rank_test, world, tmp_path):
  run = _harness.run_ranks(tmp_path, "rank_flag_wrap.py", world, select=("-k", rank_test),
                           timeout_s=180, env=WRAP_ENV)
  run.print_summary()
  run.check()
  ran = {k: v for k, v in run.outcomes(0).items() if rank_test in k}
  assert ran and all(v == "passed" for v in ran.values()), f"{rank_test}: {ran}"
