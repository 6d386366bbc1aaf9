"""all_reduce(backend="cuda") in several processes and topologies (tests/gpu/ranks).

Each case is one launch of ranks/rank_all_reduce.py; every rank's outcome of
every test is checked (_harness.py). World 2 runs everything, as one node of 2
GPUs, as 2 "nodes" of 1 (the inter-node path over NVLink stores) and with
NVSHMEM puts forced; larger worlds run the quick tests, in every ranks-per-node
split, including a non-power-of-two node count (3 and 3 x 2: the MPICH fold),
and with puts forced at 3 and 8 nodes.
On a machine with fewer GPUs than ranks, processes share GPUs evenly (ids end
in -Npergpu) and what needs NCCL is skipped.
"""

import pytest

import _harness
from _harness import Case, World

pytestmark = [pytest.mark.gpu, _harness.requires_gpus]


QUICK = ("-m", "quick")
# Timeouts: about 2.5x the expected time of the launch (world 2 on 2x H200: start-up ~20 s,
# the sweep ~50 s, the stress loops ~45 s).
CASES = [
    Case(World(2, 2), timeout_s=330),                    # everything, 1 node x 2
    Case(World(2, 1), timeout_s=330),                    # everything, 2 "nodes" x 1
    Case(World(2, 1, put=True), ("-m", "quick or stress"), timeout_s=240),
    Case(World(3, 1), QUICK, timeout_s=180),             # 3 nodes: the fold (2 GPUs: on one)
    Case(World(4, 1), QUICK, timeout_s=180),
    Case(World(4, 2), QUICK, timeout_s=180),
    Case(World(4, 4), QUICK, timeout_s=180),
    Case(World(6, 2), QUICK, timeout_s=240),             # 3 nodes x 2
    Case(World(8, 4), QUICK, timeout_s=240),
    Case(World(8, 1), QUICK, timeout_s=240),
    # NVSHMEM puts forced across 3 and 8 emulated nodes: the fold's two sends, and three
    # recursive-doubling steps, whose third put reuses the first one's staging buffer.
    Case(World(3, 1, put=True), QUICK, timeout_s=180),
    Case(World(8, 1, put=True), QUICK, timeout_s=240),
]


@pytest.mark.parametrize("case", CASES, ids=[c.world.label() for c in CASES])
def test_all_reduce(case, tmp_path):
  _harness.run_case(tmp_path, "rank_all_reduce.py", case)


# The measurement knob JAXOVERLAP_EPOCH_AT_START=1 (ffi/all_reduce/all_reduce.cu,
# AdvanceEpochsAtStart): the one-shot LL kernels advance the epochs at their start; every quick
# and stress test, world 2 (the stress loops mix the one-shot LL with the other kernels).
EPOCH_CASES = [Case(World(2, 2), ("-m", "quick or stress"), timeout_s=240)]


@pytest.mark.parametrize("case", EPOCH_CASES, ids=[c.world.label() for c in EPOCH_CASES])
def test_all_reduce_epochs_at_start(case, tmp_path):
  _harness.run_with_knob(tmp_path, "rank_all_reduce.py", case, {"JAXOVERLAP_EPOCH_AT_START": "1"},
                         {"epochs_at_start": True})


# The measurement knob JAXOVERLAP_HIERARCHICAL_LL=v3 (ffi/all_reduce/all_reduce.cu,
# HierarchicalV3Knob): hierarchical with the LL protocol runs the v3 kernel
# (ReduceScatterAllGatherKernel: an fp32 accumulator in memory, flags within the node) instead of
# HierarchicalLLKernel, so that the two can be timed against each other; the quick tests over 2
# emulated nodes of 1 rank and 3 of 2 (the fold, and a reduce-scatter within each node).
V3_CASES = [Case(World(2, 1), QUICK, timeout_s=180), Case(World(6, 2), QUICK, timeout_s=240)]


@pytest.mark.parametrize("case", V3_CASES, ids=[c.world.label() for c in V3_CASES])
def test_all_reduce_hierarchical_v3_kernel(case, tmp_path):
  _harness.run_with_knob(tmp_path, "rank_all_reduce.py", case, {"JAXOVERLAP_HIERARCHICAL_LL": "v3"},
                         {"hierarchical_ll_kernel": "v3"})
