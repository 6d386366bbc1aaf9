"""tests/gpu: the multi-process GPU suite (``pytest -m gpu tests/gpu``).

The outer tests here (test_gpu_*.py, marker ``gpu``) start the rank-side
modules of ranks/ in several processes through ``python -m jaxoverlap.launch``
and check every rank's report (_harness.py). ranks/ is not collected here:
its modules run only inside those processes, with their own conftest.
"""

collect_ignore = ["ranks"]
