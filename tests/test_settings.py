"""jaxoverlap._settings against the sources that read the variables and the docs that list them.

Trial 45: a JAXOVERLAP_* variable went into five places by hand (the runtime's compared list,
the launcher's recorded list, the README, design.md, the decisions table), and nothing said when
one was missed.
"""

import pathlib
import re

import pytest

from jaxoverlap import _settings, launch, runtime
from jaxoverlap.tuning import PARAM_KEYS

ROOT = pathlib.Path(__file__).resolve().parents[1]
BY_NAME = {s.name: s for s in _settings.SETTINGS}


# Where a name may be built from the prefix and a variable part: each builds from a list the
# table covers (checked in test_every_variable_read_is_in_the_table), and only these
# expressions may (trial 48: exempting whole files let `_ENV_PREFIX + "FOO"` in launch.py pass).
_BUILDERS = {
    "jaxoverlap/_settings.py": ("PREFIX",),  # the table itself: its definition and docstrings
    "jaxoverlap/launch.py": ("_ENV_PREFIX = _settings.PREFIX", "_ENV_PREFIX + k",
                             "{_ENV_PREFIX}{k}"),  # k: of _LAUNCH_VARIABLES or SETTINGS
    "jaxoverlap/tuning/cost_model.py": ('"JAXOVERLAP_" + key.upper()',),  # of PARAM_KEYS
}
# A name built from pieces: the prefix alone as a literal (Python or C++ concatenation, a C++
# macro's "JAXOVERLAP_" #name), a literal or f-string that starts with it and goes on with a
# placeholder ({, %), or the prefix's constant.
_BUILT = re.compile(r"""["']JAXOVERLAP_["']|["']JAXOVERLAP_[A-Z0-9_]*[{%]|"""
                    r"""\b_?(?:ENV_)?PREFIX\b""")
# The prefix's constant with a literal tail, in Python: a read of that variable.
_PREFIX_PLUS = re.compile(r"""_?(?:ENV_)?PREFIX\s*\+\s*["']([A-Z0-9_]+)["']|"""
                          r"""\{_?(?:ENV_)?PREFIX\}([A-Z0-9_]+)""")
# The JAXOVERLAP_ names that are not environment variables: include guards, the C++ macros,
# CMake's cache variables (the build backend passes JAXOVERLAP_CUDA as a CMake define).
_NOT_VARIABLES = re.compile(r"JAXOVERLAP_(?:\w+_(?:H|CUH)_|\w*RETURN_IF\w*|STAGE_BINDING|CUDA|"
                            r"CUDA_OFF_REASON|XLA_FFI_INCLUDE_DIR)$")


def _sources():
  """The package's Python, and every C++, CUDA, CMake and build file of the repository."""
  yield from sorted((ROOT / "jaxoverlap").rglob("*.py"))
  yield from sorted((ROOT / "build_backend").rglob("*.py"))
  for path in sorted(ROOT.rglob("*")):
    rel = path.relative_to(ROOT).parts
    if rel[0] in (".git", "build", ".venv", "benchmarks", "tests") or not path.is_file():
      continue
    if path.suffix in (".cu", ".cc", ".cpp", ".cxx", ".cuh", ".h", ".hh", ".hpp", ".inc",
                       ".inl", ".cmake") or path.name == "CMakeLists.txt":
      yield path


def _read_in_sources() -> dict[str, set[str]]:
  """Every variable a source reads, by file: a string literal that is exactly its name (Python,
  C++: getenv and the knob readers take one), CMake's ENV{...} (with or without $), a Python
  ``PREFIX + "NAME"``; and in C++ and CMake every JAXOVERLAP_ token that is not an include
  guard, a macro or a cache variable (a comment's mention included)."""
  found: dict[str, set[str]] = {}
  for path in _sources():
    text, rel = path.read_text(), str(path.relative_to(ROOT))
    names = [next(n for n in m if n) for m in re.findall(
        r"""["'](JAXOVERLAP_[A-Z0-9_]+)["']|ENV\{(JAXOVERLAP_[A-Z0-9_]+)\}""", text)]
    names += [_settings.PREFIX + next(n for n in m if n) for m in _PREFIX_PLUS.findall(text)]
    if path.suffix != ".py":
      names += re.findall(r"\bJAXOVERLAP_[A-Z0-9_]+\b", text)
    for name in names:
      if not _NOT_VARIABLES.match(name):
        found.setdefault(name, set()).add(rel)
  return found


def test_names_are_built_from_the_prefix_only_where_the_table_covers_them():
  """Trial 47: a name built from pieces ("JAXOVERLAP_" + "FOO", f"JAXOVERLAP_{x}", a C++
  macro) escaped the scan of literals. Only the expressions of _BUILDERS may build names."""
  built = []
  for path in _sources():
    rel = str(path.relative_to(ROOT))
    for i, line in enumerate(path.read_text().splitlines(), 1):
      rest = _PREFIX_PLUS.sub("", line)  # a literal tail is a read (checked against the table)
      if _BUILT.search(rest) and not any(b in rest for b in _BUILDERS.get(rel, ())):
        built.append(f"{rel}:{i}: {line.strip()}")
  assert not built, ("names built from the prefix outside the builders; write the variable as "
                     f"one literal (docs/design.md, 'Adding a setting'): {built}")
  for rel, expressions in _BUILDERS.items():  # each still builds (else drop it from the list)
    text = (ROOT / rel).read_text()
    assert all(e in text for e in expressions), rel


def _section(text: str, heading: str) -> str:
  start = text.index(heading)
  end = text.find("\n## ", start + len(heading))
  return text[start:end if end >= 0 else None]


def test_every_variable_read_is_in_the_table():
  read = _read_in_sources()
  assert read, "the scan found no variable at all"
  missing = {name: files for name, files in read.items()
             if name.removeprefix(_settings.PREFIX) not in BY_NAME}
  assert not missing, f"read but not in jaxoverlap/_settings.py: {missing}"
  # The names the package builds from a prefix: the launcher's and the cost model's.
  for name in (*launch._LAUNCH_VARIABLES, *(key.upper() for key in PARAM_KEYS)):
    assert name in BY_NAME, name


@pytest.mark.parametrize("setting", _settings.SETTINGS, ids=lambda s: s.name)
def test_each_entry_is_read_where_it_says(setting):
  text = (ROOT / setting.read_by).read_text()
  if setting.read_by == "jaxoverlap/tuning/cost_model.py":  # JAXOVERLAP_ + key.upper()
    assert setting.name.lower() in PARAM_KEYS and '"JAXOVERLAP_" + key.upper()' in text
  elif setting.read_by == "jaxoverlap/launch.py":  # _ENV_PREFIX + one of _LAUNCH_VARIABLES
    assert setting.name in launch._LAUNCH_VARIABLES and f'"{setting.name}"' in text
  else:
    assert re.search(rf"""["']{setting.variable}["']|ENV\{{{setting.variable}\}}""", text), (
        f"{setting.variable} is not read in {setting.read_by}")


@pytest.mark.parametrize("setting", _settings.SETTINGS, ids=lambda s: s.name)
def test_each_entry_is_documented_where_it_says(setting):
  assert setting.documented and set(setting.documented) <= {_settings.README, _settings.DESIGN}
  readme = (ROOT / "README.md").read_text()
  design = _section((ROOT / "docs/design.md").read_text(), "## Settings for testing the kernels")
  for where in setting.documented:
    text = readme if where == _settings.README else design
    if setting.name.lower() in PARAM_KEYS and setting.name not in ("NET_ALPHA_US",
                                                                    "NET_BETA_GBPS"):
      # The README's row names the network's two and "the other tuning.PARAM_KEYS likewise".
      assert "tuning.PARAM_KEYS" in text
    else:
      assert f"`{setting.variable}" in text, f"{setting.variable} is not in the {where} docs"


def test_the_docs_name_no_variable_the_table_lacks():
  readme_rows = [line for line in (ROOT / "README.md").read_text().splitlines()
                 if line.startswith("| `JAXOVERLAP_")]
  design = _section((ROOT / "docs/design.md").read_text(), "## Settings for testing the kernels")
  named = set(re.findall(r"`(JAXOVERLAP_[A-Z0-9_]+)", "\n".join(readme_rows) + design))
  assert len(readme_rows) >= 10 and named
  assert {n.removeprefix(_settings.PREFIX) for n in named} <= set(BY_NAME), named


def test_the_derived_lists():
  assert launch.SETTINGS == _settings.names(recorded=True, prefix=False)
  # By hand (trial 47: a wrong `recorded` flag passed every test): what changes a measurement.
  assert set(launch.SETTINGS) == {
      "FUSED_CMD_BUFFER", "GEMM_ALIGNMENT_CAP", "OVERLAP_HEAP_BYTES", "HEAP_BYTES",
      "RANKS_PER_NODE", "FORCE_NVSHMEM_PUT", "TUNING_FILE", "TIMEOUT_S",
      "LAMPORT_BLOCKS_PER_SM", "LAMPORT_BLOCK_BYTES", "LAMPORT_MAX_BLOCKS", "LAMPORT_POLL_NS",
      "NORM_CLUSTER", "EPOCH_AT_START", "HIERARCHICAL_LL", *(k.upper() for k in PARAM_KEYS)}
  shared = runtime._shared_settings({"heap_bytes": 1, "overlap_heap_bytes": 2}, 4)
  assert set(shared) == (
      {n.lower() for n in _settings.names(compared=_settings.VALUE, prefix=False)}
      | set(_settings.names(compared=_settings.VARIABLE)))
  assert {s.compared for s in _settings.SETTINGS} <= {"", _settings.VALUE, _settings.VARIABLE}
  assert len(BY_NAME) == len(_settings.SETTINGS), "a name twice"
