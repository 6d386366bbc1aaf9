"""The README's Python examples that run on a CPU still run, as a user would paste them.

Each runs in a fresh interpreter (the CPU quickstart sets XLA_FLAGS before jax
is imported); the GPU quickstart needs GPUs and is only checked to compile.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _python_blocks() -> dict[str, str]:
  """The README's ```python blocks, keyed by the nearest heading or bold lead before them."""
  text = (REPO / "README.md").read_text()
  blocks = {}
  for m in re.finditer(r"```python\n(.*?)```", text, re.S):
    before = text[:m.start()]
    leads = re.findall(r"^(?:#+ (.+)|\*\*(.+?)\*\*)", before, re.M)
    title = next(a or b for a, b in reversed(leads))
    blocks[title.strip()] = m.group(1)
  return blocks


BLOCKS = _python_blocks()


def _run(code: str, tmp_path: Path, devices: int | None) -> subprocess.CompletedProcess:
  script = tmp_path / "example.py"
  script.write_text(code)
  env = dict(os.environ, PYTHONPATH=str(REPO))
  env.pop("XLA_FLAGS", None)
  if devices is not None:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)


def test_the_readme_has_its_examples():
  assert {"Quickstart on a CPU", "Quickstart on GPUs", "Decode."} <= set(BLOCKS), list(BLOCKS)


def test_cpu_quickstart_runs(tmp_path):
  out = _run(BLOCKS["Quickstart on a CPU"], tmp_path, devices=None)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "all_reduce -> xla collective" in out.stdout, out.stdout


@pytest.mark.parametrize("devices", [1, 8])
def test_decode_example_runs(tmp_path, devices):
  out = _run(BLOCKS["Decode."] + "\nprint('shape', y.shape, y.dtype)\n", tmp_path, devices)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "shape (1, 1, 512) bfloat16" in out.stdout, out.stdout


def test_gpu_quickstart_compiles():
  compile(BLOCKS["Quickstart on GPUs"], "gpu_quickstart.py", "exec")
