"""compute-sanitizer (memcheck, racecheck) over the quick sweeps; opt-in.

Set ``JAXOVERLAP_SANITIZE=memcheck,racecheck`` (``SANITIZE=...`` for
scripts/gpu_check.sh suite) to run them: each tool wraps every rank of one
launch (the launcher's --wrapper) running the quick sweep of the all-reduce
(one node of 2, and 2 emulated nodes of 1: the hierarchical kernel's inter-node
step), of ``all_reduce_rms_norm`` or of the fused ops at world 2. Besides the tests'
own checks, every rank must print the tool's summary with no errors (and exit
without the tool's error code).
"""

import os
import re
import shutil

import pytest

import _harness
from _harness import World

pytestmark = [pytest.mark.gpu, _harness.requires_gpus]

TOOLS = [t for t in re.split(r"[,\s]+", os.environ.get("JAXOVERLAP_SANITIZE", "")) if t]
MODULES = {
    # (rank module, extra sanitizer options, world): the all-reduce's kernels only (XLA's are
    # many).
    "all_reduce": ("rank_all_reduce.py", "--kernel-name kns=jaxoverlap", World(2, 2)),
    "all_reduce_2nodes": ("rank_all_reduce.py", "--kernel-name kns=jaxoverlap", World(2, 1)),
    "norm": ("rank_norm.py", "--kernel-name kns=jaxoverlap", World(2, 2)),  # the norm's kernel
    "fused": ("rank_overlap.py", "", World(2, 2)),
}
SUMMARY = {
    "memcheck": re.compile(r"^\[rank (\d+)\] =+ ERROR SUMMARY: (\d+) error", re.M),
    "racecheck": re.compile(r"^\[rank (\d+)\] =+ RACECHECK SUMMARY: \d+ hazards? displayed "
                            r"\((\d+) errors?", re.M),
}


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("what", list(MODULES))
def test_sanitize(what, tool, tmp_path):
  if tool not in TOOLS:
    pytest.skip(f"opt-in: JAXOVERLAP_SANITIZE={tool} (scripts/gpu_check.sh: SANITIZE={tool})")
  if shutil.which("compute-sanitizer") is None:
    pytest.fail("JAXOVERLAP_SANITIZE is set, but compute-sanitizer is not on PATH")
  module, options, world = MODULES[what]
  wrapper = (f"compute-sanitizer --tool {tool} {options} --report-api-errors no "
             "--error-exitcode 3")
  run = _harness.run_ranks(tmp_path, module, world, select=("-k", "test_sweep_quick"),
                           timeout_s=420, startup_s=400, wrapper=" ".join(wrapper.split()),
                           label=f"{tool} {what}")
  run.print_summary()
  run.check()
  found = {int(r): int(n) for r, n in SUMMARY[tool].findall(run.output())}
  assert sorted(found) == list(range(2)), (
      f"{tool} printed its summary for ranks {sorted(found)} of 2:\n{run.tail()}")
  assert not any(found.values()), f"{tool} errors by rank {found}:\n{run.tail(120)}"
