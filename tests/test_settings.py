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


def _sources():
  yield from sorted((ROOT / "jaxoverlap").rglob("*.py"))
  for ext in ("cu", "cc", "h", "cuh"):
    yield from sorted((ROOT / "ffi").rglob(f"*.{ext}"))
  yield ROOT / "CMakeLists.txt"


def _read_in_sources() -> dict[str, set[str]]:
  """Every variable a source reads: a string literal that is exactly its name (Python, C++:
  getenv and the knob readers take one), or CMake's $ENV{...}; by file."""
  found: dict[str, set[str]] = {}
  for path in _sources():
    text = path.read_text()
    for name in re.findall(r"""["'](JAXOVERLAP_[A-Z0-9_]+)["']|\$ENV\{(JAXOVERLAP_[A-Z0-9_]+)\}""",
                           text):
      found.setdefault(next(n for n in name if n), set()).add(str(path.relative_to(ROOT)))
  return found


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
    assert re.search(rf"""["']{setting.variable}["']|\$ENV\{{{setting.variable}\}}""", text), (
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
  assert "TUNING_FILE" in launch.SETTINGS and "COORDINATOR" not in launch.SETTINGS
  shared = runtime._shared_settings({"heap_bytes": 1, "overlap_heap_bytes": 2}, 4)
  assert set(shared) == (
      {n.lower() for n in _settings.names(compared=_settings.VALUE, prefix=False)}
      | set(_settings.names(compared=_settings.VARIABLE)))
  assert {s.compared for s in _settings.SETTINGS} <= {"", _settings.VALUE, _settings.VARIABLE}
  assert len(BY_NAME) == len(_settings.SETTINGS), "a name twice"
