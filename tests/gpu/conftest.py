"""tests/gpu: the multi-process GPU suite (``pytest -m gpu tests/gpu``).

The outer tests here (test_gpu_*.py, marker ``gpu``) start the rank-side
modules of ranks/ in several processes through ``python -m jaxoverlap.launch``
and check every rank's report (_harness.py). ranks/ is not collected here:
its modules run only inside those processes, with their own conftest.
"""

import pytest

import _harness

collect_ignore = ["ranks"]


@pytest.fixture(autouse=True)
def _gpu_tests_need_the_extension(request):
  """A GPU test on a GPU machine without the CUDA extension fails instead of skipping."""
  if request.node.get_closest_marker("gpu") is not None:
    why = _harness.missing_extension()
    if why:
      pytest.fail(why, pytrace=False)
