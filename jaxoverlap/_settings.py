"""Every ``JAXOVERLAP_*`` environment variable the package reads, in one table.

For each variable this table names the file that acts on it (``read_by``; the
runtime also validates some of ``ffi/``'s at start-up) and says whether
``initialize()`` compares it across processes, whether a results file records
it in its command (``launch.reproduce_command``), and where users find it.
``runtime._shared_settings`` and ``launch.SETTINGS`` are derived from it, and
``tests/test_settings.py`` checks it against the sources (every variable that
``jaxoverlap/``, the C++, CUDA and CMake files and ``build_backend/`` read is
here) and the docs (each is in the README's variables table or in docs/design.md's
"Settings for testing the kernels", as ``documented`` says). Adding a variable:
docs/design.md, "Adding a setting".
"""

from __future__ import annotations

import dataclasses

from jaxoverlap.tuning.cost_model import PARAM_KEYS

PREFIX = "JAXOVERLAP_"

# Values of Setting.compared.
VARIABLE = "variable"  # initialize() compares the variable as set (unset: None) on every process
VALUE = "value"        # initialize() compares the value it resolves (argument or variable)
# Values of Setting.documented.
README = "README"      # the README's variables table (or its Install section, for the build)
DESIGN = "design"      # docs/design.md, "Settings for testing the kernels"


@dataclasses.dataclass(frozen=True)
class Setting:
  """One ``JAXOVERLAP_*`` variable.

  Attributes:
    name: the variable without ``PREFIX``.
    read_by: the file that acts on it.
    compared: ``VARIABLE`` or ``VALUE`` when processes that differ in it would
      lay out the heap, send or wait differently (``initialize()`` raises
      naming it), else "". Compared once, at start-up.
    recorded: whether it changes what a run measures, so that results files
      record it in their command.
    documented: ``README`` or ``DESIGN``, or both.
  """

  name: str
  read_by: str
  compared: str = ""
  recorded: bool = False
  documented: tuple[str, ...] = (README,)

  @property
  def variable(self) -> str:
    return PREFIX + self.name


_KERNELS = "ffi/all_reduce/all_reduce.cu"
_RUNTIME_CU = "ffi/runtime.cu"

SETTINGS: tuple[Setting, ...] = (
    # Set by python -m jaxoverlap.launch for each process (they differ between processes).
    Setting("COORDINATOR", "jaxoverlap/launch.py"),
    Setting("NUM_PROCESSES", "jaxoverlap/launch.py"),
    Setting("PROCESS_ID", "jaxoverlap/launch.py"),
    Setting("LOCAL_DEVICE", "jaxoverlap/launch.py"),
    # initialize()'s parameters: the heaps and the ranks per node are compared as resolved.
    Setting("HEAP_BYTES", "jaxoverlap/runtime.py", VALUE, recorded=True),
    Setting("OVERLAP_HEAP_BYTES", "jaxoverlap/runtime.py", VALUE, recorded=True),
    Setting("RANKS_PER_NODE", "jaxoverlap/runtime.py", VALUE, recorded=True),
    Setting("TIMEOUT_S", "jaxoverlap/runtime.py", recorded=True),
    Setting("INIT_TIMEOUT_S", "jaxoverlap/runtime.py"),
    # Rank 0's table is shared at initialize(), so the others' variables need not agree.
    Setting("TUNING_FILE", "jaxoverlap/tuning/results.py", recorded=True),
    Setting("FUSED_CMD_BUFFER", "jaxoverlap/runtime.py", recorded=True),
    Setting("DEBUG", _RUNTIME_CU, documented=(README, DESIGN)),
    Setting("REQUIRE_CUDA_BUILD", "CMakeLists.txt"),
    # Measurement and test knobs of the kernels.
    Setting("FORCE_NVSHMEM_PUT", _RUNTIME_CU, recorded=True, documented=(DESIGN,)),
    Setting("GEMM_ALIGNMENT_CAP", "ffi/overlap/gemm.cc", recorded=True, documented=(DESIGN,)),
    Setting("TEST_PAIR_EPOCH", _RUNTIME_CU, VARIABLE, documented=(DESIGN,)),
    Setting("TEST_LL_STALE", _RUNTIME_CU, VARIABLE, documented=(DESIGN,)),
    Setting("LAMPORT_BLOCKS_PER_SM", _KERNELS, VARIABLE, recorded=True, documented=(DESIGN,)),
    Setting("LAMPORT_BLOCK_BYTES", _KERNELS, VARIABLE, recorded=True, documented=(DESIGN,)),
    Setting("LAMPORT_MAX_BLOCKS", _KERNELS, VARIABLE, recorded=True, documented=(DESIGN,)),
    Setting("LAMPORT_POLL_NS", _KERNELS, VARIABLE, recorded=True, documented=(DESIGN,)),
    Setting("NORM_CLUSTER", _KERNELS, VARIABLE, recorded=True, documented=(DESIGN,)),
    Setting("EPOCH_AT_START", _KERNELS, VARIABLE, recorded=True, documented=(DESIGN,)),
    Setting("HIERARCHICAL_LL", _KERNELS, VARIABLE, recorded=True, documented=(DESIGN,)),
    # The cost model's overrides steer algorithm="auto": ranks that chose differently would
    # run different collectives. The README's table names two and "PARAM_KEYS".
) + tuple(Setting(key.upper(), "jaxoverlap/tuning/cost_model.py", VARIABLE, recorded=True)
          for key in PARAM_KEYS)


def names(*, compared: str | None = None, recorded: bool | None = None,
          prefix: bool = True) -> tuple[str, ...]:
  """The variables (with ``PREFIX``, or without), filtered by ``compared`` and ``recorded``."""
  return tuple(s.variable if prefix else s.name for s in SETTINGS
               if (compared is None or s.compared == compared)
               and (recorded is None or s.recorded == recorded))
